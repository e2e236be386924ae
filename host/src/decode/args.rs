//! What a paged decode call takes ([`DecodeArgs`]: its buffers), and the checks of a call.

use super::workspace::DecodeWorkspace;
use crate::batch::{block_table_reach, validate_batch, validate_prefill_batch, DecodeBatch, DeviceBatch, PrefillBatch, MAX_QUERY_LEN};
use crate::buffer::{optional_f32, DevIn, DevOut};
use crate::cache_write::KvScales;
use crate::dtype::DType;
use crate::error::{ensure, Result};
use crate::kernels::head_width;
use crate::layout::{KvCacheSpec, RowsDesc};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Device inputs and outputs of [`paged_decode`](super::paged_decode).
pub struct DecodeArgs<'a> {
    /// `[num_tokens, num_q_heads, head_size]`.
    pub q: DevIn<'a>,
    /// Shape and strides of `q`: `num_tokens` is the batch's, the head size the cache's
    /// (64, 96, 128 or 256), `num_heads` a multiple of the cache's kv heads; 16-byte aligned.
    pub q_rows: RowsDesc,
    /// The paged cache (K and V planes, per `spec`).
    pub cache: DevIn<'a>,
    /// The cache's layout and sizes (block size a multiple of 16).
    pub spec: KvCacheSpec,
    /// `[num_reqs, block_table_stride]` i32.
    pub block_table: DevIn<'a>,
    /// Entries per row of `block_table` (at least each request's `ceil(seq_len / block_size)`).
    pub block_table_stride: usize,
    /// `[num_tokens, num_q_heads, head_size]`, the dtype of `q`.
    pub out: DevOut<'a>,
    /// Shape and strides of `out` (the shape of `q`; strides may differ).
    pub out_rows: RowsDesc,
    /// `[num_tokens, num_q_heads]` f32 natural-log LSE (the sink included), if wanted.
    pub lse: Option<DevOut<'a>>,
    /// `[num_q_heads]` f32.
    pub alibi_slopes: Option<DevIn<'a>>,
    /// `[num_q_heads]` f32 logits (natural units) that join each head's softmax denominator.
    pub sinks: Option<DevIn<'a>>,
    /// Required for an FP8 cache.
    pub scales: Option<KvScales<'a>>,
}

/// The optional buffers' addresses of a checked call (0: none).
pub(super) struct CheckedArgs {
    pub alibi: u64,
    pub sinks: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    /// 0: one scale per tensor; 1: one per kv head.
    pub scale_head_stride: u32,
}

/// Checks everything of a call before planning: the spec, dtypes and head size, every buffer's
/// shape, length and alignment, the batch (decode's query lengths when `causal`, any
/// otherwise) against the block table, the device copy of the batch, and the workspace's
/// stream, head size and room for the batch.
///
/// `device_plan`: the plan is already on the device, made for the decodes of the batch, whose
/// longest has this many query tokens (the plan's `query_len`, checked against decode's limit
/// here). A mixed graph step's batch also has prefills, of any query length, which the plan
/// leaves alone; and the plan's arrays are in the step's buffer, not the workspace.
pub(super) fn check_args(
    a: &DecodeArgs<'_>,
    batch: &DecodeBatch<'_>,
    meta: &DeviceBatch<'_>,
    causal: bool,
    device_plan: Option<u32>,
    ws: &DecodeWorkspace,
    stream: &Arc<CudaStream>,
) -> Result<CheckedArgs> {
    let spec = &a.spec;
    // Its fields are public: a spec built without `KvCacheSpec::new` is checked here.
    spec.validate("spec")?;
    let (nt, hq, d) = (a.q_rows.num_tokens, a.q_rows.num_heads, a.q_rows.head_size);
    let q_dtype = a.q.dtype;
    let cache_dtype = a.cache.dtype;
    ensure(matches!(q_dtype, DType::F16 | DType::BF16), "q", || format!("dtype {q_dtype:?}: decode takes f16 or bf16 queries"))?;
    ensure(cache_dtype == q_dtype || cache_dtype.is_fp8(), "cache", || format!("dtype {cache_dtype:?} with {q_dtype:?} queries"))?;
    ensure(!cache_dtype.is_fp8() || a.scales.is_some(), "scales", || "an fp8 cache needs k/v scales".into())?;
    head_width("head_size", d)?;
    ensure(d == spec.head_size, "q", || format!("head_size {d} differs from the cache's {}", spec.head_size))?;
    ensure(hq % spec.num_kv_heads == 0, "num_q_heads", || format!("{hq} is not a multiple of num_kv_heads {}", spec.num_kv_heads))?;
    ensure(spec.block_size.is_multiple_of(16), "block_size", || format!("{} is not a multiple of 16", spec.block_size))?;
    a.q_rows.validate("q")?;
    a.out_rows.validate("out")?;
    ensure(a.q.len >= a.q_rows.required_len(), "q", || format!("buffer of {} elements is too small for {:?}", a.q.len, a.q_rows))?;
    ensure(a.out.dtype == q_dtype, "out", || format!("dtype {:?} differs from q's {q_dtype:?}", a.out.dtype))?;
    ensure(a.out_rows.num_tokens == nt && a.out_rows.num_heads == hq && a.out_rows.head_size == d, "out", || {
        format!("shape {:?} differs from q's", a.out_rows)
    })?;
    ensure(a.out.len >= a.out_rows.required_len(), "out", || {
        format!("buffer of {} elements is too small for {:?}", a.out.len, a.out_rows)
    })?;
    for (arg, ptr, strides) in [
        ("q", a.q.ptr, [a.q_rows.token_stride, a.q_rows.head_stride]),
        ("out", a.out.ptr, [a.out_rows.token_stride, a.out_rows.head_stride]),
    ] {
        ensure(ptr.is_multiple_of(16) && strides.iter().all(|s| (s * 2).is_multiple_of(16)), arg, || {
            "must be 16-byte aligned with 16-byte-multiple strides".into()
        })?;
    }
    ensure(a.cache.len >= spec.num_elements(), "cache", || {
        format!("buffer of {} elements is smaller than the layout's {}", a.cache.len, spec.num_elements())
    })?;
    // The kernels copy cache rows 16 bytes at a time (`cp.async`): a misaligned one faults,
    // which loses the CUDA context.
    ensure(a.cache.ptr.is_multiple_of(16), "cache", || format!("address {:#x} is not 16-byte aligned", a.cache.ptr))?;
    ws.check_stream(stream)?;
    let num_reqs = batch.seq_lens.len();
    if let Some(q) = device_plan.filter(|_| causal) {
        ensure(q as usize <= MAX_QUERY_LEN, "plan", || {
            format!("was made for {q} query tokens a request; decode takes 1..={MAX_QUERY_LEN}")
        })?;
    }
    if causal && device_plan.is_none() {
        validate_batch(batch, nt, spec.block_size, a.block_table_stride)?;
    } else {
        let pb = PrefillBatch { query_start_loc: batch.query_start_loc, seq_lens: batch.seq_lens, key_start_loc: None };
        validate_prefill_batch(&pb, nt, causal, Some((spec.block_size, a.block_table_stride)))?;
        ensure(num_reqs < 1 << 16, "seq_lens", || format!("{num_reqs} requests exceed the 65535 a launch takes"))?;
    }
    let need = block_table_reach(batch.seq_lens, spec.block_size, a.block_table_stride);
    ensure(a.block_table.dtype == DType::I32 && a.block_table.len >= need, "block_table", || {
        format!("must hold {need} i32 ({num_reqs} rows of {}), got {} x {:?}", a.block_table_stride, a.block_table.len, a.block_table.dtype)
    })?;
    meta.check(num_reqs)?;
    if let Some(l) = &a.lse {
        ensure(l.dtype == DType::F32 && l.len >= nt * hq, "lse", || format!("must be {nt} x {hq} f32"))?;
    }
    let alibi = optional_f32(&a.alibi_slopes, "alibi_slopes", hq)?;
    let sinks = optional_f32(&a.sinks, "sinks", hq)?;
    let (k_scale, v_scale, scale_head_stride) = match &a.scales {
        Some(s) if cache_dtype.is_fp8() => s.layout(a.spec.num_kv_heads)?,
        _ => (0, 0, 0),
    };
    ensure(ws.head_size() == d, "workspace", || format!("made for head_size {}, not {d}", ws.head_size()))?;
    if device_plan.is_none() {
        ws.check_batch(num_reqs, nt)?;
    }
    Ok(CheckedArgs { alibi, sinks, k_scale, v_scale, scale_head_stride })
}
