//! GPU paged decode (split-K + merge) and `merge_attn_states` against the f64 CPU reference, on
//! random data with poisoned outputs: head sizes, GQA ratios, speculative query lengths, cache
//! dtypes and layouts, block sizes, window / soft-cap / ALiBi / sinks, forced and planned splits,
//! empty requests and bad block ids.

mod common;

use attn_rs::batch_plan::{paged_decode_planned, BatchPlan};
use attn_rs::cache_write::KvScales;
use attn_rs::decode::{merge_attn_states, paged_decode, DecodeArgs, DecodeBatch, DecodeWorkspace, MergeArgs};
use attn_rs::{cpu, BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, RowsDesc};
use attn_rs::{AttnOptions, SplitMode};
use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use libtest_mimic::Trial;
use rand::Rng;

#[derive(Clone, Debug)]
struct Case {
    layout: KvLayout,
    head_size: usize,
    q_heads: usize,
    kv_heads: usize,
    block_size: usize,
    seq_lens: Vec<i32>,
    q_lens: Vec<i32>,
    window: Option<u32>,
    softcap: Option<f32>,
    alibi: bool,
    sinks: bool,
    split: SplitMode,
    /// Put a block id past the cache into one request's table.
    bad_block: bool,
    /// Planned once with `BatchPlan` and run as two layers (the second checked).
    planned: bool,
    /// The one request's queries and window-edge and diagonal keys planted so that every row
    /// has two dominant keys at its mask's edges (`plant_edge_markers`; needs a window).
    edge_markers: bool,
    /// FP8: one K and one V scale per kv head (else one per tensor).
    per_head_scales: bool,
    /// Queries and outputs with a gap after every head (`common::gapped_rows`): NaN in the
    /// queries' gaps, poison in the outputs' (checked untouched).
    gapped: bool,
}

impl Case {
    fn base(seq_lens: &[i32]) -> Self {
        Case {
            layout: KvLayout::FlashNhd,
            head_size: 128,
            q_heads: 32,
            kv_heads: 8,
            block_size: 16,
            seq_lens: seq_lens.to_vec(),
            q_lens: vec![1; seq_lens.len()],
            window: None,
            softcap: None,
            alibi: false,
            sinks: false,
            split: SplitMode::Auto,
            bad_block: false,
            planned: false,
            edge_markers: false,
            per_head_scales: false,
            gapped: false,
        }
    }
}

fn decode_case<Q: Element, C: Element>(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let fp8 = C::DTYPE.is_fp8();
    let (d, hq) = (c.head_size, c.q_heads);
    let num_reqs = c.seq_lens.len();
    let BlockTables { table: block_table, stride, num_blocks } =
        scattered_block_tables(&mut rng, &c.seq_lens, c.block_size, 7, c.bad_block);
    let spec = KvCacheSpec::new(c.layout, num_blocks, c.block_size, c.kv_heads, d)?;
    let mut qsl = vec![0i32];
    for &q in &c.q_lens {
        qsl.push(qsl.last().unwrap() + q);
    }
    let nt = *qsl.last().unwrap() as usize;
    let q_rows = if c.gapped { gapped_rows(nt, hq, d) } else { RowsDesc::contiguous(nt, hq, d) };
    let mut q: Vec<Q> = spread(&random_vec::<Q>(&mut rng, nt * hq * d, 1.0), &q_rows, Q::from_f32(f32::NAN));
    q.resize(q.len().max(1), Q::from_f32(0.0));
    let mut cache: Vec<C> = random_vec(&mut rng, spec.num_elements(), if fp8 { 40.0 } else { 1.0 });
    // Per head: scales 1.9x apart from the first kv head to the last.
    let (ks, vs): (Vec<f32>, Vec<f32>) = match c.per_head_scales {
        true => (0..c.kv_heads).map(|h| (0.035 + 0.03 * h as f32 / c.kv_heads as f32, 0.04 - 0.02 * h as f32 / c.kv_heads as f32)).unzip(),
        false => (vec![0.05], vec![0.03]),
    };
    let scales = if c.per_head_scales { cpu::HostScales::PerHead(&ks, &vs) } else { cpu::HostScales::Tensor(ks[0], vs[0]) };
    let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
    let sinks: Vec<f32> = (0..hq).map(|_| rng.random_range(-2.0..4.0)).collect();
    let mut opts = AttnOptions::new(d);
    opts.window = c.window;
    opts.softcap = c.softcap;
    if c.edge_markers {
        let m = MarkedRequest {
            q0: 0,
            q_len: c.q_lens[0] as usize,
            seq_len: c.seq_lens[0] as usize,
            window: c.window.expect("edge markers need a window") as usize,
            num_kv_heads: c.kv_heads,
            // FP8: keys are stored over the K scale, so the markers are planted at 1 / scale.
            softmax_scale: if fp8 { opts.softmax_scale * ks[0] } else { opts.softmax_scale },
        };
        let key_at =
            |pos: usize, kvh: usize, x: usize| spec.offset(0, block_table[pos / c.block_size] as usize, pos % c.block_size, kvh, x);
        plant_edge_markers(&mut rng, &m, &mut q, q_rows, &mut cache, key_at);
    }
    let batch = DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &qsl };

    let want = cpu::paged_decode(&cpu::DecodeRef {
        q: &q,
        q_rows,
        cache: &cache,
        spec,
        block_table: &block_table,
        block_table_stride: stride,
        batch,
        opts,
        alibi_slopes: c.alibi.then_some(&slopes[..]),
        sinks: c.sinks.then_some(&sinks[..]),
        scales: fp8.then_some(scales),
    })?;

    let up = |v: &[i32]| upload(&stream, v);
    let (q_d, cache_d, bt_d) = (upload(&stream, &q), upload(&stream, &cache), up(&block_table));
    let meta = BatchMetadata::new(&stream, &c.seq_lens, &qsl)?;
    let (slopes_d, sinks_d) = (upload(&stream, &slopes), upload(&stream, &sinks));
    let (ks_d, vs_d) = (upload(&stream, &ks), upload(&stream, &vs));
    let mut out_d: CudaSlice<Q> = upload(&stream, &vec![poison::<Q>(); q_rows.required_len().max(1)]);
    let mut lse_d: CudaSlice<f32> = upload(&stream, &vec![f32::NAN; (nt * hq).max(1)]);
    let mut ws = DecodeWorkspace::new(&stream, 4096 * hq, d, num_reqs, nt)?;
    let mut status = DeviceStatus::new(&stream)?;
    macro_rules! args {
        ($out:expr, $lse:expr) => {
            DecodeArgs {
                q: DevIn::new(&q_d, &stream),
                q_rows,
                cache: DevIn::new(&cache_d, &stream),
                spec,
                block_table: DevIn::new(&bt_d, &stream),
                block_table_stride: stride,
                out: DevOut::new($out, &stream),
                out_rows: q_rows,
                lse: Some(DevOut::new($lse, &stream)),
                alibi_slopes: c.alibi.then(|| DevIn::new(&slopes_d, &stream)),
                sinks: c.sinks.then(|| DevIn::new(&sinks_d, &stream)),
                scales: fp8.then(|| KvScales { k: DevIn::new(&ks_d, &stream), v: DevIn::new(&vs_d, &stream) }),
            }
        };
    }
    let plan = if c.planned {
        let mut bp = BatchPlan::new(&stream)?;
        let (qt, ct) = (Q::DTYPE, C::DTYPE);
        let plan = bp.plan_decode(device(), &meta, qt, ct, c.layout, d, hq, c.kv_heads, c.split, &ws)?.clone();
        let (mut scratch_out, mut scratch_lse) = (out_d.clone(), lse_d.clone());
        // Two layers on one plan: the second output is the one checked.
        for (out, lse) in [(&mut scratch_out, &mut scratch_lse), (&mut out_d, &mut lse_d)] {
            paged_decode_planned(device(), &stream, args!(out, lse), &meta, &opts, &bp, &mut ws, &mut status)?;
        }
        plan
    } else {
        paged_decode(device(), &stream, args!(&mut out_d, &mut lse_d), &meta, &opts, c.split, &mut ws, &mut status)?
    };
    let flags = status.take(&stream)?;
    let out = download(&stream, &out_d);
    check_gaps(&out[..q_rows.required_len()], &q_rows, poison::<Q>())?;
    let got: Vec<f64> = packed(&out, &q_rows).iter().map(|x| x.to_f32() as f64).collect();
    let lse: Vec<f32> = download(&stream, &lse_d);
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!("output element {i} is {} (unwritten or NaN); plan chunk {}", got[i], plan.chunk).into());
    }
    // On Hopper FP8 decode may round the queries and weights to e4m3 (`fp8_decode_rounds_to_e4m3`).
    let rows = *c.q_lens.iter().max().unwrap_or(&1) as usize * (hq / c.kv_heads);
    let e4m3 = fp8 && attn_rs::decode::fp8_decode_rounds_to_e4m3(device(), d, rows);
    let (tol, row_tol, lse_tol) = bounds(Q::DTYPE, e4m3);
    let err = rel_error(&got, &want.out);
    if !within(err, tol) {
        return Err(format!("relative error {err:.2e} > {tol:.0e} (plan: chunk {}, {} items)", plan.chunk, plan.items.len()).into());
    }
    // Row by row too: one row wrong alone (a key masked wrongly) hardly moves the global norm.
    check_rows_within(&got, &want.out, d, hq, row_tol)
        .map_err(|e| format!("{e} (plan: chunk {}, {} items)", plan.chunk, plan.items.len()))?;
    check_lse_within(&lse[..nt * hq], &want.lse[..nt * hq], hq, lse_tol)?;
    check_block_status(flags, &want, &block_table, stride, num_blocks, true)?;
    check_found_bad_block(&meta, &bt_d, &stream, stride, c.block_size, num_blocks, &want)?;
    Ok(())
}

/// Decode right after the cache write of its new tokens, as in an engine step: on Hopper the
/// decode starts while the write drains (programmatic dependent launch) and reads each
/// request's older context before waiting for it. The new tokens' slots hold NaN until the
/// write lands; they are the write's last tokens, behind a long run of filler tokens into spare
/// blocks, so a decode that read them too early would return NaN. The window is a few
/// microseconds, so the test is probabilistic. With the wait removed from `decode_kr`, 2 of 3
/// runs of 8 rounds failed, hence 20 rounds, each re-poisoned.
fn after_cache_write_case(q_len: i32, salt: u64) -> TestResult {
    use attn_rs::cache_write::{reshape_and_cache, KvWrite};
    let mut rng = rng(salt);
    let stream = new_stream();
    let (d, hq, hkv, bs) = (128, 32, 8, 16);
    let num_reqs = 96;
    let seq_lens: Vec<i32> = (0..num_reqs).map(|_| rng.random_range(q_len..=48)).collect();
    let filler = if quick() { 8192 } else { 32768 };
    let BlockTables { table, stride, num_blocks } = scattered_block_tables(&mut rng, &seq_lens, bs, filler / bs, false);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, bs, hkv, d)?;
    let used: std::collections::HashSet<i32> = table.iter().copied().filter(|&b| b >= 0).collect();
    let spare: Vec<i64> = (0..num_blocks as i64).filter(|b| !used.contains(&(*b as i32))).collect();
    // Slots written by the cache write: the filler's, then every request's new tokens.
    let mut slots: Vec<i64> = spare.iter().flat_map(|&b| (0..bs as i64).map(move |t| b * bs as i64 + t)).collect();
    let mut new_slots = Vec::new();
    for (r, &len) in seq_lens.iter().enumerate() {
        for pos in (len - q_len) as usize..len as usize {
            new_slots.push(table[r * stride + pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
        }
    }
    slots.extend(&new_slots);
    let tokens = slots.len();
    let kv_rows = RowsDesc::contiguous(tokens, hkv, d);
    let qsl: Vec<i32> = (0..=num_reqs as i32).map(|r| r * q_len).collect();
    let nt = (num_reqs as i32 * q_len) as usize;
    let q_rows = RowsDesc::contiguous(nt, hq, d);
    let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
    let opts = AttnOptions::new(d);
    let rounds = if quick() { 3 } else { 20 };
    for round in 0..rounds {
        let q: Vec<bf16> = random_vec(&mut rng, q_rows.required_len(), 1.0);
        let (k_new, v_new): (Vec<bf16>, Vec<bf16>) =
            (random_vec(&mut rng, kv_rows.required_len(), 1.0), random_vec(&mut rng, kv_rows.required_len(), 1.0));
        let mut cache: Vec<bf16> = random_vec(&mut rng, spec.num_elements(), 1.0);
        let mut poisoned = cache.clone();
        // The filler lands in blocks no request reads: only the new tokens matter here.
        for (j, &slot) in new_slots.iter().enumerate() {
            let i = tokens - new_slots.len() + j;
            let (block, t) = (slot as usize / bs, slot as usize % bs);
            for h in 0..hkv {
                for x in 0..d {
                    let src = kv_rows.offset(i, h, x);
                    cache[spec.offset(0, block, t, h, x)] = k_new[src];
                    cache[spec.offset(1, block, t, h, x)] = v_new[src];
                    poisoned[spec.offset(0, block, t, h, x)] = poison::<bf16>();
                    poisoned[spec.offset(1, block, t, h, x)] = poison::<bf16>();
                }
            }
        }
        let want = cpu::paged_decode(&cpu::DecodeRef {
            q: &q,
            q_rows,
            cache: &cache,
            spec,
            block_table: &table,
            block_table_stride: stride,
            batch,
            opts,
            alibi_slopes: None,
            sinks: None,
            scales: None,
        })?;
        let up = |v: &[i32]| upload(&stream, v);
        let (q_d, bt_d) = (upload(&stream, &q), up(&table));
        let meta = BatchMetadata::new(&stream, &seq_lens, &qsl)?;
        let (k_d, v_d, slots_d) = (upload(&stream, &k_new), upload(&stream, &v_new), upload(&stream, &slots));
        let mut cache_d = upload(&stream, &poisoned);
        let mut out_d: CudaSlice<bf16> = upload(&stream, &vec![poison::<bf16>(); q_rows.required_len()]);
        let mut ws = DecodeWorkspace::new(&stream, 4096 * hq, d, num_reqs, nt)?;
        let mut status = DeviceStatus::new(&stream)?;
        // Planned first, so that nothing is copied between the two kernels.
        let mut bp = BatchPlan::new(&stream)?;
        bp.plan_decode(device(), &meta, bf16::DTYPE, bf16::DTYPE, spec.layout, d, hq, hkv, SplitMode::Auto, &ws)?;
        let write = KvWrite {
            key: DevIn::new(&k_d, &stream),
            key_rows: kv_rows,
            value: DevIn::new(&v_d, &stream),
            value_rows: kv_rows,
            slot_mapping: DevIn::new(&slots_d, &stream),
            cache: DevOut::new(&mut cache_d, &stream),
            spec,
            scales: None,
        };
        reshape_and_cache(device(), &stream, write, &mut status)?;
        let args = DecodeArgs {
            q: DevIn::new(&q_d, &stream),
            q_rows,
            cache: DevIn::new(&cache_d, &stream),
            spec,
            block_table: DevIn::new(&bt_d, &stream),
            block_table_stride: stride,
            out: DevOut::new(&mut out_d, &stream),
            out_rows: q_rows,
            lse: None,
            alibi_slopes: None,
            sinks: None,
            scales: None,
        };
        paged_decode_planned(device(), &stream, args, &meta, &opts, &bp, &mut ws, &mut status)?;
        status.check(&stream)?;
        let got: Vec<f64> = download(&stream, &out_d).iter().map(|x| x.to_f32() as f64).collect();
        if let Some(i) = got.iter().position(|x| !x.is_finite()) {
            return Err(format!("round {round}: output element {i} is {} (a new token read before its write?)", got[i]).into());
        }
        let err = rel_error(&got, &want.out);
        if !within(err, tolerance(bf16::DTYPE)) {
            return Err(format!("round {round}: relative error {err:.2e}").into());
        }
    }
    Ok(())
}

/// Two random partial results merged on the GPU against the CPU merge, with some rows empty on
/// one side (LSE -inf).
fn merge_case<T: Element>(tokens: usize, heads: usize, d: usize, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let rows = RowsDesc::contiguous(tokens, heads, d);
    let (p, s): (Vec<T>, Vec<T>) = (random_vec(&mut rng, rows.required_len(), 2.0), random_vec(&mut rng, rows.required_len(), 2.0));
    let mut lse_p: Vec<f32> = (0..tokens * heads).map(|_| rng.random_range(-5.0..5.0)).collect();
    let lse_s: Vec<f32> = (0..tokens * heads).map(|_| rng.random_range(-5.0..5.0)).collect();
    lse_p[0] = f32::NEG_INFINITY;
    let (p_d, s_d, lp_d, ls_d) = (upload(&stream, &p), upload(&stream, &s), upload(&stream, &lse_p), upload(&stream, &lse_s));
    let mut out_d: CudaSlice<T> = upload(&stream, &vec![poison::<T>(); rows.required_len()]);
    let mut lse_d: CudaSlice<f32> = upload(&stream, &vec![f32::NAN; tokens * heads]);
    merge_attn_states(
        device(),
        &stream,
        MergeArgs {
            prefix_out: DevIn::new(&p_d, &stream),
            prefix_lse: DevIn::new(&lp_d, &stream),
            suffix_out: DevIn::new(&s_d, &stream),
            suffix_lse: DevIn::new(&ls_d, &stream),
            out: DevOut::new(&mut out_d, &stream),
            out_lse: Some(DevOut::new(&mut lse_d, &stream)),
            rows,
            lse_strides: (heads, 1),
        },
    )?;
    let got = download(&stream, &out_d);
    let got_lse = download(&stream, &lse_d);
    let f = |v: &[T], i: usize| (0..d).map(|k| v[i * d + k].to_f32() as f64).collect::<Vec<f64>>();
    let (mut all_got, mut all_want) = (vec![], vec![]);
    for i in 0..tokens * heads {
        let (o, l) = cpu::merge_states_row(&f(&p, i), lse_p[i] as f64, &f(&s, i), lse_s[i] as f64);
        all_want.extend(o);
        all_got.extend(f(&got, i));
        let ok =
            if l == f64::NEG_INFINITY { got_lse[i] == f32::NEG_INFINITY } else { (got_lse[i] as f64 - l).abs() <= 1e-4 * l.abs().max(1.0) };
        if !ok {
            return Err(format!("lse[{i}] = {}, want {l}", got_lse[i]).into());
        }
    }
    let err = rel_error(&all_got, &all_want);
    if !within(err, tolerance(T::DTYPE).max(3e-3)) {
        return Err(format!("relative error {err:.2e}").into());
    }
    Ok(())
}

fn cases() -> Vec<(String, Case, &'static str)> {
    let mut v: Vec<(String, Case, &'static str)> = Vec::new();
    let lens = [1, 17, 300, 1000, 4097];
    let mut push = |name: String, c: Case, dt: &'static str| v.push((name, c, dt));
    for dt in ["bf16_bf16", "f16_f16", "bf16_fp8", "f16_fp8"] {
        push(format!("{dt}::basic"), Case::base(&lens), dt);
    }
    for d in [64, 96, 128, 256] {
        push(format!("bf16_bf16::head_size_{d}"), Case { head_size: d, ..Case::base(&lens) }, "bf16_bf16");
        push(format!("f16_fp8::head_size_{d}"), Case { head_size: d, ..Case::base(&[5, 777]) }, "f16_fp8");
    }
    // Head sizes below a kernel's width (`attn_math::decode::width`): 32/40 on width 64, 80 on
    // 96, 112/120 on 128, 136/200/248 on 256; queries and outputs with gaps after each head, so
    // a read past the head size turns the result NaN and a write past it shows. GQA 4, 8 and
    // 16 take each decode kernel.
    for (d, hq, hkv) in [(32, 32, 8), (40, 16, 2), (80, 32, 8), (112, 32, 4), (120, 16, 1), (136, 16, 4), (200, 32, 2), (248, 8, 8)] {
        let case = Case { head_size: d, q_heads: hq, kv_heads: hkv, gapped: true, sinks: true, ..Case::base(&lens) };
        push(format!("bf16_bf16::gapped_head_size_{d}_{hq}q{hkv}kv"), case.clone(), "bf16_bf16");
        push(format!("f16_f16::gapped_head_size_{d}_split_fixed_3"), Case { split: SplitMode::Fixed(3), ..case }, "f16_f16");
    }
    // FP8 caches: the multiples of 16 and, on the `_fp8_a8` kernels (rows 8-byte aligned,
    // copied in halves), the odd multiples of 8: 40 and 56 on width 64, 72 to 120 on 128 (GQA
    // 8 and 16: the three-CTA, deep and two-group kernels), 136 and 248 on 256.
    for (d, hq, hkv) in [
        (48, 32, 8),
        (80, 32, 2),
        (112, 32, 8),
        (160, 16, 4),
        (208, 8, 1),
        (40, 32, 4),
        (56, 16, 1),
        (72, 32, 4),
        (88, 16, 2),
        (104, 32, 2),
        (120, 64, 8),
        (136, 16, 2),
        (248, 8, 4),
    ] {
        let case = Case { head_size: d, q_heads: hq, kv_heads: hkv, gapped: true, ..Case::base(&[5, 777, 2100]) };
        push(format!("bf16_fp8::gapped_head_size_{d}_{hq}q{hkv}kv"), case.clone(), "bf16_fp8");
        push(
            format!("f16_fp8::gapped_head_size_{d}_per_head_scales"),
            Case { per_head_scales: true, q_lens: vec![2, 1, 3], ..case },
            "f16_fp8",
        );
    }
    // Width 64 over long requests: the four-CTA FP8 kernels at every length.
    push("bf16_fp8::head_size_64_long".into(), Case { head_size: 64, ..Case::base(&[3000, 20_000, 1, 4097]) }, "bf16_fp8");
    for (hq, hkv) in [(8, 8), (16, 8), (32, 4), (32, 2), (32, 1), (64, 1), (128, 1), (12, 4)] {
        push(format!("bf16_bf16::gqa_{hq}q_{hkv}kv"), Case { q_heads: hq, kv_heads: hkv, ..Case::base(&[33, 2000]) }, "bf16_bf16");
    }
    for layout in KvLayout::ALL {
        push(format!("bf16_bf16::layout_{layout:?}"), Case { layout, ..Case::base(&[100, 1500]) }, "bf16_bf16");
    }
    for bs in [32, 64] {
        push(format!("bf16_bf16::block_size_{bs}"), Case { block_size: bs, ..Case::base(&lens) }, "bf16_bf16");
    }
    let spec_lens = [9, 40, 1000, 3];
    push("bf16_bf16::spec_decode_q_lens_1_3_8_2".into(), Case { q_lens: vec![1, 3, 8, 2], ..Case::base(&spec_lens) }, "bf16_bf16");
    push(
        "f16_fp8::spec_decode_gqa16".into(),
        Case { q_lens: vec![2, 8, 4, 3], q_heads: 32, kv_heads: 2, ..Case::base(&spec_lens) },
        "f16_fp8",
    );
    push("bf16_bf16::window_100".into(), Case { window: Some(100), ..Case::base(&lens) }, "bf16_bf16");
    push(
        "bf16_bf16::window_7_smaller_than_block".into(),
        Case { window: Some(7), q_lens: vec![1, 2, 1, 4, 1], ..Case::base(&lens) },
        "bf16_bf16",
    );
    push("bf16_bf16::softcap_alibi_sinks".into(), Case { softcap: Some(5.0), alibi: true, sinks: true, ..Case::base(&lens) }, "bf16_bf16");
    push(
        "f16_fp8::all_features_spec".into(),
        Case { softcap: Some(8.0), alibi: true, sinks: true, window: Some(64), q_lens: vec![3, 1, 8, 2], ..Case::base(&spec_lens) },
        "f16_fp8",
    );
    // Empty requests (0 query tokens) are decodes that produce nothing, between real ones.
    let empty = Case { q_lens: vec![1, 0, 3, 0, 2], ..Case::base(&[40, 17, 300, 0, 4097]) };
    push("bf16_bf16::empty_requests".into(), empty.clone(), "bf16_bf16");
    push("bf16_bf16::empty_requests_planned".into(), Case { planned: true, ..empty.clone() }, "bf16_bf16");
    push("f16_fp8::empty_requests".into(), empty, "f16_fp8");
    push("bf16_bf16::split_fixed_1_deterministic".into(), Case { split: SplitMode::Fixed(1), ..Case::base(&lens) }, "bf16_bf16");
    push("bf16_bf16::planned_two_layers".into(), Case { planned: true, sinks: true, ..Case::base(&[4096, 1, 333, 17, 2500]) }, "bf16_bf16");
    push("bf16_fp8::planned_mtp_3".into(), Case { planned: true, q_lens: vec![3, 1, 3], ..Case::base(&[900, 1, 64]) }, "bf16_fp8");
    push("bf16_bf16::split_fixed_7".into(), Case { split: SplitMode::Fixed(7), sinks: true, ..Case::base(&lens) }, "bf16_bf16");
    push("bf16_bf16::one_long_among_short".into(), Case { ..Case::base(&[20000, 3, 5, 1, 2, 7, 9, 16]) }, "bf16_bf16");
    push("bf16_bf16::empty_requests".into(), Case { sinks: true, ..Case::base(&[0, 5, 0, 300]) }, "bf16_bf16");
    push(
        "bf16_bf16::window_leaves_one_split".into(),
        Case { window: Some(20), split: SplitMode::Fixed(16), ..Case::base(&[8000, 4000]) },
        "bf16_bf16",
    );
    push("bf16_bf16::bad_block_id".into(), Case { bad_block: true, ..Case::base(&[100, 40]) }, "bf16_bf16");
    // Equal splits per request: the keys-rows kernels derive the items and partial rows from
    // the CTA index (nothing uploaded) and merge in pass 1; speculative tokens move the
    // partial bases, a window empties most splits, FP8 takes the deep kernel.
    push("bf16_bf16::uniform_splits_sinks".into(), Case { split: SplitMode::Fixed(4), sinks: true, ..Case::base(&[3001; 6]) }, "bf16_bf16");
    push(
        "f16_f16::uniform_splits_spec_2".into(),
        Case { split: SplitMode::Fixed(3), q_lens: vec![2; 5], alibi: true, ..Case::base(&[1500; 5]) },
        "f16_f16",
    );
    push(
        "bf16_bf16::uniform_splits_window_empties".into(),
        Case { split: SplitMode::Fixed(8), window: Some(20), sinks: true, ..Case::base(&[5000, 5000, 5000]) },
        "bf16_bf16",
    );
    push("bf16_fp8::uniform_splits_long".into(), Case { split: SplitMode::Fixed(5), sinks: true, ..Case::base(&[2500; 4]) }, "bf16_fp8");
    // One long request unsplit: on Hopper an FP8 cache's O^T adds up in the `wgmma`
    // accumulators across all of its tiles (1,024 here), and a drift with the length would show.
    push("bf16_fp8::one_long_request_unsplit".into(), Case { split: SplitMode::Fixed(1), ..Case::base(&[65_536]) }, "bf16_fp8");
    push(
        "bf16_bf16::uniform_splits_d256".into(),
        Case { split: SplitMode::Fixed(2), head_size: 256, ..Case::base(&[700; 3]) },
        "bf16_bf16",
    );
    push("bf16_bf16::uniform_splits_d96".into(), Case { split: SplitMode::Fixed(6), head_size: 96, ..Case::base(&[900; 3]) }, "bf16_bf16");
    // The FP8 decode shape (one query token, up to 16 rows per kv head) reads its fragments
    // straight from the staged FP8 rows at head sizes 64 and 128: its features, masks and
    // odd shapes, with bf16 queries (scaled into f16's range).
    push("bf16_fp8::head_size_64".into(), Case { head_size: 64, ..Case::base(&lens) }, "bf16_fp8");
    push(
        "bf16_fp8::softcap_alibi_sinks_window".into(),
        Case { softcap: Some(6.0), alibi: true, sinks: true, window: Some(300), ..Case::base(&lens) },
        "bf16_fp8",
    );
    push("bf16_fp8::bad_block_id".into(), Case { bad_block: true, ..Case::base(&[100, 40]) }, "bf16_fp8");
    // A request of 2048 keys or more takes the deep-pipeline FP8 kernels (`keys_rows::FP8_LONG_KEYS`).
    push("bf16_fp8::long_bad_block_id".into(), Case { bad_block: true, ..Case::base(&[2048, 40]) }, "bf16_fp8");
    push("f16_fp8::long_planned_sinks".into(), Case { planned: true, sinks: true, ..Case::base(&[3000, 1, 2047]) }, "f16_fp8");
    push("bf16_fp8::block_size_64".into(), Case { block_size: 64, ..Case::base(&lens) }, "bf16_fp8");
    push("bf16_fp8::gqa_32q_32kv".into(), Case { q_heads: 32, kv_heads: 32, ..Case::base(&[33, 2000]) }, "bf16_fp8");
    push("bf16_fp8::gqa_16q_1kv".into(), Case { q_heads: 16, kv_heads: 1, ..Case::base(&[33, 2000]) }, "bf16_fp8");
    // One scale per kv head: the keys-as-rows kernels (d64, d128, d96 at width 128, GQA 4 and
    // 16, split-K), the tensor-core one (d256).
    for (d, hq, hkv, dt) in
        [(128, 32, 8, "bf16_fp8"), (64, 16, 4, "f16_fp8"), (128, 32, 2, "f16_fp8"), (96, 8, 8, "bf16_fp8"), (256, 16, 4, "bf16_fp8")]
    {
        let case = Case { head_size: d, q_heads: hq, kv_heads: hkv, per_head_scales: true, sinks: true, ..Case::base(&[5, 2100, 333]) };
        push(format!("{dt}::per_head_scales_d{d}_{hq}q{hkv}kv"), case, dt);
    }
    push("bf16_fp8::split_fixed_7".into(), Case { split: SplitMode::Fixed(7), ..Case::base(&lens) }, "bf16_fp8");
    // One request of 20000 keys under a sliding window, every row with two dominant keys at
    // its mask's edges (the first key of its window, its own position) and the keys just
    // outside them as strong: one key too many or too few at either edge moves every row far
    // past the tolerance (`common::masking`; tests/cpu_decode/edge_markers.rs checks that it
    // does). The windows start inside a block; speculative tokens move each row's edges by
    // one; 8 rows per kv head take the keys-as-rows kernel, with its splits merged in the
    // kernel.
    let edges = |q_len: i32, window: u32| Case { q_lens: vec![q_len], window: Some(window), edge_markers: true, ..Case::base(&[20000]) };
    push("bf16_bf16::long_window_edges".into(), edges(1, 4093), "bf16_bf16");
    push("bf16_bf16::long_window_edges_spec_4".into(), edges(4, 3001), "bf16_bf16");
    push("f16_f16::long_window_edges_d64_gqa8".into(), Case { head_size: 64, q_heads: 16, kv_heads: 2, ..edges(1, 2050) }, "f16_f16");
    push("bf16_bf16::long_window_edges_split_7".into(), Case { split: SplitMode::Fixed(7), ..edges(3, 9000) }, "bf16_bf16");
    // 9 to 16 rows per kv head: the keys-as-rows kernel's two column groups (16-bit caches up
    // to head size 128), splits merged in the kernel; FP8 and d256 take the 16-row score tiles.
    let gqa16 = |lens: &[i32]| Case { q_heads: 32, kv_heads: 2, ..Case::base(lens) };
    push(
        "bf16_bf16::gqa16_split_fixed_5".into(),
        Case { split: SplitMode::Fixed(5), sinks: true, ..gqa16(&[3001, 700, 4097, 1]) },
        "bf16_bf16",
    );
    push("bf16_fp8::gqa16_long_split_fixed_3".into(), Case { split: SplitMode::Fixed(3), ..gqa16(&[2500; 3]) }, "bf16_fp8");
    // One split a request over whole contexts (the deterministic mode): each CTA streams its
    // request's every key, its output written without a merge.
    push("bf16_bf16::gqa16_split_fixed_1".into(), Case { split: SplitMode::Fixed(1), ..gqa16(&[4096, 4096, 4093, 1, 2049]) }, "bf16_bf16");
    push("bf16_fp8::gqa16_split_fixed_1".into(), Case { split: SplitMode::Fixed(1), ..gqa16(&[4096, 4093, 1, 2049]) }, "bf16_fp8");
    push("bf16_bf16::gqa16_planned_two_layers".into(), Case { planned: true, alibi: true, ..gqa16(&lens) }, "bf16_bf16");
    push(
        "f16_f16::spec_2_gqa8_16_rows".into(),
        Case { q_lens: vec![2, 1, 2], q_heads: 16, kv_heads: 2, split: SplitMode::Fixed(4), ..Case::base(&[1500, 900, 3000]) },
        "f16_f16",
    );
    // E5M2 caches: each FP8 kernel kind once more (keys as rows at widths 64 and 128, short,
    // deep and two-group; 16-row tiles at 256; the `_a8` twins at odd multiples of 8).
    for (d, hq, hkv, lens) in [
        (128, 32, 8, &[1, 17, 300, 1000, 4097][..]),
        (64, 16, 1, &[33, 2000][..]),
        (256, 16, 4, &[5, 777, 2100][..]),
        (80, 32, 2, &[5, 777, 2100][..]),
        (72, 32, 4, &[5, 777, 2100][..]),
        (40, 32, 4, &[5, 777][..]),
        (120, 64, 8, &[5, 777, 2100][..]),
        (136, 16, 2, &[5, 777][..]),
    ] {
        let case = Case { head_size: d, q_heads: hq, kv_heads: hkv, gapped: true, ..Case::base(lens) };
        push(format!("bf16_e5m2::gapped_head_size_{d}_{hq}q{hkv}kv"), case.clone(), "bf16_e5m2");
        push(
            format!("f16_e5m2::gapped_head_size_{d}_per_head_scales_mtp"),
            Case { per_head_scales: true, q_lens: lens.iter().zip([2, 1, 3].iter().cycle()).map(|(&l, &q)| q.min(l)).collect(), ..case },
            "f16_e5m2",
        );
    }
    push("bf16_e5m2::long_planned_sinks".into(), Case { planned: true, sinks: true, ..Case::base(&[3000, 1, 2047]) }, "bf16_e5m2");
    push(
        "f16_e5m2::softcap_alibi_sinks_window_bad_block_id".into(),
        Case { softcap: Some(30.0), alibi: true, sinks: true, window: Some(300), bad_block: true, ..Case::base(&[100, 1500]) },
        "f16_e5m2",
    );
    push("bf16_bf16::long_window_edges_gqa16".into(), Case { q_heads: 32, kv_heads: 2, ..edges(1, 4093) }, "bf16_bf16");
    // The FP8 keys-as-rows kernels take two slabs a step (one for a last odd slab): window
    // edges in either slab of a step, an odd window and odd lengths, the short-batch and
    // deep-pipeline forms, two column groups, width 64 and a bad block in the second slab.
    push("bf16_fp8::long_window_edges".into(), edges(1, 4093), "bf16_fp8");
    push("f16_fp8::long_window_edges_spec_3_gqa16".into(), Case { q_heads: 32, kv_heads: 2, ..edges(3, 3001) }, "f16_fp8");
    push(
        "bf16_e5m2::long_window_edges_d64_split_5".into(),
        Case { head_size: 64, split: SplitMode::Fixed(5), ..edges(2, 2050) },
        "bf16_e5m2",
    );
    // 16-bit GQA 16 at width 96 (two CTAs an SM, four stages): two slabs a step as well.
    push("bf16_bf16::long_window_edges_gqa16_d96".into(), Case { head_size: 96, q_heads: 32, kv_heads: 2, ..edges(2, 3001) }, "bf16_bf16");
    push("f16_f16::gqa16_d80_odd_tiles".into(), Case { head_size: 80, ..gqa16(&[1, 79, 207, 4097]) }, "f16_f16");
    push(
        "f16_fp8::window_odd_tiles_bad_block".into(),
        Case { window: Some(81), bad_block: true, ..Case::base(&[81, 1000, 15, 207, 1]) },
        "f16_fp8",
    );
    push("f16_f16::gqa16_d64_split_fixed_3".into(), Case { head_size: 64, split: SplitMode::Fixed(3), ..gqa16(&[2000, 77]) }, "f16_f16");
    // 16-bit width 64 up to 8 rows a kv head (on sm_90a the keys-on-M kernel of 8 rows): one
    // row (MHA), speculative tokens up to 8 rows, the variants and a bad block, HND, splits.
    push("bf16_bf16::mha_d64".into(), Case { head_size: 64, q_heads: 16, kv_heads: 16, ..Case::base(&lens) }, "bf16_bf16");
    push(
        "f16_f16::d64_spec_softcap_alibi_sinks_window_bad_block".into(),
        Case {
            head_size: 64,
            q_lens: vec![2, 1, 2, 1],
            softcap: Some(6.0),
            alibi: true,
            sinks: true,
            window: Some(150),
            bad_block: true,
            ..Case::base(&[2, 300, 1000, 4097])
        },
        "f16_f16",
    );
    push(
        "bf16_bf16::d64_hnd_split_fixed_3_gapped_56".into(),
        Case { head_size: 56, layout: KvLayout::FlashHnd, split: SplitMode::Fixed(3), gapped: true, ..Case::base(&[1, 900, 2100]) },
        "bf16_bf16",
    );
    push("bf16_bf16::gqa16_d256".into(), Case { head_size: 256, ..gqa16(&[2000, 77]) }, "bf16_bf16");
    // FP8 at width 256: up to 8 rows the deep-pipeline keys-as-rows kernel (planned split-K,
    // merged in the kernel), 16 rows the 16-row score tiles.
    push("bf16_fp8::gqa16_d256".into(), Case { head_size: 256, ..gqa16(&[2000, 77]) }, "bf16_fp8");
    push(
        "f16_fp8::long_planned_sinks_d256".into(),
        Case { head_size: 256, q_heads: 16, kv_heads: 2, planned: true, sinks: true, ..Case::base(&[6000, 1, 2047]) },
        "f16_fp8",
    );
    // 16 splits or more merge in two levels inside pass 1 (`attn_math::params::merge_group_splits`):
    // groups of splits, a last group of one, splits a window empties, speculative tokens'
    // rows, equal splits (no plan on the device), the 16-row kernels at widths 64 to 128.
    push(
        "bf16_bf16::two_level_merge_132".into(),
        Case { split: SplitMode::Fixed(132), sinks: true, ..gqa16(&[20000, 1, 8000]) },
        "bf16_bf16",
    );
    push("bf16_fp8::two_level_merge_gqa16_40".into(), Case { split: SplitMode::Fixed(40), ..gqa16(&[9000, 333, 2100]) }, "bf16_fp8");
    push(
        "bf16_bf16::two_level_merge_17".into(),
        Case { split: SplitMode::Fixed(17), alibi: true, ..Case::base(&[4097, 5, 3001]) },
        "bf16_bf16",
    );
    push(
        "bf16_bf16::two_level_merge_window_empties".into(),
        Case { split: SplitMode::Fixed(33), window: Some(300), sinks: true, ..Case::base(&[20000, 9000]) },
        "bf16_bf16",
    );
    push(
        "f16_f16::two_level_merge_spec_3".into(),
        Case { split: SplitMode::Fixed(24), q_lens: vec![3, 1], ..Case::base(&[6000, 2500]) },
        "f16_f16",
    );
    push("bf16_bf16::two_level_merge_uniform".into(), Case { split: SplitMode::Fixed(20), ..Case::base(&[5000; 3]) }, "bf16_bf16");
    push("f16_fp8::two_level_merge_uniform_30".into(), Case { split: SplitMode::Fixed(30), ..Case::base(&[7001; 2]) }, "f16_fp8");
    push("f16_f16::two_level_merge_gqa16_d96".into(), Case { head_size: 96, split: SplitMode::Fixed(17), ..gqa16(&[3001, 40]) }, "f16_f16");
    push("bf16_bf16::two_level_merge_gqa16_d64_planned".into(), Case { head_size: 64, planned: true, ..gqa16(&[60000, 3]) }, "bf16_bf16");
    v
}

fn main() {
    let mut trials = Vec::new();
    let all = cases();
    let picked: Vec<_> = if quick() { all.into_iter().step_by(4).collect() } else { all };
    for (i, (name, case, dt)) in picked.into_iter().enumerate() {
        let s = 1000 + i as u64;
        let f: Box<dyn FnOnce() -> TestResult + Send> = match dt {
            "bf16_bf16" => Box::new(move || decode_case::<bf16, bf16>(case, s)),
            "f16_f16" => Box::new(move || decode_case::<f16, f16>(case, s)),
            "bf16_fp8" => Box::new(move || decode_case::<bf16, Fp8E4m3>(case, s)),
            "f16_fp8" => Box::new(move || decode_case::<f16, Fp8E4m3>(case, s)),
            "bf16_e5m2" => Box::new(move || decode_case::<bf16, Fp8E5m2>(case, s)),
            "f16_e5m2" => Box::new(move || decode_case::<f16, Fp8E5m2>(case, s)),
            other => unreachable!("dtype pair {other}"),
        };
        trials.push(Trial::test(format!("decode::{name}"), f));
    }
    trials.push(Trial::test("decode::after_cache_write", || after_cache_write_case(1, 7001)));
    trials.push(Trial::test("decode::after_cache_write_spec_3", || after_cache_write_case(3, 7002)));
    trials.push(Trial::test("merge_attn_states::bf16", || merge_case::<bf16>(37, 8, 128, 1)));
    trials.push(Trial::test("merge_attn_states::f16", || merge_case::<f16>(5, 3, 64, 2)));
    trials.push(Trial::test("merge_attn_states::f32", || merge_case::<f32>(64, 4, 256, 3)));
    run_gpu_trials(trials)
}
