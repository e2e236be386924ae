//! [`paged_decode`]: checks the call ([`super::args`]), plans its launch ([`super::plan`]) and
//! runs it: the attention kernel on the plan, then the merge when one follows.

use super::args::{check_args, CheckedArgs, DecodeArgs};
use super::kernel::head_cluster;
use super::merge::launch_merge;
use super::plan::{call_kernel, plan_launch, LaunchPlan, PlanArrays, PlanSource};
use super::split::DecodePlan;
use super::workspace::DecodeWorkspace;
use crate::attn_params;
use crate::batch::{BatchMetadata, DecodeBatch, DeviceBatch};
use crate::device::AttnDevice;
use crate::error::{ensure, Result};
use crate::layout::RowsDesc;
use crate::options::{AttnOptions, PlanOptions};
use crate::status::DeviceStatus;
use crate::stream_check::refuse_foreign_capture;
use attn_math::params::{
    AttnParams, Fp8Scales, HeadDims, LocalMask, Mask, MlaParams, PerHead, ScaleLayout, Schedule, Shape, SparseIndices, VariantParams,
};
use cudarc::driver::{CudaStream, DevicePtrMut};
use std::sync::Arc;

/// Paged decode: validates everything, plans, uploads the plan, launches pass 1 and (when a
/// request has several splits) the merge. Enqueued on `stream`; block ids outside the cache are
/// skipped and raise `BLOCK_OUT_OF_RANGE` in `status`.
///
/// Each request of `batch` has 0 to [`MAX_QUERY_LEN`](super::MAX_QUERY_LEN) query tokens
/// (speculative decoding: causal among them), the last ones of its `seq_lens` keys; query head
/// `h` reads kv head `h / (num_q_heads / num_kv_heads)`. `out` gets
/// `softmax(scale * q k^T) v` per query token and head (with the options' window, soft-cap,
/// ALiBi and sinks), and `lse` its natural-log normaliser. `plan` is a [`SplitMode`](crate::SplitMode)
/// or [`PlanOptions`](crate::PlanOptions). Returns the plan it ran (for logging).
///
/// Errors, all before anything is enqueued: `InvalidArgument` naming the argument: dtypes (`q`
/// f16 or bf16, `cache` q's or FP8 with `scales`), a head size without kernels (64, 96, 128,
/// 256), shapes, buffer lengths and 16-byte alignment, a batch that does not fit the block table
/// or the workspace, and a workspace, batch or stream from another stream (`workspace`,
/// `batch`, `stream`: each belongs to the stream it was made on); `Driver` for a failed copy or
/// launch.
///
/// Ordering on Hopper (programmatic dependent launch, `ATTN_DISABLE_PDL=1` turns it off): the
/// kernel may start while the kernel launched just before it on `stream` still runs, and reads
/// the queries, block tables, sequence lengths and the cache rows of each request's context
/// before its new tokens (positions below `seq_len - q_len`) before waiting for it. Those must
/// have been written before that kernel started, as they are in an engine step (QKV
/// projection, then the cache write of the new tokens, then decode). The new tokens' rows are
/// read, and everything is written, after the wait.
///
/// Caller's part (docs/soundness.md): `batch`, `ws` (and a plan) must have been made on
/// `stream`; the contents of the caller's buffers and their ordering are the caller's, the
/// bounds of every access are the library's.
#[allow(clippy::too_many_arguments)]
pub fn paged_decode(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: DecodeArgs<'_>,
    batch: &BatchMetadata,
    opts: &AttnOptions,
    plan: impl Into<PlanOptions>,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<DecodePlan> {
    refuse_foreign_capture(stream, "stream", "paged_decode")?;
    let meta = batch.device(stream)?;
    paged_decode_from(dev, stream, a, &batch.decode_batch(), meta, opts, PlanSource::Host(plan.into()), true, ws, status)
}

/// [`paged_decode`] with its plan from `source`. Not `causal`: every query token sees every key
/// and a request takes any number of them (cascade's shared prefix: all the batch's tokens as
/// one request), on the tensor cores. `meta` is the device copy of `batch`, uploaded by the
/// library from it (a [`BatchMetadata`], or `forward`'s step buffer).
#[allow(clippy::too_many_arguments)]
pub(crate) fn paged_decode_from(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: DecodeArgs<'_>,
    batch: &DecodeBatch<'_>,
    meta: DeviceBatch<'_>,
    opts: &AttnOptions,
    source: PlanSource<'_>,
    causal: bool,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<DecodePlan> {
    let device_plan = match source {
        PlanSource::Device(dp) => Some(dp.query_len),
        PlanSource::Host(_) => None,
    };
    let checked = check_args(&a, batch, &meta, causal, device_plan, ws, stream)?;
    opts.validate_masks("opts", causal)?;
    ensure(opts.chunk_size.is_none() && opts.symmetric_window.is_none(), "opts", || {
        format!(
            "chunk_size {:?} / symmetric_window {:?}: the decode kernels have no local masks (prefill takes any query length)",
            opts.chunk_size, opts.symmetric_window
        )
    })?;
    let num_reqs = batch.seq_lens.len();
    let (nt, hq, d) = (a.q_rows.num_tokens, a.q_rows.num_heads, a.q_rows.head_size);
    if num_reqs == 0 || nt == 0 {
        return Ok(DecodePlan::default());
    }
    let tc = call_kernel(dev, a.q.dtype, a.cache.dtype, a.spec.layout, d, hq, a.spec.num_kv_heads, batch, source)?;
    let lp = plan_launch(tc, batch, source, ws.partial_rows(), |_, _| 0)?;
    run(dev, stream, &a, (&meta, num_reqs), opts, causal, &lp, &checked, ws, status)?;
    Ok(lp.plan)
}

/// Runs a planned launch on the call's checked buffers: finds the plan's arrays (uploading the
/// plan when it goes through the workspace), fills the kernel's parameters, launches it, then
/// the merge when one follows.
#[allow(clippy::too_many_arguments)]
fn run(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: &DecodeArgs<'_>,
    (meta, num_reqs): (&DeviceBatch<'_>, usize),
    opts: &AttnOptions,
    causal: bool,
    lp: &LaunchPlan<'_>,
    checked: &CheckedArgs,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<()> {
    let (spec, tc) = (&a.spec, &lp.kernel);
    let (nt, hq) = (a.q_rows.num_tokens, a.q_rows.num_heads);
    let q_dtype = a.q.dtype;
    let wp = ws.arrays(stream, lp, num_reqs, nt)?;
    let (status_ptr, _o7) = status.word.device_ptr_mut(stream);
    let [k, v] = attn_params::paged_kv(&a.cache, spec);
    let output = attn_params::output(&a.out, &a.out_rows, a.lse.as_ref());
    let tp = AttnParams {
        qkv: attn_params::qkv(&a.q, &a.q_rows, k, v),
        batch: attn_params::paged_batch(&a.block_table, a.block_table_stride, meta),
        output,
        split: wp.split_k(),
        per_head: PerHead { alibi_slopes: checked.alibi, sinks: checked.sinks },
        fp8: Fp8Scales { k_scale: checked.k_scale, v_scale: checked.v_scale },
        status: status_ptr,
        variant: VariantParams::new(opts.softmax_scale, opts.softcap, opts.window),
        shape: Shape {
            num_blocks: spec.num_blocks as u32,
            block_size: spec.block_size as u32,
            chunk: lp.chunk,
            num_q_heads: hq as u32,
            group: (hq / spec.num_kv_heads) as u32,
        },
        mask: Mask { causal: causal as u32 },
        mla: MlaParams::default(),
        local: LocalMask::new(opts.chunk_size, opts.symmetric_window),
        sparse: SparseIndices::default(),
        scale_layout: ScaleLayout { head_stride: checked.scale_head_stride, reserved: 0 },
        dims: HeadDims { qk: tc.layer.head_size as u32, v: tc.layer.head_size as u32 },
        schedule: Schedule {
            plan: lp.header,
            sched: 0,
            ctas: 0,
            merge_counters: if tc.fused_merge { ws.merge_counters_ptr(stream) } else { 0 },
            uniform_splits: lp.uniform_splits,
        },
    };
    let ctas = lp.ctas();
    ensure(ctas < i32::MAX as usize, "workspace", || format!("{ctas} CTAs exceed a launch"))?;
    let cluster = head_cluster(spec.layout, spec.head_size, a.cache.dtype.size_bytes(), spec.num_kv_heads, dev.clusters_enabled());
    dev.launch_ex(stream, tc.id, (ctas as u32, 1, 1), tc.threads, tc.smem, cluster, tp)?;
    if lp.merge {
        // A device plan's decodes are its first tokens, at most `merge_tokens` of them.
        let merge_tokens = match lp.arrays {
            PlanArrays::Device(dp) => nt.min(dp.merge_tokens),
            _ => nt,
        };
        let rows = RowsDesc { num_tokens: merge_tokens, ..a.out_rows };
        launch_merge(dev, stream, &wp, meta.query_start_loc.ptr, (&a.out, &rows), output.lse, checked.sinks, q_dtype)?;
    }
    Ok(())
}
