//! GPU tensor-core prefill against the f64 CPU reference, on random data with poisoned outputs:
//! lengths around the tile sizes, chunked prefill (query shorter than the sequence), head sizes
//! (QK 192 / V 128 too), GQA ratios, causal or not, window / soft-cap / ALiBi / sinks, paged and
//! packed K/V, cache layouts and block sizes, empty requests and bad block ids.

mod common;

use attn_rs::cache_write::KvScales;
use attn_rs::prefill::{prefill, PrefillArgs, PrefillKv, PrefillOptions, PrefillWorkspace};
use attn_rs::AttnOptions;
use attn_rs::{cpu, BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, Fp8E5m2, KvCacheSpec, KvLayout, RowsDesc};
use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use libtest_mimic::Trial;
use rand::Rng;

#[derive(Clone, Debug)]
struct Case {
    layout: KvLayout,
    dk: usize,
    dv: usize,
    q_heads: usize,
    kv_heads: usize,
    block_size: usize,
    seq_lens: Vec<i32>,
    /// New tokens per request (the last ones of the sequence); `None` = the whole sequence.
    q_lens: Option<Vec<i32>>,
    causal: bool,
    packed: bool,
    window: Option<u32>,
    softcap: Option<f32>,
    alibi: bool,
    sinks: bool,
    bad_block: bool,
    /// The one request's queries and window-edge and diagonal keys planted so that every row
    /// has two dominant keys at its mask's edges (`plant_edge_markers`; paged, causal, with a
    /// window and 16-bit K).
    edge_markers: bool,
    /// FP8: one K and one V scale per kv head (else one per tensor).
    per_head_scales: bool,
    /// Queries, outputs and packed K/V with a gap after every head (`common::gapped_rows`):
    /// NaN in the inputs' gaps, poison in the outputs' (checked untouched).
    gapped: bool,
}

impl Case {
    fn base(seq_lens: &[i32]) -> Self {
        Case {
            layout: KvLayout::FlashNhd,
            dk: 128,
            dv: 128,
            q_heads: 8,
            kv_heads: 2,
            block_size: 16,
            seq_lens: seq_lens.to_vec(),
            q_lens: None,
            causal: true,
            packed: false,
            window: None,
            softcap: None,
            alibi: false,
            sinks: false,
            bad_block: false,
            edge_markers: false,
            per_head_scales: false,
            gapped: false,
        }
    }
}

fn prefill_case<Q: Element, C: Element>(c: Case, salt: u64) -> TestResult {
    let fp8 = C::DTYPE.is_fp8();
    let (ks, vs): (Vec<f32>, Vec<f32>) = match c.per_head_scales {
        true => (0..c.kv_heads).map(|h| (0.035 + 0.03 * h as f32 / c.kv_heads as f32, 0.04 - 0.02 * h as f32 / c.kv_heads as f32)).unzip(),
        false => (vec![0.05], vec![0.03]),
    };
    let scales = if c.per_head_scales { cpu::HostScales::PerHead(&ks, &vs) } else { cpu::HostScales::Tensor(ks[0], vs[0]) };
    let mut rng = rng(salt);
    let stream = new_stream();
    let (dk, dv, hq, hkv) = (c.dk, c.dv, c.q_heads, c.kv_heads);
    let num_reqs = c.seq_lens.len();
    let q_lens = c.q_lens.clone().unwrap_or_else(|| c.seq_lens.clone());
    let mut qsl = vec![0i32];
    for &q in &q_lens {
        qsl.push(qsl.last().unwrap() + q);
    }
    let mut ksl = vec![0i32];
    for &l in &c.seq_lens {
        ksl.push(ksl.last().unwrap() + l);
    }
    let nt = *qsl.last().unwrap() as usize;
    let rows = |n: usize, h: usize, d: usize| if c.gapped { gapped_rows(n, h, d) } else { RowsDesc::contiguous(n, h, d) };
    let (q_rows, out_rows) = (rows(nt, hq, dk), rows(nt, hq, dv));
    let mut q: Vec<Q> = spread(&random_vec::<Q>(&mut rng, nt * hq * dk, 1.0), &q_rows, Q::from_f32(f32::NAN));
    q.resize(q.len().max(1), Q::from_f32(0.0));
    let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
    let sinks: Vec<f32> = (0..hq).map(|_| rng.random_range(-2.0..4.0)).collect();
    let mut opts = AttnOptions::new(dk);
    opts.window = c.window;
    opts.softcap = c.softcap;

    // Paged: a cache with scattered block tables. Packed: K and V rows.
    let BlockTables { table: block_table, stride, num_blocks } =
        scattered_block_tables(&mut rng, &c.seq_lens, c.block_size, 3, c.bad_block);
    let spec = KvCacheSpec::new(c.layout, num_blocks, c.block_size, hkv, dk)?;
    let total_keys = *ksl.last().unwrap() as usize;
    let (k_rows, v_rows) = (rows(total_keys, hkv, dk), rows(total_keys, hkv, dv));
    // An FP8 cache holds values up to ~20 (x the scales: keys and values of a few units).
    let mut cache: Vec<C> = random_vec(&mut rng, if c.packed { 1 } else { spec.num_elements() }, if fp8 { 20.0 } else { 1.0 });
    let packed_rows = |rows: &RowsDesc, rng: &mut rand::rngs::SmallRng| {
        let mut x = spread(&random_vec::<C>(rng, rows.num_tokens * rows.num_heads * rows.head_size, 1.0), rows, C::from_f32(f32::NAN));
        x.resize(x.len().max(1), C::from_f32(0.0));
        x
    };
    let k: Vec<C> = if c.packed { packed_rows(&k_rows, &mut rng) } else { vec![C::from_f32(0.0)] };
    let v: Vec<C> = if c.packed { packed_rows(&v_rows, &mut rng) } else { vec![C::from_f32(0.0)] };
    if c.edge_markers {
        assert!(c.causal && !c.packed && !fp8 && num_reqs == 1, "edge markers: one paged causal request, 16-bit cache");
        let m = MarkedRequest {
            q0: 0,
            q_len: nt,
            seq_len: c.seq_lens[0] as usize,
            window: c.window.expect("edge markers need a window") as usize,
            num_kv_heads: hkv,
            softmax_scale: opts.softmax_scale,
        };
        let key_at =
            |pos: usize, kvh: usize, x: usize| spec.offset(0, block_table[pos / c.block_size] as usize, pos % c.block_size, kvh, x);
        plant_edge_markers(&mut rng, &m, &mut q, q_rows, &mut cache, key_at);
    }

    let kv_ref = if c.packed {
        cpu::KvRef::Packed { k: &k, k_rows, v: &v, v_rows, key_start_loc: &ksl }
    } else {
        cpu::KvRef::Paged { cache: &cache, spec, block_table: &block_table, block_table_stride: stride }
    };
    let want = cpu::prefill(&cpu::PrefillRef {
        q: &q,
        q_rows,
        kv: kv_ref,
        head_size_v: dv,
        query_start_loc: &qsl,
        seq_lens: &c.seq_lens,
        causal: c.causal,
        opts,
        alibi_slopes: c.alibi.then_some(&slopes[..]),
        sinks: c.sinks.then_some(&sinks[..]),
        scales: fp8.then_some(scales),
    })?;

    let up = |v: &[i32]| upload(&stream, v);
    let (q_d, cache_d, k_d, v_d) = (upload(&stream, &q), upload(&stream, &cache), upload(&stream, &k), upload(&stream, &v));
    let bt_d = up(&block_table);
    let batch = match c.packed {
        true => BatchMetadata::with_key_start_loc(&stream, &c.seq_lens, &qsl, &ksl)?,
        false => BatchMetadata::new(&stream, &c.seq_lens, &qsl)?,
    };
    let (slopes_d, sinks_d) = (upload(&stream, &slopes), upload(&stream, &sinks));
    let (ks_d, vs_d) = (upload(&stream, &ks), upload(&stream, &vs));
    let mut ws = PrefillWorkspace::new(&stream, nt, num_reqs, hq / hkv)?;
    let mut status = DeviceStatus::new(&stream)?;
    // Twice with one workspace, the output poisoned again: the persistent kernel's work counter
    // must be back at zero for the second launch.
    let mut out_d: CudaSlice<Q>;
    let mut lse_d: CudaSlice<f32>;
    let mut runs = 0;
    let plan = loop {
        out_d = upload(&stream, &vec![poison::<Q>(); out_rows.required_len().max(1)]);
        lse_d = upload(&stream, &vec![f32::NAN; (nt * hq).max(1)]);
        let kv = if c.packed {
            PrefillKv::Packed { k: DevIn::new(&k_d, &stream), k_rows, v: DevIn::new(&v_d, &stream), v_rows }
        } else {
            PrefillKv::Paged {
                cache: DevIn::new(&cache_d, &stream),
                spec,
                block_table: DevIn::new(&bt_d, &stream),
                block_table_stride: stride,
            }
        };
        let plan = prefill(
            device(),
            &stream,
            PrefillArgs {
                q: DevIn::new(&q_d, &stream),
                q_rows,
                kv,
                out: DevOut::new(&mut out_d, &stream),
                out_rows,
                lse: Some(DevOut::new(&mut lse_d, &stream)),
                alibi_slopes: c.alibi.then(|| DevIn::new(&slopes_d, &stream)),
                sinks: c.sinks.then(|| DevIn::new(&sinks_d, &stream)),
                scales: fp8.then(|| KvScales { k: DevIn::new(&ks_d, &stream), v: DevIn::new(&vs_d, &stream) }),
            },
            &batch,
            &PrefillOptions { attn: opts, causal: c.causal },
            &mut ws,
            &mut status,
        )?;
        runs += 1;
        if runs == 2 {
            break plan;
        }
    };
    let flags = status.take(&stream)?;
    check_block_status(flags, &want, &block_table, stride, num_blocks, true)?;
    check_found_bad_block(&batch, &bt_d, &stream, stride, c.block_size, num_blocks, &want)?;
    let out = download(&stream, &out_d);
    check_gaps(&out[..out_rows.required_len()], &out_rows, poison::<Q>())?;
    let mut got: Vec<f64> = packed(&out, &out_rows).iter().map(|x| x.to_f32() as f64).collect();
    let mut lse: Vec<f32> = download(&stream, &lse_d);
    let mut want = want;
    if let Some(bad) = want.first_bad_block.filter(|_| c.bad_block) {
        // The request with the bad block reads zeros there (the reference skips the key): only
        // the other requests' rows are compared, and they must be exact as ever.
        let (t0, t1) = (qsl[bad.request as usize] as usize, qsl[bad.request as usize + 1] as usize);
        got.drain(t0 * hq * dv..t1 * hq * dv);
        want.out.drain(t0 * hq * dv..t1 * hq * dv);
        lse.drain(t0 * hq..t1 * hq);
        want.lse.drain(t0 * hq..t1 * hq);
    }
    let nt = got.len() / (hq * dv);
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!(
            "output element {i} (token {}, head {}) is {} ({} tiles)",
            i / (hq * dv),
            i / dv % hq,
            got[i],
            plan.items.len()
        )
        .into());
    }
    // The global norm, and row by row: one row wrong alone (a key masked wrongly at a long
    // context) hardly moves the global norm.
    let err = rel_error(&got, &want.out);
    let worst = max_row_error(&got, &want.out, dv);
    let e4m3 = fp8 && attn_rs::prefill::fp8_prefill_rounds_to_e4m3(device(), dk, dv);
    let (tol, row_tol, lse_tol) = bounds(Q::DTYPE, e4m3);
    if e4m3 {
        let lse_err = lse[..nt * hq]
            .iter()
            .zip(&want.lse[..nt * hq])
            .filter(|(_, w)| w.is_finite())
            .map(|(&g, &w)| (g as f64 - w).abs() / w.abs().max(1.0))
            .fold(0.0, f64::max);
        eprintln!("e4m3 d{dk}: relative error {err:.3e}, worst row {:.3e}, log-sum-exp {lse_err:.3e}", worst.err);
    }
    if !within(err, tol) || !worst.within(row_tol) {
        return Err(format!(
            "relative error {err:.2e} (at most {tol:.0e}); worst row {:.2e} (at most {row_tol:.0e}): token {}, head {} ({} tiles)",
            worst.err,
            worst.row / hq,
            worst.row % hq,
            plan.items.len()
        )
        .into());
    }
    check_lse_within(&lse[..nt * hq], &want.lse[..nt * hq], hq, lse_tol)?;
    Ok(())
}

fn cases() -> Vec<(String, Case, &'static str)> {
    let mut v: Vec<(String, Case, &'static str)> = Vec::new();
    let mut push = |name: String, c: Case, dt: &'static str| v.push((name, c, dt));
    let lens = [1, 15, 16, 17, 127, 1000];
    push("bf16::lengths_1_15_16_17_127_1000".into(), Case::base(&lens), "bf16");
    push("f16::lengths_1_15_16_17_127_1000".into(), Case::base(&lens), "f16");
    push("bf16::length_4097".into(), Case { q_heads: 2, kv_heads: 1, ..Case::base(&[4097]) }, "bf16");
    push("bf16::chunked_prefill".into(), Case { q_lens: Some(vec![1, 64, 100, 7, 300]), ..Case::base(&[50, 64, 700, 1000, 301]) }, "bf16");
    // Many more work items than CTAs (the persistent kernel runs one CTA an SM): 700 requests
    // of 1 to 40 keys, their last 1 to 3 tokens as queries, two kv heads, so that each CTA takes
    // about ten items one after another and reuses each item descriptor slot and query buffer
    // several times; 16-bit and e4m3 stages.
    let many: Vec<i32> = (0..700).map(|i| 1 + (i * 37) % 40).collect();
    let many_q: Vec<i32> = many.iter().enumerate().map(|(i, &s)| (1 + i as i32 % 3).min(s)).collect();
    let many_items = Case { q_lens: Some(many_q), ..Case::base(&many) };
    push("bf16::many_items".into(), many_items.clone(), "bf16");
    push("bf16_fp8::many_items".into(), many_items, "bf16_fp8");
    // Head sizes below a kernel's width (`attn_math::decode::width`), with gaps after every
    // head of the queries, outputs and packed K/V (NaN in the inputs'): 40 and 56 on width 64
    // (the Hopper kernel), 80 on 96, 112 on 128 (Hopper), 136 and 200 on 256; paged and packed,
    // causal and not, chunked; FP8 caches too (the odd multiples of 8 on the `_fp8_a8`
    // kernels, whose rows are copied in 8-byte halves: 40 and 56 on the Hopper width-64
    // kernel, 72 and 120 on its e4m3 widths 80 and 128, 136 and 200 on the `mma.sync` width
    // 256, which the Hopper width 256 leaves them: `hopper_prefill::ws_takes_a8`).
    for (d, hq, hkv) in [(40, 8, 2), (56, 4, 4), (72, 8, 2), (80, 8, 1), (112, 16, 2), (120, 8, 1), (136, 4, 2), (200, 8, 4)] {
        let case = Case { dk: d, dv: d, q_heads: hq, kv_heads: hkv, gapped: true, ..Case::base(&[17, 300, 129, 1]) };
        push(format!("bf16::gapped_head_size_{d}"), Case { sinks: true, ..case.clone() }, "bf16");
        push(format!("f16::gapped_head_size_{d}_packed_noncausal"), Case { packed: true, causal: false, ..case.clone() }, "f16");
        push(
            format!("bf16::gapped_head_size_{d}_packed_chunked"),
            Case { packed: true, q_lens: Some(vec![5, 100, 33, 1]), ..case.clone() },
            "bf16",
        );
        push(format!("f16_fp8::gapped_head_size_{d}_chunked"), Case { q_lens: Some(vec![5, 100, 33, 1]), ..case.clone() }, "f16_fp8");
        if d % 16 == 8 {
            // Long enough for 10 key tiles; the f64 reference's time grows with the square.
            let long = Case { seq_lens: vec![640, 77], q_lens: None, per_head_scales: true, ..case };
            push(format!("bf16_fp8::gapped_head_size_{d}_long_per_head_scales"), long, "bf16_fp8");
        }
    }
    for (dk, dv) in [(64, 64), (96, 96), (256, 256)] {
        push(format!("bf16::head_size_{dk}"), Case { dk, dv, ..Case::base(&[17, 300, 129]) }, "bf16");
        push(format!("f16::head_size_{dk}_chunked"), Case { dk, dv, q_lens: Some(vec![5, 100, 33]), ..Case::base(&[17, 300, 129]) }, "f16");
    }
    // The Hopper kernel's (`prefill_wgs_*`, persistent) two shapes get a matrix each: d64 (half
    // tiles in flight) and d256 (32-key steps, one query buffer): the lengths, many tiles (the
    // last partial; 2049 keys at d256, whose f64 reference is four times d64's work a key),
    // GQA 8, non-causal, every feature, block size 64 and a bad block id, empty requests. The
    // many-tile case is named without `d<width>_` so that a sanitizer run filtered on `d256_`
    // stays short.
    // Every feature at once, chunked: the matrices below take it at their shapes.
    let all_features =
        Case { softcap: Some(8.0), alibi: true, sinks: true, window: Some(64), q_lens: Some(vec![3, 100, 8]), ..Case::base(&[40, 500, 8]) };
    for (d, long) in [(64, 4097), (256, 2049)] {
        let width = |c: Case| Case { dk: d, dv: d, ..c };
        push(format!("bf16::d{d}_lengths_1_15_16_17_127_1000"), width(Case::base(&lens)), "bf16");
        push(format!("f16::length_{long}_gqa8_head_size_{d}"), width(Case { q_heads: 8, kv_heads: 1, ..Case::base(&[long]) }), "f16");
        push(format!("bf16::d{d}_non_causal"), width(Case { causal: false, ..Case::base(&[1, 17, 300]) }), "bf16");
        let features = width(all_features.clone());
        push(format!("bf16::d{d}_all_features_chunked"), features.clone(), "bf16");
        if d == 256 {
            // FP8 at width 256 on Hopper: the producer converts quarter-tile stages from a raw
            // ring of three.
            push(format!("f16_fp8::d{d}_all_features_chunked"), features, "f16_fp8");
        }
        push(
            format!("bf16::d{d}_block_size_64_bad_block_id"),
            width(Case { block_size: 64, bad_block: true, ..Case::base(&[100, 333]) }),
            "bf16",
        );
        push(
            format!("f16::d{d}_empty_requests_gqa4"),
            width(Case { q_lens: Some(vec![0, 5, 0, 130]), q_heads: 8, kv_heads: 2, ..Case::base(&[0, 5, 7, 200]) }),
            "f16",
        );
    }
    let d64 = |c: Case| Case { dk: 64, dv: 64, ..c };
    let d256 = |c: Case| Case { dk: 256, dv: 256, ..c };
    // FP8 at width 256 on Hopper (converted stages): many tiles (the last partial), empty
    // requests and a bad block id.
    push("bf16_fp8::length_2049_gqa4_head_size_256".into(), d256(Case { q_heads: 8, kv_heads: 2, ..Case::base(&[2049, 130]) }), "bf16_fp8");
    push(
        "bf16_fp8::d256_empty_requests_block_size_64_bad_block_id".into(),
        d256(Case { block_size: 64, bad_block: true, q_lens: Some(vec![0, 5, 0, 130]), ..Case::base(&[0, 5, 7, 333]) }),
        "bf16_fp8",
    );
    push(
        "bf16::mla_qk192_v128_packed".into(),
        Case { dk: 192, dv: 128, packed: true, q_heads: 16, kv_heads: 16, ..Case::base(&[1, 70, 300]) },
        "bf16",
    );
    push(
        "f16::mla_qk192_v128_packed_chunked".into(),
        Case { dk: 192, dv: 128, packed: true, q_heads: 4, kv_heads: 4, q_lens: Some(vec![1, 20, 64]), ..Case::base(&[1, 70, 300]) },
        "f16",
    );
    // QK 192 / V 128 on the Hopper kernel (`prefill_wgs_<q>_dk192_dv128`: Q and K rows of three
    // swizzle atoms, copied an atom at a time, one query buffer), packed K/V as DeepSeek's prefill
    // passes them: the lengths, many tiles (the last partial), GQA 8, non-causal, every feature,
    // empty requests, gaps after every head, many items a CTA.
    let qk_v = |c: Case| Case { dk: 192, dv: 128, packed: true, ..c };
    push("bf16::qk192_v128_lengths_1_15_16_17_127_1000".into(), qk_v(Case::base(&lens)), "bf16");
    push("f16::length_2049_gqa8_qk192_v128".into(), qk_v(Case { q_heads: 8, kv_heads: 1, ..Case::base(&[2049]) }), "f16");
    push("bf16::qk192_v128_non_causal".into(), qk_v(Case { causal: false, ..Case::base(&[1, 17, 300]) }), "bf16");
    push("bf16::qk192_v128_all_features_chunked".into(), qk_v(all_features), "bf16");
    push(
        "f16::qk192_v128_empty_requests_gqa4".into(),
        qk_v(Case { q_lens: Some(vec![0, 5, 0, 130]), q_heads: 8, kv_heads: 2, ..Case::base(&[0, 5, 7, 200]) }),
        "f16",
    );
    push("bf16::qk192_v128_gapped".into(), qk_v(Case { gapped: true, ..Case::base(&[17, 300, 129, 1]) }), "bf16");
    let many: Vec<i32> = (0..300).map(|i| 1 + (i * 37) % 40).collect();
    let many_q: Vec<i32> = many.iter().enumerate().map(|(i, &s)| (1 + i as i32 % 3).min(s)).collect();
    push("bf16::qk192_v128_many_items".into(), qk_v(Case { q_lens: Some(many_q), ..Case::base(&many) }), "bf16");
    for (hq, hkv) in [(4, 4), (8, 2), (16, 2), (16, 1), (12, 4)] {
        push(format!("bf16::gqa_{hq}q_{hkv}kv"), Case { q_heads: hq, kv_heads: hkv, ..Case::base(&[33, 200, 5]) }, "bf16");
    }
    push("bf16::non_causal".into(), Case { causal: false, ..Case::base(&[1, 17, 200]) }, "bf16");
    push("bf16::non_causal_packed_encoder".into(), Case { causal: false, packed: true, ..Case::base(&[3, 130, 64]) }, "bf16");
    push(
        "bf16::non_causal_queries_shorter".into(),
        Case { causal: false, q_lens: Some(vec![1, 40, 9]), ..Case::base(&[10, 300, 9]) },
        "bf16",
    );
    push("bf16::window_100".into(), Case { window: Some(100), ..Case::base(&[50, 300, 1000]) }, "bf16");
    push("bf16::window_7_chunked".into(), Case { window: Some(7), q_lens: Some(vec![3, 70, 1]), ..Case::base(&[50, 300, 1000]) }, "bf16");
    push("bf16::softcap".into(), Case { softcap: Some(5.0), ..Case::base(&[50, 300]) }, "bf16");
    push("f16::alibi".into(), Case { alibi: true, ..Case::base(&[50, 300]) }, "f16");
    push("bf16::sinks".into(), Case { sinks: true, ..Case::base(&[1, 50, 300]) }, "bf16");
    push(
        "f16::all_features_chunked".into(),
        Case { softcap: Some(8.0), alibi: true, sinks: true, window: Some(64), q_lens: Some(vec![3, 100, 8]), ..Case::base(&[40, 500, 8]) },
        "f16",
    );
    for layout in KvLayout::ALL {
        push(format!("bf16::layout_{layout:?}"), Case { layout, ..Case::base(&[100, 33]) }, "bf16");
        // Width 256 copies stages with TMA where the layout allows (tokens or heads evenly
        // spaced across blocks) and rows otherwise.
        push(format!("bf16::d256_layout_{layout:?}"), d256(Case { layout, ..Case::base(&[100, 33, 260]) }), "bf16");
    }
    for bs in [32, 64] {
        push(format!("bf16::block_size_{bs}"), Case { block_size: bs, ..Case::base(&[100, 333]) }, "bf16");
    }
    push("bf16::empty_requests".into(), Case { q_lens: Some(vec![0, 5, 0, 0]), sinks: true, ..Case::base(&[0, 5, 7, 0]) }, "bf16");
    push("bf16::bad_block_id".into(), Case { bad_block: true, ..Case::base(&[100, 40]) }, "bf16");
    push("bf16_fp8::lengths".into(), Case::base(&[1, 17, 127, 1000]), "bf16_fp8");
    push(
        "bf16_fp8::per_head_scales".into(),
        Case { kv_heads: 4, q_heads: 16, per_head_scales: true, ..Case::base(&[1, 77, 700]) },
        "bf16_fp8",
    );
    push("f16_fp8::per_head_scales_d64".into(), Case { dk: 64, dv: 64, per_head_scales: true, ..Case::base(&[33, 400]) }, "f16_fp8");
    push(
        "f16_fp8::chunked_gqa".into(),
        Case { q_lens: Some(vec![1, 64, 100]), q_heads: 16, kv_heads: 2, ..Case::base(&[50, 64, 700]) },
        "f16_fp8",
    );
    for (dk, layout) in [(64, KvLayout::FlashHnd), (96, KvLayout::FlashInferNhd), (256, KvLayout::FlashNhd)] {
        push(format!("bf16_fp8::head_size_{dk}_{layout:?}"), Case { dk, dv: dk, layout, ..Case::base(&[17, 300]) }, "bf16_fp8");
    }
    push(
        "bf16_fp8::features".into(),
        Case { softcap: Some(8.0), alibi: true, sinks: true, window: Some(64), ..Case::base(&[40, 500]) },
        "bf16_fp8",
    );
    // On Hopper FP8 caches at widths 64 to 128 run `prefill_wgs_*_fp8` (raw rows converted by
    // the producer two stages behind their copies, the rest converted at each item's end):
    // many tiles, items of one stage and of none, a bad block id.
    push("bf16_fp8::length_4097_gqa4".into(), Case { q_heads: 4, kv_heads: 1, ..Case::base(&[4097]) }, "bf16_fp8");
    push(
        "f16_fp8::d64_length_2049_gqa4_chunked".into(),
        Case { dk: 64, dv: 64, q_heads: 8, kv_heads: 2, q_lens: Some(vec![2049, 1, 130]), ..Case::base(&[2049, 300, 130]) },
        "f16_fp8",
    );
    push(
        "bf16_fp8::empty_requests_block_size_64_bad_block_id".into(),
        Case { block_size: 64, bad_block: true, q_lens: Some(vec![0, 5, 0, 130]), ..Case::base(&[0, 5, 7, 333]) },
        "bf16_fp8",
    );
    // E5M2 caches: each prefill kernel kind once more (Hopper's widths 64 and 256 on converted
    // rows, its FP8 `wgmma` widths 80 to 128, the `_a8` twins at odd
    // multiples of 8), chunked, per-head scales, features, a bad block id.
    for (d, hq, hkv) in [(128, 8, 2), (64, 4, 1), (256, 4, 2), (96, 8, 8), (72, 8, 2), (40, 8, 2), (136, 4, 2)] {
        let case = Case { dk: d, dv: d, q_heads: hq, kv_heads: hkv, gapped: d % 16 == 8, ..Case::base(&[17, 300, 129, 1]) };
        push(format!("bf16_e5m2::head_size_{d}"), case.clone(), "bf16_e5m2");
        push(
            format!("f16_e5m2::head_size_{d}_chunked_per_head_scales"),
            Case { q_lens: Some(vec![5, 100, 33, 1]), per_head_scales: true, ..case },
            "f16_e5m2",
        );
    }
    push("bf16_e5m2::length_2049_gqa4".into(), Case { q_heads: 4, kv_heads: 1, ..Case::base(&[2049]) }, "bf16_e5m2");
    push(
        "bf16_e5m2::features".into(),
        Case { softcap: Some(8.0), alibi: true, sinks: true, window: Some(64), ..Case::base(&[40, 500]) },
        "bf16_e5m2",
    );
    push(
        "f16_e5m2::empty_requests_block_size_64_bad_block_id".into(),
        Case { block_size: 64, bad_block: true, q_lens: Some(vec![0, 5, 0, 130]), ..Case::base(&[0, 5, 7, 333]) },
        "f16_e5m2",
    );
    // The last tokens of one request of 20000 keys (chunked prefill at a long context) under a
    // sliding window, every row with two dominant keys at its mask's edges (the first key of
    // its window, its own position) and the keys just outside them as strong: one key too many
    // or too few at either edge moves every row far past the tolerance (`common::masking`;
    // tests/cpu_decode/edge_markers.rs checks that it does). Windows and chunks start inside
    // blocks and tiles; d64 runs `prefill_wgs_*` on Hopper.
    let edges = |q_len: i32, window: u32| Case {
        q_heads: 4,
        kv_heads: 1,
        q_lens: Some(vec![q_len]),
        window: Some(window),
        edge_markers: true,
        ..Case::base(&[20000])
    };
    push("bf16::long_window_edges_d64".into(), d64(edges(128, 1537)), "bf16");
    push("bf16::long_window_edges_d64_block_size_64".into(), d64(Case { block_size: 64, ..edges(200, 3333) }), "bf16");
    push("f16::long_window_edges_d128".into(), edges(96, 2001), "f16");
    push("bf16::long_window_edges_head_size_256".into(), d256(edges(160, 2500)), "bf16");
    v
}

fn main() {
    let mut trials = Vec::new();
    let all = cases();
    // The quick matrix (under the sanitizers): every fourth case, and both cases of many items
    // a CTA, which are what makes the persistent kernel reuse its descriptor slots and query
    // buffers (in the others a CTA takes one or two items unless launches overlap).
    let picked: Vec<_> = if quick() {
        all.into_iter().enumerate().filter(|(i, (name, ..))| i % 4 == 0 || name.contains("many_items")).map(|(_, c)| c).collect()
    } else {
        all
    };
    for (i, (name, case, dt)) in picked.into_iter().enumerate() {
        let s = 3000 + i as u64;
        let f: Box<dyn FnOnce() -> TestResult + Send> = match dt {
            "bf16" => Box::new(move || prefill_case::<bf16, bf16>(case, s)),
            "bf16_fp8" => Box::new(move || prefill_case::<bf16, Fp8E4m3>(case, s)),
            "f16_fp8" => Box::new(move || prefill_case::<f16, Fp8E4m3>(case, s)),
            "bf16_e5m2" => Box::new(move || prefill_case::<bf16, Fp8E5m2>(case, s)),
            "f16_e5m2" => Box::new(move || prefill_case::<f16, Fp8E5m2>(case, s)),
            "f16" => Box::new(move || prefill_case::<f16, f16>(case, s)),
            other => unreachable!("dtype pair {other}"),
        };
        trials.push(Trial::test(format!("prefill::{name}"), f));
    }
    run_gpu_trials(trials)
}
