//! CUDA-graph steps against eager execution: one graph per case is captured for a bucket, then
//! replayed over many steps in which the batch size, the lengths (split-K or not) and the block
//! tables change; each replay's outputs must match the same step run eagerly (a normal step
//! metadata, its own caches), every layer, and the caches must end bit for bit equal. Padding
//! rows (requests past the step's) must come out finite. Standard attention (GQA, one and two
//! query tokens) and MLA; refusals of steps a graph cannot take.

mod common;

use common::*;
use cudarc::driver::{CudaSlice, CudaStream, CudaView};
use half::bf16;
use host::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use host::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, GraphBucket, LayerIo, NewKv};
use host::metadata::StepInput;
use host::{AttnError, DType, DevIn, DevOut, KvLayout, RowsDesc};
use libtest_mimic::Trial;
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
            ModelConfig::standard(self.hq, self.hkv, self.d, DType::BF16, 16, KvLayout::FlashNhd)
        }
    }
}

/// One layer's tensors over a fused input buffer of `rows` tokens.
fn layer<'a>(
    c: &Case,
    stream: &'a Arc<CudaStream>,
    (input, k, v): (&'a CudaSlice<bf16>, &'a CudaView<'a, bf16>, &'a CudaView<'a, bf16>),
    rows: usize,
    cache: &'a mut CudaSlice<bf16>,
    out: &'a mut CudaSlice<bf16>,
) -> LayerIo<'a> {
    let w = c.widths();
    let width = w.q + w.k + w.v;
    let q_rows = RowsDesc { num_tokens: rows, num_heads: c.hq, head_size: w.q_head, token_stride: width, head_stride: w.q_head };
    let (k, v) = (DevIn::new(k, stream), DevIn::new(v, stream));
    let new_kv = if c.mla {
        NewKv::Mla { kv_c: k, kv_c_token_stride: width, k_pe: v, k_pe_token_stride: width }
    } else {
        let kv_rows = RowsDesc { num_tokens: rows, num_heads: c.hkv, head_size: c.d, token_stride: width, head_stride: c.d };
        NewKv::Standard { k, k_rows: kv_rows, v, v_rows: kv_rows }
    };
    let out_rows = RowsDesc::contiguous(rows, c.hq, w.out / c.hq);
    LayerIo::Gpu(GpuLayer {
        q: DevIn::new(input, stream),
        q_rows,
        new_kv,
        cache: DevOut::new(cache, stream),
        out: DevOut::new(out, stream),
        out_rows,
        alibi_slopes: None,
        sinks: None,
        kv_scales: None,
    })
}

/// A step's batch: `n` requests of the bucket's query length with random lengths (short ones,
/// ones at the limit, long ones that split) over blocks drawn without repeats from the cache.
struct Step {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
}

fn random_step(rng: &mut rand::rngs::SmallRng, c: &Case, n: usize, num_blocks: usize) -> Step {
    let (q, bs) = (c.bucket.query_len, 16);
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    pool.shuffle(rng);
    let seq_lens: Vec<i32> = (0..n)
        .map(|_| match rng.random_range(0..4) {
            0 => q as i32,
            1 => rng.random_range(q..64) as i32,
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
        for pos in len - q..len {
            slots.push(row[pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
        }
        qsl.push(qsl[r] + q as i32);
    }
    Step { qsl, seq_lens, block_table, stride, slots }
}

fn graph_case(c: Case, salt: u64) -> TestResult {
    let mut rng = rng(salt);
    let dev = arc_device();
    let stream = dev.context().new_stream()?;
    let model = c.model();
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&dev), None)?;
    let (bn, rows) = (c.bucket.num_reqs, c.bucket.num_tokens());
    let num_blocks = bn * c.max_len.div_ceil(16) + 64;
    let limits = ForwardLimits { max_num_tokens: rows, max_num_reqs: bn, max_model_len: c.max_len };
    let mut config = ForwardConfig::new(model, num_blocks, limits);
    config.decode_threshold = c.bucket.query_len;
    let mut attn = Attention::new(&sel, config, Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))?;
    let mut eager = attn.new_step_metadata()?;
    let mut gstep = attn.new_graph_step(c.bucket)?;
    let spec = attn.cache_spec();

    // Both paths start from the same random caches (so any length reads real values).
    let init: Vec<bf16> = random_vec(&mut rng, spec.num_elements(), 1.0);
    let mut caches_e: Vec<_> = (0..c.layers).map(|_| upload(&stream, &init)).collect();
    let mut caches_g: Vec<_> = (0..c.layers).map(|_| upload(&stream, &init)).collect();
    let w = c.widths();
    let width = w.q + w.k + w.v;
    let mut in_g = upload(&stream, &random_vec::<bf16>(&mut rng, rows * width, 1.0));
    let mut outs_g: Vec<_> = (0..c.layers).map(|_| upload(&stream, &vec![poison::<bf16>(); rows * w.out])).collect();
    let mut graph = None;
    let mut worst = 0.0f64;

    for s in 0..c.steps {
        let n = if s == 0 { bn } else { rng.random_range(1..=bn) };
        let st = random_step(&mut rng, &c, n, num_blocks);
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
        stream.memcpy_htod(&data, &mut in_g.slice_mut(..nt * width))?;

        let mut outs_e: Vec<_> = (0..c.layers).map(|_| upload(&stream, &vec![poison::<bf16>(); nt * w.out])).collect();
        let (k_e, v_e) = (in_e.slice(w.q..), in_e.slice(w.q + w.k..));
        for (cache, out) in caches_e.iter_mut().zip(&mut outs_e) {
            attn.forward(&eager, layer(&c, &stream, (&in_e, &k_e, &v_e), nt, cache, out))?;
        }
        if graph.is_none() {
            graph = Some(attn.capture(&gstep, |a| {
                let (k_g, v_g) = (in_g.slice(w.q..), in_g.slice(w.q + w.k..));
                for (cache, out) in caches_g.iter_mut().zip(&mut outs_g) {
                    a.forward(&gstep, layer(&c, &stream, (&in_g, &k_g, &v_g), rows, cache, out))?;
                }
                Ok(())
            })?);
        }
        graph.as_ref().expect("captured").replay(&gstep)?;
        attn.check_status()?;

        for l in 0..c.layers {
            let (got, want) = (download(&stream, &outs_g[l]), download(&stream, &outs_e[l]));
            let g: Vec<f64> = got[..nt * w.out].iter().map(|x| x.to_f32() as f64).collect();
            let e: Vec<f64> = want.iter().map(|x| x.to_f32() as f64).collect();
            let err = rel_error(&g, &e);
            if err.is_nan() || err > tolerance(DType::BF16) {
                return Err(format!("step {s} ({n} requests, lengths {:?}) layer {l}: rel error {err:.3e}", st.seq_lens).into());
            }
            worst = worst.max(err);
            if let Some(i) = got[nt * w.out..].iter().position(|x| !x.to_f32().is_finite()) {
                return Err(format!("step {s} layer {l}: padding output element {i} is {:?}", got[nt * w.out + i]).into());
            }
        }
    }
    for l in 0..c.layers {
        let mismatched = bitwise_mismatches(&download(&stream, &caches_g[l]), &download(&stream, &caches_e[l]), |x| x.to_bits() as u64);
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
    let attn = Attention::new(&sel, ForwardConfig::new(model, 32, limits), Some(GpuHandles { dev, stream }))?;
    let expect = |what: &str, arg: &str, r: Result<(), AttnError>| -> TestResult {
        match r {
            Err(AttnError::InvalidArgument { arg: a, .. }) if a == arg => Ok(()),
            other => Err(format!("{what}: expected a refusal of `{arg}`, got {other:?}").into()),
        }
    };
    expect("bucket past max_num_reqs", "bucket", attn.new_graph_step(GraphBucket::decode(5)).map(|_| ()))?;
    expect(
        "bucket of two-token queries, threshold 1",
        "bucket",
        attn.new_graph_step(GraphBucket { num_reqs: 2, query_len: 2 }).map(|_| ()),
    )?;
    let mut g = attn.new_graph_step(GraphBucket::decode(2))?;
    let build = |g: &mut host::forward::StepMetadata, qsl: &[i32], lens: &[i32], slots: &[i64]| {
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
    let cpu = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None)?;
    let cpu_attn = Attention::new(&cpu, ForwardConfig::new(model, 32, limits), None)?;
    expect("the cpu backend", "backend", cpu_attn.new_graph_step(GraphBucket::decode(2)).map(|_| ()))
}

fn main() {
    let std = |hq, hkv, d, bucket, steps, max_len| Case { mla: false, hq, hkv, d, bucket, layers: 2, steps, max_len };
    let mut cases = vec![
        ("gqa4_d128_bucket8", std(32, 8, 128, GraphBucket::decode(8), 100, 3000)),
        ("gqa8_d64_bucket3_q2", std(16, 2, 64, GraphBucket { num_reqs: 3, query_len: 2 }, 40, 1500)),
        ("mla16_bucket4", Case { mla: true, hq: 16, hkv: 1, d: 576, bucket: GraphBucket::decode(4), layers: 2, steps: 40, max_len: 2000 }),
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
    run_gpu_trials(trials)
}
