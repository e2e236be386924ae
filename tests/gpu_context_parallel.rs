//! Context-parallel decode on one GPU: a batch's contexts dealt across N ranks (each rank its
//! own cache, written by the GPU cache write with the rank's slot mapping), each rank's decode
//! over its share into its part, the parts exchanged on the device and merged on every rank.
//! Every rank's merged output must be the same bit for bit and match the f64 reference of the
//! whole (unsharded) context: N in {2, 3, 4}, interleaves 1 and 16 (and 64 with blocks of 64),
//! odd lengths, one-token and empty requests, GQA 1 to 16, scattered tables, FP8 caches (per
//! tensor and per head), soft-cap and sinks. Also the refusals of the shard's arguments and of
//! the buffers.

mod common;

use attn_rs::cache_write::{reshape_and_cache, KvScales, KvWrite};
use attn_rs::context_parallel::{CpDecode, CpShard};
use attn_rs::decode::{paged_decode, DecodeArgs, DecodeBatch, DecodeWorkspace};
use attn_rs::{
    cpu, AttnOptions, BatchMetadata, DType, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc, SplitMode,
};
use common::*;
use cudarc::driver::CudaSlice;
use half::{bf16, f16};
use libtest_mimic::Trial;
use rand::Rng;

#[derive(Clone, Debug)]
struct Case {
    ranks: usize,
    interleave: usize,
    block_size: usize,
    layout: KvLayout,
    head_size: usize,
    q_heads: usize,
    kv_heads: usize,
    seq_lens: Vec<i32>,
    softcap: Option<f32>,
    sinks: bool,
    per_head_scales: bool,
}

impl Case {
    fn base(ranks: usize, seq_lens: &[i32]) -> Self {
        Case {
            ranks,
            interleave: 1,
            block_size: 16,
            layout: KvLayout::FlashNhd,
            head_size: 128,
            q_heads: 32,
            kv_heads: 8,
            seq_lens: seq_lens.to_vec(),
            softcap: None,
            sinks: false,
            per_head_scales: false,
        }
    }
}

fn start_locs(lens: impl Iterator<Item = i32>) -> Vec<i32> {
    let mut qsl = vec![0i32];
    for l in lens {
        qsl.push(qsl.last().unwrap() + l);
    }
    qsl
}

fn cp_case<Q: Element + std::fmt::Debug, C: Element>(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let stream = new_stream();
    let dev = device();
    let fp8 = C::DTYPE.is_fp8();
    let (d, hq, hkv, bs, n) = (c.head_size, c.q_heads, c.kv_heads, c.block_size, c.ranks);
    let num_reqs = c.seq_lens.len();
    // The whole contexts' keys and values, token by token (request after request).
    let ctx_qsl = start_locs(c.seq_lens.iter().copied());
    let ctx_tokens = *ctx_qsl.last().unwrap() as usize;
    let kv_rows = RowsDesc::contiguous(ctx_tokens, hkv, d);
    let (k_all, v_all): (Vec<Q>, Vec<Q>) =
        (random_vec(&mut rng, kv_rows.required_len().max(1), 1.0), random_vec(&mut rng, kv_rows.required_len().max(1), 1.0));
    let (ks, vs): (Vec<f32>, Vec<f32>) = match c.per_head_scales {
        true => (0..hkv).map(|h| (0.035 + 0.03 * h as f32 / hkv as f32, 0.04 - 0.02 * h as f32 / hkv as f32)).unzip(),
        false => (vec![0.05], vec![0.03]),
    };
    let host_scales = if c.per_head_scales { cpu::HostScales::PerHead(&ks, &vs) } else { cpu::HostScales::Tensor(ks[0], vs[0]) };
    let sinks: Vec<f32> = (0..hq).map(|_| rng.random_range(-2.0..4.0)).collect();
    let mut opts = AttnOptions::new(d);
    opts.softcap = c.softcap;

    // The reference: the whole contexts in one cache (world size 1), f64.
    let one = CpShard::new(1, 0, 1)?;
    let ref_tables = scattered_block_tables(&mut rng, &c.seq_lens, bs, 3, false);
    let ref_spec = KvCacheSpec::new(c.layout, ref_tables.num_blocks, bs, hkv, d)?;
    let ref_step = one.shard_step(&ctx_qsl, &c.seq_lens, &ref_tables.table, ref_tables.stride, bs, ref_tables.num_blocks)?;
    let mut ref_cache = vec![C::from_f32(0.0); ref_spec.num_elements()];
    cpu::reshape_and_cache(
        &k_all,
        kv_rows,
        &v_all,
        kv_rows,
        &ref_step.slot_mapping,
        &mut ref_cache,
        &ref_spec,
        fp8.then_some(host_scales),
    )?;
    let dec_qsl: Vec<i32> = (0..=num_reqs as i32).collect();
    let q_rows = RowsDesc::contiguous(num_reqs, hq, d);
    let q: Vec<Q> = random_vec(&mut rng, q_rows.required_len().max(1), 1.0);
    let want = cpu::paged_decode(&cpu::DecodeRef {
        q: &q,
        q_rows,
        cache: &ref_cache,
        spec: ref_spec,
        block_table: &ref_tables.table,
        block_table_stride: ref_tables.stride,
        batch: DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &dec_qsl },
        opts,
        alibi_slopes: None,
        sinks: c.sinks.then_some(&sinks[..]),
        scales: fp8.then_some(host_scales),
    })?;

    // The group's table: an entry per `block_size * ranks` positions, one cache per rank.
    let tables = scattered_block_tables(&mut rng, &c.seq_lens, bs * n, 2, false);
    let spec = KvCacheSpec::new(c.layout, tables.num_blocks, bs, hkv, d)?;
    let (k_d, v_d) = (upload(&stream, &k_all), upload(&stream, &v_all));
    let (q_d, bt_d, sinks_d) = (upload(&stream, &q), upload(&stream, &tables.table), upload(&stream, &sinks));
    let (ks_d, vs_d) = (upload(&stream, &ks), upload(&stream, &vs));
    let scales = || fp8.then(|| KvScales { k: DevIn::new(&ks_d, &stream), v: DevIn::new(&vs_d, &stream) });
    let mut status = DeviceStatus::new(&stream)?;
    let mut ws = DecodeWorkspace::new(&stream, 4096 * hq, d, num_reqs.max(1), num_reqs.max(1))?;
    let mut parts = Vec::new();
    let mut caches: Vec<CudaSlice<C>> = Vec::new();
    for rank in 0..n {
        let shard = CpShard::new(n, rank, c.interleave)?;
        // Every context position written by its owner only (the others' slots are -1).
        let ctx = shard.shard_step(&ctx_qsl, &c.seq_lens, &tables.table, tables.stride, bs, tables.num_blocks)?;
        let owned = ctx.slot_mapping.iter().filter(|&&s| s >= 0).count();
        let expected: usize = c.seq_lens.iter().map(|&l| shard.local_len(l as usize)).sum();
        if owned != expected {
            return Err(format!("rank {rank} writes {owned} tokens, its local lengths sum to {expected}").into());
        }
        let mut cache_d = upload(&stream, &vec![poison::<C>(); spec.num_elements()]);
        let slots_d = upload(&stream, &ctx.slot_mapping);
        let w = KvWrite {
            key: DevIn::new(&k_d, &stream),
            key_rows: kv_rows,
            value: DevIn::new(&v_d, &stream),
            value_rows: kv_rows,
            slot_mapping: DevIn::new(&slots_d, &stream),
            cache: DevOut::new(&mut cache_d, &stream),
            spec,
            scales: scales(),
        };
        reshape_and_cache(dev, &stream, w, &mut status)?;
        // The decode step: each request's last token, over the rank's share.
        let step = shard.shard_step(&dec_qsl, &c.seq_lens, &tables.table, tables.stride, bs, tables.num_blocks)?;
        let meta = BatchMetadata::new(&stream, &step.local_seq_lens, &dec_qsl)?;
        let mut part = CpDecode::new(&stream, shard, Q::DTYPE, q_rows.required_len(), num_reqs * hq)?;
        {
            let (out, lse) = part.partial_out(&q_rows)?;
            let a = DecodeArgs {
                q: DevIn::new(&q_d, &stream),
                q_rows,
                cache: DevIn::new(&cache_d, &stream),
                spec,
                block_table: DevIn::new(&bt_d, &stream),
                block_table_stride: tables.stride,
                out,
                out_rows: q_rows,
                lse: Some(lse),
                alibi_slopes: None,
                // The sinks join one rank's softmax: rank 0's.
                sinks: (c.sinks && rank == 0).then(|| DevIn::new(&sinks_d, &stream)),
                scales: scales(),
            };
            paged_decode(dev, &stream, a, &meta, &opts, SplitMode::Auto, &mut ws, &mut status)?;
        }
        caches.push(cache_d);
        parts.push(part);
    }
    status.take(&stream)?.into_result()?;
    CpDecode::exchange_on_one_device(&mut parts, &stream, &q_rows)?;
    let mut outs = Vec::new();
    for part in parts.iter_mut() {
        let mut out_d: CudaSlice<Q> = upload(&stream, &vec![poison::<Q>(); q_rows.required_len().max(1)]);
        let mut lse_d: CudaSlice<f32> = upload(&stream, &vec![f32::NAN; (num_reqs * hq).max(1)]);
        part.merge(dev, &stream, DevOut::new(&mut out_d, &stream), &q_rows, Some(DevOut::new(&mut lse_d, &stream)))?;
        outs.push((download(&stream, &out_d), download(&stream, &lse_d)));
    }
    for (rank, (o, l)) in outs.iter().enumerate().skip(1) {
        let bits = |x: &Q| x.to_f32().to_bits() as u64;
        let m = bitwise_mismatches(o, &outs[0].0, bits);
        if !m.is_empty() || l.iter().zip(&outs[0].1).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("rank {rank}'s merged output differs from rank 0's: {m:?}").into());
        }
    }
    let (out, lse) = &outs[0];
    let got: Vec<f64> = out[..q_rows.required_len()].iter().map(|x| x.to_f32() as f64).collect();
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        return Err(format!("output element {i} is {} (unwritten or NaN)", got[i]).into());
    }
    // On Hopper FP8 decode may round the queries and weights to e4m3 (`fp8_decode_rounds_to_e4m3`).
    let (tol, row_tol, lse_tol) = bounds(Q::DTYPE, fp8 && attn_rs::decode::fp8_decode_rounds_to_e4m3(dev, d, hq / hkv));
    let err = rel_error(&got, &want.out);
    if !within(err, tol) {
        return Err(format!("relative error {err:.2e} > {tol:.0e}").into());
    }
    check_rows_within(&got, &want.out, d, hq, row_tol)?;
    check_lse_within(&lse[..num_reqs * hq], &want.lse[..num_reqs * hq], hq, lse_tol)?;
    Ok(())
}

/// What context-parallel decode refuses, before anything runs.
fn refusals() -> TestResult {
    let shard = CpShard::new(2, 1, 4)?;
    let expect_err = |r: attn_rs::Result<attn_rs::context_parallel::ShardedStep>, arg: &str| -> TestResult {
        match r {
            Err(attn_rs::AttnError::InvalidArgument { arg: a, .. }) if a == arg => Ok(()),
            other => Err(format!("expected a refusal naming `{arg}`, got {other:?}").into()),
        }
    };
    // A block size that is not a multiple of the interleave.
    expect_err(shard.shard_step(&[0, 1], &[5], &[0], 1, 6, 4), "block_size")?;
    // A table row too short for its request: 40 tokens need 2 entries of 2 x 16.
    expect_err(shard.shard_step(&[0, 1], &[40], &[0], 1, 16, 4), "block_table_stride")?;
    // A block id outside the cache for a token this rank holds (position 39 is rank 1's).
    expect_err(shard.shard_step(&[0, 1], &[40], &[0, 9], 2, 16, 4), "block_table")?;
    for (w, r, i, arg) in [(0, 0, 1, "world_size"), (2, 2, 1, "rank"), (2, 0, 0, "interleave")] {
        match CpShard::new(w, r, i) {
            Err(attn_rs::AttnError::InvalidArgument { arg: a, .. }) if a == arg => {}
            other => return Err(format!("CpShard::new({w}, {r}, {i}): expected a refusal naming `{arg}`, got {other:?}").into()),
        }
    }
    let stream = new_stream();
    let mut part = CpDecode::new(&stream, shard, DType::BF16, 8 * 4 * 64, 8 * 4)?;
    // Rows past the capacity the buffers were made for.
    match part.partial_out(&RowsDesc::contiguous(9, 4, 64)) {
        Err(attn_rs::AttnError::InvalidArgument { arg: "out_rows", .. }) => {}
        other => return Err(format!("expected a refusal naming `out_rows`, got {:?}", other.map(|_| ())).into()),
    }
    // The exchange takes the ranks of one group in order.
    let mut wrong = vec![
        CpDecode::new(&stream, CpShard::new(2, 1, 1)?, DType::BF16, 64, 1)?,
        CpDecode::new(&stream, CpShard::new(2, 0, 1)?, DType::BF16, 64, 1)?,
    ];
    match CpDecode::exchange_on_one_device(&mut wrong, &stream, &RowsDesc::contiguous(1, 1, 64)) {
        Err(attn_rs::AttnError::InvalidArgument { arg: "ranks", .. }) => {}
        other => return Err(format!("expected a refusal naming `ranks`, got {other:?}").into()),
    }
    // A rank that left its group (its exchange dropped) fails the others' exchange, not hangs it.
    let mut group = attn_rs::context_parallel::LocalGroup::new(2)?;
    drop(group.pop());
    let mut ex = group.pop().expect("rank 0");
    let mut p0 = CpDecode::new(&stream, CpShard::new(2, 0, 1)?, DType::BF16, 64, 1)?;
    match p0.exchange_with(&mut ex, &RowsDesc::contiguous(1, 1, 64)) {
        Err(attn_rs::AttnError::InvalidArgument { arg: "exchange", reason }) if reason.contains("rank 1") => Ok(()),
        other => Err(format!("expected the exchange to fail naming rank 1, got {other:?}").into()),
    }
}

/// What every rank of [`forward_cp_case`] reads: the contexts' keys and values before the
/// steps, each step's new ones and queries, the sinks, the group's tables.
struct RankInputs {
    k_init: Vec<bf16>,
    v_init: Vec<bf16>,
    step_kv: Vec<(Vec<bf16>, Vec<bf16>)>,
    qs: Vec<Vec<bf16>>,
    sink_logits: Vec<f32>,
    tables: BlockTables,
    init: Vec<i32>,
}

/// `forward` with context parallelism: `n` ranks on one device, one thread each (their own
/// stream, cache and `Attention`, exchanging through a `LocalGroup`). The contexts are written
/// with the ops (each rank its share), then `steps` decode steps run through `forward`, each
/// writing `q_len` tokens a request (more than one: speculative tokens); every rank's output must equal the others' bit for bit and
/// match the f64 reference of the whole context.
fn forward_cp_case<C: Element + Send + Sync + 'static>(n: usize, interleave: usize, sinks: bool, q_len: usize, salt: u64) -> TestResult {
    use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
    use attn_rs::context_parallel::LocalGroup;
    use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv};
    use attn_rs::metadata::StepInput;
    let mut rng = rng(salt);
    let (hq, hkv, d, bs, steps) = (32, 8, 128, 16, 3);
    let fp8 = C::DTYPE.is_fp8();
    let init: Vec<i32> = vec![1, 5, 16, 333, 1000, 2047, 31];
    let nr = init.len();
    let finals: Vec<i32> = init.iter().map(|&l| l + (steps * q_len) as i32).collect();
    let fin_qsl = start_locs(finals.iter().copied());
    let all_rows = RowsDesc::contiguous(*fin_qsl.last().unwrap() as usize, hkv, d);
    let (k_all, v_all): (Vec<bf16>, Vec<bf16>) =
        (random_vec(&mut rng, all_rows.required_len(), 1.0), random_vec(&mut rng, all_rows.required_len(), 1.0));
    // Rows of `k_all`/`v_all` at (request, position) pairs, as a contiguous tensor.
    let gather = |src: &[bf16], at: &[(usize, usize)]| -> Vec<bf16> {
        at.iter().flat_map(|&(r, p)| src[(fin_qsl[r] as usize + p) * hkv * d..][..hkv * d].to_vec()).collect()
    };
    let nt = nr * q_len;
    let q_rows = RowsDesc::contiguous(nt, hq, d);
    let qs: Vec<Vec<bf16>> = (0..steps).map(|_| random_vec(&mut rng, q_rows.required_len(), 1.0)).collect();
    let sink_logits: Vec<f32> = (0..hq).map(|_| rng.random_range(-2.0..3.0)).collect();
    let (ks, vs) = (vec![0.05f32], vec![0.03f32]);
    let features = Features { sinks, sliding_window: false, softcap: true, alibi: false };
    let model = ModelConfig {
        cache_dtype: C::DTYPE,
        ..ModelConfig::standard(hq, hkv, d, DType::BF16, bs, KvLayout::FlashNhd).with_features(features)
    };
    let tables = scattered_block_tables(&mut rng, &finals, bs * n, 2, false);
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 16, max_model_len: 4096 };
    let mut config = ForwardConfig::new(model, tables.num_blocks, limits);
    config.opts.softcap = Some(30.0);
    config.decode_threshold = q_len;

    // The f64 reference of each step over the whole contexts.
    let one = CpShard::new(1, 0, 1)?;
    let ref_tables = scattered_block_tables(&mut rng, &finals, bs, 1, false);
    let ref_spec = KvCacheSpec::new(KvLayout::FlashNhd, ref_tables.num_blocks, bs, hkv, d)?;
    let ref_slots = one.shard_step(&fin_qsl, &finals, &ref_tables.table, ref_tables.stride, bs, ref_tables.num_blocks)?.slot_mapping;
    let mut ref_cache = vec![C::from_f32(0.0); ref_spec.num_elements()];
    let host_scales = cpu::HostScales::Tensor(ks[0], vs[0]);
    cpu::reshape_and_cache(&k_all, all_rows, &v_all, all_rows, &ref_slots, &mut ref_cache, &ref_spec, fp8.then_some(host_scales))?;
    let dec_qsl: Vec<i32> = (0..=nr as i32).map(|r| r * q_len as i32).collect();
    let mut wants = Vec::new();
    for (s, q) in qs.iter().enumerate() {
        let lens: Vec<i32> = init.iter().map(|&l| l + ((s + 1) * q_len) as i32).collect();
        wants.push(cpu::paged_decode(&cpu::DecodeRef {
            q,
            q_rows,
            cache: &ref_cache,
            spec: ref_spec,
            block_table: &ref_tables.table,
            block_table_stride: ref_tables.stride,
            batch: DecodeBatch { seq_lens: &lens, query_start_loc: &dec_qsl },
            opts: config.opts,
            alibi_slopes: None,
            sinks: sinks.then_some(&sink_logits[..]),
            scales: fp8.then_some(host_scales),
        })?);
    }

    let dev = arc_device();
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let init_at: Vec<(usize, usize)> = init.iter().enumerate().flat_map(|(r, &l)| (0..l as usize).map(move |p| (r, p))).collect();
    let (k_init, v_init) = (gather(&k_all, &init_at), gather(&v_all, &init_at));
    let step_kv: Vec<(Vec<bf16>, Vec<bf16>)> = (0..steps)
        .map(|s| {
            let at: Vec<(usize, usize)> =
                init.iter().enumerate().flat_map(|(r, &l)| (0..q_len).map(move |i| (r, l as usize + s * q_len + i))).collect();
            (gather(&k_all, &at), gather(&v_all, &at))
        })
        .collect();
    let shared = std::sync::Arc::new(RankInputs { k_init, v_init, step_kv, qs, sink_logits, tables, init: init.clone() });
    let run_rank = move |ex: LocalGroup, config: ForwardConfig, shared: std::sync::Arc<RankInputs>| -> Result<Vec<Vec<bf16>>, String> {
        let RankInputs { k_init, v_init, step_kv, qs, sink_logits, tables, init } = &*shared;
        let e = |x: attn_rs::AttnError| x.to_string();
        let shard = config.context_parallel.expect("a rank's config");
        let stream = dev.context().new_stream().map_err(|x| x.to_string())?;
        let mut attn = Attention::new(&sel, config, Some(GpuHandles { dev: dev.clone(), stream: stream.clone() })).map_err(e)?;
        attn.set_cp_exchange(Box::new(ex)).map_err(e)?;
        let spec = match attn.cache_spec() {
            attn_rs::forward::CacheSpec::Paged(s) => s,
            other => return Err(format!("{other:?}")),
        };
        let mut cache: CudaSlice<C> = upload(&stream, &vec![poison::<C>(); spec.num_elements()]);
        let (ks_d, vs_d, sinks_d) = (upload(&stream, &ks), upload(&stream, &vs), upload(&stream, sink_logits));
        // The contexts before the steps: each rank writes its share with the cache write op.
        let init_qsl = start_locs(init.iter().copied());
        let ctx = shard.shard_step(&init_qsl, init, &tables.table, tables.stride, bs, tables.num_blocks).map_err(e)?;
        let rows = RowsDesc::contiguous(*init_qsl.last().unwrap() as usize, hkv, d);
        let (k_d, v_d, slots_d) = (upload(&stream, k_init), upload(&stream, v_init), upload(&stream, &ctx.slot_mapping));
        let mut status = DeviceStatus::new(&stream).map_err(e)?;
        let w = KvWrite {
            key: DevIn::new(&k_d, &stream),
            key_rows: rows,
            value: DevIn::new(&v_d, &stream),
            value_rows: rows,
            slot_mapping: DevIn::new(&slots_d, &stream),
            cache: DevOut::new(&mut cache, &stream),
            spec,
            scales: fp8.then(|| KvScales { k: DevIn::new(&ks_d, &stream), v: DevIn::new(&vs_d, &stream) }),
        };
        reshape_and_cache(dev.as_ref(), &stream, w, &mut status).map_err(e)?;
        let mut step = attn.new_step_metadata().map_err(e)?;
        let mut outs = Vec::new();
        for (s, ((k, v), q)) in step_kv.iter().zip(qs).enumerate() {
            let lens: Vec<i32> = init.iter().map(|&l| l + ((s + 1) * q_len) as i32).collect();
            // The group's step as the engine has it; the rank's slots come from its table.
            let slots = vec![-1i64; nt];
            step.build(&StepInput {
                query_start_loc: &dec_qsl,
                seq_lens: &lens,
                block_table: &tables.table,
                block_table_stride: tables.stride,
                slot_mapping: &slots,
                num_actual_tokens: nt,
                num_blocks: tables.num_blocks,
                block_size: bs,
            })
            .map_err(e)?;
            let kv_rows = RowsDesc::contiguous(nt, hkv, d);
            let (q_d, k_d, v_d) = (upload(&stream, q), upload(&stream, k), upload(&stream, v));
            let mut out_d: CudaSlice<bf16> = upload(&stream, &vec![poison::<bf16>(); q_rows.required_len()]);
            attn.forward(
                &step,
                LayerIo::Gpu(GpuLayer {
                    q: DevIn::new(&q_d, &stream),
                    q_rows,
                    new_kv: NewKv::Standard {
                        k: DevIn::new(&k_d, &stream),
                        k_rows: kv_rows,
                        v: DevIn::new(&v_d, &stream),
                        v_rows: kv_rows,
                    },
                    cache: DevOut::new(&mut cache, &stream),
                    out: DevOut::new(&mut out_d, &stream),
                    out_rows: q_rows,
                    alibi_slopes: None,
                    sinks: sinks.then(|| DevIn::new(&sinks_d, &stream)),
                    kv_scales: fp8.then(|| (DevIn::new(&ks_d, &stream), DevIn::new(&vs_d, &stream))),
                }),
            )
            .map_err(e)?;
            outs.push(download(&stream, &out_d));
        }
        attn.check_status().map_err(e)?;
        Ok(outs)
    };
    let handles: Vec<_> = LocalGroup::new(n)?
        .into_iter()
        .enumerate()
        .map(|(rank, ex)| {
            let config =
                ForwardConfig { context_parallel: Some(CpShard::new(n, rank, interleave).expect("a valid shard")), ..config.clone() };
            let (shared, run_rank) = (shared.clone(), run_rank.clone());
            std::thread::spawn(move || run_rank(ex, config, shared))
        })
        .collect();
    let outs: Vec<Vec<Vec<bf16>>> = handles.into_iter().map(|h| h.join().expect("a rank's thread")).collect::<Result<_, _>>()?;
    // On Hopper FP8 decode may round the queries and weights to e4m3 (`fp8_decode_rounds_to_e4m3`).
    let (_, row_tol, _) = bounds(DType::BF16, fp8 && attn_rs::decode::fp8_decode_rounds_to_e4m3(device(), d, q_len * (hq / hkv)));
    for (s, want) in wants.iter().enumerate() {
        for (rank, o) in outs.iter().enumerate().skip(1) {
            if o[s].iter().zip(&outs[0][s]).any(|(a, b)| a.to_bits() != b.to_bits()) {
                return Err(format!("step {s}: rank {rank}'s output differs from rank 0's").into());
            }
        }
        let got: Vec<f64> = outs[0][s].iter().map(|x| x.to_f64()).collect();
        check_rows_within(&got, &want.out, d, hq, row_tol).map_err(|m| format!("step {s}: {m}"))?;
    }
    Ok(())
}

/// What every rank of [`mla_cp_case`] reads: the contexts' latents and rope keys (request
/// after request), the queries, the lengths and their start locations.
struct MlaInputs {
    kv_c: Vec<bf16>,
    k_pe: Vec<bf16>,
    q: Vec<bf16>,
    lens: Vec<i32>,
    qsl: Vec<i32>,
}

/// MLA: `n` ranks on one device, one thread each (their own stream and latent cache, written
/// by the GPU latent cache write with the rank's slots), each running `CpDecode::decode_mla`
/// over a `LocalGroup`; every rank's output equal bit for bit and within bound of the f64
/// reference of the whole latent contexts.
/// With `forward`, the same through `Attention::forward` on the `mla` backend: the contexts but
/// each request's last token written with the op, that token by the step.
fn mla_cp_case<C: Element + Send + Sync + 'static>(n: usize, interleave: usize, hq: usize, forward: bool, salt: u64) -> TestResult {
    use attn_rs::cache_write::{concat_and_cache_mla, MlaWrite};
    use attn_rs::context_parallel::LocalGroup;
    use attn_rs::mla::MlaArgs;
    use attn_rs::MlaCacheSpec;
    const QK: usize = 576;
    const V: usize = 512;
    let mut rng = rng(salt);
    let fp8 = C::DTYPE.is_fp8();
    let bs = 64;
    // A step through `forward` has a token a request: no empty request there.
    let lens: Vec<i32> = [1, 0, 63, 64, 65, 777, 2048, 4097].into_iter().map(|l| if forward { l.max(1) } else { l }).collect();
    let nr = lens.len();
    let qsl = start_locs(lens.iter().copied());
    let tokens = *qsl.last().unwrap() as usize;
    let (kv_c, k_pe): (Vec<bf16>, Vec<bf16>) =
        (random_vec(&mut rng, (tokens * 512).max(1), 1.0), random_vec(&mut rng, (tokens * 64).max(1), 1.0));
    let q_rows = RowsDesc::contiguous(nr, hq, QK);
    let out_rows = RowsDesc::contiguous(nr, hq, V);
    let q: Vec<bf16> = random_vec(&mut rng, q_rows.required_len(), 1.0);
    let scale = 0.05f32;
    let opts = AttnOptions::new(QK);
    // The reference: the whole latent contexts in one cache.
    let one = CpShard::new(1, 0, 1)?;
    let ref_tables = scattered_block_tables(&mut rng, &lens, bs, 1, false);
    let ref_spec = MlaCacheSpec::deepseek(ref_tables.num_blocks, bs)?;
    let ref_slots = one.shard_step(&qsl, &lens, &ref_tables.table, ref_tables.stride, bs, ref_tables.num_blocks)?.slot_mapping;
    let mut ref_cache = vec![C::from_f32(0.0); ref_spec.num_elements()];
    cpu::concat_and_cache_mla(&kv_c, 512, &k_pe, 64, tokens, &ref_slots, &mut ref_cache, &ref_spec, fp8.then_some(scale))?;
    let dec_qsl: Vec<i32> = (0..=nr as i32).collect();
    let want = cpu::prefill(&cpu::PrefillRef {
        q: &q,
        q_rows,
        kv: cpu::KvRef::Mla { cache: &ref_cache, spec: ref_spec, block_table: &ref_tables.table, block_table_stride: ref_tables.stride },
        head_size_v: V,
        query_start_loc: &dec_qsl,
        seq_lens: &lens,
        causal: true,
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: fp8.then_some((scale, scale).into()),
    })?;
    let tables = std::sync::Arc::new(scattered_block_tables(&mut rng, &lens, bs * n, 2, false));
    let inputs = std::sync::Arc::new(MlaInputs { kv_c, k_pe, q, lens: lens.clone(), qsl });
    let handles: Vec<_> = LocalGroup::new(n)?
        .into_iter()
        .enumerate()
        .map(|(rank, mut ex)| {
            let (tables, inputs) = (tables.clone(), inputs.clone());
            std::thread::spawn(move || -> Result<Vec<bf16>, String> {
                let e = |x: attn_rs::AttnError| x.to_string();
                let MlaInputs { kv_c, k_pe, q, lens, qsl } = &*inputs;
                let stream = new_stream();
                let shard = CpShard::new(n, rank, interleave).map_err(e)?;
                let spec = MlaCacheSpec::deepseek(tables.num_blocks, bs).map_err(e)?;
                let mut ctx = shard.shard_step(qsl, lens, &tables.table, tables.stride, bs, tables.num_blocks).map_err(e)?;
                if forward {
                    // The step writes each request's last token.
                    for &end in &qsl[1..] {
                        ctx.slot_mapping[end as usize - 1] = -1;
                    }
                }
                let mut cache: CudaSlice<C> = upload(&stream, &vec![poison::<C>(); spec.num_elements()]);
                let (kv_d, pe_d, slots_d, scale_d) =
                    (upload(&stream, kv_c), upload(&stream, k_pe), upload(&stream, &ctx.slot_mapping), upload(&stream, &[scale]));
                let mut status = DeviceStatus::new(&stream).map_err(e)?;
                let w = MlaWrite {
                    kv_c: DevIn::new(&kv_d, &stream),
                    kv_c_token_stride: 512,
                    k_pe: DevIn::new(&pe_d, &stream),
                    k_pe_token_stride: 64,
                    num_tokens: ctx.slot_mapping.len(),
                    slot_mapping: DevIn::new(&slots_d, &stream),
                    cache: DevOut::new(&mut cache, &stream),
                    spec,
                    scale: fp8.then(|| DevIn::new(&scale_d, &stream)),
                };
                concat_and_cache_mla(device(), &stream, w, &mut status).map_err(e)?;
                if forward {
                    return mla_forward_rank::<C>(shard, ex, (&stream, &mut cache), &tables, inputs.as_ref(), (hq, scale)).map_err(e);
                }
                let local: Vec<i32> = lens.iter().map(|&l| shard.local_len(l as usize) as i32).collect();
                let dec_qsl: Vec<i32> = (0..=lens.len() as i32).collect();
                let meta = BatchMetadata::new(&stream, &local, &dec_qsl).map_err(e)?;
                let (q_d, bt_d) = (upload(&stream, q), upload(&stream, &tables.table));
                let mut ws = DecodeWorkspace::new(&stream, 4096 * hq, V, lens.len(), lens.len()).map_err(e)?;
                let mut part = CpDecode::new(&stream, shard, DType::BF16, out_rows.required_len(), lens.len() * hq).map_err(e)?;
                let mut out_d: CudaSlice<bf16> = upload(&stream, &vec![poison::<bf16>(); out_rows.required_len()]);
                let a = MlaArgs {
                    q: DevIn::new(&q_d, &stream),
                    q_rows,
                    cache: DevIn::new(&cache, &stream),
                    spec,
                    block_table: DevIn::new(&bt_d, &stream),
                    block_table_stride: tables.stride,
                    out: DevOut::new(&mut out_d, &stream),
                    out_rows,
                    lse: None,
                    scales: fp8.then(|| KvScales { k: DevIn::new(&scale_d, &stream), v: DevIn::new(&scale_d, &stream) }),
                };
                part.decode_mla(device(), &stream, a, &meta, opts.softmax_scale, SplitMode::Auto, &mut ws, &mut status, &mut ex)
                    .map_err(e)?;
                status.take(&stream).map_err(e)?.into_result().map_err(e)?;
                Ok(download(&stream, &out_d))
            })
        })
        .collect();
    let outs: Vec<Vec<bf16>> = handles.into_iter().map(|h| h.join().expect("a rank's thread")).collect::<Result<_, _>>()?;
    for (rank, o) in outs.iter().enumerate().skip(1) {
        if o.iter().zip(&outs[0]).any(|(a, b)| a.to_bits() != b.to_bits()) {
            return Err(format!("rank {rank}'s output differs from rank 0's").into());
        }
    }
    let got: Vec<f64> = outs[0].iter().map(|x| x.to_f64()).collect();
    // The narrow shape over an FP8 cache on sm_90a rounds queries and weights to e4m3.
    let e4m3 = C::DTYPE.is_fp8() && attn_rs::mla::fp8_mla_rounds_to_e4m3(device());
    check_rows_within(&got, &want.out, V, hq, bounds(DType::BF16, e4m3).1)?;
    Ok(())
}

/// One rank of [`mla_cp_case`] through `forward`: an `Attention` on the `mla` backend with the
/// rank's shard, one decode step (each request's last token written by the step); its output.
fn mla_forward_rank<C: Element>(
    shard: CpShard,
    ex: attn_rs::context_parallel::LocalGroup,
    (stream, cache): (&std::sync::Arc<cudarc::driver::CudaStream>, &mut CudaSlice<C>),
    tables: &BlockTables,
    MlaInputs { kv_c, k_pe, q, lens, qsl }: &MlaInputs,
    (hq, scale): (usize, f32),
) -> attn_rs::Result<Vec<bf16>> {
    use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
    use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv};
    use attn_rs::metadata::StepInput;
    let (n, bs) = (lens.len(), 64);
    let model = ModelConfig { cache_dtype: C::DTYPE, ..ModelConfig::mla(hq, DType::BF16, bs) };
    let dev = arc_device();
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 16, max_model_len: 8192 };
    let config = ForwardConfig { context_parallel: Some(shard), ..ForwardConfig::new(model, tables.num_blocks, limits) };
    let mut attn = Attention::new(&sel, config, Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    attn.set_cp_exchange(Box::new(ex))?;
    let mut step = attn.new_step_metadata()?;
    let dec_qsl: Vec<i32> = (0..=n as i32).collect();
    let slots = vec![-1i64; n];
    step.build(&StepInput {
        query_start_loc: &dec_qsl,
        seq_lens: lens,
        block_table: &tables.table,
        block_table_stride: tables.stride,
        slot_mapping: &slots,
        num_actual_tokens: n,
        num_blocks: tables.num_blocks,
        block_size: bs,
    })?;
    // Each request's last token's latent and rope key.
    let last =
        |src: &[bf16], w: usize| -> Vec<bf16> { qsl[1..].iter().flat_map(|&end| src[(end as usize - 1) * w..][..w].to_vec()).collect() };
    let (kv_d, pe_d, q_d) = (upload(stream, &last(kv_c, 512)), upload(stream, &last(k_pe, 64)), upload(stream, q));
    let scale_d = upload(stream, &[scale]);
    let out_rows = RowsDesc::contiguous(n, hq, 512);
    let mut out_d: CudaSlice<bf16> = upload(stream, &vec![poison::<bf16>(); out_rows.required_len()]);
    let fp8 = C::DTYPE.is_fp8();
    attn.forward(
        &step,
        LayerIo::Gpu(GpuLayer {
            q: DevIn::new(&q_d, stream),
            q_rows: RowsDesc::contiguous(n, hq, 576),
            new_kv: NewKv::Mla {
                kv_c: DevIn::new(&kv_d, stream),
                kv_c_token_stride: 512,
                k_pe: DevIn::new(&pe_d, stream),
                k_pe_token_stride: 64,
            },
            cache: DevOut::new(cache, stream),
            out: DevOut::new(&mut out_d, stream),
            out_rows,
            alibi_slopes: None,
            sinks: None,
            kv_scales: fp8.then(|| (DevIn::new(&scale_d, stream), DevIn::new(&scale_d, stream))),
        }),
    )?;
    attn.check_status()?;
    Ok(download(stream, &out_d))
}

fn main() {
    // Odd lengths, one token, an empty request, lengths below and past one dealing round.
    let lens = |rng_salt: u64, n: usize| -> Vec<i32> {
        let mut r = rng(rng_salt);
        let mut v: Vec<i32> = (0..n).map(|_| r.random_range(1..3000)).collect();
        v.extend([1, 0, 2, 3, 17, 4097]);
        v
    };
    let mut cases: Vec<(String, Case)> = Vec::new();
    for n in [2, 3, 4] {
        cases.push((format!("n{n}_gqa4_d128"), Case::base(n, &lens(n as u64, 9))));
        cases.push((
            format!("n{n}_interleave16_gqa8"),
            Case { interleave: 16, q_heads: 32, kv_heads: 4, ..Case::base(n, &lens(10 + n as u64, 7)) },
        ));
    }
    cases.push(("n2_gqa16_d64".into(), Case { q_heads: 16, kv_heads: 1, head_size: 64, ..Case::base(2, &lens(21, 5)) }));
    cases.push((
        "n3_mha_d96_hnd".into(),
        Case { q_heads: 8, kv_heads: 8, head_size: 96, layout: KvLayout::FlashHnd, ..Case::base(3, &lens(22, 5)) },
    ));
    cases.push((
        "n4_interleave64_bs64_d256".into(),
        Case { interleave: 64, block_size: 64, q_heads: 8, kv_heads: 2, head_size: 256, ..Case::base(4, &lens(23, 5)) },
    ));
    cases.push(("n2_softcap_sinks".into(), Case { softcap: Some(30.0), sinks: true, ..Case::base(2, &lens(24, 6)) }));
    cases.push(("n3_sinks_gqa2".into(), Case { sinks: true, q_heads: 16, kv_heads: 8, ..Case::base(3, &lens(25, 6)) }));
    cases.push(("n1".into(), Case::base(1, &lens(26, 3))));
    let mut trials: Vec<Trial> = Vec::new();
    for (i, (name, c)) in cases.into_iter().enumerate() {
        if c.ranks == 1 {
            // A group of one has nothing to merge: the merge refuses it.
            trials.push(Trial::test(format!("cp::{name}_refuses_merge"), move || {
                let stream = new_stream();
                let mut p = CpDecode::new(&stream, CpShard::new(1, 0, 1)?, DType::BF16, 64, 1)?;
                let rows = RowsDesc::contiguous(1, 1, 64);
                let mut out: CudaSlice<bf16> = upload(&stream, &[bf16::ZERO; 64]);
                match p.merge(device(), &stream, DevOut::new(&mut out, &stream), &rows, None) {
                    Err(attn_rs::AttnError::InvalidArgument { arg: "shard", .. }) => Ok(()),
                    other => Err(format!("expected a refusal naming `shard`, got {other:?}").into()),
                }
            }));
            continue;
        }
        let salt = 9000 + 10 * i as u64;
        let c2 = c.clone();
        trials.push(Trial::test(format!("cp::bf16::{name}"), move || cp_case::<bf16, bf16>(c, salt)));
        if quick() {
            continue;
        }
        let c3 = c2.clone();
        trials.push(Trial::test(format!("cp::f16::{name}"), move || cp_case::<f16, f16>(c2, salt + 1)));
        trials.push(Trial::test(format!("cp::bf16_fp8::{name}"), move || cp_case::<bf16, Fp8E4m3>(c3, salt + 2)));
    }
    trials.push(Trial::test("cp::fp8_per_head_scales_n2", || {
        cp_case::<bf16, Fp8E4m3>(Case { per_head_scales: true, ..Case::base(2, &[1, 77, 1500, 4097]) }, 9900)
    }));
    trials.push(Trial::test("cp::refusals", refusals));
    trials.push(Trial::test("cp::mla::n2_16_heads", || mla_cp_case::<bf16>(2, 1, 16, false, 9960)));
    trials.push(Trial::test("cp::mla::n3_interleave64_128_heads", || mla_cp_case::<bf16>(3, 64, 128, false, 9961)));
    trials.push(Trial::test("cp::mla::n4_fp8_16_heads", || mla_cp_case::<Fp8E4m3>(4, 1, 16, false, 9962)));
    trials.push(Trial::test("cp::forward::mla_n2_16_heads", || mla_cp_case::<bf16>(2, 1, 16, true, 9963)));
    trials.push(Trial::test("cp::forward::mla_n3_fp8_128_heads", || mla_cp_case::<Fp8E4m3>(3, 16, 128, true, 9964)));
    trials.push(Trial::test("cp::forward::n2_bf16", || forward_cp_case::<bf16>(2, 1, false, 1, 9950)));
    trials.push(Trial::test("cp::forward::n3_interleave16_sinks", || forward_cp_case::<bf16>(3, 16, true, 1, 9951)));
    trials.push(Trial::test("cp::forward::n2_fp8_sinks", || forward_cp_case::<Fp8E4m3>(2, 1, true, 1, 9952)));
    trials.push(Trial::test("cp::forward::n2_speculative_3", || forward_cp_case::<bf16>(2, 1, true, 3, 9953)));
    trials.push(Trial::test("cp::forward::n4_interleave16_speculative_4_fp8", || forward_cp_case::<Fp8E4m3>(4, 16, false, 4, 9954)));
    run_gpu_trials(trials)
}
