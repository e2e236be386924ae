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
//!   the bucket can have ([`TcKernel::max_items`]), the items past the step's are `NO_WORK`
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

use super::io::{GpuLayer, NewKv};
use super::step::StepMetadata;
use crate::buffer::KeepAlive;
use crate::decode::{plan_decode_tc, DecodeBatch, DevicePlan, SplitMode, TcKernel};
use crate::error::{ensure, AttnError, Result};
use crate::metadata::{validate, BatchSplit, Region, StagingLayout, StagingSizes, StepInput, ALIGN_WORDS};
use attn_math::params::NO_WORK;
use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode, CUstreamCaptureStatus};
use cudarc::driver::{CudaGraph, CudaStream};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// The batch a graph is captured for: up to `num_reqs` decode requests of exactly `query_len`
/// query tokens each (1, or 1 + speculative tokens); smaller batches are padded to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphBucket {
    pub num_reqs: usize,
    pub query_len: usize,
}

impl GraphBucket {
    /// One-token decodes of up to `num_reqs` requests.
    pub fn decode(num_reqs: usize) -> Self {
        GraphBucket { num_reqs, query_len: 1 }
    }

    /// Query tokens of a padded step: the rows the layer tensors (q, k, v, out) must have.
    pub fn num_tokens(&self) -> usize {
        self.num_reqs * self.query_len
    }
}

/// A graph step's fixed part (the bucket, the kernel, the layout of its device words) and the
/// host buffers it packs each step into.
pub(crate) struct GraphPlanner {
    bucket: GraphBucket,
    tc: TcKernel,
    mode: SplitMode,
    num_q_heads: usize,
    partial_capacity: usize,
    capacity_items: usize,
    layout: StagingLayout,
    /// `[num_items, chunk, 0, 0]` after the layout's arrays.
    header: Region,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    words: Vec<u32>,
}

impl GraphPlanner {
    /// `block_width`: block-table entries per request (`max_model_len / block_size`, rounded up).
    pub(crate) fn new(
        bucket: GraphBucket,
        tc: TcKernel,
        mode: SplitMode,
        num_q_heads: usize,
        block_width: usize,
        partial_capacity: usize,
    ) -> Result<Self> {
        let (n, nt) = (bucket.num_reqs, bucket.num_tokens());
        ensure(n > 0 && bucket.query_len > 0, "bucket", || format!("{bucket:?} is empty"))?;
        let capacity_items = tc.max_items(n, bucket.query_len as u32, mode);
        let layout = StagingLayout::new(&StagingSizes {
            num_reqs: n,
            block_table_stride: block_width,
            num_actual_tokens: nt,
            num_decodes: n,
            num_prefills: 0,
            num_work_items: 2 * capacity_items,
            num_decode_tokens: nt,
        });
        let header = Region { offset: layout.total_words, len: ALIGN_WORDS };
        Ok(GraphPlanner {
            bucket,
            tc,
            mode,
            num_q_heads,
            partial_capacity,
            capacity_items,
            layout,
            header,
            query_start_loc: Vec::with_capacity(n + 1),
            seq_lens: Vec::with_capacity(n),
            words: vec![0; header.end()],
        })
    }

    pub(crate) fn bucket(&self) -> GraphBucket {
        self.bucket
    }

    /// Words of the device buffer.
    pub(crate) fn total_words(&self) -> usize {
        self.header.end()
    }

    pub(crate) fn layout(&self) -> &StagingLayout {
        &self.layout
    }

    /// The padded step's start locations and lengths, as built.
    pub(crate) fn padded(&self) -> (&[i32], &[i32]) {
        (&self.query_start_loc, &self.seq_lens)
    }

    /// Checks `input` (a full [`validate`], then: decodes of the bucket's query length, no more
    /// requests than the bucket, rows within the block-table width), pads it to the bucket,
    /// plans its splits and packs the words. The split of the padded step.
    pub(crate) fn build(&mut self, input: &StepInput<'_>) -> Result<BatchSplit> {
        validate(input)?;
        let GraphBucket { num_reqs: bn, query_len: q } = self.bucket;
        let n = input.num_reqs();
        ensure(n <= bn, "seq_lens", || format!("{n} requests exceed the graph bucket's {bn}"))?;
        if let Some(r) = (0..n).find(|&r| input.query_len(r) != q as i64) {
            return Err(AttnError::invalid(
                "query_start_loc",
                format!("request {r} has {} query tokens; the graph bucket takes exactly {q} each", input.query_len(r)),
            ));
        }
        let width = self.layout.block_table_stride;
        if let Some(r) = (0..n).find(|&r| input.blocks_needed(r) > width) {
            return Err(AttnError::invalid(
                "seq_lens",
                format!("request {r} has length {}: past the {width} blocks of max_model_len", input.seq_lens[r]),
            ));
        }

        self.query_start_loc.clear();
        self.query_start_loc.extend((0..=bn).map(|r| (r * q) as i32));
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(input.seq_lens);
        self.seq_lens.resize(bn, 0);
        let batch = DecodeBatch { seq_lens: &self.seq_lens, query_start_loc: &self.query_start_loc };
        let tc = &self.tc;
        let plan = plan_decode_tc(&batch, self.num_q_heads, tc.group, tc.shape, tc.target, tc.slots, self.mode, self.partial_capacity);
        let items = plan.items.len() / 2;
        ensure(items <= self.capacity_items, "step", || {
            format!("its plan has {items} work items, the graph's grid {}: a planner bug", self.capacity_items)
        })?;

        let (l, words) = (&self.layout, &mut self.words);
        let put_i32 = |words: &mut [u32], r: Region, v: &[i32]| {
            for (w, &x) in words[r.range()].iter_mut().zip(v) {
                *w = x as u32;
            }
        };
        put_i32(words, l.query_start_loc, &self.query_start_loc);
        put_i32(words, l.seq_lens, &self.seq_lens);
        for r in 0..n {
            let used = input.blocks_needed(r);
            let src = &input.block_table[r * input.block_table_stride..][..used];
            put_i32(words, Region { offset: l.block_table.offset + r * width, len: used }, src);
        }
        let slots = &mut words[l.slot_mapping.range()];
        for (t, pair) in slots.chunks_exact_mut(2).enumerate() {
            let s = if t < input.num_actual_tokens { input.slot_mapping[t] } else { -1 };
            pair[0] = s as u64 as u32;
            pair[1] = (s as u64 >> 32) as u32;
        }
        words[l.prefill_query_start_loc.offset] = 0;
        // Items past the step's do nothing (their CTAs exit at once): the grid is fixed.
        let items_words = &mut words[l.work_items.range()];
        items_words[..plan.items.len()].copy_from_slice(&plan.items);
        for pad in items_words[plan.items.len()..].chunks_exact_mut(2) {
            pad.copy_from_slice(&[0, NO_WORK]);
        }
        words[l.req_num_splits.range()].copy_from_slice(&plan.req_num_splits);
        words[l.req_partial_base.range()].copy_from_slice(&plan.req_partial_base);
        words[l.token_request.range()].copy_from_slice(&plan.token_request);
        words[self.header.range()].copy_from_slice(&[items as u32, plan.chunk, 0, 0]);
        let nt = self.bucket.num_tokens();
        Ok(BatchSplit { num_decodes: bn, num_decode_tokens: nt, num_prefills: 0, num_prefill_tokens: 0 })
    }

    /// The words [`build`](Self::build) packed.
    pub(crate) fn words(&self) -> &[u32] {
        &self.words
    }

    /// The plan's arrays in the device buffer at `base` (its address).
    pub(crate) fn device_plan(&self, base: u64) -> DevicePlan {
        let at = |r: Region| base + r.byte_offset() as u64;
        let l = &self.layout;
        DevicePlan {
            kernel: self.tc.id,
            layer: self.tc.layer,
            items: at(l.work_items),
            req_num_splits: at(l.req_num_splits),
            req_partial_base: at(l.req_partial_base),
            token_request: at(l.token_request),
            header: at(self.header),
            capacity_items: self.capacity_items,
            // Launched at capture whatever that step's plan (requests with one split are
            // skipped by the merge kernel).
            needs_merge: true,
            cluster: 0,
        }
    }
}

/// A captured step ([`Attention::capture`](super::Attention::capture)): replay it after each
/// [`StepMetadata::build`] of its graph step.
///
/// The kernels it replays use device memory by address, so it holds a handle to every piece
/// of it, and none is freed while it lives: the graph step's device buffer (its arrays and
/// split plan), the capturing `Attention`'s workspaces, merge counters and status words, its
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

/// Captures in progress ([`Attention::capture`](super::Attention::capture)) in this process.
/// While there are none, the library's calls need not ask the driver whether their stream is
/// being captured.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Counts one capture in progress while alive.
pub(crate) struct CaptureInProgress(());

impl CaptureInProgress {
    pub(crate) fn begin() -> Self {
        CAPTURES.fetch_add(1, Ordering::SeqCst);
        CaptureInProgress(())
    }
}

impl Drop for CaptureInProgress {
    fn drop(&mut self) {
        CAPTURES.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Refuses (naming `arg`) work for `stream` while it is being captured by a capture that would
/// not hold that work's memory: another `Attention`'s, on a shared stream. One atomic load when
/// no capture is in progress.
pub(crate) fn refuse_foreign_capture(stream: &CudaStream, arg: &'static str, what: &str) -> Result<()> {
    if CAPTURES.load(Ordering::SeqCst) == 0 {
        return Ok(());
    }
    let status = stream.capture_status()?;
    ensure(status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE, arg, || {
        format!(
            "{what} cannot run while its stream is being captured into a graph that would not keep its memory \
             alive (record only the capturing Attention's forward calls, with its graph step)"
        )
    })
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

    /// Checks that a recorded layer runs the captured step on buffers the graph can hold, and
    /// takes a handle to each; refuses (naming the argument) before anything is enqueued.
    pub(crate) fn take(&mut self, step: &StepMetadata, layer: &GpuLayer<'_>) -> Result<()> {
        ensure(step.is_device(&self.step), "step", || {
            "is not the graph step being captured: a graph replays the step it was captured with".into()
        })?;
        let mut held = Vec::with_capacity(9);
        let mut need = |arg: &'static str, keep: Option<&KeepAlive>| -> Result<()> {
            held.push(keep.cloned().ok_or_else(|| AttnError::invalid(arg, NOT_SHARED))?);
            Ok(())
        };
        need("q", layer.q.keep_alive())?;
        match &layer.new_kv {
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
