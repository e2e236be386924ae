//! A decode batch's split plan made and uploaded once, then used by every layer's call (vLLM's
//! metadata builders, FlashMLA's `get_mla_metadata`): the layers launch with no planning and
//! no copy, so each call's merge overlaps the next call's start (programmatic dependent
//! launch), where a planning call ([`paged_decode`](crate::decode::paged_decode),
//! [`mla_attention`](crate::mla::mla_attention)) puts a copy between them.
//!
//! ```no_run
//! # fn demo(dev: &attn_rs::AttnDevice, stream: &std::sync::Arc<cudarc::driver::CudaStream>,
//! #         ws: &mut attn_rs::decode::DecodeWorkspace, status: &mut attn_rs::DeviceStatus,
//! #         layers: Vec<attn_rs::mla::MlaArgs<'_>>, batch: attn_rs::BatchMetadata) -> attn_rs::Result<()> {
//! use attn_rs::batch_plan::{mla_attention_planned, BatchPlan};
//! use attn_rs::{DType, SplitMode};
//! let mut plan = BatchPlan::new(stream)?; // once, for this stream
//! // Each step: plan the batch, then run every layer with it.
//! plan.plan_mla(dev, &batch, DType::BF16, DType::BF16, 16, SplitMode::Auto, ws)?;
//! for args in layers {
//!     mla_attention_planned(dev, stream, args, &batch, 0.07, &plan, ws, status)?;
//! }
//! # Ok(()) }
//! ```

use crate::batch::{validate_prefill_batch, BatchMetadata, DecodeBatch, PrefillBatch};
use crate::decode::{
    append_plan, decode_tc_kernel, max_len, max_query_len, paged_decode_from, plan_launch, DecodeArgs, DecodeKernel, DecodePlan,
    DecodeWorkspace, DevicePlan, PlanSource, TcKernel,
};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::kernels::head_width;
use crate::layout::KvLayout;
use crate::mla::{mla_attention_from, mla_cluster, mla_tc_kernel, MlaArgs};
use crate::options::{AttnOptions, PlanOptions};
use crate::status::DeviceStatus;
use crate::stream_check::{check_stream, refuse_foreign_capture};
use crate::words::Region;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// One batch's plan on the device, remade each step by [`plan_mla`](Self::plan_mla) or
/// [`plan_decode`](Self::plan_decode) (its buffer grows when a step needs more, and is reused
/// otherwise). What its offsets depend on is checked by every call that uses it: the batch
/// (the planned one), the kernel (which names the dtypes, the cache format and the head size),
/// the heads, the workspace's room, and the stream (the plan's, the workspace's and the
/// batch's must be the call's).
pub struct BatchPlan {
    stream: Arc<CudaStream>,
    device: CudaSlice<u32>,
    words: Vec<u32>,
    planned: Option<Planned>,
}

struct Planned {
    plan: DecodePlan,
    device: DevicePlan,
    seq_lens: Vec<i32>,
    query_start_loc: Vec<i32>,
    /// The workspace's partial rows when planned: a smaller one cannot take the plan.
    partial_rows: usize,
}

impl BatchPlan {
    /// An empty plan buffer on `stream`: every plan made in it, and every call that uses it,
    /// runs on that stream (one per stream).
    ///
    /// Errors: `Driver` when the allocation fails.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(BatchPlan { stream: stream.clone(), device: stream.alloc_zeros(256)?, words: Vec::new(), planned: None })
    }

    /// Plans a batch of MLA decodes (`num_heads` query heads, `q_dtype` queries, a
    /// `cache_dtype` latent cache) for [`mla_attention_planned`], and uploads it on the stream.
    /// Returns the plan (for logging).
    ///
    /// Errors: `InvalidArgument` for a batch, dtypes or head count the MLA kernels do not take,
    /// a plan that does not fit `ws`, or a batch or workspace of another stream; `Driver` when
    /// the copy fails.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_mla(
        &mut self,
        dev: &AttnDevice,
        batch: &BatchMetadata,
        q_dtype: DType,
        cache_dtype: DType,
        num_heads: usize,
        plan: impl Into<PlanOptions>,
        ws: &DecodeWorkspace,
    ) -> Result<&DecodePlan> {
        let plan = plan.into();
        self.check_streams(batch, ws)?;
        let batch = &batch.decode_batch();
        let max_q = check_batch(batch, q_dtype, cache_dtype, num_heads)?;
        let tc = mla_tc_kernel(dev, q_dtype, cache_dtype.fp8_format(), num_heads, max_q, &plan.tuning)?;
        self.plan_for(dev, tc, batch, plan, ws)
    }

    /// Plans a batch of paged decodes for [`paged_decode_planned`] (the tensor-core kernels),
    /// and uploads it on the stream. Returns the plan (for logging). `layout`: the cache's, which
    /// the split depends on (16-bit NHD caches whose head rows are not whole 128-byte lines take
    /// shorter splits); a call over a cache of another layout runs the plan as it is.
    ///
    /// Errors: `InvalidArgument` for a batch, dtypes, head size or head counts the decode
    /// kernels do not take, a plan that does not fit `ws`, or a batch or workspace of another
    /// stream; `Driver` when the copy fails.
    #[allow(clippy::too_many_arguments)]
    pub fn plan_decode(
        &mut self,
        dev: &AttnDevice,
        batch: &BatchMetadata,
        q_dtype: DType,
        cache_dtype: DType,
        layout: KvLayout,
        head_size: usize,
        num_q_heads: usize,
        num_kv_heads: usize,
        plan: impl Into<PlanOptions>,
        ws: &DecodeWorkspace,
    ) -> Result<&DecodePlan> {
        let plan = plan.into();
        self.check_streams(batch, ws)?;
        let batch = &batch.decode_batch();
        ensure(num_kv_heads > 0 && num_q_heads.is_multiple_of(num_kv_heads), "num_q_heads", || {
            format!("{num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        })?;
        let max_q = check_batch(batch, q_dtype, cache_dtype, num_q_heads)?;
        head_width("head_size", head_size)?;
        let tc = decode_tc_kernel(
            dev,
            q_dtype,
            cache_dtype,
            layout,
            head_size,
            num_q_heads,
            num_kv_heads,
            max_q,
            max_len(batch.seq_lens),
            &plan.tuning,
        )?;
        self.plan_for(dev, tc, batch, plan, ws)
    }

    fn plan_for(
        &mut self,
        dev: &AttnDevice,
        tc: TcKernel,
        batch: &DecodeBatch<'_>,
        options: PlanOptions,
        ws: &DecodeWorkspace,
    ) -> Result<&DecodePlan> {
        self.planned = None;
        // MLA's plans may run their splits as thread-block clusters.
        let mla = tc.kernel == DecodeKernel::Mla;
        let cluster = |plan: &DecodePlan, tuning: &_| if mla { mla_cluster(dev, &tc, plan, tuning) } else { 0 };
        let plan = plan_launch(tc, batch, PlanSource::Host(options), ws.partial_rows(), cluster)?.plan;
        ws.check_plan(&plan, batch.seq_lens.len(), batch.query_start_loc.last().map_or(0, |&n| n as usize))?;
        let mut words = std::mem::take(&mut self.words);
        words.clear();
        let r = append_plan(&mut words, &plan);
        if self.device.len() < words.len() {
            self.device = self.stream.alloc_zeros(words.len().next_power_of_two())?;
        }
        // One pageable copy: the driver sends a small one with the stream's commands, which
        // measured cheaper than a copy-engine transfer from pinned memory (docs/decode.md).
        let copied = self.stream.memcpy_htod(&words[..], &mut self.device.slice_mut(..words.len()));
        self.words = words;
        copied?;
        let base = self.device.device_ptr(&self.stream).0;
        let at = |r: Region| base + r.byte_offset() as u64;
        let device = DevicePlan {
            kernel: tc.id,
            layer: tc.layer,
            items: at(r.items),
            req_num_splits: at(r.req_num_splits),
            req_partial_base: at(r.req_partial_base),
            token_request: at(r.token_request),
            header: at(r.header),
            capacity_items: plan.items.len() / 2,
            query_len: max_query_len(batch),
            merge_tokens: usize::MAX,
            needs_merge: plan.needs_merge(),
            cluster: plan.cluster,
        };
        let planned = Planned {
            plan,
            device,
            seq_lens: batch.seq_lens.to_vec(),
            query_start_loc: batch.query_start_loc.to_vec(),
            partial_rows: ws.partial_rows(),
        };
        Ok(&self.planned.insert(planned).plan)
    }

    /// Refuses a batch or workspace of another stream than the plan's.
    fn check_streams(&self, batch: &BatchMetadata, ws: &DecodeWorkspace) -> Result<()> {
        check_stream("batch", batch.stream(), &self.stream)?;
        ws.check_stream(&self.stream)
    }

    /// The plan for `batch`, after checking it is the planned batch, on the call's stream.
    fn for_batch(&self, stream: &Arc<CudaStream>, batch: &BatchMetadata, ws: &DecodeWorkspace) -> Result<&Planned> {
        check_stream("plan", &self.stream, stream)?;
        self.check_streams(batch, ws)?;
        let batch = &batch.decode_batch();
        let Some(p) = self.planned.as_ref() else {
            return Err(AttnError::InvalidArgument { arg: "plan", reason: "nothing planned yet (call plan_mla or plan_decode)".into() });
        };
        ensure(p.seq_lens == batch.seq_lens && p.query_start_loc == batch.query_start_loc, "batch", || {
            "differs from the batch the plan was made for".into()
        })?;
        ensure(ws.partial_rows() >= p.partial_rows, "workspace", || {
            format!("holds {} partial rows, the plan was made for {}", ws.partial_rows(), p.partial_rows)
        })?;
        Ok(p)
    }
}

/// Checks what planning reads (the batch, the dtypes: the calls check the rest before any
/// launch), and returns the most query tokens a request has.
fn check_batch(batch: &DecodeBatch<'_>, q_dtype: DType, cache_dtype: DType, num_heads: usize) -> Result<u32> {
    let qsl = batch.query_start_loc;
    let num_tokens = qsl.last().map_or(0, |&n| n.max(0) as usize);
    let pb = PrefillBatch { query_start_loc: qsl, seq_lens: batch.seq_lens, key_start_loc: None };
    validate_prefill_batch(&pb, num_tokens, true, None)?;
    ensure(matches!(q_dtype, DType::F16 | DType::BF16), "q_dtype", || format!("{q_dtype:?}: decode takes f16 or bf16 queries"))?;
    ensure(cache_dtype == q_dtype || cache_dtype.is_fp8(), "cache_dtype", || format!("{cache_dtype:?} with {q_dtype:?} queries"))?;
    ensure(num_heads > 0, "num_heads", || "is 0".into())?;
    // Validated: the start locations do not decrease from 0, so no difference wraps.
    let max_q = qsl.windows(2).map(|w| (w[1] - w[0]) as u32).max().unwrap_or(1);
    // The kernels count a request's query rows (tokens x heads) in a u32.
    ensure(max_q as u64 * num_heads as u64 <= u32::MAX as u64, "query_start_loc", || {
        format!("a request has {max_q} query tokens x {num_heads} heads, more rows than a launch counts")
    })?;
    Ok(max_q)
}

/// [`mla_attention`](crate::mla::mla_attention) with the plan made by
/// [`BatchPlan::plan_mla`] for this `batch`: no planning, no copy.
///
/// Errors: [`mla_attention`](crate::mla::mla_attention)'s, and `InvalidArgument` (`plan`,
/// `batch`, `workspace`) when nothing was planned, the batch is not the planned one, the plan
/// was made for another kernel or heads, or the workspace is smaller than the planned one's.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention_planned(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: MlaArgs<'_>,
    batch: &BatchMetadata,
    softmax_scale: f32,
    plan: &BatchPlan,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<()> {
    refuse_foreign_capture(stream, "stream", "mla_attention_planned")?;
    let p = plan.for_batch(stream, batch, ws)?;
    let meta = batch.device(stream)?;
    mla_attention_from(dev, stream, a, &batch.decode_batch(), meta, softmax_scale, PlanSource::Device(&p.device), ws, status).map(drop)
}

/// [`paged_decode`](crate::decode::paged_decode) with the plan made by
/// [`BatchPlan::plan_decode`] for this `batch`: no planning, no copy.
///
/// Errors: [`paged_decode`](crate::decode::paged_decode)'s, and `InvalidArgument` (`plan`,
/// `batch`, `workspace`) when nothing was planned, the batch is not the planned one, the plan
/// was made for another kernel or heads, or the workspace is smaller than the planned one's.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode_planned(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: DecodeArgs<'_>,
    batch: &BatchMetadata,
    opts: &AttnOptions,
    plan: &BatchPlan,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<()> {
    refuse_foreign_capture(stream, "stream", "paged_decode_planned")?;
    let p = plan.for_batch(stream, batch, ws)?;
    let meta = batch.device(stream)?;
    paged_decode_from(dev, stream, a, &batch.decode_batch(), meta, opts, PlanSource::Device(&p.device), true, ws, status).map(drop)
}
