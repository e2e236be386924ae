//! CUDA-graph steps: a decode step (cache write, split-K decode, merge) captured once per batch
//! size and replayed with the CPU out of the loop.
//!
//! What makes a step replayable: every launch's grid and arguments must be the same whatever
//! the step holds. So a graph step ([`Attention::new_graph_step`](super::Attention::new_graph_step))
//! - pads the batch to its [`GraphBucket`]: padding requests have the bucket's query length,
//!   length 0 and slot -1 (the cache write skips them, decode writes them zeros);
//! - keeps every array the kernels read (start locations, lengths, block table rows as wide as
//!   `max_model_len` needs, slots, the split plan) at fixed offsets of one device buffer,
//!   rewritten by one copy in [`StepMetadata::build`](super::StepMetadata::build), outside the
//!   graph;
//! - plans the splits on the host as eager steps do, then hands the kernels the plan's item
//!   chunk through a header in that buffer: the attention grid covers the most items a plan of
//!   the bucket can have (`TcKernel::max_items`), the items past the step's are `NO_WORK`
//!   (their CTAs exit at once), and the merge is always launched (it skips requests with one
//!   split).
//!
//! Inside the captured region `forward` copies nothing, allocates nothing, waits for nothing and
//! decides nothing from the step's contents.
//!
//! A graph replays its kernels on the addresses they were captured with, long after the calls
//! that recorded them returned: so the [`StepGraph`] owns a share of all that memory (see its
//! doc), and a recorded layer's buffers must be [`SharedBuf`](crate::buffer::SharedBuf)s, whose
//! handles it takes. A borrowed buffer is refused at the recorded call, naming the argument.

use super::graph_plan::GraphBucket;
use super::io::{GpuLayer, NewKv};
use super::step::StepMetadata;
use crate::buffer::KeepAlive;
use crate::error::{ensure, AttnError, Result};
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::Arc;

/// A captured step ([`Attention::capture`](super::Attention::capture)): replay it after each
/// [`StepMetadata::build`] of its graph step (and of any other graph step its layers ran, such
/// as an encoder-decoder model's cross-attention step: a replay reads each one's last build).
///
/// The kernels it replays use device memory by address, so it holds a handle to every piece
/// of it, and none is freed while it lives: the graph steps' device buffers (their arrays and
/// split plans), the capturing `Attention`'s workspaces, merge counters and status words, its
/// device (the loaded kernels), and the caller's buffers the recorded layers took (as
/// [`SharedBuf`](crate::buffer::SharedBuf)s). Dropping the `Attention`, the step or the
/// caller's handles first is fine; the memory goes with the graph. Dropping the graph waits for
/// its stream, so no replay is running when what it held is freed.
pub struct StepGraph {
    graph: CudaGraph,
    stream: Arc<CudaStream>,
    owner: u64,
    bucket: GraphBucket,
    /// The graph step's device buffer, which identifies the step [`replay`](Self::replay) takes.
    step: KeepAlive,
    /// The library's memory and the caller's buffers the captured kernels use: held, never read.
    _held: Vec<KeepAlive>,
}

impl StepGraph {
    /// The bucket the graph was captured for.
    pub fn bucket(&self) -> GraphBucket {
        self.bucket
    }

    /// Enqueues the captured work on the stream it was captured on, reading `step`'s device
    /// buffer. `step` must be the graph step it was captured with: its last
    /// [`build`](StepMetadata::build) is what runs. Nothing waits.
    pub fn replay(&self, step: &StepMetadata) -> Result<()> {
        let same = step.owner == self.owner && step.graph_bucket() == Some(self.bucket) && step.is_device(&self.step);
        ensure(same, "step", || "is not the graph step this graph was captured with".into())?;
        ensure(step.is_built(), "step", || "was not built (its last build failed)".into())?;
        Ok(self.graph.launch()?)
    }
}

impl Drop for StepGraph {
    fn drop(&mut self) {
        // The handles are released after this (field drops): wait for the replays in flight,
        // which may use memory that only this graph still holds. A failure here leaves nothing
        // to do but release them.
        let _ = self.stream.synchronize();
    }
}

/// Captures what `record` enqueues on `stream` into a graph: thread-local capture (any
/// synchronisation or allocation in this thread during the capture fails it), with cudarc's
/// cross-stream event tracking off for the duration (one stream needs none, and its event
/// waits would break the capture).
pub(crate) fn capture_stream(stream: &Arc<CudaStream>, record: impl FnOnce() -> Result<()>) -> Result<CudaGraph> {
    let _tracking_off = TrackingOff::begin(stream);
    (|| {
        stream.begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)?;
        let recorded = record();
        let graph = stream.end_capture(CUgraphInstantiate_flags(0));
        recorded?;
        graph?.ok_or_else(|| AttnError::invalid("record", "captured nothing"))
    })()
}

/// Event tracking is a setting of the whole context: with captures in several threads at once,
/// the first one to end must not turn it back on under the others (their next event wait on an
/// uncaptured stream would invalidate their capture). Off while any capture runs, restored by
/// the last one to end.
struct TrackingOff {
    ctx: Arc<cudarc::driver::CudaContext>,
}

/// Per context (its handle): captures in progress, and whether tracking was on before the first.
static TRACKING_OFF: std::sync::Mutex<Vec<(usize, usize, bool)>> = std::sync::Mutex::new(Vec::new());

impl TrackingOff {
    fn begin(stream: &Arc<CudaStream>) -> Self {
        let ctx = stream.context().clone();
        let key = ctx.cu_ctx() as usize;
        let mut all = TRACKING_OFF.lock().unwrap_or_else(|e| e.into_inner());
        match all.iter_mut().find(|e| e.0 == key) {
            Some(e) => e.1 += 1,
            None => {
                all.push((key, 1, ctx.is_event_tracking()));
                // SAFETY: a capture uses only its own stream while tracking is off; restored by
                // the last capture's `drop`.
                unsafe { ctx.disable_event_tracking() };
            }
        }
        TrackingOff { ctx }
    }
}

impl Drop for TrackingOff {
    fn drop(&mut self) {
        let key = self.ctx.cu_ctx() as usize;
        let mut all = TRACKING_OFF.lock().unwrap_or_else(|e| e.into_inner());
        let Some(i) = all.iter().position(|e| e.0 == key) else { return };
        all[i].1 -= 1;
        if all[i].1 == 0 {
            let (_, _, was_on) = all.swap_remove(i);
            if was_on {
                // SAFETY: restores the context's setting from before the first capture.
                unsafe { self.ctx.enable_event_tracking() };
            }
        }
    }
}

/// What a capture collects: the step being captured (its device buffer's handle) and a handle
/// to every buffer the recorded calls take.
pub(crate) struct Capture {
    step: KeepAlive,
    held: Vec<KeepAlive>,
    /// Whether the Attention times its layers after the capture (off during it).
    pub(crate) timing_after: bool,
}

const NOT_SHARED: &str = "a buffer captured into a graph must be a SharedBuf (DevIn::shared, DevOut::shared), \
                          so that the graph keeps it alive";

impl Capture {
    /// A capture of `step` (a graph step), holding `library`: the capturing executor's memory.
    pub(crate) fn new(step: &StepMetadata, library: Vec<KeepAlive>, timing_after: bool) -> Result<Self> {
        let step = step.device_keep_alive().ok_or_else(|| AttnError::invalid("step", "has no device buffer"))?;
        Ok(Capture { step, held: library, timing_after })
    }

    /// Checks that a recorded layer runs a graph step on buffers the graph can hold, and takes a
    /// handle to each; refuses (naming the argument) before anything is enqueued. Layers may run
    /// other graph steps of the Attention than the captured one (an encoder-decoder model's
    /// cross-attention step beside its decoder step): the graph holds their device buffers too,
    /// and replays read each one's last build.
    pub(crate) fn take(&mut self, step: &StepMetadata, layer: &GpuLayer<'_>) -> Result<()> {
        let mut held = Vec::with_capacity(10);
        if !step.is_device(&self.step) {
            let other = step.graph_bucket().and(step.device_keep_alive());
            held.push(other.ok_or_else(|| {
                AttnError::invalid("step", "is not a graph step: a graph replays graph steps (Attention::new_graph_step) only")
            })?);
        }
        let mut need = |arg: &'static str, keep: Option<&KeepAlive>| -> Result<()> {
            held.push(keep.cloned().ok_or_else(|| AttnError::invalid(arg, NOT_SHARED))?);
            Ok(())
        };
        need("q", layer.q.keep_alive())?;
        match &layer.new_kv {
            NewKv::None => {}
            NewKv::Standard { k, v, .. } => {
                need("k", k.keep_alive())?;
                need("v", v.keep_alive())?;
            }
            NewKv::Mla { kv_c, k_pe, .. } => {
                need("kv_c", kv_c.keep_alive())?;
                need("k_pe", k_pe.keep_alive())?;
            }
        }
        need("cache", layer.cache.keep_alive())?;
        need("out", layer.out.keep_alive())?;
        if let Some(b) = &layer.alibi_slopes {
            need("alibi_slopes", b.keep_alive())?;
        }
        if let Some(b) = &layer.sinks {
            need("sinks", b.keep_alive())?;
        }
        if let Some((k, v)) = &layer.kv_scales {
            need("kv_scales", k.keep_alive())?;
            need("kv_scales", v.keep_alive())?;
        }
        self.held.append(&mut held);
        Ok(())
    }

    /// The graph, holding what the capture collected (each buffer once).
    pub(crate) fn into_graph(self, graph: CudaGraph, stream: Arc<CudaStream>, owner: u64, bucket: GraphBucket) -> StepGraph {
        let Capture { step, mut held, .. } = self;
        held.sort_by_key(|k| Arc::as_ptr(k).cast::<()>());
        held.dedup_by(|a, b| Arc::ptr_eq(a, b));
        StepGraph { graph, stream, owner, bucket, step, _held: held }
    }
}
