//! Context-parallel decode across the GPUs of one machine, through NCCL: one thread a GPU, each
//! rank writing its share of every context with the GPU cache write and running
//! `CpDecode::decode` (its decode, the all-gather, the merge).
//!
//! 1. Checks: small batches (odd lengths, one-token and empty requests, GQA 4 and 16, FP8,
//!    sinks, soft-cap), through `CpDecode::decode` and through `Attention::forward` with a
//!    context-parallel config: every rank's merged output equal bit for bit, and against the
//!    f64 CPU reference of the whole context; the refusals (two query tokens, a window).
//! 2. Benchmark (`--shapes`, requests x context, 32 q / 8 kv heads, d128, bf16, block size 16):
//!    rank 0's decode of the whole context on one GPU, then the group's step (decode of each
//!    share, all-gather, merge) timed on every rank, and each rank's decode alone; the merged
//!    output against the one-GPU one.
//!
//! Needs `libnccl.so` on the loader's path (`context_parallel::nccl_available` says where).

use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::cache_write::{concat_and_cache_mla, reshape_and_cache, KvScales, KvWrite, MlaWrite};
use attn_rs::context_parallel::{nccl_available, new_comm, CpDecode, CpShard, NcclExchange};
use attn_rs::cudarc::driver::sys::CUevent_flags;
use attn_rs::cudarc::driver::{CudaSlice, CudaStream};
use attn_rs::cudarc::nccl::safe::Id;
use attn_rs::decode::{paged_decode, DecodeArgs, DecodeBatch, DecodeWorkspace};
use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv};
use attn_rs::metadata::StepInput;
use attn_rs::mla::{mla_attention, MlaArgs};
use attn_rs::{
    cpu, AttnDevice, AttnError, AttnOptions, BatchMetadata, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3, KvCacheSpec, KvLayout,
    MlaCacheSpec, Result, RowsDesc, SplitMode,
};
use clap::Parser;
use half::bf16;
use serde::Serialize;
use std::sync::{Arc, Barrier};

#[derive(Parser, Clone)]
#[command(about = "Context-parallel decode across this machine's GPUs through NCCL: checks, then timings")]
struct Args {
    /// Ranks, one GPU each (GPUs 0..ranks); default: every GPU.
    #[arg(long)]
    ranks: Option<usize>,
    /// Benchmark shapes, `requests x context` separated by commas.
    #[arg(long, default_value = "1x1048576,8x131072")]
    shapes: String,
    /// MLA shapes (DeepSeek's 512 + 64 latent cache, bf16, block size 64),
    /// `requests x context x heads` separated by commas ("" for none).
    #[arg(long, default_value = "1x1048576x16,64x16384x128")]
    mla_shapes: String,
    /// Positions a rank takes before the next one's turn.
    #[arg(long, default_value_t = 1)]
    interleave: usize,
    /// Timed steps per measurement (the median of 5 such batches is reported).
    #[arg(long, default_value_t = 20)]
    iters: usize,
    /// Only the checks.
    #[arg(long)]
    check_only: bool,
    /// Write the results as JSON here.
    #[arg(long)]
    json: Option<std::path::PathBuf>,
}

const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;
const BS: usize = 16;

/// A small batch to check.
#[derive(Clone, Debug)]
struct Check {
    name: &'static str,
    seq_lens: Vec<i32>,
    hq: usize,
    hkv: usize,
    fp8: bool,
    sinks: bool,
    softcap: Option<f32>,
    /// Through `Attention::forward` (the step's token written by its cache write) instead of
    /// `CpDecode::decode`.
    forward: bool,
}

fn checks() -> Vec<Check> {
    let lens = vec![1, 0, 2, 17, 333, 1001, 2048, 4097];
    let base = Check { name: "gqa4", seq_lens: lens.clone(), hq: 32, hkv: 8, fp8: false, sinks: false, softcap: None, forward: false };
    vec![
        base.clone(),
        Check { name: "gqa16_sinks", hq: 32, hkv: 2, sinks: true, ..base.clone() },
        Check { name: "fp8_softcap", fp8: true, softcap: Some(30.0), ..base.clone() },
        // A decode step has its token: every length at least 1.
        Check { name: "forward_sinks", seq_lens: lens.iter().map(|&l| l.max(1)).collect(), sinks: true, forward: true, ..base.clone() },
        Check { name: "forward_fp8", seq_lens: lens.iter().map(|&l| l.max(1)).collect(), fp8: true, forward: true, ..base },
    ]
}

/// Pseudo-random values (a 64-bit LCG): every rank draws the same ones.
fn values(len: usize, seed: u64) -> Vec<bf16> {
    let mut s = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            bf16::from_f32((s >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0)
        })
        .collect()
}

/// `requests` rows of `ceil(len / vblock)` consecutive blocks each.
fn table(requests: usize, len: usize, vblock: usize) -> (Vec<i32>, usize, usize) {
    let e = len.div_ceil(vblock).max(1);
    ((0..(requests * e) as i32).collect(), e, requests * e)
}

struct Rank {
    dev: Arc<AttnDevice>,
    stream: Arc<CudaStream>,
    shard: CpShard,
    ex: NcclExchange,
    /// A communicator's id for each `forward` check (each `Attention` takes one).
    forward_ids: std::iter::Skip<std::vec::IntoIter<Id>>,
    status: DeviceStatus,
}

/// Each request's context in chunks of up to `chunk` positions, as the new tokens of a step on
/// the request's own row: (positions in the chunk, this rank's slot of each).
fn context_chunks(
    shard: CpShard,
    seq_lens: &[i32],
    (table, stride): (&[i32], usize),
    (block_size, num_blocks): (usize, usize),
    chunk: usize,
) -> Result<Vec<(usize, Vec<i64>)>> {
    let mut chunks = Vec::new();
    for (req, &len) in seq_lens.iter().enumerate() {
        let row = &table[req * stride..(req + 1) * stride];
        let mut at = 0;
        while at < len as usize {
            let n = chunk.min(len as usize - at);
            chunks.push((n, shard.shard_step(&[0, n as i32], &[(at + n) as i32], row, stride, block_size, num_blocks)?.slot_mapping));
            at += n;
        }
    }
    Ok(chunks)
}

/// A cache for `shard` of `num_blocks` blocks with each request's context written by the GPU
/// cache write, `chunk` tokens a launch, the keys and values of position `p` being row `p %
/// chunk` of `k` and `v`.
#[allow(clippy::too_many_arguments)]
fn write_contexts<C: Element>(
    r: &mut Rank,
    shard: CpShard,
    seq_lens: &[i32],
    table: &[i32],
    stride: usize,
    spec: KvCacheSpec,
    (k, v, chunk): (&CudaSlice<bf16>, &CudaSlice<bf16>, usize),
    scales: Option<(&CudaSlice<f32>, &CudaSlice<f32>)>,
) -> Result<CudaSlice<C>> {
    let mut cache: CudaSlice<C> = r.stream.alloc_zeros(spec.num_elements())?;
    for (n, slots) in context_chunks(shard, seq_lens, (table, stride), (spec.block_size, spec.num_blocks), chunk)? {
        let slots = r.stream.clone_htod(&slots)?;
        let rows = RowsDesc::contiguous(n, spec.num_kv_heads, spec.head_size);
        let s = &r.stream;
        let w = KvWrite {
            key: DevIn::new(k, s),
            key_rows: rows,
            value: DevIn::new(v, s),
            value_rows: rows,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scales: scales.map(|(ks, vs)| KvScales { k: DevIn::new(ks, s), v: DevIn::new(vs, s) }),
        };
        reshape_and_cache(&r.dev, &r.stream, w, &mut r.status)?;
    }
    r.status.take(&r.stream)?.into_result()?;
    Ok(cache)
}

/// What a rank sends back of a check: its merged output, and on rank 0 the errors against the
/// f64 reference.
struct CheckOut {
    name: &'static str,
    out: Vec<bf16>,
    rel_error: Option<f64>,
}

fn run_check<C: Element>(r: &mut Rank, c: &Check) -> Result<CheckOut> {
    let n = c.seq_lens.len();
    let world = r.shard.world_size;
    let q_rows = RowsDesc::contiguous(n, c.hq, D);
    let q = values(q_rows.required_len(), 1);
    let chunk = 4096;
    let kv_rows = RowsDesc::contiguous(chunk, c.hkv, D);
    let (k_h, v_h) = (values(kv_rows.required_len(), 2), values(kv_rows.required_len(), 3));
    let sinks_h: Vec<f32> = (0..c.hq).map(|h| (h % 5) as f32 - 1.5).collect();
    let (ks_h, vs_h) = (vec![0.05f32], vec![0.03f32]);
    let s = r.stream.clone();
    let (k, v, ks, vs) = (s.clone_htod(&k_h)?, s.clone_htod(&v_h)?, s.clone_htod(&ks_h)?, s.clone_htod(&vs_h)?);
    let (q_d, sinks_d) = (s.clone_htod(&q)?, s.clone_htod(&sinks_h)?);
    let max_len = *c.seq_lens.iter().max().unwrap() as usize;
    let (tab, stride, blocks) = table(n, max_len, BS * world);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, blocks, BS, c.hkv, D)?;
    let scales = c.fp8.then_some((&ks, &vs));
    // Through `forward`, the step's token (each request's last) is written by the step.
    let written: Vec<i32> = c.seq_lens.iter().map(|&l| l - c.forward as i32).collect();
    let mut cache = write_contexts::<C>(r, r.shard, &written, &tab, stride, spec, (&k, &v, chunk), scales)?;
    let dec_qsl: Vec<i32> = (0..=n as i32).collect();
    let local: Vec<i32> = c.seq_lens.iter().map(|&l| r.shard.local_len(l as usize) as i32).collect();
    let meta = BatchMetadata::new(&s, &local, &dec_qsl)?;
    let mut opts = AttnOptions::new(D);
    opts.softcap = c.softcap;
    let mut ws = DecodeWorkspace::new(&s, 4096 * c.hq, D, n, n)?;
    let mut part = CpDecode::new(&s, r.shard, attn_rs::DType::BF16, q_rows.required_len(), n * c.hq)?;
    let mut out: CudaSlice<bf16> = s.clone_htod(&vec![bf16::NAN; q_rows.required_len()])?;
    let bt = s.clone_htod(&tab)?;
    let a = DecodeArgs {
        q: DevIn::new(&q_d, &s),
        q_rows,
        cache: DevIn::new(&cache, &s),
        spec,
        block_table: DevIn::new(&bt, &s),
        block_table_stride: stride,
        out: DevOut::new(&mut out, &s),
        out_rows: q_rows,
        lse: None,
        alibi_slopes: None,
        sinks: c.sinks.then(|| DevIn::new(&sinks_d, &s)),
        scales: c.fp8.then(|| KvScales { k: DevIn::new(&ks, &s), v: DevIn::new(&vs, &s) }),
    };
    if c.forward {
        drop(a);
        let rows = |at: &[i32], src: &[bf16]| -> Vec<bf16> {
            at.iter().flat_map(|&p| src[(p as usize - 1) % chunk * c.hkv * D..][..c.hkv * D].to_vec()).collect()
        };
        let (k_new, v_new) = (s.clone_htod(&rows(&c.seq_lens, &k_h))?, s.clone_htod(&rows(&c.seq_lens, &v_h))?);
        let features = Features { sinks: c.sinks, sliding_window: false, softcap: c.softcap.is_some(), alibi: false };
        let model = ModelConfig {
            cache_dtype: C::DTYPE,
            ..ModelConfig::standard(c.hq, c.hkv, D, attn_rs::DType::BF16, BS, KvLayout::FlashNhd).with_features(features)
        };
        let limits = ForwardLimits { max_num_tokens: n, max_num_reqs: n, max_model_len: max_len };
        let config = ForwardConfig { context_parallel: Some(r.shard), opts, ..ForwardConfig::new(model, blocks, limits) };
        let sel = select_backend_no_env(&model, &DeviceInfo::from_device(&r.dev), None)?;
        let mut attn = Attention::new(&sel, config, Some(GpuHandles { dev: r.dev.clone(), stream: s.clone() }))?;
        let id = r.forward_ids.next().expect("an id for each forward check");
        attn.set_cp_exchange(Box::new(NcclExchange(new_comm(&s, r.shard, id)?)))?;
        let mut step = attn.new_step_metadata()?;
        let slots = vec![-1i64; n];
        let input = StepInput {
            query_start_loc: &dec_qsl,
            seq_lens: &c.seq_lens,
            block_table: &tab,
            block_table_stride: stride,
            slot_mapping: &slots,
            num_actual_tokens: n,
            num_blocks: blocks,
            block_size: BS,
        };
        step.build(&input)?;
        let kv_rows = RowsDesc::contiguous(n, c.hkv, D);
        attn.forward(
            &step,
            LayerIo::Gpu(GpuLayer {
                q: DevIn::new(&q_d, &s),
                q_rows,
                new_kv: NewKv::Standard { k: DevIn::new(&k_new, &s), k_rows: kv_rows, v: DevIn::new(&v_new, &s), v_rows: kv_rows },
                cache: DevOut::new(&mut cache, &s),
                out: DevOut::new(&mut out, &s),
                out_rows: q_rows,
                alibi_slopes: None,
                sinks: c.sinks.then(|| DevIn::new(&sinks_d, &s)),
                kv_scales: c.fp8.then(|| (DevIn::new(&ks, &s), DevIn::new(&vs, &s))),
            }),
        )?;
        attn.check_status()?;
    } else {
        part.decode(&r.dev, &s, a, &meta, &opts, SplitMode::Auto, &mut ws, &mut r.status, &mut r.ex)?;
    }
    r.status.take(&s)?.into_result()?;
    let got = s.clone_dtoh(&out)?;
    let rel_error = (r.shard.rank == 0).then(|| -> Result<f64> {
        // The f64 reference of the whole contexts (position p's rows: row p % chunk).
        let one = CpShard::new(1, 0, 1)?;
        let (tab1, stride1, blocks1) = table(n, max_len, BS);
        let spec1 = KvCacheSpec::new(KvLayout::FlashNhd, blocks1, BS, c.hkv, D)?;
        let mut cache1 = vec![C::from_f32(0.0); spec1.num_elements()];
        let host_scales = c.fp8.then_some(cpu::HostScales::Tensor(ks_h[0], vs_h[0]));
        for (m, slots) in context_chunks(one, &c.seq_lens, (&tab1, stride1), (BS, blocks1), chunk)? {
            let rows = RowsDesc::contiguous(m, c.hkv, D);
            cpu::reshape_and_cache(&k_h, rows, &v_h, rows, &slots, &mut cache1, &spec1, host_scales)?;
        }
        let want = cpu::paged_decode(&cpu::DecodeRef {
            q: &q,
            q_rows,
            cache: &cache1,
            spec: spec1,
            block_table: &tab1,
            block_table_stride: stride1,
            batch: DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &dec_qsl },
            opts,
            alibi_slopes: None,
            sinks: c.sinks.then_some(&sinks_h[..]),
            scales: host_scales,
        })?;
        Ok(row_error(&got, &want.out, D))
    });
    Ok(CheckOut { name: c.name, out: got, rel_error: rel_error.transpose()? })
}

/// The worst row's relative error (NaN if any output is not finite).
fn row_error(got: &[bf16], want: &[f64], d: usize) -> f64 {
    let mut worst = 0f64;
    for (g, w) in got.chunks(d).zip(want.chunks(d)) {
        let num: f64 = g.iter().zip(w).map(|(g, w)| (g.to_f64() - w).powi(2)).sum();
        let den: f64 = w.iter().map(|w| w * w).sum();
        let e = if den == 0.0 { num.sqrt() } else { (num / den).sqrt() };
        if !e.is_finite() || g.iter().any(|x| !x.to_f32().is_finite()) {
            return f64::NAN;
        }
        worst = worst.max(e);
    }
    worst
}

/// The refusals every rank must meet before anything is enqueued (all ranks make the same
/// calls, so none waits in the all-gather for a rank that was refused).
fn check_refusals(r: &mut Rank) -> std::result::Result<(), String> {
    let s = r.stream.clone();
    let q_rows = RowsDesc::contiguous(2, HQ, D);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, 4, BS, HKV, D).map_err(|e| e.to_string())?;
    let alloc = |n| s.alloc_zeros::<bf16>(n).map_err(|e| e.to_string());
    let (q, cache) = (alloc(q_rows.required_len())?, alloc(spec.num_elements())?);
    let bt = s.clone_htod(&[0i32, 1, 2, 3]).map_err(|e| e.to_string())?;
    let mut out = alloc(q_rows.required_len())?;
    let mut ws = DecodeWorkspace::new(&s, 4096, D, 2, 2).map_err(|e| e.to_string())?;
    let mut part = CpDecode::new(&s, r.shard, attn_rs::DType::BF16, q_rows.required_len(), 2 * HQ).map_err(|e| e.to_string())?;
    let mut window = AttnOptions::new(D);
    window.window = Some(8);
    // Two query tokens in one request; then one token each, with a window.
    for (qsl, lens, opts, arg) in
        [(vec![0, 2], vec![20], AttnOptions::new(D), "query_start_loc"), (vec![0, 1, 2], vec![20, 20], window, "opts")]
    {
        let meta = BatchMetadata::new(&s, &lens, &qsl).map_err(|e| e.to_string())?;
        let a = DecodeArgs {
            q: DevIn::new(&q, &s),
            q_rows,
            cache: DevIn::new(&cache, &s),
            spec,
            block_table: DevIn::new(&bt, &s),
            block_table_stride: 2,
            out: DevOut::new(&mut out, &s),
            out_rows: q_rows,
            lse: None,
            alibi_slopes: None,
            sinks: None,
            scales: None,
        };
        match part.decode(&r.dev, &s, a, &meta, &opts, SplitMode::Auto, &mut ws, &mut r.status, &mut r.ex) {
            Err(AttnError::InvalidArgument { arg: a, .. }) if a == arg => {}
            other => return Err(format!("expected a refusal naming `{arg}`, got {other:?}")),
        }
    }
    Ok(())
}

#[derive(Serialize, Clone, Debug)]
struct ShapeResult {
    shape: String,
    ranks: usize,
    /// Rank 0's decode of the whole contexts, alone on one GPU.
    one_gpu_us: f64,
    /// The group's step on each rank: decode of its share, all-gather, merge.
    step_us: Vec<f64>,
    /// Each rank's decode of its share alone.
    local_decode_us: Vec<f64>,
    /// Each rank's all-gather of the parts alone.
    exchange_us: Vec<f64>,
    /// Each rank's merge alone.
    merge_us: Vec<f64>,
    /// The slowest rank's step over the one-GPU decode.
    step_over_one_gpu: f64,
    /// Merged output against the one-GPU output: worst row's relative error (rank 0).
    rel_error_vs_one_gpu: f64,
    /// K and V bytes of the whole contexts, over the step's time (GB/s).
    step_gbps: f64,
    /// The attended pairs' FLOPs over the step's time (TFLOP/s).
    step_tflops: f64,
}

/// Median of 5 event-timed batches of `iters` calls of `f`, in microseconds a call.
fn time(stream: &Arc<CudaStream>, iters: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..3 {
        f()?;
    }
    let mut times = Vec::new();
    for _ in 0..5 {
        let (start, end) = (
            stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
            stream.context().new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?,
        );
        start.record(stream)?;
        for _ in 0..iters {
            f()?;
        }
        end.record(stream)?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)? as f64 * 1e3 / iters as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[2])
}

/// A decode's inputs in the benchmark.
struct Inputs<'a> {
    q: &'a CudaSlice<bf16>,
    q_rows: RowsDesc,
    cache: &'a CudaSlice<bf16>,
    spec: KvCacheSpec,
    block_table: &'a CudaSlice<i32>,
    stride: usize,
    meta: &'a BatchMetadata,
}

fn decode_args<'a>(i: &'a Inputs<'a>, s: &'a CudaStream, out: DevOut<'a>, lse: Option<DevOut<'a>>) -> DecodeArgs<'a> {
    DecodeArgs {
        q: DevIn::new(i.q, s),
        q_rows: i.q_rows,
        cache: DevIn::new(i.cache, s),
        spec: i.spec,
        block_table: DevIn::new(i.block_table, s),
        block_table_stride: i.stride,
        out,
        out_rows: i.q_rows,
        lse,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    }
}

/// What a timed call runs.
enum Mode<'a> {
    /// The whole contexts on one GPU.
    Whole,
    /// The rank's decode of its share into its part.
    Local(&'a mut CpDecode),
    /// The group's step: the rank's decode, the all-gather, the merge.
    Step(&'a mut CpDecode),
}

fn run(r: &mut Rank, ws: &mut DecodeWorkspace, i: &Inputs<'_>, out: &mut CudaSlice<bf16>, mode: &mut Mode<'_>) -> Result<()> {
    let s = r.stream.clone();
    let opts = AttnOptions::new(D);
    match mode {
        Mode::Whole => {
            paged_decode(&r.dev, &s, decode_args(i, &s, DevOut::new(out, &s), None), i.meta, &opts, SplitMode::Auto, ws, &mut r.status)
                .map(|_| ())
        }
        Mode::Local(part) => {
            let (o, l) = part.partial_out(&i.q_rows)?;
            paged_decode(&r.dev, &s, decode_args(i, &s, o, Some(l)), i.meta, &opts, SplitMode::Auto, ws, &mut r.status).map(|_| ())
        }
        Mode::Step(part) => part.decode(
            &r.dev,
            &s,
            decode_args(i, &s, DevOut::new(out, &s), None),
            i.meta,
            &opts,
            SplitMode::Auto,
            ws,
            &mut r.status,
            &mut r.ex,
        ),
    }
}

/// One shape's times on a rank.
struct ShapeTimes {
    /// Rank 0: the one-GPU time and output.
    one_gpu: Option<(f64, Vec<bf16>)>,
    step_us: f64,
    /// The rank's attention over its share alone.
    local_us: f64,
    /// The all-gather of the parts alone, the ranks in step.
    exchange_us: f64,
    /// The merge of the gathered parts alone.
    merge_us: f64,
    /// The group's merged output.
    out: Vec<bf16>,
}

fn bench_shape(r: &mut Rank, barrier: &Barrier, requests: usize, len: usize, iters: usize) -> Result<ShapeTimes> {
    let s = r.stream.clone();
    let world = r.shard.world_size;
    let chunk = 8192;
    let kv_rows = RowsDesc::contiguous(chunk, HKV, D);
    let (k, v) = (s.clone_htod(&values(kv_rows.required_len(), 12))?, s.clone_htod(&values(kv_rows.required_len(), 13))?);
    let q_rows = RowsDesc::contiguous(requests, HQ, D);
    let q = s.clone_htod(&values(q_rows.required_len(), 11))?;
    let seq_lens = vec![len as i32; requests];
    let qsl: Vec<i32> = (0..=requests as i32).collect();
    let mut ws = DecodeWorkspace::new(&s, 4 * r.dev.sm_count() as usize * 8 * HQ / HKV * 4, D, requests, requests)?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(q_rows.required_len())?;
    // One GPU, the whole contexts: rank 0, while the others wait.
    let one_gpu = if r.shard.rank == 0 {
        let one = CpShard::new(1, 0, 1)?;
        let (tab, stride, blocks) = table(requests, len, BS);
        let spec = KvCacheSpec::new(KvLayout::FlashNhd, blocks, BS, HKV, D)?;
        let cache = write_contexts::<bf16>(r, one, &seq_lens, &tab, stride, spec, (&k, &v, chunk), None)?;
        let bt = s.clone_htod(&tab)?;
        let meta = BatchMetadata::new(&s, &seq_lens, &qsl)?;
        let i = Inputs { q: &q, q_rows, cache: &cache, spec, block_table: &bt, stride, meta: &meta };
        let us = time(&s, iters, || run(r, &mut ws, &i, &mut out, &mut Mode::Whole))?;
        Some((us, s.clone_dtoh(&out)?))
    } else {
        None
    };
    barrier.wait();
    let (tab, stride, blocks) = table(requests, len, BS * world);
    let spec = KvCacheSpec::new(KvLayout::FlashNhd, blocks, BS, HKV, D)?;
    let shard = r.shard;
    let cache = write_contexts::<bf16>(r, shard, &seq_lens, &tab, stride, spec, (&k, &v, chunk), None)?;
    let bt = s.clone_htod(&tab)?;
    let local: Vec<i32> = seq_lens.iter().map(|&l| shard.local_len(l as usize) as i32).collect();
    let meta = BatchMetadata::new(&s, &local, &qsl)?;
    let i = Inputs { q: &q, q_rows, cache: &cache, spec, block_table: &bt, stride, meta: &meta };
    let mut part = CpDecode::new(&s, shard, attn_rs::DType::BF16, q_rows.required_len(), requests * HQ)?;
    let local_us = time(&s, iters, || run(r, &mut ws, &i, &mut out, &mut Mode::Local(&mut part)))?;
    let (exchange_us, merge_us) = exchange_and_merge(r, barrier, &mut part, &q_rows, &mut out, iters)?;
    s.synchronize()?;
    barrier.wait();
    let step_us = time(&s, iters, || run(r, &mut ws, &i, &mut out, &mut Mode::Step(&mut part)))?;
    r.status.take(&s)?.into_result()?;
    Ok(ShapeTimes { one_gpu, step_us, local_us, exchange_us, merge_us, out: s.clone_dtoh(&out)? })
}

/// A latent cache for `shard` with each request's context written by the GPU latent cache
/// write, `chunk` tokens a launch (position `p`'s latent and rope key: row `p % chunk`).
fn write_latents(
    r: &mut Rank,
    shard: CpShard,
    seq_lens: &[i32],
    (table, stride): (&[i32], usize),
    spec: MlaCacheSpec,
    (kv_c, k_pe, chunk): (&CudaSlice<bf16>, &CudaSlice<bf16>, usize),
) -> Result<CudaSlice<bf16>> {
    let mut cache: CudaSlice<bf16> = r.stream.alloc_zeros(spec.num_elements())?;
    for (n, slots) in context_chunks(shard, seq_lens, (table, stride), (spec.block_size, spec.num_blocks), chunk)? {
        let slots = r.stream.clone_htod(&slots)?;
        let s = &r.stream;
        let w = MlaWrite {
            kv_c: DevIn::new(kv_c, s),
            kv_c_token_stride: spec.latent_dim,
            k_pe: DevIn::new(k_pe, s),
            k_pe_token_stride: spec.rope_dim,
            num_tokens: n,
            slot_mapping: DevIn::new(&slots, s),
            cache: DevOut::new(&mut cache, s),
            spec,
            scale: None,
        };
        concat_and_cache_mla(&r.dev, &r.stream, w, &mut r.status)?;
    }
    r.status.take(&r.stream)?.into_result()?;
    Ok(cache)
}

/// The exchange alone (the ranks in step) and the merge alone, over the parts the local
/// timing left: where a step's time beyond its attention goes.
fn exchange_and_merge(
    r: &mut Rank,
    barrier: &Barrier,
    part: &mut CpDecode,
    rows: &RowsDesc,
    out: &mut CudaSlice<bf16>,
    iters: usize,
) -> Result<(f64, f64)> {
    let s = r.stream.clone();
    s.synchronize()?;
    barrier.wait();
    let exchange_us = time(&s, iters, || part.exchange_with(&mut r.ex, rows))?;
    let merge_us = time(&s, iters, || part.merge(&r.dev, &s, DevOut::new(out, &s), rows, None))?;
    Ok((exchange_us, merge_us))
}

/// An MLA call's inputs in the benchmark.
struct MlaInputs<'a> {
    q: &'a CudaSlice<bf16>,
    q_rows: RowsDesc,
    out_rows: RowsDesc,
    cache: &'a CudaSlice<bf16>,
    spec: MlaCacheSpec,
    block_table: &'a CudaSlice<i32>,
    stride: usize,
}

fn mla_args<'a>(i: &'a MlaInputs<'a>, s: &'a CudaStream, out: DevOut<'a>, lse: Option<DevOut<'a>>) -> MlaArgs<'a> {
    MlaArgs {
        q: DevIn::new(i.q, s),
        q_rows: i.q_rows,
        cache: DevIn::new(i.cache, s),
        spec: i.spec,
        block_table: DevIn::new(i.block_table, s),
        block_table_stride: i.stride,
        out,
        out_rows: i.out_rows,
        lse,
        scales: None,
    }
}

/// One MLA shape (`requests x context`, `heads` query heads over the latent): rank 0's MLA
/// attention over the whole contexts, then each rank's over its share alone and the group's
/// step (`CpDecode::decode_mla`).
fn bench_mla_shape(r: &mut Rank, barrier: &Barrier, (requests, len, heads): (usize, usize, usize), iters: usize) -> Result<ShapeTimes> {
    let s = r.stream.clone();
    let (bs, chunk) = (64, 8192);
    let (kv_c, k_pe) = (s.clone_htod(&values(chunk * 512, 22))?, s.clone_htod(&values(chunk * 64, 23))?);
    let q_rows = RowsDesc::contiguous(requests, heads, 576);
    let out_rows = RowsDesc::contiguous(requests, heads, 512);
    let q = s.clone_htod(&values(q_rows.required_len(), 21))?;
    let seq_lens = vec![len as i32; requests];
    let qsl: Vec<i32> = (0..=requests as i32).collect();
    let scale = AttnOptions::new(576).softmax_scale;
    // Split-K partials as `forward` sizes them for MLA: 4 waves of 8 rows a CTA.
    let mut ws = DecodeWorkspace::new(&s, 4 * r.dev.sm_count() as usize * 8 * heads, 512, requests, requests)?;
    let mut out: CudaSlice<bf16> = s.alloc_zeros(out_rows.required_len())?;
    let one_gpu = if r.shard.rank == 0 {
        let (tab, stride, blocks) = table(requests, len, bs);
        let spec = MlaCacheSpec::deepseek(blocks, bs)?;
        let cache = write_latents(r, CpShard::new(1, 0, 1)?, &seq_lens, (&tab, stride), spec, (&kv_c, &k_pe, chunk))?;
        let bt = s.clone_htod(&tab)?;
        let meta = BatchMetadata::new(&s, &seq_lens, &qsl)?;
        let i = MlaInputs { q: &q, q_rows, out_rows, cache: &cache, spec, block_table: &bt, stride };
        let us = time(&s, iters, || {
            let a = mla_args(&i, &s, DevOut::new(&mut out, &s), None);
            mla_attention(&r.dev, &s, a, &meta, scale, SplitMode::Auto, &mut ws, &mut r.status).map(|_| ())
        })?;
        Some((us, s.clone_dtoh(&out)?))
    } else {
        None
    };
    barrier.wait();
    let shard = r.shard;
    let (tab, stride, blocks) = table(requests, len, bs * shard.world_size);
    let spec = MlaCacheSpec::deepseek(blocks, bs)?;
    let cache = write_latents(r, shard, &seq_lens, (&tab, stride), spec, (&kv_c, &k_pe, chunk))?;
    let bt = s.clone_htod(&tab)?;
    let local: Vec<i32> = seq_lens.iter().map(|&l| shard.local_len(l as usize) as i32).collect();
    let meta = BatchMetadata::new(&s, &local, &qsl)?;
    let mut part = CpDecode::new(&s, shard, attn_rs::DType::BF16, out_rows.required_len(), requests * heads)?;
    let i = MlaInputs { q: &q, q_rows, out_rows, cache: &cache, spec, block_table: &bt, stride };
    let local_us = time(&s, iters, || {
        let (o, l) = part.partial_out(&out_rows)?;
        mla_attention(&r.dev, &s, mla_args(&i, &s, o, Some(l)), &meta, scale, SplitMode::Auto, &mut ws, &mut r.status).map(|_| ())
    })?;
    let (exchange_us, merge_us) = exchange_and_merge(r, barrier, &mut part, &out_rows, &mut out, iters)?;
    s.synchronize()?;
    barrier.wait();
    let step_us = time(&s, iters, || {
        let a = mla_args(&i, &s, DevOut::new(&mut out, &s), None);
        part.decode_mla(&r.dev, &s, a, &meta, scale, SplitMode::Auto, &mut ws, &mut r.status, &mut r.ex)
    })?;
    r.status.take(&s)?.into_result()?;
    Ok(ShapeTimes { one_gpu, step_us, local_us, exchange_us, merge_us, out: s.clone_dtoh(&out)? })
}

/// A rank's figures of one shape.
struct ShapeReport {
    rank: usize,
    /// The shape as its row names it.
    name: String,
    /// K/V (or latent) bytes of the whole contexts.
    bytes: f64,
    /// Output elements a (token, head) row.
    row: usize,
    /// FLOPs of the attended query-key pairs (Q K^T and P V).
    flops: f64,
    times: ShapeTimes,
}

enum Report {
    Check(CheckOut),
    Shape(ShapeReport),
}

/// `a x b [x c]` as `n` numbers.
fn parse_dims(shape: &str, n: usize) -> std::result::Result<Vec<usize>, String> {
    let dims: Vec<usize> = shape
        .split('x')
        .map(|d| d.trim().parse().map_err(|_| format!("shape {shape}: not numbers")))
        .collect::<std::result::Result<_, _>>()?;
    if dims.len() != n {
        return Err(format!("shape {shape}: want {n} numbers separated by x"));
    }
    Ok(dims)
}

fn rank_main(
    rank: usize,
    world: usize,
    ids: Vec<Id>,
    barrier: Arc<Barrier>,
    args: Args,
    tx: std::sync::mpsc::Sender<Report>,
) -> std::result::Result<(), String> {
    let e = |e: AttnError| format!("rank {rank}: {e}");
    let dev = Arc::new(AttnDevice::new(rank).map_err(e)?);
    let stream = dev.context().new_stream().map_err(|x| e(x.into()))?;
    let shard = CpShard::new(world, rank, args.interleave).map_err(e)?;
    let ex = NcclExchange(new_comm(&stream, shard, ids[0]).map_err(e)?);
    let status = DeviceStatus::new(&stream).map_err(e)?;
    let mut r = Rank { dev, stream, shard, ex, forward_ids: ids.into_iter().skip(1), status };
    for c in checks() {
        let out = if c.fp8 { run_check::<Fp8E4m3>(&mut r, &c) } else { run_check::<bf16>(&mut r, &c) };
        tx.send(Report::Check(out.map_err(e)?)).unwrap();
    }
    check_refusals(&mut r).map_err(|m| format!("rank {rank}: {m}"))?;
    if args.check_only {
        return Ok(());
    }
    for shape in args.shapes.split(',').filter(|s| !s.is_empty()) {
        let dims = parse_dims(shape, 2)?;
        barrier.wait();
        let times = bench_shape(&mut r, &barrier, dims[0], dims[1], args.iters).map_err(e)?;
        let name = format!("{shape}, 32q/8kv d128 bf16, block 16, interleave {}", args.interleave);
        let bytes = (dims[0] * dims[1] * HKV * D * 2 * 2) as f64;
        let flops = (dims[0] * dims[1] * HQ * 4 * D) as f64;
        tx.send(Report::Shape(ShapeReport { rank, name, bytes, row: D, flops, times })).unwrap();
    }
    for shape in args.mla_shapes.split(',').filter(|s| !s.is_empty()) {
        let dims = parse_dims(shape, 3)?;
        barrier.wait();
        let times = bench_mla_shape(&mut r, &barrier, (dims[0], dims[1], dims[2]), args.iters).map_err(e)?;
        let name = format!("MLA {shape}, 512+64 bf16, block 64, interleave {}", args.interleave);
        let bytes = (dims[0] * dims[1] * 576 * 2) as f64;
        let flops = (dims[0] * dims[1] * dims[2] * 2 * (576 + 512)) as f64;
        tx.send(Report::Shape(ShapeReport { rank, name, bytes, row: 512, flops, times })).unwrap();
    }
    Ok(())
}

fn main() {
    let args = Args::parse();
    if let Err(e) = nccl_available() {
        eprintln!("cp-bench: {e}");
        std::process::exit(2);
    }
    let gpus = attn_rs::cudarc::driver::CudaContext::device_count().unwrap_or(0) as usize;
    let world = args.ranks.unwrap_or(gpus);
    if world < 2 || world > gpus {
        eprintln!("cp-bench: {world} ranks on {gpus} GPUs: context parallelism needs 2 or more GPUs");
        std::process::exit(2);
    }
    // One communicator for the ops, one for each `forward` check.
    let ids: Vec<Id> = (0..1 + checks().iter().filter(|c| c.forward).count()).map(|_| Id::new().expect("NCCL unique id")).collect();
    let barrier = Arc::new(Barrier::new(world));
    let (tx, rx) = std::sync::mpsc::channel();
    let handles: Vec<_> = (0..world)
        .map(|rank| {
            let (b, a, t, ids) = (barrier.clone(), args.clone(), tx.clone(), ids.clone());
            std::thread::spawn(move || rank_main(rank, world, ids, b, a, t))
        })
        .collect();
    drop(tx);
    let reports: Vec<Report> = rx.into_iter().collect();
    let mut failed = false;
    for (rank, h) in handles.into_iter().enumerate() {
        if let Err(m) = h.join().unwrap_or_else(|_| Err(format!("rank {rank} panicked"))) {
            eprintln!("FAIL {m}");
            failed = true;
        }
    }
    // Checks: every rank's output equal to rank 0's, rank 0's against the reference.
    for c in checks() {
        let outs: Vec<&CheckOut> =
            reports.iter().filter_map(|r| if let Report::Check(o) = r { (o.name == c.name).then_some(o) } else { None }).collect();
        let err = outs.iter().find_map(|o| o.rel_error).unwrap_or(f64::NAN);
        let same = outs.iter().all(|o| o.out.iter().zip(&outs[0].out).all(|(a, b)| a.to_bits() == b.to_bits()));
        let tol = if c.fp8 { 2e-2 } else { 1e-2 };
        let ok = same && outs.len() == world && err <= tol;
        failed |= !ok;
        println!(
            "{} check {:<14} ranks equal: {same}, worst row vs f64 reference {err:.2e} (bound {tol:.0e})",
            if ok { "ok  " } else { "FAIL" },
            c.name
        );
    }
    let mut results = Vec::new();
    let mut names: Vec<(String, f64, usize, f64)> = Vec::new();
    for r in &reports {
        if let Report::Shape(s) = r {
            if !names.iter().any(|(n, ..)| n == &s.name) {
                names.push((s.name.clone(), s.bytes, s.row, s.flops));
            }
        }
    }
    for (name, bytes, row, flops) in names {
        let rows: Vec<&ShapeReport> =
            reports.iter().filter_map(|r| if let Report::Shape(s) = r { (s.name == name).then_some(s) } else { None }).collect();
        if rows.len() != world {
            continue;
        }
        let (mut step, mut local, mut exchange, mut merge) = (vec![0.0; world], vec![0.0; world], vec![0.0; world], vec![0.0; world]);
        let (mut one_us, mut one_out, mut out0) = (f64::NAN, Vec::new(), Vec::new());
        for ShapeReport { rank, times: t, .. } in rows {
            (step[*rank], local[*rank], exchange[*rank], merge[*rank]) = (t.step_us, t.local_us, t.exchange_us, t.merge_us);
            if let Some((us, o)) = &t.one_gpu {
                one_us = *us;
                one_out = o.clone();
                out0 = t.out.clone();
            }
        }
        let want: Vec<f64> = one_out.iter().map(|x| x.to_f64()).collect();
        let err = row_error(&out0, &want, row);
        let slowest = step.iter().copied().fold(0.0, f64::max);
        failed |= err.is_nan() || err > 1e-2;
        let r = ShapeResult {
            shape: name,
            ranks: world,
            one_gpu_us: one_us,
            step_us: step,
            local_decode_us: local,
            exchange_us: exchange,
            merge_us: merge,
            step_over_one_gpu: slowest / one_us,
            rel_error_vs_one_gpu: err,
            step_gbps: bytes / (slowest * 1e-6) / 1e9,
            step_tflops: flops / (slowest * 1e-6) / 1e12,
        };
        println!(
            "{:<58} one GPU {:>8.1} us | {world} GPUs: step {:>8.1} us (local decode {:>8.1}, exchange {:>6.1}, merge {:>6.1}) = {:.3}x | {:.0} GB/s, {:.0} TFLOP/s | vs one GPU {:.1e}",
            r.shape,
            r.one_gpu_us,
            slowest,
            r.local_decode_us.iter().copied().fold(0.0, f64::max),
            r.exchange_us.iter().copied().fold(0.0, f64::max),
            r.merge_us.iter().copied().fold(0.0, f64::max),
            r.step_over_one_gpu,
            r.step_gbps,
            r.step_tflops,
            err
        );
        results.push(r);
    }
    if let Some(p) = &args.json {
        std::fs::write(p, serde_json::to_string_pretty(&results).unwrap()).expect("write the JSON");
    }
    if failed {
        std::process::exit(1);
    }
}
