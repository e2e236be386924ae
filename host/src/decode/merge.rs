//! The merges of partial attention results by their LSEs: split-K's pass 2 (the decode merge
//! kernel, after a plan's splits), and the public [`merge_attn_states`].

use super::workspace::WorkspacePtrs;
use crate::buffer::{DevIn, DevOut};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, Result};
use crate::kernels::KernelId;
use crate::layout::RowsDesc;
use crate::stream_check::refuse_foreign_capture;
use attn_math::params::{DecodeMergeParams, MergeStatesParams, MAX_MERGE_HEAD_SIZE, MERGE_SHARED_BYTES, MERGE_THREADS};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Pass 2 of split-K into `out` (`[num_tokens, num_heads, head_size]` rows): one CTA of 4 warps
/// per (token, head), meeting in 4 x head_size f32 of shared memory.
#[allow(clippy::too_many_arguments)]
pub(crate) fn launch_merge(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    wp: &WorkspacePtrs,
    query_start_loc: u64,
    (out, out_rows): (&DevOut<'_>, &RowsDesc),
    lse: u64,
    sinks: u64,
    dtype: DType,
) -> Result<()> {
    let (nt, hq, d) = (out_rows.num_tokens, out_rows.num_heads, out_rows.head_size);
    ensure(d <= MAX_MERGE_HEAD_SIZE as usize && d.is_multiple_of(4), "out", || {
        format!("head size {d}: the split-K merge takes multiples of 4 up to {MAX_MERGE_HEAD_SIZE}")
    })?;
    let m = DecodeMergeParams {
        partial_out: wp.partial_out,
        partial_lse: wp.partial_lse,
        query_start_loc,
        req_num_splits: wp.req_num_splits,
        req_partial_base: wp.req_partial_base,
        token_request: wp.token_request,
        out: out.ptr,
        out_token_stride: out_rows.token_stride as u64,
        out_head_stride: out_rows.head_stride as u64,
        lse,
        sinks,
        num_tokens: nt as u32,
        num_q_heads: hq as u32,
        head_size: d as u32,
    };
    dev.launch_pdl(stream, KernelId::DecodeMerge { out: dtype }, ((nt * hq) as u32, 1, 1), MERGE_THREADS, MERGE_SHARED_BYTES, m)
}

/// Inputs of [`merge_attn_states`]: two partial results of the same queries over disjoint keys.
pub struct MergeArgs<'a> {
    /// The first partial output, laid out as `rows` (the dtype of `out`).
    pub prefix_out: DevIn<'a>,
    /// Its f32 natural-log LSEs, laid out by `lse_strides` (-inf: attended nothing).
    pub prefix_lse: DevIn<'a>,
    /// The second partial output, laid out as `rows`.
    pub suffix_out: DevIn<'a>,
    /// Its f32 LSEs, laid out by `lse_strides`.
    pub suffix_lse: DevIn<'a>,
    /// The merged output, laid out as `rows` (f16, bf16 or f32).
    pub out: DevOut<'a>,
    /// The merged f32 LSEs, laid out by `lse_strides`, if wanted.
    pub out_lse: Option<DevOut<'a>>,
    /// Shape and strides of the three outputs.
    pub rows: RowsDesc,
    /// Element strides (token, head) of the three LSE tensors: `(num_heads, 1)` for
    /// `[num_tokens, num_heads]`, `(1, num_tokens)` for vLLM's `[num_heads, num_tokens]`.
    pub lse_strides: (usize, usize),
}

/// `out = merge(prefix, suffix)` weighted by their LSEs; an empty side (LSE -inf) contributes
/// nothing. f16, bf16 or f32 outputs. For each (token, head) row, with `m = max(lse_p, lse_s)`:
/// `out = (e^(lse_p - m) prefix + e^(lse_s - m) suffix) / (e^(lse_p - m) + e^(lse_s - m))` and
/// `out_lse = m + ln(e^(lse_p - m) + e^(lse_s - m))`. Enqueued on `stream`.
///
/// Errors, before anything is enqueued: `InvalidArgument` for rows that do not validate,
/// buffers of another dtype or shorter than `rows`/`lse_strides` need
/// ([`merge_attn_states_sizes`]), or an output dtype other than f16/bf16/f32; `Driver` for a
/// failed launch.
pub fn merge_attn_states(dev: &AttnDevice, stream: &Arc<CudaStream>, a: MergeArgs<'_>) -> Result<()> {
    refuse_foreign_capture(stream, "stream", "merge_attn_states")?;
    merge_attn_states_from(dev, stream, a)
}

/// [`merge_attn_states`] for `forward`, which may be recording its own graph.
pub(crate) fn merge_attn_states_from(dev: &AttnDevice, stream: &CudaStream, a: MergeArgs<'_>) -> Result<()> {
    let dt = a.out.dtype;
    ensure(matches!(dt, DType::F16 | DType::BF16 | DType::F32), "out", || format!("dtype {dt:?}"))?;
    let r = a.rows;
    let (out_need, lse_need) = merge_attn_states_sizes(&r, a.lse_strides)?;
    for (arg, b) in [("prefix_out", &a.prefix_out), ("suffix_out", &a.suffix_out)] {
        ensure(b.dtype == dt && b.len >= out_need, arg, || {
            format!("must be {dt:?} with {out_need} elements, got {} x {:?}", b.len, b.dtype)
        })?;
    }
    ensure(a.out.len >= out_need, "out", || format!("buffer of {} elements is too small ({out_need} needed)", a.out.len))?;
    for (arg, b) in [("prefix_lse", &a.prefix_lse), ("suffix_lse", &a.suffix_lse)] {
        ensure(b.dtype == DType::F32 && b.len >= lse_need, arg, || {
            format!("must be f32 with {lse_need} elements, got {} x {:?}", b.len, b.dtype)
        })?;
    }
    if let Some(l) = &a.out_lse {
        ensure(l.dtype == DType::F32 && l.len >= lse_need, "out_lse", || format!("must be f32 with {lse_need} elements"))?;
    }
    if r.num_tokens == 0 || r.num_heads == 0 || r.head_size == 0 {
        return Ok(());
    }
    let p = MergeStatesParams {
        prefix_out: a.prefix_out.ptr,
        suffix_out: a.suffix_out.ptr,
        out: a.out.ptr,
        prefix_lse: a.prefix_lse.ptr,
        suffix_lse: a.suffix_lse.ptr,
        out_lse: a.out_lse.as_ref().map_or(0, |l| l.ptr),
        token_stride: r.token_stride as u64,
        head_stride: r.head_stride as u64,
        lse_token_stride: a.lse_strides.0 as u64,
        lse_head_stride: a.lse_strides.1 as u64,
        num_tokens: r.num_tokens as u32,
        num_heads: r.num_heads as u32,
        head_size: r.head_size as u32,
    };
    // In range: `merge_attn_states_sizes` bounds tokens x heads by u32::MAX.
    let warps = (r.num_tokens * r.num_heads) as u32;
    dev.launch(stream, KernelId::MergeAttnStates { out: dt }, (warps.div_ceil(8), 1, 1), 256, 0, p)
}

/// What [`merge_attn_states`] checks of its shape before looking at the buffers: rows that
/// [`RowsDesc::validate`] takes (arg `rows`), at most `u32::MAX` (token, head) rows and a head
/// size that fits a u32 (the kernel's parameters), and LSE strides whose last element fits a
/// usize (arg `lse_strides`). Returns the elements each output buffer and each LSE buffer must
/// hold (0 and 0 for rows with no tokens or no heads).
pub fn merge_attn_states_sizes(rows: &RowsDesc, lse_strides: (usize, usize)) -> Result<(usize, usize)> {
    rows.validate("rows")?;
    let (nt, nh) = (rows.num_tokens, rows.num_heads);
    // `validate` checked that tokens x heads fits a usize.
    ensure(nt * nh <= u32::MAX as usize && rows.head_size <= u32::MAX as usize, "rows", || {
        format!("{nt} tokens x {nh} heads of {} exceed the kernel's u32 sizes", rows.head_size)
    })?;
    if nt == 0 || nh == 0 {
        return Ok((rows.required_len(), 0));
    }
    let last = (nt - 1).checked_mul(lse_strides.0).and_then(|t| (nh - 1).checked_mul(lse_strides.1).and_then(|h| t.checked_add(h)));
    let lse_need = last.and_then(|l| l.checked_add(1));
    let lse_need = lse_need.ok_or_else(|| {
        crate::error::AttnError::invalid("lse_strides", format!("{lse_strides:?} over {nt} tokens x {nh} heads overflow a usize"))
    })?;
    Ok((rows.required_len(), lse_need))
}
