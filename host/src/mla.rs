//! MLA attention over the latent cache (DeepSeek-V2/V3): with the K up-projection absorbed into
//! the query, attention is multi-query over one 576-wide head (512 compressed KV + 64 rope)
//! whose value is the first 512 columns of the same row.
//!
//! Runs on the MLA kernel (`mla_<q>[_fp8]_{narrow,wide}`, geometry in `attn_math::mla`): a CTA
//! of 8 warps copies each cached row once into shared memory (FP8 rows raw), computes
//! Q K^T once per tile, and shares the weights P through shared memory with warps that each own a
//! slice of the 512 output columns. Up to 16 query rows per request (heads x query tokens) take
//! the narrow shape (16 rows, memory-bound), more take 64-row tiles (wide, compute-bound).
//! Split-K, its plan and the merge are the decode path's (`DecodeWorkspace`, allocated with head
//! size 512). Query lengths are free: multi-token prediction (causal among the new tokens) and
//! chunked prefill in latent form.

use crate::attn_params;
use crate::batch::{block_table_reach, validate_prefill_batch, BatchMetadata, DecodeBatch, DeviceBatch, PrefillBatch};
use crate::buffer::{f32_values, DevIn, DevOut};
use crate::cache_write::KvScales;
use crate::decode::{
    launch_merge, plan_launch, DecodeKernel, DecodePlan, DecodeWorkspace, LayerShape, PlanArrays, PlanSource, TcKernel, TcShape,
};
use crate::device::AttnDevice;
use crate::dtype::{DType, Fp8Format};
use crate::error::{ensure, Result};
use crate::kernels::{KernelId, MlaTile};
use crate::layout::{MlaCacheSpec, RowsDesc};
use crate::options::{PlanOptions, Tuning};
use crate::status::DeviceStatus;
use crate::stream_check::refuse_foreign_capture;
use attn_math::mla;
use attn_math::params::{
    AttnParams, Fp8Scales, HeadDims, LocalMask, Mask, MlaParams, PerHead, ScaleLayout, Schedule, Shape, SparseIndices, SplitK,
    VariantParams,
};
use attn_math::prefill::{MLA_QK, MLA_V};
use cudarc::driver::{CudaStream, DevicePtrMut};
use std::sync::Arc;

/// Device inputs and outputs of [`mla_attention`].
pub struct MlaArgs<'a> {
    /// `[num_tokens, num_heads, 576]`: the absorbed queries (latent part, then rope).
    pub q: DevIn<'a>,
    /// Shape and strides of `q` (head size 576; 16-byte aligned, 16-byte-multiple strides).
    pub q_rows: RowsDesc,
    /// `[num_blocks, block_size, 576]` (`concat_and_cache_mla`'s cache).
    pub cache: DevIn<'a>,
    /// The latent cache's sizes (512 + 64).
    pub spec: MlaCacheSpec,
    /// `[num_reqs, block_table_stride]` i32.
    pub block_table: DevIn<'a>,
    /// Entries per row of `block_table` (at least each request's `ceil(seq_len / block_size)`).
    pub block_table_stride: usize,
    /// `[num_tokens, num_heads, 512]`, the dtype of q.
    pub out: DevOut<'a>,
    /// Shape and strides of `out` (head size 512).
    pub out_rows: RowsDesc,
    /// `[num_tokens, num_heads]` f32 natural-log LSE, if wanted.
    pub lse: Option<DevOut<'a>>,
    /// Required for an FP8 cache (the same scale for K and V: pass it as both).
    pub scales: Option<KvScales<'a>>,
}

fn check_rows(arg: &'static str, ptr: u64, rows: &RowsDesc, len: usize, width: usize) -> Result<()> {
    rows.validate(arg)?;
    ensure(rows.head_size == width, arg, || format!("head size {} (MLA takes {width})", rows.head_size))?;
    ensure(len >= rows.required_len(), arg, || format!("buffer of {len} elements is too small for {rows:?}"))?;
    ensure(ptr.is_multiple_of(16) && (rows.token_stride * 2).is_multiple_of(16) && (rows.head_stride * 2).is_multiple_of(16), arg, || {
        "must be 16-byte aligned with 16-byte-multiple strides".into()
    })
}

/// MLA attention: validates everything, plans the splits, uploads the plan, launches the
/// attention kernel and (for requests with several splits) the merge. Enqueued on `stream`;
/// block ids outside the cache are never read and raise `BLOCK_OUT_OF_RANGE` in `status`.
/// Ordering on Hopper as [`paged_decode`](crate::decode::paged_decode)'s: the context's latent
/// rows (positions below `seq_len - q_len`) are read before waiting for the kernel ahead.
///
/// Every query head attends the one latent head: scores are `q . row` over all 576 columns,
/// the output is the weighted sum of the rows' first 512 columns; any number of query tokens
/// per request, causal among them (multi-token prediction, latent prefill). `ws` must have been
/// made for head size 512. Returns the split plan it ran (for logging).
///
/// Errors, before anything is enqueued: `InvalidArgument` naming the argument for dtypes
/// (queries f16 or bf16, the cache q's dtype or FP8 with `scales`), a spec other than 512 + 64,
/// shapes, buffer lengths and 16-byte alignment, a batch that does not fit the block table or
/// the workspace, and a workspace, batch or stream from another stream; `Driver` for a failed
/// copy or launch.
///
/// Caller's part (docs/soundness.md): `batch`, `ws` (and a plan) must have been made on
/// `stream`; the contents of the caller's buffers and their ordering are the caller's, the
/// bounds of every access are the library's.
#[allow(clippy::too_many_arguments)]
pub fn mla_attention(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: MlaArgs<'_>,
    batch: &BatchMetadata,
    softmax_scale: f32,
    plan: impl Into<PlanOptions>,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<DecodePlan> {
    refuse_foreign_capture(stream, "stream", "mla_attention")?;
    let meta = batch.device(stream)?;
    mla_attention_from(dev, stream, a, &batch.decode_batch(), meta, softmax_scale, PlanSource::Host(plan.into()), ws, status)
}

/// The MLA kernel for `max_q` query tokens per request of `hq` heads, and its CTA target.
///
/// The MLA kernel (`mla_<q>[_fp8|_e5m2]_{narrow,wide}`, `attn_math::mla`; over FP8 caches both
/// shapes run e4m3 `wgmma` on sm_90a ([`fp8_mla_rounds_to_e4m3`]); on sm_80 FP8 rows are
/// converted exactly, in registers on the narrow shape and slot by slot in shared memory on the
/// wide one).
/// The split plan aims at [`Tuning::mla_waves`] waves of CTAs.
pub(crate) fn mla_tc_kernel(
    dev: &AttnDevice,
    q_dtype: DType,
    fp8: Option<Fp8Format>,
    hq: usize,
    max_q: u32,
    tuning: &Tuning,
) -> Result<TcKernel> {
    let (id, s) = mla_kernel_id(q_dtype, fp8, max_q * hq as u32);
    mla_tc_kernel_of(dev, id, s, fp8.is_some(), hq, tuning)
}

/// [`mla_tc_kernel`] for kernel `id` of shape `s` (dense or sparse).
fn mla_tc_kernel_of(dev: &AttnDevice, id: KernelId, s: mla::MlaShape, fp8: bool, hq: usize, tuning: &Tuning) -> Result<TcKernel> {
    let shape = TcShape { block_m: s.block_m, block_n: s.block_n, ctas_per_item: 1 };
    // Over an FP8 cache on sm_90a both shapes have layouts of their own (e4m3 `wgmma`).
    let smem = match (on_e4m3(dev, fp8), s == mla::NARROW) {
        (true, true) => mla::narrow_e4m3_layout().total,
        (true, false) => mla::wide_e4m3_layout().total,
        (false, _) => mla::shared_layout(s, fp8).total,
    };
    let threads = mla::THREADS;
    // One wave of resident CTAs (one per SM): measured on the H100 against two and four, whose
    // extra splits cost more (per-CTA start, partials, merge) than the tail they shorten
    // (docs/mla.md).
    let waves = tuning.mla_waves.max(1);
    let resident = dev.resident_ctas(id, threads, smem)?;
    let target = waves * dev.sm_count() as u64 * resident as u64;
    // No even-waves splitting: the MLA plans were measured without it.
    let layer = LayerShape { num_q_heads: hq, num_kv_heads: 1, head_size: MLA_V as usize };
    Ok(TcKernel {
        kernel: DecodeKernel::Mla,
        id,
        layer,
        smem,
        shape,
        threads,
        group: hq as u32,
        target,
        slots: 0,
        fused_merge: false,
        max_chunk: None,
    })
}

/// Whether MLA over an FP8 cache on `device` rounds the queries and the softmax weights to e4m3:
/// on sm_90a both shapes run both products on e4m3 `wgmma` with the cache's bytes as they are,
/// the queries with one scale a row (its largest magnitude to e4m3's 448) and the weights
/// times 2^7, as FlashMLA's and vLLM's FP8 MLA run on FP8 operands. Elsewhere the cache's
/// values are converted exactly and the result is as precise as over a 16-bit cache holding
/// the same values. The same for both FP8 formats, dense and sparse, at any number of query
/// rows.
pub fn fp8_mla_rounds_to_e4m3(device: &AttnDevice) -> bool {
    on_e4m3(device, true)
}

/// Whether MLA over this cache runs on e4m3 `wgmma` (sm_90a, an FP8 cache: `mla::narrow_e4m3`
/// and `mla::wide_e4m3` in the kernels). The narrow kernel's two warpgroups merge their halves
/// of the keys in shared memory, and it combines up to 4 splits in a cluster.
fn on_e4m3(dev: &AttnDevice, fp8: bool) -> bool {
    fp8 && dev.ptx_target() == "sm_90a"
}

/// The MLA kernel for requests of at most `rows` query rows (tokens x heads), and its shape:
/// up to 16 rows the narrow one.
pub(crate) fn mla_kernel_id(q: DType, fp8: Option<Fp8Format>, rows: u32) -> (KernelId, mla::MlaShape) {
    let s = mla::shape_for_rows(rows);
    (KernelId::Mla { q, fp8, tile: if s == mla::NARROW { MlaTile::Narrow } else { MlaTile::Wide } }, s)
}

/// The cluster size that combines a plan's splits in shared memory ([`DecodePlan::cluster`]),
/// or 0 for the merge kernel. It takes the narrow kernel on the sm_90a module (thread-block
/// clusters); a plan whose requests all have the same number of splits, 2 to 8 (the portable
/// cluster size), so that consecutive CTAs are one request's splits; and clusters that all fit
/// on the GPU at once (a cluster lives in one GPC: on the H100, 32 clusters of 4 did not fit and
/// took 1.6x the merge kernel's time). On the H100 this saved the merge's 5 us at 16 heads x
/// batch 64 (docs/mla.md). [`Tuning::mla_clusters`] off turns it off. Over an FP8 cache (the
/// narrow shape's e4m3 kernel) up to 4 splits.
pub(crate) fn mla_cluster(dev: &AttnDevice, tc: &TcKernel, plan: &DecodePlan, tuning: &Tuning) -> u32 {
    let narrow = tc.shape.block_m == mla::NARROW.block_m && matches!(tc.id, KernelId::Mla { tile: MlaTile::Narrow, .. });
    let off = !tuning.mla_clusters;
    let Some(&splits) = plan.req_num_splits.first() else { return 0 };
    let uniform = plan.req_num_splits.iter().all(|&s| s == splits) && plan.row_groups == 1;
    // The narrow shape over an FP8 cache (e4m3 `wgmma` on sm_90a) combines fewer splits.
    let fp8 = matches!(tc.id, KernelId::Mla { fp8: Some(_), .. });
    let most = if fp8 { mla::E4M3_CLUSTER_RANKS } else { 8 };
    if !(dev.clusters_enabled() && narrow && !off && uniform && (2..=most).contains(&splits)) {
        return 0;
    }
    let clusters = plan.req_num_splits.len() as u32;
    match dev.max_active_clusters(tc.id, tc.threads, tc.smem, splits) {
        Ok(fit) if clusters <= fit => splits,
        _ => 0,
    }
}

/// What [`check_mla`] found: the sizes and types a launch needs.
struct Checked {
    nt: usize,
    hq: usize,
    q_dtype: DType,
    fp8: Option<Fp8Format>,
    num_reqs: usize,
    /// The device addresses of the FP8 scales (0 for a 16-bit cache).
    k_scale: u64,
    v_scale: u64,
}

/// The checks dense and sparse MLA share: dtypes, the spec, q/out/lse/cache buffers, the batch
/// against the block table and its device copy, the workspace's stream and head size.
fn check_mla(
    a: &MlaArgs<'_>,
    batch: &DecodeBatch<'_>,
    meta: &DeviceBatch<'_>,
    softmax_scale: f32,
    ws: &DecodeWorkspace,
    stream: &Arc<CudaStream>,
) -> Result<Checked> {
    let spec = &a.spec;
    let (nt, hq) = (a.q_rows.num_tokens, a.q_rows.num_heads);
    let q_dtype = a.q.dtype;
    ensure(matches!(q_dtype, DType::F16 | DType::BF16), "q", || format!("dtype {q_dtype:?}: MLA takes f16 or bf16 queries"))?;
    // The fields are public: sizes (elements, slots, strides) are exact only for a valid spec.
    spec.validate("spec")?;
    ensure(spec.row_width() == MLA_QK as usize, "spec", || format!("latent rows of {} (the MLA kernels take 512 + 64)", spec.row_width()))?;
    ensure(spec.latent_dim == MLA_V as usize, "spec", || format!("latent_dim {} (the MLA kernels take 512)", spec.latent_dim))?;
    ensure(spec.block_size.is_multiple_of(16), "block_size", || format!("{} is not a multiple of 16", spec.block_size))?;
    let cache_dtype = a.cache.dtype;
    ensure(cache_dtype == q_dtype || cache_dtype.is_fp8(), "cache", || format!("dtype {cache_dtype:?} with {q_dtype:?} queries"))?;
    let fp8 = cache_dtype.fp8_format();
    ensure(fp8.is_none() || a.scales.is_some(), "scales", || "an fp8 cache needs its scale".into())?;
    ensure(a.cache.len >= spec.num_elements(), "cache", || {
        format!("buffer of {} elements is smaller than the layout's {}", a.cache.len, spec.num_elements())
    })?;
    ensure(a.cache.ptr.is_multiple_of(16), "cache", || "must be 16-byte aligned".into())?;
    check_rows("q", a.q.ptr, &a.q_rows, a.q.len, MLA_QK as usize)?;
    ensure(a.out.dtype == q_dtype, "out", || format!("dtype {:?} differs from q's {q_dtype:?}", a.out.dtype))?;
    check_rows("out", a.out.ptr, &a.out_rows, a.out.len, MLA_V as usize)?;
    ensure(a.out_rows.num_tokens == nt && a.out_rows.num_heads == hq, "out", || format!("shape {:?} differs from q's", a.out_rows))?;
    ensure(softmax_scale.is_finite() && softmax_scale > 0.0, "softmax_scale", || format!("{softmax_scale}"))?;
    let num_reqs = batch.seq_lens.len();
    ensure(num_reqs < 1 << 16, "seq_lens", || format!("{num_reqs} requests exceed the 65535 a launch takes"))?;
    let pb = PrefillBatch { query_start_loc: batch.query_start_loc, seq_lens: batch.seq_lens, key_start_loc: None };
    validate_prefill_batch(&pb, nt, true, Some((spec.block_size, a.block_table_stride)))?;
    let need = block_table_reach(batch.seq_lens, spec.block_size, a.block_table_stride);
    ensure(a.block_table.dtype == DType::I32 && a.block_table.len >= need, "block_table", || {
        format!("must hold {need} i32 ({num_reqs} rows of {}), got {} x {:?}", a.block_table_stride, a.block_table.len, a.block_table.dtype)
    })?;
    meta.check(num_reqs)?;
    ws.check_stream(stream)?;
    if let Some(l) = &a.lse {
        ensure(l.dtype == DType::F32 && l.len >= nt * hq, "lse", || format!("must be {nt} x {hq} f32"))?;
    }
    let (k_scale, v_scale) = match &a.scales {
        Some(s) if fp8.is_some() => (f32_values(&s.k, "scales.k", 1)?, f32_values(&s.v, "scales.v", 1)?),
        _ => (0, 0),
    };
    ensure(ws.head_size() == MLA_V as usize, "workspace", || format!("made for head_size {}, MLA needs 512", ws.head_size()))?;
    Ok(Checked { nt, hq, q_dtype, fp8, num_reqs, k_scale, v_scale })
}

/// [`mla_attention`] with its plan from `source`; `meta` is the device copy of `batch`, uploaded
/// by the library from it.
#[allow(clippy::too_many_arguments)]
pub(crate) fn mla_attention_from(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: MlaArgs<'_>,
    batch: &DecodeBatch<'_>,
    meta: DeviceBatch<'_>,
    softmax_scale: f32,
    source: PlanSource<'_>,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<DecodePlan> {
    let Checked { nt, hq, q_dtype, fp8, num_reqs, k_scale, v_scale } = check_mla(&a, batch, &meta, softmax_scale, ws, stream)?;
    if num_reqs == 0 || nt == 0 {
        return Ok(DecodePlan::default());
    }

    let max_q = batch.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as u32).max().unwrap_or(1);
    // A device plan's kernel was chosen when it was planned; the tuning changes only the CTA
    // target and the clusters, which are the plan's.
    let tuning = match source {
        PlanSource::Host(p) => p.tuning,
        PlanSource::Device(_) => Tuning::DEFAULT,
    };
    let tc = mla_tc_kernel(dev, q_dtype, fp8, hq, max_q, &tuning)?;
    let rows_per_tile = tc.shape.block_m as usize;
    ensure(max_q as usize * hq <= rows_per_tile << 16, "query_start_loc", || {
        format!("a request has {} query rows (tokens x heads); a launch takes {}", max_q as usize * hq, rows_per_tile << 16)
    })?;
    let slices = tc.shape.ctas_per_item;
    let lp = plan_launch(tc, batch, source, ws.partial_rows(), |plan, t| mla_cluster(dev, &tc, plan, t))?;
    let wp = ws.arrays(stream, &lp, num_reqs, nt)?;
    let cluster = lp.cluster;
    let (status_ptr, _o) = status.word.device_ptr_mut(stream);
    let scales = Fp8Scales { k_scale, v_scale };
    let p = AttnParams {
        mla: MlaParams { v_slices: slices, v_row: MLA_V, cluster },
        schedule: Schedule { plan: lp.header, ..Schedule::default() },
        ..latent_params(&a, &meta, wp.split_k(), status_ptr, softmax_scale, scales, lp.chunk, hq)
    };
    let ctas = lp.ctas();
    ensure(ctas < i32::MAX as usize, "workspace", || format!("{ctas} CTAs exceed a launch"))?;
    dev.launch_ex(stream, tc.id, (ctas as u32, 1, 1), tc.threads, tc.smem, cluster.max(1), p)?;
    if lp.merge {
        launch_merge(dev, stream, &wp, meta.query_start_loc.ptr, (&a.out, &a.out_rows), p.output.lse, 0, q_dtype)?;
    }
    Ok(lp.plan)
}

/// The parameter block of a latent launch, dense or sparse: the queries, the latent cache as
/// both K and V, the batch, the outputs and the splits, causal, one V slice and no cluster,
/// schedule or index list (each caller sets what its launch changes).
#[allow(clippy::too_many_arguments)]
fn latent_params(
    a: &MlaArgs<'_>,
    meta: &DeviceBatch<'_>,
    split: SplitK,
    status: u64,
    softmax_scale: f32,
    scales: Fp8Scales,
    chunk: u32,
    hq: usize,
) -> AttnParams {
    let strides = a.spec.strides();
    AttnParams {
        qkv: attn_params::qkv(&a.q, &a.q_rows, (a.cache.ptr, strides), (a.cache.ptr, strides)),
        batch: attn_params::paged_batch(&a.block_table, a.block_table_stride, meta),
        output: attn_params::output(&a.out, &a.out_rows, a.lse.as_ref()),
        split,
        per_head: PerHead::default(),
        fp8: scales,
        status,
        variant: VariantParams::new(softmax_scale, None, None),
        shape: Shape {
            num_blocks: a.spec.num_blocks as u32,
            block_size: a.spec.block_size as u32,
            chunk,
            num_q_heads: hq as u32,
            group: hq as u32,
        },
        mask: Mask { causal: 1 },
        mla: MlaParams { v_slices: 1, v_row: MLA_V, cluster: 0 },
        schedule: Schedule::default(),
        local: LocalMask::default(),
        sparse: SparseIndices::default(),
        // The latent cache has one head: its one scale.
        scale_layout: ScaleLayout::default(),
        dims: HeadDims::default(),
    }
}

/// The index list of [`mla_sparse_attention`]: each query token's top-k positions.
pub struct SparseIndexArgs<'a> {
    /// `[num_tokens, row_stride]` i32 (4-byte aligned): token t's `topk` entries at
    /// `t * row_stride ..`, positions (0-based) within its request's sequence, in any order;
    /// -1 is padding.
    pub indices: DevIn<'a>,
    /// Entries per token (k, at least 1; DeepSeek-V3.2: 2048).
    pub topk: usize,
    /// Elements between consecutive tokens' rows (at least `topk`).
    pub row_stride: usize,
}

/// Checks an index tensor of `len` elements for `num_tokens` tokens of `topk` entries, rows
/// `row_stride` apart (the GPU call's and the CPU reference's checks).
pub(crate) fn check_indices(len: usize, num_tokens: usize, topk: usize, row_stride: usize) -> Result<()> {
    // The plan treats k as a sequence length (i32), and the kernel indexes entries in 32 bits.
    ensure(topk >= 1 && topk <= i32::MAX as usize, "topk", || format!("{topk} (takes 1 to {})", i32::MAX))?;
    ensure(row_stride >= topk, "indices", || format!("row stride {row_stride} is shorter than topk {topk}"))?;
    let need = match num_tokens {
        0 => Some(0),
        n => (n - 1).checked_mul(row_stride).and_then(|x| x.checked_add(topk)),
    };
    ensure(need.is_some_and(|need| len >= need), "indices", || {
        format!("buffer of {len} i32 is too small for {num_tokens} rows of {topk} entries {row_stride} apart")
    })
}

/// The sparse MLA kernel for `hq` heads a query token (`mla_sparse_<q>[_fp8|_e5m2]_{narrow,wide}`):
/// up to 16 heads the narrow shape, more the wide one (a token's heads in 64-row tiles).
pub(crate) fn mla_sparse_kernel_id(q: DType, fp8: Option<Fp8Format>, hq: u32) -> (KernelId, mla::MlaShape) {
    let (id, s) = mla_kernel_id(q, fp8, hq);
    let KernelId::Mla { q, fp8, tile } = id else { unreachable!("mla_kernel_id names an MLA kernel") };
    (KernelId::MlaSparse { q, fp8, tile }, s)
}

/// Sparse MLA attention (DeepSeek-V3.2, as vLLM's sparse FlashMLA backend): each query token
/// attends only the `topk` positions its row of `idx.indices` lists, over its request's latent
/// cache (no causal mask: the list is the mask), with every head of the token sharing the list.
/// Enqueued on `stream`. Same inputs as [`mla_attention`] otherwise (16-bit and FP8 caches).
///
/// Entries equal to -1 are padding and skipped. Entries outside `0..seq_len` of the token's
/// request are skipped and raise `INDEX_OUT_OF_RANGE` in `status` (the first one recorded:
/// token, entry, value; [`DeviceStatus::check`] returns it as
/// [`AttnError::IndexOutOfRange`](crate::AttnError::IndexOutOfRange)); block ids outside the
/// cache raise `BLOCK_OUT_OF_RANGE` as in dense MLA. A token none of whose entries is read
/// outputs zeros and an LSE of -inf. Attending the same position twice counts it twice.
/// Ordering on Hopper as [`paged_decode`](crate::decode::paged_decode)'s, except that the cache
/// rows are all read after the kernel waits for the one launched before it (an index list may
/// name the new tokens); the index tensor is read before, so it must have been written before
/// that kernel started.
///
/// Each query token is a work item of its own (the plan's requests are the tokens, each with
/// `topk` keys; long lists are split as long contexts are), so `ws` must hold `num_tokens`
/// requests and tokens. Returns the split plan it ran (its requests are the query tokens; its
/// `token_request` names each token's request in `batch`).
///
/// Errors, before anything is enqueued: those of [`mla_attention`] (the batch's query tokens
/// must still be the last ones of their sequences), and `InvalidArgument` for `topk` (0 or past
/// `i32::MAX`), an index tensor that is not i32, not 4-byte aligned, or too small for
/// `num_tokens` rows of `topk` entries `row_stride` apart, more than 65535 query tokens, and a
/// workspace too small for the per-token plan; `Driver` for a failed copy or launch.
#[allow(clippy::too_many_arguments)]
pub fn mla_sparse_attention(
    dev: &AttnDevice,
    stream: &Arc<CudaStream>,
    a: MlaArgs<'_>,
    idx: SparseIndexArgs<'_>,
    batch: &BatchMetadata,
    softmax_scale: f32,
    plan: impl Into<PlanOptions>,
    ws: &mut DecodeWorkspace,
    status: &mut DeviceStatus,
) -> Result<DecodePlan> {
    refuse_foreign_capture(stream, "stream", "mla_sparse_attention")?;
    let options: PlanOptions = plan.into();
    let meta = batch.device(stream)?;
    let host = batch.decode_batch();
    let Checked { nt, hq, q_dtype, fp8, num_reqs, k_scale, v_scale } = check_mla(&a, &host, &meta, softmax_scale, ws, stream)?;
    ensure(idx.indices.dtype == DType::I32, "indices", || format!("dtype {:?} (takes i32)", idx.indices.dtype))?;
    ensure(idx.indices.ptr.is_multiple_of(4), "indices", || "must be 4-byte aligned".into())?;
    check_indices(idx.indices.len, nt, idx.topk, idx.row_stride)?;
    ensure(nt < 1 << 16, "q", || format!("{nt} query tokens exceed the 65535 a sparse launch takes (one request each)"))?;
    if num_reqs == 0 || nt == 0 {
        return Ok(DecodePlan::default());
    }

    // The plan's batch: one request of `topk` keys per query token.
    let per_token_lens = vec![idx.topk as i32; nt];
    let per_token_starts: Vec<i32> = (0..=nt as i32).collect();
    let per_token = DecodeBatch { seq_lens: &per_token_lens, query_start_loc: &per_token_starts };
    let (id, s) = mla_sparse_kernel_id(q_dtype, fp8, hq as u32);
    let tc = mla_tc_kernel_of(dev, id, s, fp8.is_some(), hq, &options.tuning)?;
    let mut lp = plan_launch(tc, &per_token, PlanSource::Host(options), ws.partial_rows(), |_, _| 0)?;
    // The kernel finds each token's request in the plan's `token_request` (the batch's, not the
    // plan batch's identity), so the plan is always uploaded; the merge, told that every token
    // is its own request, does not read it.
    lp.plan.token_request.clear();
    for r in 0..num_reqs {
        let (q0, q1) = (host.query_start_loc[r], host.query_start_loc[r + 1]);
        lp.plan.token_request.extend(std::iter::repeat_n(r as u32, (q1 - q0) as usize));
    }
    lp.arrays = PlanArrays::Upload;
    lp.uniform_splits = 0;
    let wp = ws.arrays(stream, &lp, nt, nt)?;
    let (status_ptr, _o) = status.word.device_ptr_mut(stream);
    let scales = Fp8Scales { k_scale, v_scale };
    let p = AttnParams {
        // The list is the mask.
        mask: Mask { causal: 0 },
        mla: MlaParams { v_slices: tc.shape.ctas_per_item, v_row: MLA_V, cluster: 0 },
        sparse: SparseIndices {
            indices: idx.indices.ptr,
            row_stride: idx.row_stride as u64,
            token_request: wp.token_request,
            topk: idx.topk as u32,
            reserved: 0,
        },
        ..latent_params(&a, &meta, wp.split_k(), status_ptr, softmax_scale, scales, lp.chunk, hq)
    };
    let ctas = lp.ctas();
    ensure(ctas < i32::MAX as usize, "workspace", || format!("{ctas} CTAs exceed a launch"))?;
    dev.launch_ex(stream, tc.id, (ctas as u32, 1, 1), tc.threads, tc.smem, 1, p)?;
    if lp.merge {
        // No `query_start_loc`: the merge's requests are the tokens.
        launch_merge(dev, stream, &wp, 0, (&a.out, &a.out_rows), p.output.lse, 0, q_dtype)?;
    }
    Ok(lp.plan)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mla_kernel_choice() {
        let e4m3 = |on: bool| on.then_some(Fp8Format::E4m3);
        let name = |q, fp8, rows| mla_kernel_id(q, e4m3(fp8), rows).0.entry_name();
        assert_eq!(name(DType::BF16, false, 16), "mla_bf16_narrow");
        assert_eq!(name(DType::BF16, true, 1), "mla_bf16_fp8_narrow");
        assert_eq!(name(DType::F16, false, 17), "mla_f16_wide");
        assert_eq!(name(DType::F16, true, 128), "mla_f16_fp8_wide");
        assert_eq!(mla_kernel_id(DType::BF16, None, 16).1, mla::NARROW);
        assert_eq!(mla_kernel_id(DType::BF16, None, 64).1, mla::WIDE);
        let sparse = |q, fp8, heads| mla_sparse_kernel_id(q, e4m3(fp8), heads).0.entry_name();
        assert_eq!(sparse(DType::BF16, false, 16), "mla_sparse_bf16_narrow");
        assert_eq!(sparse(DType::BF16, true, 128), "mla_sparse_bf16_fp8_wide");
        assert_eq!(sparse(DType::F16, true, 8), "mla_sparse_f16_fp8_narrow");
        assert_eq!(mla_kernel_id(DType::BF16, Some(Fp8Format::E5m2), 128).0.entry_name(), "mla_bf16_e5m2_wide");
        assert_eq!(mla_sparse_kernel_id(DType::F16, Some(Fp8Format::E5m2), 8).0.entry_name(), "mla_sparse_f16_e5m2_narrow");
    }

    #[test]
    fn index_tensor_checks_name_the_argument() {
        let arg = |r: Result<()>| match r {
            Err(crate::AttnError::InvalidArgument { arg, .. }) => arg,
            other => panic!("expected a refusal, got {other:?}"),
        };
        assert!(check_indices(3 * 2048, 3, 2048, 2048).is_ok());
        // The last row needs only `topk` entries past its start.
        assert!(check_indices(2 * 4096 + 7, 3, 7, 4096).is_ok());
        assert!(check_indices(0, 0, 1, 1).is_ok());
        assert_eq!(arg(check_indices(2 * 4096 + 6, 3, 7, 4096)), "indices");
        assert_eq!(arg(check_indices(100, 1, 0, 1)), "topk");
        assert_eq!(arg(check_indices(100, 1, 1 << 31, 1 << 31)), "topk");
        assert_eq!(arg(check_indices(100, 2, 8, 7)), "indices");
        assert_eq!(arg(check_indices(usize::MAX, usize::MAX, 8, usize::MAX / 2)), "indices");
    }
}
