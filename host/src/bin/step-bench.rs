//! Step-level benchmark of `host::forward` (what an engine calls), in two parts:
//!
//! - cascade: 64 decode requests sharing a 4096-token prefix, each with 256 tokens of its own
//!   (its new one included), 32q/8kv, d128, bf16: one layer's `forward` (cache write and
//!   attention) with cascade forced on against the plain path.
//! - graphs: a decode step of 32 layers (batch 64 and batch 8; context 2048 and 512), launched
//!   eagerly against replayed from a CUDA graph, and the kernels' own time per layer (CUDA events
//!   around each layer's kernels in a GPU-bound eager run).
//!
//! Times are medians over CUDA-event timings after warm-up.
//! `step-bench [--quick] [--json PATH] [--only cascade|graph] [--event-tracking]`.

use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use half::bf16;
use host::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use host::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, GraphBucket, LayerIo, NewKv, StepMetadata};
use host::metadata::{CascadeMode, StepInput};
use host::{AttnDevice, DType, DevIn, DevOut, KvLayout, Result, RowsDesc, SharedBuf};
use std::sync::Arc;
use std::time::Instant;

const BS: usize = 16;
const HQ: usize = 32;
const HKV: usize = 8;
const D: usize = 128;

/// Median over `reps` event-timed batches of `batch` calls of `f` (per call), after `warmup`
/// untimed calls, in microseconds. Back-to-back calls keep the GPU fed, so the host's cost of
/// submitting the first launch does not land inside the timed region (as in attn-bench).
fn time(stream: &Arc<CudaStream>, warmup: usize, reps: usize, batch: usize, mut f: impl FnMut() -> Result<()>) -> Result<f64> {
    for _ in 0..warmup {
        f()?;
    }
    let ctx = stream.context();
    let (start, end) = (ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?, ctx.new_event(Some(CUevent_flags::CU_EVENT_DEFAULT))?);
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        start.record(stream)?;
        for _ in 0..batch {
            f()?;
        }
        end.record(stream)?;
        end.synchronize()?;
        times.push(start.elapsed_ms(&end)? as f64 * 1e3 / batch as f64);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Deterministic values in [-1, 1) (an LCG: no RNG in the library's binaries).
fn values(len: usize, seed: u64) -> Vec<bf16> {
    let mut x = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    (0..len)
        .map(|_| {
            x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            bf16::from_f32(((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0)
        })
        .collect()
}

/// A decode batch: `n` requests of one query token; request r's blocks are `shared` blocks
/// common to all, then its own.
struct Batch {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
    num_blocks: usize,
}

impl Batch {
    fn new(n: usize, shared_tokens: usize, own_tokens: usize) -> Batch {
        let shared = shared_tokens / BS;
        let own = own_tokens.div_ceil(BS);
        let stride = shared + own;
        let mut table = Vec::with_capacity(n * stride);
        let (mut qsl, mut seq_lens, mut slots) = (vec![0], Vec::new(), Vec::new());
        for r in 0..n {
            let row_start = table.len();
            table.extend(0..shared as i32);
            // Own blocks interleaved across requests (scattered, as an allocator leaves them).
            table.extend((0..own).map(|b| (shared + b * n + r) as i32));
            let len = shared_tokens + own_tokens;
            let pos = len - 1;
            slots.push(table[row_start + pos / BS] as i64 * BS as i64 + (pos % BS) as i64);
            qsl.push(r as i32 + 1);
            seq_lens.push(len as i32);
        }
        Batch { qsl, seq_lens, table, stride, slots, num_blocks: shared + own * n }
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: self.seq_lens.len(),
            num_blocks: self.num_blocks,
            block_size: BS,
        }
    }
}

/// A model's per-step buffers: the fused q/k/v rows and the output. Shared, as an engine that
/// captures graphs keeps them: a graph holds what it captured.
struct Io {
    qkv: SharedBuf<bf16>,
    out: SharedBuf<bf16>,
    rows: usize,
}

impl Io {
    fn new(stream: &Arc<CudaStream>, rows: usize) -> Result<Io> {
        let qkv = SharedBuf::new(stream.clone_htod(&values(rows * (HQ + 2 * HKV) * D, 7))?);
        Ok(Io { qkv, out: SharedBuf::new(stream.alloc_zeros(rows * HQ * D)?), rows })
    }

    /// One layer over `cache`.
    fn forward(&self, attn: &mut Attention, step: &StepMetadata, cache: &SharedBuf<bf16>, stream: &Arc<CudaStream>) -> Result<()> {
        let width = (HQ + 2 * HKV) * D;
        let k = DevIn::shared_range(&self.qkv, HQ * D.., stream)?;
        let v = DevIn::shared_range(&self.qkv, (HQ + HKV) * D.., stream)?;
        let kv_rows = RowsDesc { num_tokens: self.rows, num_heads: HKV, head_size: D, token_stride: width, head_stride: D };
        attn.forward(
            step,
            LayerIo::Gpu(GpuLayer {
                q: DevIn::shared(&self.qkv, stream),
                q_rows: RowsDesc { num_tokens: self.rows, num_heads: HQ, head_size: D, token_stride: width, head_stride: D },
                new_kv: NewKv::Standard { k, k_rows: kv_rows, v, v_rows: kv_rows },
                cache: DevOut::shared(cache, stream),
                out: DevOut::shared(&self.out, stream),
                out_rows: RowsDesc::contiguous(self.rows, HQ, D),
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            }),
        )
    }
}

fn attention(
    dev: &Arc<AttnDevice>,
    stream: &Arc<CudaStream>,
    num_blocks: usize,
    limits: ForwardLimits,
    cascade: CascadeMode,
) -> Result<Attention> {
    let model = ModelConfig::standard(HQ, HKV, D, DType::BF16, BS, KvLayout::FlashNhd);
    let sel = select_backend_no_env(&model, &DeviceInfo::from_device(dev), None)?;
    let config = ForwardConfig { cascade, ..ForwardConfig::new(model, num_blocks, limits) };
    Attention::new(&sel, config, Some(GpuHandles { dev: dev.clone(), stream: stream.clone() }))
}

struct Line {
    name: String,
    us: f64,
    note: String,
}

fn cascade_bench(dev: &Arc<AttnDevice>, stream: &Arc<CudaStream>, quick: bool, lines: &mut Vec<Line>) -> Result<()> {
    let (n, prefix, own) = (64, 4096, 256);
    let batch = Batch::new(n, prefix, own);
    let limits = ForwardLimits { max_num_tokens: n, max_num_reqs: n, max_model_len: prefix + own };
    let io = Io::new(stream, n)?;
    let reps = if quick { 20 } else { 100 };
    let mut results = Vec::new();
    for mode in [CascadeMode::Off, CascadeMode::On] {
        let mut attn = attention(dev, stream, batch.num_blocks, limits, mode)?;
        let cache = SharedBuf::new(stream.clone_htod(&values(attn.cache_spec().num_elements(), 3))?);
        let mut step = attn.new_step_metadata()?;
        step.build(&batch.input())?;
        let us = time(stream, 10, reps, 10, || io.forward(&mut attn, &step, &cache, stream))?;
        attn.check_status()?;
        // The GPU's own time (events around the layer's kernels): host-bound if well below `us`.
        attn.set_timing(true);
        for _ in 0..reps {
            io.forward(&mut attn, &step, &cache, stream)?;
        }
        let t = attn.take_times()?;
        attn.set_timing(false);
        let gpu_us = (t.cache_write + t.attention).as_secs_f64() * 1e6 / t.layers as f64;
        let what = if step.cascade_prefix().is_some() { "cascade" } else { "plain" };
        results.push(us);
        let kv_bytes = |tokens: usize| (tokens * HKV * D * 2 * 2) as f64;
        let bytes = if what == "plain" { kv_bytes(n * (prefix + own)) } else { kv_bytes(prefix + n * own) };
        lines.push(Line {
            name: format!("cascade: {what}"),
            us,
            note: format!(
                "{n} x ({prefix} shared + {own} own), KV read {:.0} MB, {:.0} GB/s; GPU time (events, mean) {gpu_us:.1} us",
                bytes / 1e6,
                bytes / us / 1e3
            ),
        });
    }
    lines.push(Line { name: "cascade: speed-up".into(), us: results[0] / results[1], note: "plain time / cascade time (x)".into() });
    Ok(())
}

fn graph_bench(
    dev: &Arc<AttnDevice>,
    stream: &Arc<CudaStream>,
    n: usize,
    context: usize,
    quick: bool,
    lines: &mut Vec<Line>,
) -> Result<()> {
    let layers = 32;
    let batch = Batch::new(n, 0, context);
    let limits = ForwardLimits { max_num_tokens: n, max_num_reqs: n, max_model_len: context };
    let mut attn = attention(dev, stream, batch.num_blocks, limits, CascadeMode::Off)?;
    let mut caches = Vec::with_capacity(layers);
    let init = values(attn.cache_spec().num_elements(), 5);
    for _ in 0..layers {
        caches.push(SharedBuf::new(stream.clone_htod(&init)?));
    }
    let io = Io::new(stream, n)?;
    let mut eager = attn.new_step_metadata()?;
    let mut graph_step = attn.new_graph_step(GraphBucket::decode(n))?;
    let t = Instant::now();
    eager.build(&batch.input())?;
    let eager_build = t.elapsed().as_secs_f64() * 1e6;
    let t = Instant::now();
    graph_step.build(&batch.input())?;
    let graph_build = t.elapsed().as_secs_f64() * 1e6;
    let reps = if quick { 10 } else { 30 };

    let mut step_eager = || -> Result<()> {
        for cache in &caches {
            io.forward(&mut attn, &eager, cache, stream)?;
        }
        Ok(())
    };
    let eager_us = time(stream, 3, reps, 1, &mut step_eager)?;
    // The kernels' own time: events around each layer's kernels, in a GPU-bound eager run.
    attn.set_timing(true);
    let _ = attn.take_times()?;
    for _ in 0..3 {
        for cache in &caches {
            io.forward(&mut attn, &eager, cache, stream)?;
        }
    }
    let times = attn.take_times()?;
    attn.set_timing(false);
    let kernel_us = (times.cache_write + times.attention).as_secs_f64() * 1e6 / times.layers as f64;

    let graph = attn.capture(&graph_step, |a| {
        for cache in &caches {
            io.forward(a, &graph_step, cache, stream)?;
        }
        Ok(())
    })?;
    let graph_us = time(stream, 3, reps, 1, || graph.replay(&graph_step))?;
    attn.check_status()?;
    let shape = format!("{layers} layers, batch {n}, context {context}");
    let per = |us: f64| us / layers as f64;
    lines.push(Line {
        name: format!("graph step: eager ({shape})"),
        us: per(eager_us),
        note: format!("per layer; step {eager_us:.0} us, build {eager_build:.1} us"),
    });
    lines.push(Line {
        name: format!("graph step: replay ({shape})"),
        us: per(graph_us),
        note: format!("per layer; step {graph_us:.0} us, build {graph_build:.1} us"),
    });
    lines.push(Line {
        name: format!("graph step: kernels ({shape})"),
        us: kernel_us,
        note: format!("per layer, events around each layer; replay / kernels = {:.3}", per(graph_us) / kernel_us),
    });
    // The decode's rate inside a step: a layer's K and V bytes over its replayed time (which
    // also holds the layer's cache write), so neighbouring layers' decodes never overlap.
    let kv_bytes = (2 * 2 * n * context * HKV * D) as f64; // bf16 K and V
    lines.push(Line {
        name: format!("graph step: decode GB/s ({shape})"),
        us: kv_bytes / (per(graph_us) * 1e3),
        note: "K and V bytes of a layer / replayed time per layer (cache write included), GB/s".into(),
    });
    Ok(())
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().collect();
    let quick = args.iter().any(|a| a == "--quick");
    let json_path = args.iter().position(|a| a == "--json").and_then(|i| args.get(i + 1)).cloned();
    if !AttnDevice::driver_available() {
        eprintln!("step-bench: no CUDA driver or GPU; nothing to measure");
        std::process::exit(2);
    }
    let dev = Arc::new(AttnDevice::new(0)?);
    let stream = dev.context().new_stream()?;
    // As in attn-bench: the bench owns every buffer, so cudarc's cross-stream event tracking
    // (an event wait and record per buffer per call) would only add host work between launches.
    // `forward` orders its own second stream (cascade) with explicit events.
    let untracked = !args.iter().any(|a| a == "--event-tracking");
    if untracked {
        // SAFETY: every buffer here is used on `stream` only (and `forward`'s side stream, which
        // it orders itself).
        unsafe { dev.context().disable_event_tracking() };
    }
    println!("device: {}, cudarc event tracking {}", dev.context().name()?, if untracked { "off" } else { "on (--event-tracking)" });
    // `--only cascade|graph`: one part.
    let only = args.iter().position(|a| a == "--only").and_then(|i| args.get(i + 1)).cloned();
    let want = |part: &str| only.as_deref().is_none_or(|o| o == part);
    let mut lines = Vec::new();
    if want("cascade") {
        cascade_bench(&dev, &stream, quick, &mut lines)?;
    }
    if want("graph") {
        // `STEP_BENCH_GRAPH_SHAPES=64x4096,8x512`: other (batch x context) steps.
        let shapes = std::env::var("STEP_BENCH_GRAPH_SHAPES").unwrap_or_else(|_| "64x2048,8x512".into());
        for shape in shapes.split(',') {
            let parsed = shape.split_once('x').and_then(|(n, c)| Some((n.trim().parse().ok()?, c.trim().parse().ok()?)));
            let Some((n, context)) = parsed else {
                return Err(host::AttnError::InvalidArgument { arg: "STEP_BENCH_GRAPH_SHAPES", reason: format!("bad shape {shape:?}") });
            };
            graph_bench(&dev, &stream, n, context, quick, &mut lines)?;
        }
    }
    let mut json = String::from("[\n");
    for (i, l) in lines.iter().enumerate() {
        println!("{:<55} {:>10.2}  {}", l.name, l.us, l.note);
        let sep = if i + 1 < lines.len() { "," } else { "" };
        json.push_str(&format!("  {{\"name\": {:?}, \"value\": {:.3}, \"note\": {:?}}}{sep}\n", l.name, l.us, l.note));
    }
    json.push_str("]\n");
    if let Some(p) = json_path {
        std::fs::write(&p, json).unwrap_or_else(|e| panic!("writing {p}: {e}"));
    }
    Ok(())
}
