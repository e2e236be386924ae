//! CUDA-graph steps against eager execution: one graph per case is captured for a bucket, then
//! replayed over many steps in which the batch size, the lengths (split-K or not) and the block
//! tables change; each replay's outputs must match the same step run eagerly (a normal step
//! metadata, its own caches), every layer, and the caches must end bit for bit equal. Padding
//! rows (requests past the step's) must come out finite (uniform buckets) or untouched (mixed
//! buckets). Mixed buckets take decodes, new prompts and chunks in changing mixes; bf16 and FP8
//! caches; per-layer settings (a window and a soft-cap on one layer, sinks on the other); chunked local
//! attention on one layer (chunks of whole blocks as a local batch, over a 16-bit or an FP8 cache;
//! others through the local-mask prefill kernel). Standard attention (GQA, one and two
//! query tokens) and MLA; refusals of steps a graph cannot take.
//!
//! A graph holds what it captured: the captured layers' buffers are `SharedBuf`s, and a borrowed
//! one is refused, as are other calls whose memory the graph would not hold; a graph replays
//! correctly after its Attention and the engine's handles to its buffers are dropped.

mod common;

use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::forward::{
    Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, GraphBucket, LayerIo, LayerSpec, NewKv, StepMetadata,
};
use attn_rs::metadata::StepInput;
use attn_rs::{AttnError, AttnOptions, DType, DevIn, DevOut, Element, Fp8E4m3, KvLayout, RowsDesc, SharedBuf};
use common::*;
use cudarc::driver::CudaStream;
use half::bf16;
use libtest_mimic::{Failed, Trial};
use rand::seq::SliceRandom;
use rand::Rng;
use std::sync::Arc;

#[derive(Clone, Debug)]
struct Case {
    /// MLA (latent cache, `hq` heads) instead of standard attention.
    mla: bool,
    hq: usize,
    hkv: usize,
    d: usize,
    bucket: GraphBucket,
    /// An FP8 (e4m3) cache with per-tensor scales (standard attention).
    fp8: bool,
    /// Per-layer settings (standard attention, two layers): a sliding window and a soft-cap on
    /// layer 0, attention sinks on layer 1.
    per_layer: bool,
    /// Chunked local attention in chunks of this many positions on layer 0 of two: chunks of
    /// whole blocks run on a local batch of their own graph step (a mixed one in speculative
    /// and mixed buckets), others through the local-mask prefill kernel over the whole step.
    chunk: Option<u32>,
    /// Decodes have at most this many query tokens (a uniform bucket's query length).
    threshold: usize,
    layers: usize,
    steps: usize,
    max_len: usize,
}

/// Column widths of one token's fused input row: q, then the new K/V (or latent + rope).
struct Widths {
    q: usize,
    k: usize,
    v: usize,
    out: usize,
    q_head: usize,
}

impl Case {
    fn widths(&self) -> Widths {
        if self.mla {
            Widths { q: self.hq * 576, k: 512, v: 64, out: self.hq * 512, q_head: 576 }
        } else {
            let kv = self.hkv * self.d;
            Widths { q: self.hq * self.d, k: kv, v: kv, out: self.hq * self.d, q_head: self.d }
        }
    }

    fn model(&self) -> ModelConfig {
        if self.mla {
            ModelConfig::mla(self.hq, DType::BF16, 16)
        } else {
            let mut m = ModelConfig::standard(self.hq, self.hkv, self.d, DType::BF16, 16, KvLayout::FlashNhd);
            if self.per_layer {
                m = m.with_features(Features { sinks: true, sliding_window: true, softcap: true, alibi: false });
            }
            if self.fp8 {
                m.with_cache_dtype(DType::Fp8E4m3)
            } else {
                m
            }
        }
    }
}

/// An FP8 cache's K and V scales (f32 each), shared: a graph holds them.
type Scales = (SharedBuf<f32>, SharedBuf<f32>);

/// One layer's tensors: `q`, `k` and `v` are views of a fused input buffer of `rows` tokens.
fn layer<'a>(
    c: &Case,
    rows: usize,
    (q, k, v): (DevIn<'a>, DevIn<'a>, DevIn<'a>),
    cache: DevOut<'a>,
    out: DevOut<'a>,
    scales: Option<(&'a Scales, &'a Arc<CudaStream>)>,
) -> LayerIo<'a> {
    let w = c.widths();
    let width = w.q + w.k + w.v;
    let q_rows = RowsDesc { num_tokens: rows, num_heads: c.hq, head_size: w.q_head, token_stride: width, head_stride: w.q_head };
    let new_kv = if c.mla {
        NewKv::Mla { kv_c: k, kv_c_token_stride: width, k_pe: v, k_pe_token_stride: width }
    } else {
        let kv_rows = RowsDesc { num_tokens: rows, num_heads: c.hkv, head_size: c.d, token_stride: width, head_stride: c.d };
        NewKv::Standard { k, k_rows: kv_rows, v, v_rows: kv_rows }
    };
    let out_rows = RowsDesc::contiguous(rows, c.hq, w.out / c.hq);
    let kv_scales = scales.map(|((k, v), stream)| (DevIn::shared(k, stream), DevIn::shared(v, stream)));
    LayerIo::Gpu(GpuLayer { q, q_rows, new_kv, cache, out, out_rows, alibi_slopes: None, sinks: None, kv_scales })
}

/// A per-layer case's layer `l` with the sinks its spec names (layer 1), shared.
fn with_sinks<'a>(c: &Case, l: usize, io: LayerIo<'a>, sinks: &'a SharedBuf<f32>, stream: &'a Arc<CudaStream>) -> LayerIo<'a> {
    match io {
        LayerIo::Gpu(g) if c.per_layer && l == 1 => LayerIo::Gpu(GpuLayer { sinks: Some(DevIn::shared(sinks, stream)), ..g }),
        other => other,
    }
}

/// A layer as a graph captures it: every buffer a `SharedBuf`, held by the graph.
fn shared_layer<'a, C: Element>(
    c: &Case,
    stream: &'a Arc<CudaStream>,
    input: &'a SharedBuf<bf16>,
    cache: &'a SharedBuf<C>,
    out: &'a SharedBuf<bf16>,
    scales: Option<&'a Scales>,
) -> Result<LayerIo<'a>, AttnError> {
    let w = c.widths();
    let qkv = (DevIn::shared(input, stream), DevIn::shared_range(input, w.q.., stream)?, DevIn::shared_range(input, w.q + w.k.., stream)?);
    let scales = scales.map(|s| (s, stream));
    Ok(layer(c, c.bucket.num_tokens(), qkv, DevOut::shared(cache, stream), DevOut::shared(out, stream), scales))
}

/// A step's batch: `n` requests with random lengths (short ones, ones at the limit, long ones
/// that split) over blocks drawn without repeats from the cache. A uniform bucket's requests
/// have its query length; a mixed bucket's are decodes (1 to the decode threshold tokens), then
/// prefills (new prompts and chunks after a cached context) in the bucket's tokens.
#[derive(Clone)]
struct Step {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
}

fn random_step(rng: &mut rand::rngs::SmallRng, c: &Case, n: usize, num_blocks: usize) -> Step {
    let bs = 16;
    let q_lens = match c.bucket {
        GraphBucket::Uniform { query_len, .. } => vec![query_len; n],
        GraphBucket::Mixed { num_tokens, .. } => mixed_query_lens(rng, n, num_tokens, c.threshold),
    };
    let n = q_lens.len();
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    pool.shuffle(rng);
    let seq_lens: Vec<i32> = q_lens
        .iter()
        .map(|&q| match rng.random_range(0..4) {
            0 => q as i32,
            1 => rng.random_range(q..(q + 64).min(c.max_len)) as i32,
            _ => rng.random_range(q..=c.max_len) as i32,
        })
        .collect();
    let stride = seq_lens.iter().map(|&l| (l as usize).div_ceil(bs)).max().unwrap_or(0) + 1;
    let mut block_table = vec![-5; n * stride];
    let (mut qsl, mut slots) = (vec![0], Vec::new());
    for (r, &len) in seq_lens.iter().enumerate() {
        let len = len as usize;
        let row = &mut block_table[r * stride..][..len.div_ceil(bs)];
        for b in row.iter_mut() {
            *b = pool.pop().expect("enough blocks");
        }
        let q = q_lens[r];
        for pos in len - q..len {
            slots.push(row[pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
        }
        qsl.push(qsl[r] + q as i32);
    }
    Step { qsl, seq_lens, block_table, stride, slots }
}

/// Query lengths of a mixed step of up to `n` requests in `num_tokens` tokens, decodes first:
/// a random number of decodes (1 to `threshold` tokens), then as many prefills (more than
/// `threshold` tokens) as the tokens left hold, sharing a random part of them.
fn mixed_query_lens(rng: &mut rand::rngs::SmallRng, n: usize, num_tokens: usize, threshold: usize) -> Vec<usize> {
    let nd = rng.random_range(0..=n);
    let mut q: Vec<usize> = (0..nd).map(|_| rng.random_range(1..=threshold)).collect();
    let left = num_tokens - q.iter().sum::<usize>();
    let np = (n - nd).min(left / (threshold + 1));
    let mut extra = rng.random_range(0..=left - np * (threshold + 1));
    for p in 0..np {
        let share = if p + 1 == np { extra } else { rng.random_range(0..=extra) };
        extra -= share;
        q.push(threshold + 1 + share);
    }
    q
}

/// A case's model: its backend and configuration (limits of its bucket), and the cache's blocks.
struct CaseModel {
    sel: attn_rs::backend::Selection,
    config: ForwardConfig,
    num_blocks: usize,
}

impl CaseModel {
    fn new(c: &Case, dev: &Arc<attn_rs::AttnDevice>) -> Result<CaseModel, Failed> {
        let model = c.model();
        let sel = select_backend_no_env(&model, &DeviceInfo::from_device(dev), None)?;
        let (bn, rows) = (c.bucket.num_reqs(), c.bucket.num_tokens());
        let num_blocks = bn * c.max_len.div_ceil(16) + 64;
        let limits = ForwardLimits { max_num_tokens: rows, max_num_reqs: bn, max_model_len: c.max_len };
        let mut config = ForwardConfig::new(model, num_blocks, limits);
        if c.per_layer {
            let opts = AttnOptions::new(c.d);
            let windowed = LayerSpec::decoder(AttnOptions { window: Some(96), softcap: Some(30.0), ..opts });
            config = config.with_layers(vec![windowed, LayerSpec { sinks: true, ..LayerSpec::decoder(opts) }]);
        }
        if let Some(chunk) = c.chunk {
            let opts = AttnOptions::new(c.d);
            config =
                config.with_layers(vec![LayerSpec::decoder(AttnOptions { chunk_size: Some(chunk), ..opts }), LayerSpec::decoder(opts)]);
        }
        config.decode_threshold = c.threshold;
        Ok(CaseModel { sel, config, num_blocks })
    }

    fn attention(&self, dev: &Arc<attn_rs::AttnDevice>, stream: &Arc<CudaStream>) -> Result<Attention, AttnError> {
        Attention::new(&self.sel, self.config.clone(), Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))
    }
}

fn build(step: &mut StepMetadata, st: &Step, num_blocks: usize) -> Result<(), AttnError> {
    let input = StepInput {
        query_start_loc: &st.qsl,
        seq_lens: &st.seq_lens,
        block_table: &st.block_table,
        block_table_stride: st.stride,
        slot_mapping: &st.slots,
        num_actual_tokens: *st.qsl.last().expect("start locations") as usize,
        num_blocks,
        block_size: 16,
    };
    step.build(&input).map(|_| ())
}

fn graph_case(c: Case, salt: u64) -> TestResult {
    match c.fp8 {
        true => graph_case_on::<Fp8E4m3>(c, salt),
        false => graph_case_on::<bf16>(c, salt),
    }
}

/// [`graph_case`] with a cache of `C`.
fn graph_case_on<C: Element + std::fmt::Debug>(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let model = CaseModel::new(&c, &dev)?;
    let (bn, rows, num_blocks) = (c.bucket.num_reqs(), c.bucket.num_tokens(), model.num_blocks);
    let mut attn = model.attention(&dev, &stream)?;
    let mut eager = attn.new_step_metadata()?;
    let mut gstep = attn.new_graph_step(c.bucket)?;
    let spec = attn.cache_spec();

    // Both paths start from the same random caches (so any length reads real values).
    let init: Vec<C> = random_vec(&mut rng, spec.num_elements(), 1.0);
    let mut caches_e: Vec<_> = (0..c.layers).map(|_| upload(&stream, &init)).collect();
    let sinks = SharedBuf::new(upload(&stream, &random_vec::<f32>(&mut rng, c.hq, 1.5)));
    let scales: Option<Scales> = c.fp8.then(|| (SharedBuf::new(upload(&stream, &[0.02f32])), SharedBuf::new(upload(&stream, &[0.03f32]))));
    // What the graph captures is shared: it holds a handle to each.
    let caches_g: Vec<_> = (0..c.layers).map(|_| SharedBuf::new(upload(&stream, &init))).collect();
    let w = c.widths();
    let width = w.q + w.k + w.v;
    let in_g = SharedBuf::new(upload(&stream, &random_vec::<bf16>(&mut rng, rows * width, 1.0)));
    let outs_g: Vec<_> = (0..c.layers).map(|_| SharedBuf::new(upload(&stream, &vec![poison::<bf16>(); rows * w.out]))).collect();
    let mut graph = None;
    let mut worst = 0.0f64;
    let mixed = matches!(c.bucket, GraphBucket::Mixed { .. });

    for s in 0..c.steps {
        let n = if s == 0 { bn } else { rng.random_range(1..=bn) };
        let st = random_step(&mut rng, &c, n, num_blocks);
        let n = st.seq_lens.len();
        let nt = st.qsl[n] as usize;
        let input = StepInput {
            query_start_loc: &st.qsl,
            seq_lens: &st.seq_lens,
            block_table: &st.block_table,
            block_table_stride: st.stride,
            slot_mapping: &st.slots,
            num_actual_tokens: nt,
            num_blocks,
            block_size: 16,
        };
        eager.build(&input)?;
        gstep.build(&input)?;
        let data: Vec<bf16> = random_vec(&mut rng, nt * width, 1.0);
        let in_e = upload(&stream, &data);
        in_g.write_from_host(&stream, &data)?;

        let mut outs_e: Vec<_> = (0..c.layers).map(|_| upload(&stream, &vec![poison::<bf16>(); nt * w.out])).collect();
        let (k_e, v_e) = (in_e.slice(w.q..), in_e.slice(w.q + w.k..));
        for (l, (cache, out)) in caches_e.iter_mut().zip(&mut outs_e).enumerate() {
            let qkv = (DevIn::new(&in_e, &stream), DevIn::new(&k_e, &stream), DevIn::new(&v_e, &stream));
            let sc = scales.as_ref().map(|s| (s, &stream));
            let io = with_sinks(&c, l, layer(&c, nt, qkv, DevOut::new(cache, &stream), DevOut::new(out, &stream), sc), &sinks, &stream);
            attn.forward_layer(&eager, l, io)?;
        }
        if graph.is_none() {
            graph = Some(attn.capture(&gstep, |a| {
                for (l, (cache, out)) in caches_g.iter().zip(&outs_g).enumerate() {
                    let io = shared_layer(&c, &stream, &in_g, cache, out, scales.as_ref())?;
                    a.forward_layer(&gstep, l, with_sinks(&c, l, io, &sinks, &stream))?;
                }
                Ok(())
            })?);
        }
        if mixed {
            for out in &outs_g {
                out.write_from_host(&stream, &vec![poison::<bf16>(); rows * w.out])?;
            }
        }
        graph.as_ref().expect("captured").replay(&gstep)?;
        attn.check_status()?;

        for l in 0..c.layers {
            let (got, want) = (download(&stream, outs_g[l].as_cuda_slice()), download(&stream, &outs_e[l]));
            let g: Vec<f64> = got[..nt * w.out].iter().map(|x| x.to_f32() as f64).collect();
            let e: Vec<f64> = want.iter().map(|x| x.to_f32() as f64).collect();
            let err = rel_error(&g, &e);
            if err.is_nan() || err > tolerance(DType::BF16) {
                return Err(format!("step {s} ({n} requests, lengths {:?}) layer {l}: rel error {err:.3e}", st.seq_lens).into());
            }
            worst = worst.max(err);
            // A mixed step leaves its padding rows as they were (poisoned before the replay).
            let bad = |x: &bf16| if mixed { x.to_bits() != poison::<bf16>().to_bits() } else { !x.to_f32().is_finite() };
            if let Some(i) = got[nt * w.out..].iter().position(bad) {
                return Err(format!("step {s} layer {l}: padding output element {i} is {:?}", got[nt * w.out + i]).into());
            }
        }
    }
    for l in 0..c.layers {
        let got = download(&stream, caches_g[l].as_cuda_slice());
        let mismatched = bitwise_mismatches(&got, &download(&stream, &caches_e[l]), |x| x.to_f32().to_bits() as u64);
        if !mismatched.is_empty() {
            return Err(format!("layer {l}: caches differ: {mismatched:?}").into());
        }
    }
    eprintln!("{:?}: {} steps, worst rel error vs eager {worst:.2e}", c.bucket, c.steps);
    Ok(())
}

/// Steps a graph step refuses, naming the argument; and a backend without graphs.
fn refusals() -> TestResult {
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let model = ModelConfig::standard(8, 2, 128, DType::BF16, 16, KvLayout::FlashNhd);
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let limits = ForwardLimits { max_num_tokens: 8, max_num_reqs: 4, max_model_len: 64 };
    let attn = Attention::new(&sel, ForwardConfig::new(model, 32, limits), Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    let expect = |what: &str, arg: &str, r: Result<(), AttnError>| -> TestResult {
        match r {
            Err(AttnError::InvalidArgument { arg: a, .. }) if a == arg => Ok(()),
            other => Err(format!("{what}: expected a refusal of `{arg}`, got {other:?}").into()),
        }
    };
    expect("bucket past max_num_reqs", "bucket", attn.new_graph_step(GraphBucket::decode(5)).map(|_| ()))?;
    expect("bucket of two-token queries, threshold 1", "bucket", attn.new_graph_step(GraphBucket::uniform(2, 2)).map(|_| ()))?;
    expect("mixed bucket past max_num_tokens", "bucket", attn.new_graph_step(GraphBucket::mixed(2, 9)).map(|_| ()))?;
    let mut g = attn.new_graph_step(GraphBucket::decode(2))?;
    let build = |g: &mut attn_rs::forward::StepMetadata, qsl: &[i32], lens: &[i32], slots: &[i64]| {
        let table = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12];
        g.build(&StepInput {
            query_start_loc: qsl,
            seq_lens: lens,
            block_table: &table,
            block_table_stride: 4,
            slot_mapping: slots,
            num_actual_tokens: *qsl.last().unwrap() as usize,
            num_blocks: 32,
            block_size: 16,
        })
        .map(|_| ())
    };
    expect("three requests in a bucket of two", "seq_lens", build(&mut g, &[0, 1, 2, 3], &[5, 5, 5], &[0, 1, 2]))?;
    expect("a prefill in a decode bucket", "query_start_loc", build(&mut g, &[0, 1, 3], &[5, 5], &[0, 1, 2]))?;
    build(&mut g, &[0, 1, 2], &[5, 40], &[20, 111])?;
    if g.num_actual_tokens() != 2 || g.seq_lens() != [5, 40] {
        return Err(format!("padded step: {} tokens, lengths {:?}", g.num_actual_tokens(), g.seq_lens()).into());
    }
    build(&mut g, &[0, 1], &[7], &[22])?;
    if g.num_actual_tokens() != 2 || g.seq_lens() != [7, 0] || g.query_start_loc() != [0, 1, 2] {
        return Err(format!("padded step: {} tokens, lengths {:?}", g.num_actual_tokens(), g.seq_lens()).into());
    }
    // A mixed bucket: padded to one request more, which holds the padding tokens.
    let mut m = attn.new_graph_step(GraphBucket::mixed(2, 6))?;
    expect("three requests in a mixed bucket of two", "seq_lens", build(&mut m, &[0, 1, 2, 3], &[5, 5, 5], &[0, 1, 2]))?;
    expect("a decode after a prefill", "query_start_loc", build(&mut m, &[0, 3, 4], &[5, 5], &[0, 1, 2, 3]))?;
    build(&mut m, &[0, 1, 4], &[5, 10], &[20, 111, 112, 113])?;
    if m.num_actual_tokens() != 6 || m.seq_lens() != [5, 10, 0] || m.query_start_loc() != [0, 1, 4, 6] {
        return Err(format!("padded mixed step: {} tokens, {:?} / {:?}", m.num_actual_tokens(), m.query_start_loc(), m.seq_lens()).into());
    }
    build(&mut m, &[0, 3], &[3], &[20, 21, 22])?;
    if m.query_start_loc() != [0, 3, 3, 6] || m.split().num_decodes != 0 || m.prefill_query_start_loc() != [0, 3, 3, 6] {
        return Err(format!("padded mixed step: {:?}, split {:?}", m.query_start_loc(), m.split()).into());
    }
    let mla = ModelConfig::mla(16, DType::BF16, 16);
    let mla_sel = select_backend_no_env(&mla, &DeviceInfo::from_device(&dev), None)?;
    let handles = GpuHandles { dev: dev.clone(), stream: stream.clone() };
    let mla_attn = Attention::new(&mla_sel, ForwardConfig::new(mla, 32, limits), Some(handles))?;
    expect("a mixed bucket of an MLA model", "bucket", mla_attn.new_graph_step(GraphBucket::mixed(2, 6)).map(|_| ()))?;
    let cpu = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None)?;
    let cpu_attn = Attention::new(&cpu, ForwardConfig::new(model, 32, limits), None)?;
    expect("the cpu backend", "backend", cpu_attn.new_graph_step(GraphBucket::decode(2)).map(|_| ()))
}

/// What a capture refuses, naming the argument, before the refused call enqueues anything: a
/// layer with a borrowed (not shared) buffer, a `forward` with an eager step, another Attention's
/// `forward` or a step's `build` on the stream being captured, making a step inside the
/// capture; and a replay with a step other than the captured one. The Attention captures and
/// replays fine after all of them, also a graph whose layers run two graph steps, after the
/// second one is dropped (the graph holds it).
fn capture_refusals() -> TestResult {
    let mut rng = rng(7100);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let c = Case {
        mla: false,
        hq: 8,
        hkv: 2,
        d: 128,
        bucket: GraphBucket::decode(2),
        fp8: false,
        per_layer: false,
        chunk: None,
        threshold: 1,
        layers: 1,
        steps: 1,
        max_len: 256,
    };
    let model = CaseModel::new(&c, &dev)?;
    let mut attn = model.attention(&dev, &stream)?;
    // A second model on the same stream (a draft model, say).
    let mut other = model.attention(&dev, &stream)?;
    let (mut gstep, mut eager, mut other_step) = (attn.new_graph_step(c.bucket)?, attn.new_step_metadata()?, other.new_step_metadata()?);
    let st = random_step(&mut rng, &c, 2, model.num_blocks);
    for step in [&mut gstep, &mut eager, &mut other_step] {
        build(step, &st, model.num_blocks)?;
    }
    let w = c.widths();
    let rows = c.bucket.num_tokens();
    let input = SharedBuf::new(upload(&stream, &random_vec::<bf16>(&mut rng, rows * (w.q + w.k + w.v), 1.0)));
    let cache = SharedBuf::new(upload(&stream, &random_vec::<bf16>(&mut rng, attn.cache_spec().num_elements(), 1.0)));
    let out = SharedBuf::new(upload(&stream, &vec![poison::<bf16>(); rows * w.out]));
    let mut plain_cache = upload(&stream, &vec![bf16::ZERO; cache.len()]);
    let mut plain_out = upload(&stream, &vec![bf16::ZERO; out.len()]);
    let expect = |what: &str, arg: &str, r: Result<(), AttnError>| -> TestResult {
        match r {
            Err(AttnError::InvalidArgument { arg: a, reason }) if a == arg => {
                eprintln!("{what}: refused `{a}`: {reason}");
                Ok(())
            }
            other => Err(format!("{what}: expected a refusal of `{arg}`, got {other:?}").into()),
        }
    };
    let qkv = || -> Result<_, AttnError> {
        Ok((
            DevIn::shared(&input, &stream),
            DevIn::shared_range(&input, w.q.., &stream)?,
            DevIn::shared_range(&input, w.q + w.k.., &stream)?,
        ))
    };

    let r = attn.capture(&gstep, |a| {
        a.forward(&gstep, layer(&c, rows, qkv()?, DevOut::new(&mut plain_cache, &stream), DevOut::shared(&out, &stream), None))
    });
    expect("a borrowed cache", "cache", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |a| {
        a.forward(&gstep, layer(&c, rows, qkv()?, DevOut::shared(&cache, &stream), DevOut::new(&mut plain_out, &stream), None))
    });
    expect("a borrowed output", "out", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |a| {
        let (_, k, v) = qkv()?;
        let q = DevIn::new(input.as_cuda_slice(), &stream);
        a.forward(&gstep, layer(&c, rows, (q, k, v), DevOut::shared(&cache, &stream), DevOut::shared(&out, &stream), None))
    });
    expect("a borrowed query", "q", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |a| a.forward(&eager, shared_layer(&c, &stream, &input, &cache, &out, None)?));
    expect("a forward with an eager step", "step", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |_| other.forward(&other_step, shared_layer(&c, &stream, &input, &cache, &out, None)?));
    expect("another Attention's forward on the captured stream", "stream", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |_| build(&mut other_step, &st, model.num_blocks));
    expect("a step's build on the captured stream", "stream", r.map(|_| ()))?;
    let r = attn.capture(&gstep, |a| a.new_step_metadata().map(|_| ()));
    expect("a step made inside the capture", "capture", r.map(|_| ()))?;
    expect("a range past the buffer", "range", DevIn::shared_range(&input, ..input.len() + 1, &stream).map(|_| ()))?;
    expect("a host write past the buffer", "src", out.write_from_host(&stream, &vec![bf16::ZERO; out.len() + 1]))?;

    // Nothing above left the stream capturing, or the Attention unable to capture. A layer may
    // run another graph step (a cross-attention step's, say): the graph holds it too.
    let mut gstep2 = attn.new_graph_step(c.bucket)?;
    build(&mut gstep2, &st, model.num_blocks)?;
    let both = attn.capture(&gstep, |a| {
        a.forward(&gstep, shared_layer(&c, &stream, &input, &cache, &out, None)?)?;
        a.forward(&gstep2, shared_layer(&c, &stream, &input, &cache, &out, None)?)
    })?;
    drop(gstep2);
    both.replay(&gstep)?;
    attn.check_status()?;
    drop(both);
    let graph = attn.capture(&gstep, |a| a.forward(&gstep, shared_layer(&c, &stream, &input, &cache, &out, None)?))?;
    let mut gstep2 = attn.new_graph_step(c.bucket)?;
    build(&mut gstep2, &st, model.num_blocks)?;
    expect("a replay with another graph step of the bucket", "step", graph.replay(&gstep2))?;
    expect("a replay with an eager step", "step", graph.replay(&eager))?;
    graph.replay(&gstep)?;
    attn.check_status()?;
    let got = download(&stream, out.as_cuda_slice());
    if let Some(i) = got.iter().position(|x| !x.to_f32().is_finite()) {
        return Err(format!("output element {i} is {:?} after the replay", got[i]).into());
    }
    Ok(())
}

/// The graph keeps what it uses (a mixed bucket's: the prefill kernel's counters too): capture,
/// drop the Attention, its eager step and every handle to the captured buffers (inputs, caches,
/// outputs) but one clone of the last layer's output, reallocate (poison) as much memory as was
/// dropped, then replay over several steps, the graph step rebuilt before each. Each replay's output must match a separate Attention's eager run
/// of the same steps (its own caches, from the same start). Meant to run under
/// compute-sanitizer memcheck too: a replay touching freed memory fails it.
fn graph_outlives_its_owners() -> TestResult {
    let mut rng = rng(7200);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let c = Case {
        mla: false,
        hq: 16,
        hkv: 4,
        d: 128,
        bucket: GraphBucket::mixed(4, 96),
        fp8: false,
        per_layer: false,
        chunk: None,
        threshold: 1,
        layers: 2,
        steps: 8,
        max_len: 1200,
    };
    let model = CaseModel::new(&c, &dev)?;
    let (w, bn, rows) = (c.widths(), c.bucket.num_reqs(), c.bucket.num_tokens());
    let width = w.q + w.k + w.v;
    let num_blocks = model.num_blocks;

    let mut attn = model.attention(&dev, &stream)?;
    let spec = attn.cache_spec();
    let init: Vec<bf16> = random_vec(&mut rng, spec.num_elements(), 1.0);
    let data: Vec<bf16> = random_vec(&mut rng, rows * width, 1.0);
    let mut gstep = attn.new_graph_step(c.bucket)?;
    let eager = attn.new_step_metadata()?;
    let first = random_step(&mut rng, &c, bn, num_blocks);
    build(&mut gstep, &first, num_blocks)?;

    let caches_g: Vec<_> = (0..c.layers).map(|_| SharedBuf::new(upload(&stream, &init))).collect();
    let in_g = SharedBuf::new(upload(&stream, &data));
    let outs_g: Vec<_> = (0..c.layers).map(|_| SharedBuf::new(upload(&stream, &vec![poison::<bf16>(); rows * w.out]))).collect();
    let graph = attn.capture(&gstep, |a| {
        for (cache, out) in caches_g.iter().zip(&outs_g) {
            a.forward(&gstep, shared_layer(&c, &stream, &in_g, cache, out, None)?)?;
        }
        Ok(())
    })?;
    let reader = outs_g[c.layers - 1].clone();
    drop((attn, eager, caches_g, in_g, outs_g));
    stream.synchronize()?;
    // Were anything freed, these would likely take its place (and the replays clobber them).
    let decoys: Vec<_> = (0..c.layers)
        .flat_map(|_| {
            [upload(&stream, &vec![poison::<bf16>(); spec.num_elements()]), upload(&stream, &vec![poison::<bf16>(); rows * w.out])]
        })
        .chain([upload(&stream, &vec![poison::<bf16>(); rows * width])])
        .collect();

    // The reference: another Attention, eager, its own caches from the same start.
    let mut reference = model.attention(&dev, &stream)?;
    let mut ref_step = reference.new_step_metadata()?;
    let mut caches_e: Vec<_> = (0..c.layers).map(|_| upload(&stream, &init)).collect();
    for s in 0..c.steps {
        let n = if s == 0 { bn } else { rng.random_range(1..=bn) };
        let st = if s == 0 { first.clone() } else { random_step(&mut rng, &c, n, num_blocks) };
        let n = st.seq_lens.len();
        let nt = st.qsl[n] as usize;
        build(&mut gstep, &st, num_blocks)?;
        graph.replay(&gstep)?;
        build(&mut ref_step, &st, num_blocks)?;
        let in_e = upload(&stream, &data[..nt * width]);
        let (k_e, v_e) = (in_e.slice(w.q..), in_e.slice(w.q + w.k..));
        let mut out_e = upload(&stream, &vec![poison::<bf16>(); nt * w.out]);
        for cache in caches_e.iter_mut() {
            let qkv = (DevIn::new(&in_e, &stream), DevIn::new(&k_e, &stream), DevIn::new(&v_e, &stream));
            reference.forward(&ref_step, layer(&c, nt, qkv, DevOut::new(cache, &stream), DevOut::new(&mut out_e, &stream), None))?;
        }
        reference.check_status()?;
        let (got, want) = (download(&stream, reader.as_cuda_slice()), download(&stream, &out_e));
        let g: Vec<f64> = got[..nt * w.out].iter().map(|x| x.to_f32() as f64).collect();
        let e: Vec<f64> = want.iter().map(|x| x.to_f32() as f64).collect();
        let err = rel_error(&g, &e);
        if err.is_nan() || err > tolerance(DType::BF16) {
            return Err(format!("replay {s} ({n} requests, lengths {:?}): rel error {err:.3e} against eager", st.seq_lens).into());
        }
    }
    let poisoned = decoys.iter().all(|d| download(&stream, d).iter().all(|x| x.to_bits() == poison::<bf16>().to_bits()));
    if !poisoned {
        return Err("memory allocated after the drops was written: the graph used freed memory".into());
    }
    drop(graph);
    drop(gstep);
    stream.synchronize()?;
    Ok(())
}

fn main() {
    let std = |hq, hkv, d, bucket, threshold, steps, max_len| Case {
        mla: false,
        hq,
        hkv,
        d,
        bucket,
        fp8: false,
        per_layer: false,
        chunk: None,
        threshold,
        layers: 2,
        steps,
        max_len,
    };
    let fp8 = |c: Case| Case { fp8: true, ..c };
    let per_layer = |c: Case| Case { per_layer: true, ..c };
    let chunked = |c: Case| Case { chunk: Some(64), ..c };
    let chunked_40 = |c: Case| Case { chunk: Some(40), ..c };
    let mut cases = vec![
        ("gqa4_d128_bucket8", std(32, 8, 128, GraphBucket::decode(8), 1, 100, 3000)),
        ("gqa8_d64_bucket3_q2", std(16, 2, 64, GraphBucket::uniform(3, 2), 2, 40, 1500)),
        (
            "mla16_bucket4",
            Case {
                mla: true,
                hq: 16,
                hkv: 1,
                d: 576,
                bucket: GraphBucket::decode(4),
                fp8: false,
                per_layer: false,
                chunk: None,
                threshold: 1,
                layers: 2,
                steps: 40,
                max_len: 2000,
            },
        ),
        ("mixed_gqa4_d128_8x700", std(32, 8, 128, GraphBucket::mixed(8, 700), 1, 40, 3000)),
        ("mixed_gqa8_d64_5x300_spec3", std(16, 2, 64, GraphBucket::mixed(5, 300), 3, 30, 1500)),
        ("mixed_mqa_d80_6x257", std(8, 1, 80, GraphBucket::mixed(6, 257), 1, 30, 900)),
        ("mixed_per_layer_gqa4_d128_6x300", per_layer(std(32, 8, 128, GraphBucket::mixed(6, 300), 1, 30, 2000))),
        ("per_layer_gqa4_d128_bucket5", per_layer(std(32, 8, 128, GraphBucket::decode(5), 1, 30, 2000))),
        ("fp8_gqa4_d128_bucket6", fp8(std(32, 8, 128, GraphBucket::decode(6), 1, 30, 3000))),
        ("fp8_mixed_gqa4_d128_6x400", fp8(std(32, 8, 128, GraphBucket::mixed(6, 400), 1, 30, 2000))),
        ("chunked_gqa4_d128_bucket6", chunked(std(32, 8, 128, GraphBucket::decode(6), 1, 30, 2000))),
        ("mixed_chunked_gqa8_d64_5x300_spec3", chunked(std(16, 2, 64, GraphBucket::mixed(5, 300), 3, 30, 1500))),
        ("fp8_chunked_gqa4_d128_bucket6", fp8(chunked(std(32, 8, 128, GraphBucket::decode(6), 1, 30, 2000)))),
        ("fp8_mixed_chunked_gqa4_d128_6x400", fp8(chunked(std(32, 8, 128, GraphBucket::mixed(6, 400), 1, 30, 2000)))),
        ("chunked_gqa8_d64_bucket3_q2", chunked(std(16, 2, 64, GraphBucket::uniform(3, 2), 2, 30, 1500))),
        ("fp8_chunked_gqa4_d128_bucket4_q3", fp8(chunked(std(32, 8, 128, GraphBucket::uniform(4, 3), 3, 30, 2000)))),
        ("chunks_of_40_gqa8_d64_bucket3_q2", chunked_40(std(16, 2, 64, GraphBucket::uniform(3, 2), 2, 30, 1500))),
        ("mixed_chunks_of_40_gqa4_d128_5x300", chunked_40(std(32, 8, 128, GraphBucket::mixed(5, 300), 1, 30, 1500))),
    ];
    if quick() {
        for (_, c) in &mut cases {
            c.steps = c.steps.min(6);
        }
    }
    let mut trials: Vec<Trial> = cases
        .into_iter()
        .enumerate()
        .map(|(i, (name, c))| Trial::test(format!("graph::{name}"), move || graph_case(c, 7000 + i as u64)))
        .collect();
    trials.push(Trial::test("graph::refusals", refusals));
    trials.push(Trial::test("graph::capture_refusals", capture_refusals));
    trials.push(Trial::test("graph::outlives_its_owners", graph_outlives_its_owners));
    run_gpu_trials(trials)
}
