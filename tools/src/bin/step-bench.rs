//! Step-level benchmark of `attn_rs::forward` (what an engine calls), in two parts:
//!
//! - cascade: 64 decode requests sharing a 4096-token prefix, each with 256 tokens of its own
//!   (its new one included), 32q/8kv, d128, bf16: one layer's `forward` (cache write and
//!   attention) with cascade forced on against the plain path.
//! - graphs: a decode step of 32 layers (batch 64 and batch 8; context 2048 and 512), launched
//!   eagerly against replayed from a CUDA graph, and the kernels' own time per layer (CUDA events
//!   around each layer's kernels in a GPU-bound eager run).
//! - mixed graphs: steps of 32 layers with decodes and a prefill (64 decodes at context 2048
//!   and a 512-token chunk after 1536 cached; 8 decodes at 512 and a 2048-token prompt), the
//!   same three timings from a mixed bucket's graph, and a decode-only step replayed from it.
//!
//! Times are medians over CUDA-event timings after warm-up.
//! `step-bench [--quick] [--json PATH] [--only cascade|graph|mixed] [--event-tracking]` (`--help`).

use attn_rs::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use attn_rs::forward::{
    Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, GraphBucket, LayerIo, NewKv, StepGraph, StepMetadata,
};
use attn_rs::metadata::{CascadeMode, StepInput};
use attn_rs::{AttnDevice, DType, DevIn, DevOut, KvLayout, Result, RowsDesc, SharedBuf};
use clap::{CommandFactory, Parser, ValueEnum};
use cudarc::driver::sys::CUevent_flags;
use cudarc::driver::CudaStream;
use half::bf16;
use serde::Serialize;
use std::io;
use std::path::PathBuf;
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

    /// [`Batch::new`]`(n, 0, context)`, then one prefill request of `chunk` query tokens after
    /// `cached` tokens of its own (a chunk of a long prompt, or a new prompt for 0).
    fn mixed(n: usize, context: usize, chunk: usize, cached: usize) -> Batch {
        let mut b = Batch::new(n, 0, context.max(cached + chunk));
        let len = cached + chunk;
        let blocks = len.div_ceil(BS);
        // Its blocks after the decodes'; its row as wide as theirs.
        let first = b.num_blocks as i32;
        b.table.extend((0..b.stride as i32).map(|i| if (i as usize) < blocks { first + i } else { 0 }));
        b.slots.extend((cached..len).map(|pos| (first as i64 + (pos / BS) as i64) * BS as i64 + (pos % BS) as i64));
        b.qsl.push((n + chunk) as i32);
        b.seq_lens.push(len as i32);
        b.num_blocks += blocks;
        b
    }

    /// The decodes' lengths: `Batch::new` took the longest of the decodes' and the prefill's.
    fn with_decode_len(mut self, n: usize, context: usize) -> Batch {
        for l in &mut self.seq_lens[..n] {
            *l = context as i32;
        }
        for (r, s) in self.slots[..n].iter_mut().enumerate() {
            let pos = context - 1;
            *s = self.table[r * self.stride + pos / BS] as i64 * BS as i64 + (pos % BS) as i64;
        }
        self
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: *self.qsl.last().expect("start locations") as usize,
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

/// A built step's three timings per step: launched eagerly, the kernels' own time per layer
/// (events around each layer's kernels in a GPU-bound eager run), and replayed from a graph
/// captured with `graph_step`; and the graph.
struct StepTimes {
    eager_us: f64,
    kernel_us: f64,
    graph_us: f64,
    graph: StepGraph,
}

fn time_step(
    attn: &mut Attention,
    (eager, graph_step): (&StepMetadata, &StepMetadata),
    caches: &[SharedBuf<bf16>],
    io: &Io,
    stream: &Arc<CudaStream>,
    reps: usize,
) -> Result<StepTimes> {
    let eager_us = time(stream, 3, reps, 1, || caches.iter().try_for_each(|c| io.forward(attn, eager, c, stream)))?;
    attn.set_timing(true);
    let _ = attn.take_times()?;
    for _ in 0..3 {
        for cache in caches {
            io.forward(attn, eager, cache, stream)?;
        }
    }
    let times = attn.take_times()?;
    attn.set_timing(false);
    let kernel_us = (times.cache_write + times.attention).as_secs_f64() * 1e6 / times.layers as f64;
    let graph = attn.capture(graph_step, |a| caches.iter().try_for_each(|c| io.forward(a, graph_step, c, stream)))?;
    let graph_us = time(stream, 3, reps, 1, || graph.replay(graph_step))?;
    attn.check_status()?;
    Ok(StepTimes { eager_us, kernel_us, graph_us, graph })
}

/// The eager, replay and kernels lines of `t` (per layer of `layers`), `what` naming the part.
fn step_lines(lines: &mut Vec<Line>, what: &str, shape: &str, layers: usize, t: &StepTimes, (eager_note, graph_note): (&str, &str)) {
    let per = |us: f64| us / layers as f64;
    let (e, g) = (t.eager_us, t.graph_us);
    lines.push(Line { name: format!("{what}: eager ({shape})"), us: per(e), note: format!("per layer; step {e:.0} us{eager_note}") });
    lines.push(Line { name: format!("{what}: replay ({shape})"), us: per(g), note: format!("per layer; step {g:.0} us{graph_note}") });
    lines.push(Line {
        name: format!("{what}: kernels ({shape})"),
        us: t.kernel_us,
        note: format!("per layer, events around each layer; replay / kernels = {:.3}", per(g) / t.kernel_us),
    });
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
    let t = time_step(&mut attn, (&eager, &graph_step), &caches, &io, stream, reps)?;
    let shape = format!("{layers} layers, batch {n}, context {context}");
    let per = |us: f64| us / layers as f64;
    let graph_us = t.graph_us;
    let notes = (format!(", build {eager_build:.1} us"), format!(", build {graph_build:.1} us"));
    step_lines(lines, "graph step", &shape, layers, &t, (&notes.0, &notes.1));
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

/// A step of 32 layers with `n` decodes at `context` and one prefill of `chunk` tokens after
/// `cached`, eagerly and replayed from a graph of the mixed bucket it fills exactly; the
/// kernels' own time; and a step of the decodes alone replayed from the same graph (the
/// bucket's padding tokens are then a request of length 0).
#[allow(clippy::too_many_arguments)]
fn mixed_graph_bench(
    dev: &Arc<AttnDevice>,
    stream: &Arc<CudaStream>,
    (n, context, chunk, cached): (usize, usize, usize, usize),
    quick: bool,
    lines: &mut Vec<Line>,
) -> Result<()> {
    let layers = 32;
    let batch = Batch::mixed(n, context, chunk, cached).with_decode_len(n, context);
    let rows = n + chunk;
    let bucket = GraphBucket::mixed(n + 1, rows);
    let limits = ForwardLimits { max_num_tokens: rows, max_num_reqs: n + 1, max_model_len: context.max(cached + chunk) };
    let mut attn = attention(dev, stream, batch.num_blocks, limits, CascadeMode::Off)?;
    let init = values(attn.cache_spec().num_elements(), 5);
    let caches: Vec<_> = (0..layers).map(|_| Ok(SharedBuf::new(stream.clone_htod(&init)?))).collect::<Result<_>>()?;
    let io = Io::new(stream, rows)?;
    let mut eager = attn.new_step_metadata()?;
    let mut graph_step = attn.new_graph_step(bucket)?;
    eager.build(&batch.input())?;
    graph_step.build(&batch.input())?;
    let reps = if quick { 10 } else { 30 };
    let t = time_step(&mut attn, (&eager, &graph_step), &caches, &io, stream, reps)?;
    // The decodes alone, from the same graph.
    let decodes = Batch::new(n, 0, context);
    graph_step.build(&StepInput { num_blocks: batch.num_blocks, ..decodes.input() })?;
    let decode_only_us = time(stream, 3, reps, 1, || t.graph.replay(&graph_step))?;
    attn.check_status()?;
    let shape = format!("{layers} layers, {n} x {context} + {chunk} after {cached}");
    let per = |us: f64| us / layers as f64;
    step_lines(lines, "mixed graph", &shape, layers, &t, ("", ""));
    lines.push(Line {
        name: format!("mixed graph: decodes only ({shape})"),
        us: per(decode_only_us),
        note: format!("per layer, the {n} decodes alone replayed from the same graph; step {decode_only_us:.0} us"),
    });
    Ok(())
}

/// A decode step of 32 layers, eagerly and from a CUDA graph (`--only graph`), steps of
/// decodes and a prefill from a mixed bucket's graph (`--only mixed`), and a cascade layer
/// against the plain path (`--only cascade`); times are medians over CUDA-event timings after
/// warm-up.
#[derive(Parser, Debug)]
#[command(
    name = "step-bench",
    after_long_help = "Environment variable: STEP_BENCH_GRAPH_SHAPES=64x4096,8x512: the graph part's steps (batch x context; \
default 64x2048,8x512)."
)]
struct Cli {
    /// Fewer timed repetitions.
    #[arg(long)]
    quick: bool,
    /// Also write the lines as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Only this part.
    #[arg(long, value_enum, value_name = "PART")]
    only: Option<Part>,
    /// Keep cudarc's cross-stream event tracking on (off by default: the bench owns every
    /// buffer).
    #[arg(long)]
    event_tracking: bool,
}

/// A part of the benchmark (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Part {
    /// A cascade layer against the plain path.
    Cascade,
    /// A decode step, eager against replayed from a CUDA graph.
    Graph,
    /// Steps of decodes and a prefill, eager against replayed from a mixed bucket's graph.
    Mixed,
}

/// `STEP_BENCH_GRAPH_SHAPES`: the graph part's (batch, context) steps.
fn graph_shapes() -> std::result::Result<Vec<(usize, usize)>, String> {
    let shapes = std::env::var("STEP_BENCH_GRAPH_SHAPES").unwrap_or_else(|_| "64x2048,8x512".into());
    shapes
        .split(',')
        .map(|shape| {
            let parsed = shape.split_once('x').and_then(|(n, c)| Some((n.trim().parse().ok()?, c.trim().parse().ok()?)));
            parsed.filter(|&(n, c)| n > 0 && c > 0).ok_or_else(|| format!("STEP_BENCH_GRAPH_SHAPES: bad shape {shape:?} (BATCHxCONTEXT)"))
        })
        .collect()
}

/// The JSON file: an array of `{"name", "value", "note"}`, one a line.
#[derive(Serialize)]
struct JsonLine<'a> {
    name: &'a str,
    value: f64,
    note: &'a str,
}

/// JSON with each element of the top array on an indented line of its own, `": "` and `", "`
/// between an object's keys and values.
struct LinePerElement;

impl serde_json::ser::Formatter for LinePerElement {
    fn begin_array_value<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        w.write_all(if first { b"\n  " } else { b",\n  " })
    }

    fn end_array<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b"\n]")
    }

    fn begin_object_key<W: ?Sized + io::Write>(&mut self, w: &mut W, first: bool) -> io::Result<()> {
        if first {
            Ok(())
        } else {
            w.write_all(b", ")
        }
    }

    fn begin_object_value<W: ?Sized + io::Write>(&mut self, w: &mut W) -> io::Result<()> {
        w.write_all(b": ")
    }
}

fn json_text(lines: &[Line]) -> serde_json::Result<Vec<u8>> {
    let items: Vec<JsonLine> = lines.iter().map(|l| JsonLine { name: &l.name, value: (l.us * 1e3).round() / 1e3, note: &l.note }).collect();
    let mut text = Vec::new();
    items.serialize(&mut serde_json::Serializer::with_formatter(&mut text, LinePerElement))?;
    text.push(b'\n');
    Ok(text)
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    let want = |part: Part| cli.only.is_none_or(|o| o == part);
    // Checked before the device is opened, as the flags are.
    let shapes = match want(Part::Graph).then(graph_shapes).transpose() {
        Ok(shapes) => shapes.unwrap_or_default(),
        Err(e) => Cli::command().error(clap::error::ErrorKind::ValueValidation, e).exit(),
    };
    if !AttnDevice::driver_available() {
        eprintln!("step-bench: no CUDA driver or GPU; nothing to measure");
        std::process::exit(2);
    }
    let dev = Arc::new(AttnDevice::new(0)?);
    let stream = dev.context().new_stream()?;
    // As in attn-bench: the bench owns every buffer, so cudarc's cross-stream event tracking
    // (an event wait and record per buffer per call) would only add host work between launches.
    // `forward` orders its own second stream (cascade) with explicit events.
    let untracked = !cli.event_tracking;
    if untracked {
        // SAFETY: every buffer here is used on `stream` only (and `forward`'s side stream, which
        // it orders itself).
        unsafe { dev.context().disable_event_tracking() };
    }
    println!("device: {}, cudarc event tracking {}", dev.context().name()?, if untracked { "off" } else { "on (--event-tracking)" });
    let mut lines = Vec::new();
    if want(Part::Cascade) {
        cascade_bench(&dev, &stream, cli.quick, &mut lines)?;
    }
    for (n, context) in shapes {
        graph_bench(&dev, &stream, n, context, cli.quick, &mut lines)?;
    }
    if want(Part::Mixed) {
        for shape in [(64, 2048, 512, 1536), (8, 512, 2048, 0)] {
            mixed_graph_bench(&dev, &stream, shape, cli.quick, &mut lines)?;
        }
    }
    for l in &lines {
        println!("{:<55} {:>10.2}  {}", l.name, l.us, l.note);
    }
    if let Some(p) = &cli.json {
        let text = json_text(&lines).unwrap_or_else(|e| panic!("JSON of the lines: {e}"));
        std::fs::write(p, text).unwrap_or_else(|e| panic!("writing {}: {e}", p.display()));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("step-bench").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_take_both_spellings() {
        let cli = parse(&["--json=s.json", "--only=graph", "--quick"]).unwrap();
        assert_eq!((cli.json.as_deref(), cli.only, cli.quick), (Some(std::path::Path::new("s.json")), Some(Part::Graph), true));
        assert_eq!(parse(&["--only", "cascade"]).unwrap().only, Some(Part::Cascade));
        for args in [&["--only", "graphs"][..], &["--json"], &["--quick=1"], &["--reps", "3"]] {
            assert_eq!(parse(args).unwrap_err().exit_code(), 2, "{args:?}");
        }
    }

    #[test]
    fn json_keeps_the_stored_files_shape() {
        let line = |name: &str, us, note: &str| Line { name: name.into(), us, note: note.into() };
        let text = String::from_utf8(json_text(&[line("cascade: \"plain\"", 238.95712, "a"), line("b", 3.0, "x\\y")]).unwrap()).unwrap();
        assert_eq!(
            text,
            "[\n  {\"name\": \"cascade: \\\"plain\\\"\", \"value\": 238.957, \"note\": \"a\"},\n  {\"name\": \"b\", \"value\": 3.0, \"note\": \"x\\\\y\"}\n]\n"
        );
    }
}
