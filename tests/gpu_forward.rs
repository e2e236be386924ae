//! GPU `forward` on the `tensor-core` backend against the same calls on the `cpu` backend:
//! several steps of mixed batches (decodes first, chunked prefills, scattered blocks, strided
//! fused-QKV rows, padding rows) per case, outputs compared by relative error and the caches
//! bit for bit after the last step; long contexts (decode split-K and merge), multi-token
//! decodes, layouts, head sizes, dtypes and features (chunked local attention as local batches,
//! over FP8 caches among them); refusals before any launch.

mod common;

use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, HostElement, LayerIo, NewKv};
use attn_rs::metadata::{is_decode, StepInput};
use attn_rs::{AttnError, DType, DevIn, DevOut, Fp8E4m3, Fp8E5m2, KvLayout, RowsDesc};
use common::*;
use half::{bf16, f16};
use libtest_mimic::Trial;
use rand::seq::SliceRandom;
use rand::Rng;
use std::collections::HashMap;

#[derive(Clone, Debug)]
struct Case {
    hq: usize,
    hkv: usize,
    d: usize,
    layout: KvLayout,
    block_size: usize,
    threshold: usize,
    window: Option<u32>,
    /// Chunked local attention (Llama 4): a query sees the keys of its own chunk of positions.
    chunk: Option<u32>,
    softcap: Option<f32>,
    alibi: bool,
    sinks: bool,
    padding: usize,
    /// An FP8 cache of this type (with k/v scales) instead of one of the query dtype.
    fp8: Option<DType>,
    /// The FP8 scales one per kv head (else one per tensor).
    per_head_scales: bool,
    steps: Vec<Vec<(usize, usize)>>,
}

/// The FP8 cache types of [`Case::fp8`].
const E4M3: Option<DType> = Some(DType::Fp8E4m3);
const E5M2: Option<DType> = Some(DType::Fp8E5m2);

fn mixed_steps() -> Vec<Vec<(usize, usize)>> {
    vec![
        vec![(0, 37)],
        vec![(1, 20), (0, 1)],
        vec![(0, 1), (1, 133), (2, 5)],
        vec![(2, 1), (1, 1), (0, 1), (3, 17)],
        vec![(3, 40), (0, 1), (2, 1), (1, 1)],
    ]
}

/// Long contexts: decode split-K and the merge.
fn long_steps() -> Vec<Vec<(usize, usize)>> {
    vec![vec![(0, 1500), (1, 700)], vec![(0, 1), (1, 1), (2, 900)], vec![(1, 1), (2, 1), (0, 1), (3, 300)]]
}

fn base(hq: usize, hkv: usize, d: usize) -> Case {
    Case {
        hq,
        hkv,
        d,
        layout: KvLayout::FlashNhd,
        block_size: 16,
        threshold: 1,
        window: None,
        chunk: None,
        softcap: None,
        alibi: false,
        sinks: false,
        padding: 0,
        fp8: None,
        per_head_scales: false,
        steps: mixed_steps(),
    }
}

fn cases() -> Vec<(String, Case, DType)> {
    let long = long_steps();
    let spec = vec![vec![(0, 30), (1, 12)], vec![(0, 3), (1, 4), (2, 9)], vec![(2, 2), (0, 1), (1, 5), (3, 4)]];
    vec![
        ("llama_gqa4_d128".into(), base(32, 8, 128), DType::BF16),
        ("gqa4_d128_f16".into(), base(8, 2, 128), DType::F16),
        ("mha_d64_hnd".into(), Case { layout: KvLayout::FlashHnd, padding: 3, ..base(4, 4, 64) }, DType::BF16),
        ("gqa2_d96_flashinfer_bs32".into(), Case { layout: KvLayout::FlashInferNhd, block_size: 32, ..base(4, 2, 96) }, DType::F16),
        ("mqa_d256_flashinfer_hnd".into(), Case { layout: KvLayout::FlashInferHnd, ..base(8, 1, 256) }, DType::BF16),
        ("fp8_cache_gqa4_d128".into(), Case { fp8: E4M3, ..base(32, 8, 128) }, DType::BF16),
        (
            "fp8_cache_long_f16_d64_hnd_per_head_scales".into(),
            Case { fp8: E4M3, per_head_scales: true, layout: KvLayout::FlashHnd, steps: long_steps(), ..base(8, 2, 64) },
            DType::F16,
        ),
        ("long_contexts_split_k".into(), Case { steps: long, ..base(32, 8, 128) }, DType::BF16),
        ("multi_token_decodes".into(), Case { threshold: 4, steps: spec, ..base(8, 2, 128) }, DType::BF16),
        // Head sizes below the kernels' widths: Phi-2's 80 (width 96), 112 with an FP8 cache
        // (width 128), 40 with long contexts (width 64), 200 (width 256).
        ("phi2_like_d80".into(), Case { steps: long_steps(), ..base(32, 32, 80) }, DType::F16),
        ("fp8_cache_d112_multi_token".into(), Case { fp8: E4M3, threshold: 4, ..base(16, 4, 112) }, DType::BF16),
        ("gqa8_d40_hnd_long".into(), Case { layout: KvLayout::FlashHnd, padding: 2, steps: long_steps(), ..base(16, 2, 40) }, DType::BF16),
        // FP8 caches at odd multiples of 8 (the `_fp8_a8` kernels): 72 (width 128 decode, the
        // Hopper e4m3 width-80 prefill), 40 in HND with long contexts (width 64).
        ("fp8_cache_d72_multi_token".into(), Case { fp8: E4M3, threshold: 4, ..base(32, 4, 72) }, DType::BF16),
        (
            "fp8_cache_d40_hnd_long".into(),
            Case { fp8: E4M3, layout: KvLayout::FlashHnd, steps: long_steps(), ..base(16, 2, 40) },
            DType::F16,
        ),
        // E5M2 caches: d128 with long contexts (the deep-pipeline decode), 72 multi-token (the
        // `_e5m2_a8` kernels, the Hopper FP8 width-80 prefill), 64 in HND with per-head scales.
        ("e5m2_cache_gqa4_d128_long".into(), Case { fp8: E5M2, steps: long_steps(), ..base(32, 8, 128) }, DType::BF16),
        ("e5m2_cache_d72_multi_token".into(), Case { fp8: E5M2, threshold: 4, ..base(32, 4, 72) }, DType::F16),
        (
            "e5m2_cache_d64_hnd_per_head_scales".into(),
            Case { fp8: E5M2, per_head_scales: true, layout: KvLayout::FlashHnd, ..base(8, 2, 64) },
            DType::BF16,
        ),
        // Chunked local attention in chunks of whole blocks: the layer runs on the step's local
        // batch (requests cut at chunk starts, decode and prefill kernels unmasked). 16-bit at
        // 128 across chunk edges with a window too, E4M3 at 128, E5M2 at 72 with long contexts
        // (split-K within a chunk).
        ("chunked_local_window_gqa4_d128".into(), Case { chunk: Some(48), window: Some(40), ..base(32, 8, 128) }, DType::BF16),
        ("fp8_cache_chunked_local_gqa4_d128".into(), Case { fp8: E4M3, chunk: Some(48), ..base(32, 8, 128) }, DType::BF16),
        (
            "e5m2_cache_chunked_local_d72_long".into(),
            Case { fp8: E5M2, chunk: Some(1024), steps: long_steps(), ..base(16, 4, 72) },
            DType::F16,
        ),
        ("mqa_d200_window_sinks".into(), Case { window: Some(50), sinks: true, ..base(8, 1, 200) }, DType::BF16),
        (
            "window_softcap_alibi_sinks".into(),
            Case { window: Some(40), softcap: Some(10.0), alibi: true, sinks: true, ..base(8, 2, 128) },
            DType::BF16,
        ),
    ]
}

/// `T`: the query dtype; `C`: the cache's (`T`, or FP8 with scales).
fn forward_case<T: HostElement + std::fmt::Debug, C: HostElement + std::fmt::Debug>(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let features = Features { sinks: c.sinks, sliding_window: c.window.is_some(), softcap: c.softcap.is_some(), alibi: c.alibi };
    let model = ModelConfig {
        cache_dtype: C::DTYPE,
        ..ModelConfig::standard(c.hq, c.hkv, c.d, T::DTYPE, c.block_size, c.layout).with_features(features)
    };
    let fp8 = C::DTYPE.is_fp8();
    // Values in [-1, 1) over scales of 1/32 and 1/48 (per head: 1/32 .. 1/60 and 1/48 ..
    // 1/20): FP8 codes up to 60, well inside e4m3.
    let (ks, vs): (Vec<f32>, Vec<f32>) = match c.per_head_scales {
        true => (0..c.hkv).map(|h| (1.0 / (32.0 + 28.0 * h as f32 / c.hkv as f32), 1.0 / (48.0 - 28.0 * h as f32 / c.hkv as f32))).unzip(),
        false => (vec![1.0 / 32.0], vec![1.0 / 48.0]),
    };
    let gpu_sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let cpu_sel = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None)?;
    if gpu_sel.name() != "tensor-core" {
        return Err(format!("selected {}", gpu_sel.name()).into());
    }
    let num_blocks = 256;
    let limits = ForwardLimits { max_num_tokens: 4096, max_num_reqs: 16, max_model_len: 4096 };
    let mut config = ForwardConfig::new(model, num_blocks, limits);
    config.decode_threshold = c.threshold;
    config.opts.window = c.window;
    config.opts.chunk_size = c.chunk;
    config.opts.softcap = c.softcap;
    let mut ga = Attention::new(&gpu_sel, config.clone(), Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    let mut ca = Attention::new(&cpu_sel, config, None)?;
    let (mut gm, mut cm) = (ga.new_step_metadata()?, ca.new_step_metadata()?);
    let cache_len = ga.cache_spec().num_elements();
    let mut gcache = stream.alloc_zeros::<C>(cache_len)?;
    let mut ccache = vec![C::default(); cache_len];
    let (k_scale_d, v_scale_d) = (upload(&stream, &ks), upload(&stream, &vs));
    let slopes: Vec<f32> = (0..c.hq).map(|h| 0.5f32.powi(h as i32 % 8 + 1)).collect();
    let sinks: Vec<f32> = (0..c.hq).map(|_| rng.random_range(-2.0..3.0)).collect();
    let (slopes_d, sinks_d) = (upload(&stream, &slopes), upload(&stream, &sinks));
    let mut free: Vec<i32> = (0..num_blocks as i32).collect();
    free.shuffle(&mut rng);
    let mut reqs: HashMap<usize, (Vec<i32>, usize)> = HashMap::new();
    let (wq, wkv) = (c.hq * c.d, c.hkv * c.d);
    let width = wq + 2 * wkv + 64; // a fused projection row with a gap (16-byte multiples)
    let bs = c.block_size;

    for (s, step) in c.steps.iter().enumerate() {
        let mut order = step.clone();
        order.sort_by_key(|&(_, q)| !is_decode(q as i64, c.threshold));
        let nt: usize = order.iter().map(|p| p.1).sum();
        let rows = nt + c.padding;
        let (mut qsl, mut seq_lens, mut slots) = (vec![0i32], Vec::new(), Vec::new());
        for &(id, q) in &order {
            let (blocks, len) = reqs.entry(id).or_default();
            while blocks.len() * bs < *len + q {
                blocks.push(free.pop().ok_or("out of blocks")?);
            }
            for pos in *len..*len + q {
                slots.push(blocks[pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
            }
            qsl.push(qsl.last().unwrap() + q as i32);
            seq_lens.push((*len + q) as i32);
        }
        let stride = order.iter().map(|(id, _)| reqs[id].0.len()).max().unwrap() + 2;
        let mut block_table = vec![-3; order.len() * stride];
        for (i, (id, _)) in order.iter().enumerate() {
            block_table[i * stride..][..reqs[id].0.len()].copy_from_slice(&reqs[id].0);
        }
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &block_table,
            block_table_stride: stride,
            slot_mapping: &slots,
            num_actual_tokens: nt,
            num_blocks,
            block_size: bs,
        };
        gm.build(&input)?;
        cm.build(&input)?;

        let data: Vec<T> = random_vec(&mut rng, rows * width, 1.0);
        let data_d = upload(&stream, &data);
        let q_rows = RowsDesc { num_tokens: rows, num_heads: c.hq, head_size: c.d, token_stride: width, head_stride: c.d };
        let kv_rows = RowsDesc { num_tokens: rows, num_heads: c.hkv, head_size: c.d, token_stride: width, head_stride: c.d };
        let out_rows = RowsDesc::contiguous(rows, c.hq, c.d);
        let mut out_d = upload(&stream, &vec![poison::<T>(); out_rows.required_len()]);
        let mut out_h = vec![T::default(); out_rows.required_len()];
        let (kv_k, kv_v) = (data_d.slice(wq..), data_d.slice(wq + wkv..));
        ga.forward(
            &gm,
            LayerIo::Gpu(GpuLayer {
                q: DevIn::new(&data_d, &stream),
                q_rows,
                new_kv: NewKv::Standard { k: DevIn::new(&kv_k, &stream), k_rows: kv_rows, v: DevIn::new(&kv_v, &stream), v_rows: kv_rows },
                cache: DevOut::new(&mut gcache, &stream),
                out: DevOut::new(&mut out_d, &stream),
                out_rows,
                alibi_slopes: c.alibi.then(|| DevIn::new(&slopes_d, &stream)),
                sinks: c.sinks.then(|| DevIn::new(&sinks_d, &stream)),
                kv_scales: fp8.then(|| (DevIn::new(&k_scale_d, &stream), DevIn::new(&v_scale_d, &stream))),
            }),
        )?;
        ca.forward(
            &cm,
            LayerIo::Cpu(CpuLayer {
                q: T::host_in(&data),
                q_rows,
                new_kv: NewKv::Standard { k: T::host_in(&data[wq..]), k_rows: kv_rows, v: T::host_in(&data[wq + wkv..]), v_rows: kv_rows },
                cache: C::host_out(&mut ccache),
                out: T::host_out(&mut out_h),
                out_rows,
                alibi_slopes: c.alibi.then(|| f32::host_in(&slopes)),
                sinks: c.sinks.then(|| f32::host_in(&sinks)),
                kv_scales: fp8.then(|| (f32::host_in(&ks), f32::host_in(&vs))),
            }),
        )?;
        ga.check_status()?;
        let got = download(&stream, &out_d);
        let per_token = c.hq * c.d;
        // The decode kernel's query rows a kv head: the step's longest decode request's tokens.
        let decode_q = order.iter().filter(|&&(_, q)| is_decode(q as i64, c.threshold)).map(|p| p.1).max().unwrap_or(1);
        let decode_rows = decode_q * (c.hq / c.hkv);
        for (b, &(id, _)) in order.iter().enumerate() {
            let span = qsl[b] as usize * per_token..qsl[b + 1] as usize * per_token;
            let g: Vec<f64> = got[span.clone()].iter().map(|x| x.to_f32() as f64).collect();
            let w: Vec<f64> = out_h[span].iter().map(|x| x.to_f32() as f64).collect();
            let err = rel_error(&g, &w);
            // Prefills and decodes from an FP8 cache may round to e4m3 (`fp8_prefill_rounds_to_e4m3`,
            // `fp8_decode_rounds_to_e4m3`).
            let e4m3 = attn_rs::prefill::fp8_prefill_rounds_to_e4m3(device(), c.d, c.d)
                || attn_rs::decode::fp8_decode_rounds_to_e4m3(device(), c.d, decode_rows);
            let tol = if fp8 && e4m3 { E4M3_TOLERANCE.0 } else { tolerance(T::DTYPE) };
            if !within(err, tol) {
                return Err(format!("step {s} request {id} (batch row {b}): rel error {err:.3e}").into());
            }
        }
        if got[nt * per_token..].iter().any(|x| !x.to_f32().is_nan()) {
            return Err(format!("step {s}: padding output rows were written").into());
        }
        for (id, q) in &order {
            reqs.get_mut(id).unwrap().1 += q;
        }
    }
    let gc = download(&stream, &gcache);
    let mismatched = bitwise_mismatches(&gc, &ccache, |x| x.to_f32().to_bits() as u64);
    if !mismatched.is_empty() {
        return Err(format!("caches differ: {mismatched:?}").into());
    }
    Ok(())
}

/// Refusals on the GPU happen before any launch: the cache and output stay as they were.
fn refusals() -> TestResult {
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let model = ModelConfig::standard(8, 2, 128, DType::BF16, 16, KvLayout::FlashNhd);
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let limits = ForwardLimits { max_num_tokens: 64, max_num_reqs: 4, max_model_len: 64 };
    let mut attn =
        Attention::new(&sel, ForwardConfig::new(model, 8, limits), Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    let mut meta = attn.new_step_metadata()?;
    let (qsl, seq_lens, block_table, slots) = ([0, 1, 6], [4, 5], [2, 0, 0, 1], [35i64, 0, 1, 2, 3, 4]);
    meta.build(&StepInput {
        query_start_loc: &qsl,
        seq_lens: &seq_lens,
        block_table: &block_table,
        block_table_stride: 2,
        slot_mapping: &slots,
        num_actual_tokens: 6,
        num_blocks: 8,
        block_size: 16,
    })?;
    let q = upload(&stream, &vec![bf16::from_f32(0.5); 7 * 8 * 128]);
    let kv = upload(&stream, &vec![bf16::from_f32(0.25); 7 * 2 * 128]);
    let mut cache = stream.alloc_zeros::<bf16>(attn.cache_spec().num_elements())?;
    let mut out = stream.alloc_zeros::<bf16>(6 * 8 * 128)?;
    let kv_rows = RowsDesc::contiguous(6, 2, 128);
    let cases: Vec<(&str, &str, usize, RowsDesc)> = vec![
        ("misaligned q", "q", 1, RowsDesc::contiguous(6, 8, 128)),
        ("q token stride not a 16-byte multiple", "q", 0, RowsDesc { token_stride: 8 * 128 + 1, ..RowsDesc::contiguous(6, 8, 128) }),
        ("q heads", "q", 0, RowsDesc::contiguous(6, 4, 128)),
    ];
    for (what, arg, offset, q_rows) in cases {
        let qv = q.slice(offset..);
        let r = attn.forward(
            &meta,
            LayerIo::Gpu(GpuLayer {
                q: DevIn::new(&qv, &stream),
                q_rows,
                new_kv: NewKv::Standard { k: DevIn::new(&kv, &stream), k_rows: kv_rows, v: DevIn::new(&kv, &stream), v_rows: kv_rows },
                cache: DevOut::new(&mut cache, &stream),
                out: DevOut::new(&mut out, &stream),
                out_rows: RowsDesc::contiguous(6, 8, 128),
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            }),
        );
        match r {
            Err(AttnError::InvalidArgument { arg: a, .. }) if a == arg => {}
            other => return Err(format!("{what}: expected a refusal of `{arg}`, got {other:?}").into()),
        }
    }
    // Host tensors for a GPU backend.
    let mut host_cache = vec![bf16::ZERO; 4];
    let mut host_out = vec![bf16::ZERO; 4];
    let host_q = vec![bf16::ZERO; 4];
    let r = attn.forward(
        &meta,
        LayerIo::Cpu(CpuLayer {
            q: host_q.as_slice().into(),
            q_rows: RowsDesc::contiguous(6, 8, 128),
            new_kv: NewKv::Standard { k: host_q.as_slice().into(), k_rows: kv_rows, v: host_q.as_slice().into(), v_rows: kv_rows },
            cache: host_cache.as_mut_slice().into(),
            out: host_out.as_mut_slice().into(),
            out_rows: RowsDesc::contiguous(6, 8, 128),
            alibi_slopes: None,
            sinks: None,
            kv_scales: None,
        }),
    );
    if !matches!(r, Err(AttnError::InvalidArgument { arg: "layer", .. })) {
        return Err(format!("host tensors: expected a refusal of `layer`, got {r:?}").into());
    }
    attn.check_status()?;
    if download(&stream, &cache).iter().any(|x| x.to_f32() != 0.0) || download(&stream, &out).iter().any(|x| x.to_f32() != 0.0) {
        return Err("a refused forward wrote to the cache or the output".into());
    }
    // MLA on the GPU: the "mla" backend, on the GPU (engine-sim checks its results against the
    // CPU backend step by step).
    let mla = ModelConfig::mla(16, DType::BF16, 64);
    let sel = select_backend_no_env(&mla, &DeviceInfo::from_device(&dev), None)?;
    let attn = Attention::new(&sel, ForwardConfig::new(mla, 8, limits), Some(GpuHandles { dev, stream }))?;
    if sel.name() != "mla" || !attn.runs_on_gpu() {
        return Err(format!("MLA model: backend {} on the GPU: {}", sel.name(), attn.runs_on_gpu()).into());
    }
    Ok(())
}

fn main() {
    let mut trials = Vec::new();
    let all = cases();
    let picked: Vec<_> = if quick() { all.into_iter().step_by(3).collect() } else { all };
    for (i, (name, case, dt)) in picked.into_iter().enumerate() {
        let s = 6000 + i as u64;
        let f: Box<dyn FnOnce() -> TestResult + Send> = match (dt, case.fp8) {
            (DType::F16, None) => Box::new(move || forward_case::<f16, f16>(case, s)),
            (DType::F16, E4M3) => Box::new(move || forward_case::<f16, Fp8E4m3>(case, s)),
            (DType::F16, _) => Box::new(move || forward_case::<f16, Fp8E5m2>(case, s)),
            (_, None) => Box::new(move || forward_case::<bf16, bf16>(case, s)),
            (_, E4M3) => Box::new(move || forward_case::<bf16, Fp8E4m3>(case, s)),
            (_, _) => Box::new(move || forward_case::<bf16, Fp8E5m2>(case, s)),
        };
        trials.push(Trial::test(format!("forward::{name}"), f));
    }
    trials.push(Trial::test("forward::refusals", refusals));
    run_gpu_trials(trials)
}
