//! Varlen prefill attention on tensor cores (vLLM's `flash_attn_varlen_func` with a block
//! table): queries packed by `query_start_loc`, keys and values from the paged cache or from
//! packed tensors (`cu_seqlens_k`, for encoders and MLA prefill), causal aligned to the end of
//! each sequence (chunked prefill, prefix caching) or not.
//!
//! The host cuts each request's query rows (token x query head of a kv head) into tiles of
//! the kernel's `block_m` and orders the tiles by the keys they attend: requests by their
//! longest tile, and each request's tiles longest first, so that a batch of mixed lengths keeps
//! every SM busy to the end and the CTAs running at once share K/V in L2. One CTA per (tile,
//! kv head), the kv heads of a tile adjacent in the grid.

use crate::attn_params;
use crate::batch::{block_table_reach, BatchMetadata, DeviceBatch};
use crate::buffer::{optional_f32, DevIn, DevOut};
use crate::cache_write::KvScales;
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, Result};
use crate::kernels::{head_width, CacheRows, KernelId};
use crate::layout::{KvCacheSpec, RowsDesc};
use crate::options::AttnOptions;
use crate::status::DeviceStatus;
use crate::stream_check::{check_stream, refuse_foreign_capture};
use crate::tensor_map::{map_geometry, paged_kv_maps, PagedShape};
use attn_math::decode::width_in;
use attn_math::hopper_prefill;
use attn_math::paging::CacheStrides;
use attn_math::params::{
    AttnParams, BatchMeta, Fp8Scales, HeadDims, LocalMask, Mask, MlaParams, PagedKvMaps, PerHead, ScaleLayout, Schedule, Shape,
    SparseIndices, SplitK, VariantParams, WgsParams,
};
use attn_math::prefill::{block_m, shared_layout, HEAD_SIZES, MIN_BLOCK_M, THREADS};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

// The planner and the batch checks alone, for the tests in `tests/` (not part of the API).
#[doc(hidden)]
pub use crate::batch::{validate_prefill_batch, PrefillBatch};

/// Where keys and values come from.
pub enum PrefillKv<'a> {
    /// The paged cache (already written by `reshape_and_cache`).
    Paged {
        /// The paged cache (K and V planes, per `spec`; the query dtype, or FP8 with `scales`).
        cache: DevIn<'a>,
        /// The cache's layout and sizes.
        spec: KvCacheSpec,
        /// `[num_reqs, block_table_stride]` i32.
        block_table: DevIn<'a>,
        /// Entries per row of `block_table`.
        block_table_stride: usize,
    },
    /// Packed `[total_keys, num_kv_heads, head_size]` tensors; request r's keys are rows
    /// `key_start_loc[r]..key_start_loc[r + 1]` (the batch's
    /// [`key_start_loc`](crate::BatchMetadata::with_key_start_loc)).
    Packed {
        /// The keys, `[total_keys, num_kv_heads, head_size_qk]`, the query dtype.
        k: DevIn<'a>,
        /// Shape and strides of `k`.
        k_rows: RowsDesc,
        /// The values, `[total_keys, num_kv_heads, head_size_v]`, the query dtype.
        v: DevIn<'a>,
        /// Shape and strides of `v`.
        v_rows: RowsDesc,
    },
}

/// Device inputs and outputs of [`prefill`].
pub struct PrefillArgs<'a> {
    /// `[num_tokens, num_q_heads, head_size_qk]`.
    pub q: DevIn<'a>,
    /// Shape and strides of `q` (f16 or bf16; 16-byte aligned, 16-byte-multiple strides).
    pub q_rows: RowsDesc,
    /// Where the keys and values come from.
    pub kv: PrefillKv<'a>,
    /// `[num_tokens, num_q_heads, head_size_v]`, the dtype of q.
    pub out: DevOut<'a>,
    /// Shape and strides of `out`.
    pub out_rows: RowsDesc,
    /// `[num_tokens, num_q_heads]` f32 natural-log LSE (the sink included), if wanted.
    pub lse: Option<DevOut<'a>>,
    /// `[num_q_heads]` f32 ALiBi slopes: each logit gets `slope * (key - query position)`.
    pub alibi_slopes: Option<DevIn<'a>>,
    /// `[num_q_heads]` f32 attention-sink logits that join each head's softmax denominator.
    pub sinks: Option<DevIn<'a>>,
    /// Required for an FP8 paged cache, ignored otherwise.
    pub scales: Option<KvScales<'a>>,
}

/// Options of a prefill call.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PrefillOptions {
    /// Scale, sliding window and soft-cap.
    pub attn: AttnOptions,
    /// Causal, aligned to the end of the sequence: query i of a request with `q_len` L and
    /// `seq_len` S sees keys `0..=S - L + i`. `false`: every query sees every key (encoders).
    pub causal: bool,
}

/// The work of one launch, as [`prefill`] returns it (for logging; the call needs nothing from
/// it): one item per query-row tile, in launch order.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefillPlan {
    /// `[request, row_tile << 16 | split]` per tile (split is 0: prefill does not split keys).
    pub items: Vec<[u32; 2]>,
}

/// Cuts every request into tiles of `block_m` query rows (the kernel's, from
/// `attn_math::prefill::block_m`) and orders them by the keys they attend (an upper bound under
/// causality): requests longest first, and each request's tiles longest first.
#[doc(hidden)]
pub fn plan_prefill(batch: &PrefillBatch<'_>, group: usize, causal: bool, window: Option<u32>, block_m: u32) -> PrefillPlan {
    // Takes the batch as given without panicking: decreasing start locations count as empty
    // requests, a zero group or tile as 1. `prefill` refuses requests of more than 65536 tiles
    // (the item's 16-bit tile index) before planning.
    let (group, block_m) = (group.max(1), block_m.max(1));
    let qsl = batch.query_start_loc;
    let n = batch.seq_lens.len().min(qsl.len().saturating_sub(1));
    let mut tiles: Vec<(u64, [u32; 2])> = Vec::new();
    for r in 0..n {
        let q_len = (qsl[r + 1] as i64 - qsl[r] as i64).max(0) as u64;
        let seq_len = batch.seq_lens[r].max(0) as u64;
        let rows = q_len.saturating_mul(group as u64);
        for tile in 0..rows.div_ceil(block_m as u64).min(1 << 16) {
            let last_token = ((tile + 1) * block_m as u64).min(rows).div_ceil(group as u64);
            let first_token = tile * block_m as u64 / group as u64;
            let mut keys = if causal { (seq_len + last_token).saturating_sub(q_len) } else { seq_len };
            if let Some(w) = window {
                keys = keys.min(w as u64 + (last_token - first_token));
            }
            tiles.push((keys, [r as u32, (tile as u32) << 16]));
        }
    }
    // Requests in the order of their longest tile, each request's tiles longest first: the
    // longest tiles still start first, and the CTAs running at once take tiles of the same
    // request, which share its K/V in L2 (8 x 2048 at head size 64: L2 hit rate 11% -> 74%).
    let mut longest = std::collections::HashMap::new();
    for &(keys, [req, _]) in &tiles {
        let l = longest.entry(req).or_insert(0);
        *l = keys.max(*l);
    }
    // Stable: equal requests keep their order.
    tiles.sort_by_key(|&(keys, [req, _])| (std::cmp::Reverse(longest[&req]), req, std::cmp::Reverse(keys)));
    PrefillPlan { items: tiles.into_iter().map(|(_, i)| i).collect() }
}

/// Prefill tiles already on the device (a mixed CUDA-graph step's, [`crate::forward`]): cut for
/// `kernel` over the whole padded batch, `[request, row_tile << 16]` pairs with `NO_WORK` past
/// the step's, counted by the header `[num_tiles, 0]` the kernels read (`Schedule::plan`).
#[derive(Clone, Debug)]
pub(crate) struct DevicePrefillPlan {
    /// The kernel the tiles were cut for (its `block_m`).
    pub kernel: KernelId,
    pub items: u64,
    pub header: u64,
    /// Tiles the grid covers.
    pub capacity_tiles: usize,
}

/// Where a prefill call's tiles come from: planned here and uploaded (eager calls), or already
/// on the device (graph steps: nothing is copied, and the launch is the same whatever the plan).
#[derive(Clone, Copy)]
pub(crate) enum PrefillSource<'p> {
    Host,
    Device(&'p DevicePrefillPlan),
}

/// Device memory for the plan. Allocate once for the largest batch.
pub struct PrefillWorkspace {
    items: CudaSlice<u32>,
    /// The persistent kernel's two counters (next CTA, CTAs done), zero between launches: the
    /// kernel's last CTA zeroes them. A workspace serves one stream at a time.
    sched: CudaSlice<u32>,
    /// The stream every call that uses this workspace runs on (`crate::stream_check`).
    stream: Arc<CudaStream>,
}

impl PrefillWorkspace {
    /// Query-row tiles a batch of `max_tokens` tokens in `max_reqs` requests can need.
    /// (Saturating: sizes that overflow are ones [`new`](Self::new) refuses.)
    pub fn max_tiles(max_tokens: usize, max_reqs: usize, group: usize) -> usize {
        max_tokens.saturating_mul(group).div_ceil(MIN_BLOCK_M as usize).saturating_add(max_reqs)
    }

    /// A workspace for calls on `stream` (one workspace per stream) of up to `max_tokens` query
    /// tokens in `max_reqs` requests, `group` query heads per kv head.
    ///
    /// Errors: `InvalidArgument` (`max_tokens`) when that many tiles are past what a launch
    /// indexes; `Driver` when an allocation fails.
    pub fn new(stream: &Arc<CudaStream>, max_tokens: usize, max_reqs: usize, group: usize) -> Result<Self> {
        let tiles = Self::max_tiles(max_tokens, max_reqs, group);
        ensure(tiles <= (i32::MAX / 2) as usize, "max_tokens", || {
            format!("{max_tokens} tokens x {group} heads per kv head in {max_reqs} requests need {tiles} tiles, past what a launch indexes")
        })?;
        Ok(PrefillWorkspace {
            items: stream.alloc_zeros(2 * Self::max_tiles(max_tokens, max_reqs, group).max(1))?,
            sched: stream.alloc_zeros(2)?,
            stream: stream.clone(),
        })
    }
}

/// The kernel a prefill launch runs and its geometry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct PrefillKernel {
    pub id: KernelId,
    pub block_m: u32,
    pub threads: u32,
    pub smem: u32,
    /// Persistent CTAs (at most one an SM, taking the plan's CTAs in turn from a counter).
    pub persistent: bool,
}

/// The prefill kernel of the module `target` (`AttnDevice::ptx_target`) for head sizes `dk`,
/// `dv` over K/V of type `kv` (the queries', or an FP8 cache's): Hopper's warp-specialised
/// persistent `wgmma` kernel (`prefill_wgs_*`, in the sm_90a module) for QK = V, at widths 64,
/// 80, 96, 112, 128 and 256 (16-bit caches) or up to 128 (FP8), and for QK 192 / V 128 from
/// 16-bit K/V; the `mma.sync` kernel at [`prefill_widths`] for every other case.
#[cfg(test)]
pub(crate) fn prefill_kernel(target: &str, q: DType, kv: DType, dk: usize, dv: usize) -> PrefillKernel {
    prefill_kernel_for(target, q, kv, dk, dv, false).unwrap()
}

/// [`prefill_kernel`], or with `local` (chunked local attention or a symmetric window) the
/// `mma.sync` kernel built with the local masks (`prefill_local_*`: 16-bit K/V, QK = V; the
/// caller checks [`has_local_kernel`]).
pub(crate) fn prefill_kernel_for(target: &str, q: DType, kv: DType, dk: usize, dv: usize, local: bool) -> Result<PrefillKernel> {
    let fp8 = kv.is_fp8();
    let (wk, wv) = prefill_widths(dk, dv, fp8)?;
    if local {
        return Ok(PrefillKernel {
            id: KernelId::PrefillLocal { q, head_size: wk },
            block_m: block_m(wk, wv, false, false),
            threads: THREADS,
            smem: shared_layout(wk, wv, false, false).total,
            persistent: false,
        });
    }
    let hopper_widths: &[u32] = if fp8 { &hopper_prefill::FP8_HEAD_SIZES } else { &hopper_prefill::HEAD_SIZES };
    // FP8 caches have one head size (`prefill_widths`).
    let rows = CacheRows::of(kv, dk);
    let a8 = matches!(rows, CacheRows::Fp8 { a8: true, .. });
    let hopper = match target {
        "sm_90a" if dk == dv => width_in(dk as u32, hopper_widths).map(|w| (w, w)),
        "sm_90a" if !fp8 && hopper_prefill::QK_V_PAIRS.contains(&(wk, wv)) => Some((wk, wv)),
        _ => None,
    };
    // Rows 8-byte aligned at width 256 keep the `mma.sync` kernel (`hopper_prefill::ws_takes_a8`).
    let hopper = hopper.filter(|&(w, _)| !a8 || hopper_prefill::ws_takes_a8(w));
    Ok(match hopper {
        Some((w, w_v)) => PrefillKernel {
            id: KernelId::PrefillWgs { q, rows, head_size: w, head_size_v: w_v },
            block_m: hopper_prefill::BLOCK_M,
            threads: hopper_prefill::WS_THREADS,
            smem: hopper_prefill::ws_layout_qk_v(w, w_v, fp8).total,
            persistent: true,
        },
        None => PrefillKernel {
            id: KernelId::Prefill { q, rows, head_size_qk: wk, head_size_v: wv },
            block_m: block_m(wk, wv, false, fp8),
            threads: THREADS,
            smem: shared_layout(wk, wv, false, fp8).total,
            persistent: false,
        },
    })
}

/// Whether FP8-cache prefill on `device` at head sizes `dk`, `dv` runs its MMAs on FP8
/// operands: Hopper's `prefill_wgs_*_{fp8,e5m2}` kernels at widths 80 to 128 round the queries
/// (one scale a 64-row warpgroup of a work item, its largest magnitude to e4m3's 448) and the
/// softmax weights to e4m3, as vLLM's FP8 attention on FlashAttention-3 does, at twice the
/// 16-bit MMA rate (the cache's E4M3 or E5M2 keys and values as they are). Otherwise the cache's
/// values are converted exactly into the queries' type and the result is as precise as with a
/// 16-bit cache holding the same values. The same for both FP8 formats.
pub fn fp8_prefill_rounds_to_e4m3(device: &crate::AttnDevice, dk: usize, dv: usize) -> bool {
    matches!(
        prefill_kernel_for(device.ptx_target(), DType::BF16, DType::Fp8E4m3, dk, dv, false),
        Ok(PrefillKernel { id: KernelId::PrefillWgs { head_size, .. }, .. }) if head_size > 64
    )
}

/// Whether a kernel with the local masks exists for these K/V: 16-bit (not FP8), QK = V (at
/// every head size the kernels take).
pub(crate) fn has_local_kernel(fp8: bool, dk: usize, dv: usize) -> bool {
    !fp8 && dk == dv
}

/// The kernel widths head sizes (qk `dk`, v `dv`) run at: for QK = V, [`head_width`]'s (every
/// multiple of 8 from 32 to 256); unequal head sizes only as the
/// pairs built exactly (QK 192 / V 128, 16-bit K/V).
pub(crate) fn prefill_widths(dk: usize, dv: usize, fp8: bool) -> Result<(u32, u32)> {
    if dk == dv {
        let w = head_width("head_size", dk)?;
        return Ok((w, w));
    }
    let unequal: Vec<(u32, u32)> = HEAD_SIZES.into_iter().filter(|(k, v)| k != v).collect();
    ensure(!fp8 && unequal.contains(&(dk as u32, dv as u32)), "head_size", || {
        format!("(qk {dk}, v {dv}): unequal head sizes run as {unequal:?} with 16-bit K/V")
    })?;
    Ok((dk as u32, dv as u32))
}

/// Checks a 16-bit tensor's rows: dtype, shape, 16-byte alignment, buffer length.
fn check_rows(arg: &'static str, b: &DevIn<'_>, rows: &RowsDesc, dtype: DType) -> Result<()> {
    ensure(b.dtype == dtype, arg, || format!("dtype {:?}, expected {dtype:?}", b.dtype))?;
    rows.validate(arg)?;
    ensure(b.len >= rows.required_len(), arg, || format!("buffer of {} elements is too small for {rows:?}", b.len))?;
    ensure(b.ptr.is_multiple_of(16) && (rows.token_stride * 2).is_multiple_of(16) && (rows.head_stride * 2).is_multiple_of(16), arg, || {
        "must be 16-byte aligned with 16-byte-multiple strides".into()
    })
}

/// Prefill attention: validates everything, plans, uploads the plan, launches. Enqueued on
/// `stream`; block ids outside the cache are never read and raise `BLOCK_OUT_OF_RANGE` in
/// `status` (the keys read as zeros). Ordering on Hopper as [`paged_decode`](crate::decode::paged_decode)'s
/// (only metadata and queries are read before the wait for the kernel before; the cache rows after).
///
/// Request r's queries are rows `query_start_loc[r]..query_start_loc[r + 1]` of `q`, over its
/// `seq_lens[r]` keys (paged: through its block-table row; packed: rows of `k`/`v` from
/// `key_start_loc[r]`). Causal is aligned to the end of the sequence (chunked prefill, prefix
/// caching). Query head `h` reads kv head `h / (num_q_heads / num_kv_heads)`. Returns the tile
/// plan it ran (for logging). From an FP8 cache on Hopper at head sizes 72 to 128 the queries
/// and softmax weights are rounded to e4m3 ([`fp8_prefill_rounds_to_e4m3`]).
///
/// Errors, before anything is enqueued: `InvalidArgument` naming the argument for dtypes (f16
/// or bf16 queries; the paged cache q's dtype or FP8 with `scales`; packed K/V q's dtype), head
/// sizes without kernels, shapes, buffer lengths and 16-byte alignment, a batch that does not
/// fit the block table or the workspace, a missing `key_start_loc` for packed K/V, and a
/// workspace, batch or stream from another stream; `Driver` for a failed copy or launch.
///
/// Caller's part (docs/soundness.md): `batch`, `ws` (and a plan) must have been made on
/// `stream`; the contents of the caller's buffers and their ordering are the caller's, the
/// bounds of every access are the library's.
#[allow(clippy::too_many_arguments)]
pub fn prefill(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: PrefillArgs<'_>,
    batch: &BatchMetadata,
    opts: &PrefillOptions,
    ws: &mut PrefillWorkspace,
    status: &mut DeviceStatus,
) -> Result<PrefillPlan> {
    refuse_foreign_capture(stream, "stream", "prefill")?;
    let meta = batch.device(stream)?;
    prefill_from(dev, stream, a, &batch.prefill_batch(), meta, opts, PrefillSource::Host, ws, status)
}

/// [`prefill`] with the device copy `meta` of `batch`, uploaded by the library from it (a
/// [`BatchMetadata`], or `forward`'s step buffer), and its tiles from `source`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn prefill_from(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: PrefillArgs<'_>,
    batch: &PrefillBatch<'_>,
    meta: DeviceBatch<'_>,
    opts: &PrefillOptions,
    source: PrefillSource<'_>,
    ws: &mut PrefillWorkspace,
    status: &mut DeviceStatus,
) -> Result<PrefillPlan> {
    check_stream("workspace", &ws.stream, stream)?;
    let (nt, hq, dk) = (a.q_rows.num_tokens, a.q_rows.num_heads, a.q_rows.head_size);
    let dv = a.out_rows.head_size;
    let q_dtype = a.q.dtype;
    ensure(matches!(q_dtype, DType::F16 | DType::BF16), "q", || format!("dtype {q_dtype:?}: prefill takes f16 or bf16"))?;
    check_rows("q", &a.q, &a.q_rows, q_dtype)?;
    ensure(a.out.dtype == q_dtype, "out", || format!("dtype {:?} differs from q's {q_dtype:?}", a.out.dtype))?;
    a.out_rows.validate("out")?;
    ensure(a.out_rows.num_tokens == nt && a.out_rows.num_heads == hq, "out", || format!("shape {:?} differs from q's", a.out_rows))?;
    ensure(a.out.len >= a.out_rows.required_len(), "out", || format!("buffer of {} elements is too small", a.out.len))?;
    ensure(
        a.out.ptr.is_multiple_of(4) && a.out_rows.token_stride.is_multiple_of(2) && a.out_rows.head_stride.is_multiple_of(2),
        "out",
        || "must be 4-byte aligned with even strides".into(),
    )?;
    if !opts.causal {
        ensure(opts.attn.window.is_none(), "window", || "a sliding window needs causal attention".into())?;
    }
    opts.attn.validate_masks("opts", opts.causal)?;
    let num_reqs = batch.seq_lens.len();
    // The K/V's type: the queries', or an FP8 cache's (checked below).
    let kv_dtype = match &a.kv {
        PrefillKv::Paged { cache, .. } => cache.dtype,
        PrefillKv::Packed { .. } => q_dtype,
    };
    let fp8 = kv_dtype.is_fp8();
    prefill_widths(dk, dv, fp8)?;
    let (k_scale, v_scale, scale_head_stride) = match (&a.scales, &a.kv) {
        (Some(s), PrefillKv::Paged { spec, .. }) if fp8 => s.layout(spec.num_kv_heads)?,
        _ => (0, 0, 0),
    };

    let (k, v, num_kv_heads, kv_batch, num_blocks, block_size) = match &a.kv {
        PrefillKv::Paged { cache, spec, block_table, block_table_stride } => {
            spec.validate("spec")?;
            ensure(cache.dtype == q_dtype || cache.dtype.is_fp8(), "cache", || {
                format!("dtype {:?} with {q_dtype:?} queries (takes the queries' dtype, fp8 e4m3 or e5m2)", cache.dtype)
            })?;
            ensure(!cache.dtype.is_fp8() || a.scales.is_some(), "scales", || "an fp8 cache needs k/v scales".into())?;
            ensure(dk == dv && spec.head_size == dk, "head_size", || {
                format!("the paged cache holds head size {}, the call has qk {dk} / v {dv}", spec.head_size)
            })?;
            ensure(cache.len >= spec.num_elements(), "cache", || format!("buffer of {} elements is smaller than the layout's", cache.len))?;
            ensure(cache.ptr.is_multiple_of(16), "cache", || "must be 16-byte aligned".into())?;
            ensure(batch.key_start_loc.is_none(), "key_start_loc", || "given with a paged cache".into())?;
            validate_prefill_batch(batch, nt, opts.causal, Some((spec.block_size, *block_table_stride)))?;
            let need = block_table_reach(batch.seq_lens, spec.block_size, *block_table_stride);
            ensure(block_table.dtype == DType::I32 && block_table.len >= need, "block_table", || {
                format!("must hold {need} i32 ({num_reqs} rows of {block_table_stride}), got {} x {:?}", block_table.len, block_table.dtype)
            })?;
            let [k, v] = attn_params::paged_kv(cache, spec);
            let kv_batch = attn_params::paged_batch(block_table, *block_table_stride, &meta);
            (k, v, spec.num_kv_heads, kv_batch, spec.num_blocks as u32, spec.block_size as u32)
        }
        PrefillKv::Packed { k, k_rows, v, v_rows } => {
            ensure(a.scales.is_none(), "scales", || "packed K/V take the queries' dtype; scales are for an fp8 cache".into())?;
            check_rows("k", k, k_rows, q_dtype)?;
            check_rows("v", v, v_rows, q_dtype)?;
            ensure(k_rows.head_size == dk && v_rows.head_size == dv, "head_size", || {
                format!("k/v rows have {} / {}, q {dk} and out {dv}", k_rows.head_size, v_rows.head_size)
            })?;
            ensure(k_rows.num_heads == v_rows.num_heads && k_rows.num_tokens == v_rows.num_tokens, "v", || {
                format!("shape {v_rows:?} differs from k's {k_rows:?}")
            })?;
            let ksl = batch.key_start_loc.ok_or_else(|| crate::error::AttnError::invalid("key_start_loc", "needed with packed K/V"))?;
            validate_prefill_batch(batch, nt, opts.causal, None)?;
            ensure(ksl[num_reqs] as usize <= k_rows.num_tokens, "key_start_loc", || {
                format!("ends at {}, but k has {} rows", ksl[num_reqs], k_rows.num_tokens)
            })?;
            let ksl_ptr = meta.key_start_loc.as_ref().map(|k| k.ptr).ok_or_else(|| {
                crate::error::AttnError::invalid("key_start_loc", "the batch's device copy has none (BatchMetadata::with_key_start_loc)")
            })?;
            let strides = |r: &RowsDesc| CacheStrides { block: 0, token: r.token_stride as u64, head: r.head_stride as u64 };
            let kv_batch = BatchMeta { key_start_loc: ksl_ptr, query_start_loc: meta.query_start_loc.ptr, ..BatchMeta::default() };
            ((k.ptr, strides(k_rows)), (v.ptr, strides(v_rows)), k_rows.num_heads, kv_batch, 0, 1)
        }
    };
    ensure(num_kv_heads > 0 && hq.is_multiple_of(num_kv_heads), "num_q_heads", || {
        format!("{hq} is not a multiple of num_kv_heads {num_kv_heads}")
    })?;
    meta.check(num_reqs)?;
    if let Some(l) = &a.lse {
        ensure(l.dtype == DType::F32 && l.len >= nt * hq, "lse", || format!("must be {nt} x {hq} f32"))?;
    }
    let alibi = optional_f32(&a.alibi_slopes, "alibi_slopes", hq)?;
    let sinks = optional_f32(&a.sinks, "sinks", hq)?;
    if num_reqs == 0 || nt == 0 {
        return Ok(PrefillPlan::default());
    }
    let group = hq / num_kv_heads;
    let max_rows = (0..num_reqs).map(|r| (batch.query_start_loc[r + 1] - batch.query_start_loc[r]) as usize * group).max().unwrap_or(0);
    let local = opts.attn.chunk_size.is_some() || opts.attn.symmetric_window.is_some();
    ensure(!local || has_local_kernel(fp8, dk, dv), "opts", || {
        format!(
            "chunk_size {:?} / symmetric_window {:?}: the local-mask kernels take 16-bit K/V with equal head sizes (fp8 {fp8}, qk {dk}, v {dv})",
            opts.attn.chunk_size, opts.attn.symmetric_window
        )
    })?;
    let kernel = prefill_kernel_for(dev.ptx_target(), q_dtype, kv_dtype, dk, dv, local)?;
    let bm = kernel.block_m;
    ensure(max_rows <= bm as usize * 65536, "query_start_loc", || {
        format!("a request has {max_rows} query rows (tokens x {group} heads per kv head); a launch takes {}", bm as usize * 65536)
    })?;
    let (plan, tiles, items_ptr, header) = match source {
        PrefillSource::Host => {
            let plan = plan_prefill(batch, group, opts.causal, opts.attn.window, bm);
            ensure(2 * plan.items.len() <= ws.items.len(), "workspace", || {
                format!("the plan has {} tiles, the workspace holds {}", plan.items.len(), ws.items.len() / 2)
            })?;
            if plan.items.is_empty() {
                return Ok(plan);
            }
            let flat: Vec<u32> = plan.items.iter().flatten().copied().collect();
            stream.memcpy_htod(&flat, &mut ws.items.slice_mut(..flat.len()))?;
            let tiles = plan.items.len();
            (plan, tiles, ws.items.device_ptr(stream).0, 0)
        }
        PrefillSource::Device(dp) => {
            ensure(dp.kernel == kernel.id, "plan", || format!("was made for kernel {}, the call runs {}", dp.kernel, kernel.id))?;
            (PrefillPlan::default(), dp.capacity_tiles, dp.items, dp.header)
        }
    };
    ensure((tiles * num_kv_heads) < i32::MAX as usize, "q", || "too many tiles x kv heads for one launch".into())?;
    let (status_ptr, _o2) = status.word.device_ptr_mut(stream);
    let ctas = (tiles * num_kv_heads) as u32;
    let (sched_ptr, _o3) = ws.sched.device_ptr_mut(stream);
    let p = AttnParams {
        qkv: attn_params::qkv(&a.q, &a.q_rows, k, v),
        batch: kv_batch,
        output: attn_params::output(&a.out, &a.out_rows, a.lse.as_ref()),
        split: SplitK { work_items: items_ptr, ..SplitK::default() },
        per_head: PerHead { alibi_slopes: alibi, sinks },
        fp8: Fp8Scales { k_scale, v_scale },
        status: status_ptr,
        variant: VariantParams::new(opts.attn.softmax_scale, opts.attn.softcap, opts.attn.window),
        shape: Shape { num_blocks, block_size, chunk: 0, num_q_heads: hq as u32, group: group as u32 },
        mask: Mask { causal: opts.causal as u32 },
        mla: MlaParams::default(),
        local: LocalMask::new(opts.attn.chunk_size, opts.attn.symmetric_window),
        sparse: SparseIndices::default(),
        scale_layout: ScaleLayout { head_stride: scale_head_stride, reserved: 0 },
        dims: HeadDims { qk: dk as u32, v: dv as u32 },
        // A device plan's header counts its tiles (the persistent kernel's CTAs) and gives
        // chunk 0 (prefill does not split keys).
        schedule: Schedule {
            plan: header,
            sched: if kernel.persistent { sched_ptr } else { 0 },
            ctas: if kernel.persistent && header == 0 { ctas } else { 0 },
            ..Schedule::default()
        },
    };
    let grid = if kernel.persistent { ctas.min(dev.sm_count()) } else { ctas };
    if let KernelId::PrefillWgs { rows, head_size, .. } = kernel.id {
        // At the widths whose producer copies stages with TMA, the cache's tensor maps where its
        // layout allows (`tensor_map::map_geometry`); without them the producer copies rows.
        let kv_maps = match &a.kv {
            PrefillKv::Paged { .. } if hopper_prefill::ws_tma_stages(head_size, rows.is_fp8()) => {
                let shape = PagedShape {
                    strides: k.1,
                    num_blocks: num_blocks as u64,
                    block_size: block_size as u64,
                    num_heads: num_kv_heads as u64,
                    head_size: dk as u64,
                };
                let stage_keys = hopper_prefill::ws_stage_keys(head_size, false);
                map_geometry(&shape, head_size as u64, stage_keys as u64).map(|g| paged_kv_maps(k.0, v.0, &g)).unwrap_or_default()
            }
            _ => PagedKvMaps::default(),
        };
        dev.launch_pdl(stream, kernel.id, (grid, 1, 1), kernel.threads, kernel.smem, WgsParams { attn: p, kv_maps })?;
    } else {
        dev.launch_pdl(stream, kernel.id, (grid, 1, 1), kernel.threads, kernel.smem, p)?;
    }
    Ok(plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel each module runs: the persistent `wgmma` kernel on sm_90a for QK = V (at its
    /// widths, fewer from FP8) and QK 192 / V 128 (16-bit), the `mma.sync` kernel at its width for
    /// everything else.
    #[test]
    fn prefill_kernel_choice() {
        let kv = |q, fp8| if fp8 { DType::Fp8E4m3 } else { q };
        let name = |target, q, fp8, dk, dv| prefill_kernel(target, q, kv(q, fp8), dk, dv).id.entry_name();
        let (bf16, f16) = (DType::BF16, DType::F16);
        assert_eq!(name("sm_90a", bf16, false, 64, 64), "prefill_wgs_bf16_d64");
        assert_eq!(name("sm_90a", f16, false, 128, 128), "prefill_wgs_f16_d128");
        assert_eq!(name("sm_90a", bf16, true, 128, 128), "prefill_wgs_bf16_fp8_d128");
        assert_eq!(name("sm_90a", f16, true, 48, 48), "prefill_wgs_f16_fp8_d64");
        assert_eq!(name("sm_80", bf16, true, 128, 128), "prefill_bf16_fp8_dk128_dv128");
        assert_eq!(name("sm_90a", bf16, false, 96, 96), "prefill_wgs_bf16_d96");
        assert_eq!(name("sm_90a", bf16, false, 72, 72), "prefill_wgs_bf16_d80");
        assert_eq!(name("sm_90a", bf16, false, 104, 104), "prefill_wgs_bf16_d112");
        assert_eq!(name("sm_90a", bf16, false, 120, 120), "prefill_wgs_bf16_d128");
        assert_eq!(name("sm_90a", bf16, false, 40, 40), "prefill_wgs_bf16_d64");
        assert_eq!(name("sm_90a", bf16, false, 136, 136), "prefill_wgs_bf16_d256");
        assert_eq!(name("sm_90a", f16, false, 256, 256), "prefill_wgs_f16_d256");
        assert_eq!(name("sm_80", bf16, false, 256, 256), "prefill_bf16_dk256_dv256");
        assert_eq!(name("sm_90a", bf16, true, 256, 256), "prefill_wgs_bf16_fp8_d256");
        assert_eq!(name("sm_90a", f16, true, 160, 160), "prefill_wgs_f16_fp8_d256");
        assert_eq!(name("sm_90a", bf16, true, 80, 80), "prefill_wgs_bf16_fp8_d80");
        assert_eq!(name("sm_80", bf16, true, 80, 80), "prefill_bf16_fp8_dk96_dv96");
        assert_eq!(name("sm_80", f16, false, 80, 80), "prefill_f16_dk96_dv96");
        assert!(prefill_kernel_for("sm_80", bf16, bf16, 84, 84, false).is_err());
        // FP8 rows of an odd multiple of 8: the `_fp8_a8` twins.
        assert_eq!(name("sm_80", bf16, true, 72, 72), "prefill_bf16_fp8_a8_dk96_dv96");
        assert_eq!(name("sm_90a", f16, true, 72, 72), "prefill_wgs_f16_fp8_a8_d80");
        assert_eq!(name("sm_90a", bf16, true, 40, 40), "prefill_wgs_bf16_fp8_a8_d64");
        assert_eq!(name("sm_90a", bf16, true, 200, 200), "prefill_bf16_fp8_a8_dk256_dv256");
        assert_eq!(name("sm_90a", bf16, true, 208, 208), "prefill_wgs_bf16_fp8_d256");
        assert_eq!(name("sm_90a", bf16, true, 48, 48), "prefill_wgs_bf16_fp8_d64");
        // E5M2 caches: the `_e5m2` kernels of the same shapes.
        let e5m2 = |target, dk| prefill_kernel(target, bf16, DType::Fp8E5m2, dk, dk).id.entry_name();
        assert_eq!(e5m2("sm_90a", 128), "prefill_wgs_bf16_e5m2_d128");
        assert_eq!(e5m2("sm_90a", 72), "prefill_wgs_bf16_e5m2_a8_d80");
        assert_eq!(e5m2("sm_80", 256), "prefill_bf16_e5m2_dk256_dv256");
        assert_eq!(name("sm_90a", bf16, false, 192, 128), "prefill_wgs_bf16_dk192_dv128");
        assert_eq!(name("sm_90a", f16, false, 192, 128), "prefill_wgs_f16_dk192_dv128");
        assert_eq!(name("sm_80", bf16, false, 192, 128), "prefill_bf16_dk192_dv128");
        assert_eq!(name("sm_80", bf16, false, 64, 64), "prefill_bf16_dk64_dv64");
        assert_eq!(name("sm_80", f16, true, 256, 256), "prefill_f16_fp8_dk256_dv256");
        let local = |target| prefill_kernel_for(target, bf16, bf16, 128, 128, true).unwrap().id.entry_name();
        assert_eq!((local("sm_80"), local("sm_90a")), ("prefill_local_bf16_dk128_dv128".into(), "prefill_local_bf16_dk128_dv128".into()));
        assert!(has_local_kernel(false, 256, 256) && !has_local_kernel(true, 128, 128) && !has_local_kernel(false, 192, 128));
        let wgs = prefill_kernel("sm_90a", bf16, bf16, 64, 64);
        assert!(wgs.persistent && wgs.block_m == hopper_prefill::BLOCK_M && wgs.threads == hopper_prefill::WS_THREADS);
        let d128 = prefill_kernel("sm_90a", bf16, bf16, 128, 128);
        assert!(d128.persistent && d128.smem == hopper_prefill::ws_layout(128, false).total);
        let d256 = prefill_kernel("sm_90a", bf16, bf16, 256, 256);
        assert!(d256.persistent && d256.smem == hopper_prefill::ws_layout(256, false).total);
        let qk_v = prefill_kernel("sm_90a", bf16, bf16, 192, 128);
        assert!(qk_v.persistent && qk_v.smem == hopper_prefill::ws_layout_qk_v(192, 128, false).total);
        let fp8 = prefill_kernel("sm_90a", bf16, DType::Fp8E4m3, 128, 128);
        assert!(fp8.persistent && fp8.smem == hopper_prefill::ws_layout(128, true).total);
        let mma = prefill_kernel("sm_80", bf16, bf16, 128, 128);
        assert_eq!((mma.block_m, mma.threads, mma.persistent), (block_m(128, 128, false, false), THREADS, false));
        assert_eq!(mma.smem, shared_layout(128, 128, false, false).total);
    }
}
