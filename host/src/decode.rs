//! Paged decode attention with two-pass split-K (flash-decoding), and the public LSE merge
//! `merge_attn_states`.
//!
//! The host plans each batch from its host-side metadata (`seq_lens`, `query_start_loc`): one
//! chunk size for the batch (`attn_math::split::plan_chunk`), so long requests get many splits
//! and short ones few and the CTAs fill the GPU; requests with one split write their output
//! directly, the others go through the workspace and the merge kernel. The plan is uploaded into
//! a caller-owned [`DecodeWorkspace`]; nothing is allocated per call.

use crate::batch::{BatchMetadata, DeviceBatch};
use crate::buffer::{DevIn, DevOut};
use crate::cache_write::KvScales;
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, Result};
use crate::forward::graph::refuse_foreign_capture;
use crate::kernels::KernelId;
use crate::layout::{KvCacheSpec, RowsDesc};
use crate::metadata::plan_words::{append_plan, plan_words};
use crate::metadata::{Region, ALIGN_WORDS};
use crate::status::DeviceStatus;
use crate::stream_check::check_stream;
use attn_math::decode::HEAD_SIZES;
use attn_math::keys_rows;
use attn_math::params::{DecodeMergeParams, MergeStatesParams, PrefillParams, MAX_MERGE_HEAD_SIZE, MERGE_SHARED_BYTES, MERGE_THREADS};
use attn_math::prefill::{block_m, block_n, shared_layout};
use attn_math::softmax::LOG2_E;
use attn_math::split::{even_waves_chunk, num_splits, plan_chunk, EVEN_WAVES_MAX_SPLITS};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

pub use crate::plan_options::{PlanOptions, SplitMode, Tuning};

/// Query tokens per request that decode takes (speculative decoding: causal among them).
pub const MAX_QUERY_LEN: usize = 8;
/// Splits shorter than this cost more in merging than they gain.
pub(crate) const MIN_CHUNK: u32 = 256;

/// Attention options of a layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttnOptions {
    pub softmax_scale: f32,
    /// Sliding window: each query sees its last `window` keys (itself included).
    pub window: Option<u32>,
    /// Logit soft-cap: `cap * tanh(logit / cap)`.
    pub softcap: Option<f32>,
}

impl AttnOptions {
    pub fn new(head_size: usize) -> Self {
        AttnOptions { softmax_scale: 1.0 / (head_size as f32).sqrt(), window: None, softcap: None }
    }
}

/// A batch's host-side metadata, as the planners take it. The ops take a
/// [`BatchMetadata`](crate::batch::BatchMetadata), which holds these and their device copy.
#[derive(Clone, Copy, Debug)]
pub struct DecodeBatch<'a> {
    /// `[num_reqs]` context lengths, new tokens included.
    pub seq_lens: &'a [i32],
    /// `[num_reqs + 1]`, starting at 0.
    pub query_start_loc: &'a [i32],
}

/// Device inputs and outputs of [`paged_decode`].
pub struct DecodeArgs<'a> {
    /// `[num_tokens, num_q_heads, head_size]`.
    pub q: DevIn<'a>,
    pub q_rows: RowsDesc,
    /// The paged cache (K and V planes, per `spec`).
    pub cache: DevIn<'a>,
    pub spec: KvCacheSpec,
    /// `[num_reqs, block_table_stride]` i32.
    pub block_table: DevIn<'a>,
    pub block_table_stride: usize,
    /// `[num_tokens, num_q_heads, head_size]`, the dtype of `q`.
    pub out: DevOut<'a>,
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

/// The per-batch plan: chunk size, work items and where each request's partials go.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodePlan {
    pub chunk: u32,
    /// Query rows per CTA, and the row tiles of the request with the most rows.
    pub rows_per_cta: u32,
    pub row_groups: u32,
    /// `request, row_tile << 16 | split` per work item.
    pub items: Vec<u32>,
    pub kernel: DecodeKernel,
    pub req_num_splits: Vec<u32>,
    pub req_partial_base: Vec<u32>,
    pub token_request: Vec<u32>,
    /// Partial rows (head_size f32 each) the plan uses in the workspace.
    pub partial_rows: usize,
    /// MLA on sm_90a: every request has this many splits (2..=8), run as one thread-block
    /// cluster that combines them in shared memory (no partials, no merge kernel); 0 = off.
    pub cluster: u32,
}

impl DecodePlan {
    pub fn needs_merge(&self) -> bool {
        self.cluster <= 1 && self.req_num_splits.iter().any(|&s| s > 1)
    }

    /// The splits of every request when they are all the same (more than one), and the work
    /// items are the ones a CTA derives from its index with `PrefillParams::uniform_splits`
    /// (split `i % n` of request `i / n`, row tile 0; partial rows in request order, so request
    /// r's start at `n * num_q_heads * query_start_loc[r]`).
    pub fn uniform_splits(&self) -> Option<u32> {
        let n = *self.req_num_splits.first()?;
        let uniform = n > 1
            && self.cluster <= 1
            && self.req_num_splits.iter().all(|&s| s == n)
            && self.items.len() == 2 * n as usize * self.req_num_splits.len()
            && self.items.chunks(2).enumerate().all(|(i, it)| it[0] == i as u32 / n && it[1] == i as u32 % n);
        uniform.then_some(n)
    }

    /// Whether the tensor-core kernels need the plan's arrays on the device. Not when the work
    /// items are the ones CTAs derive from their index (`PrefillParams::work_items` 0): CTA i is
    /// split `i % c` of request `i / c`, row tile 0, for every request, `c` being the cluster
    /// size or 1 (one split, one row tile, at least one query token each). The call then copies
    /// nothing, and its launch follows the kernel before it directly (programmatic dependent
    /// launch).
    pub fn needs_device_plan(&self) -> bool {
        let per = self.cluster.max(1);
        let implicit = self.items.len() == 2 * per as usize * self.req_num_splits.len()
            && self.items.chunks(2).enumerate().all(|(i, it)| it[0] == i as u32 / per && it[1] == i as u32 % per);
        !implicit
    }
}

/// Partial rows (head_size f32 each) the splits of a chunk size need: `splits x q_len x
/// num_q_heads` for every request split more than once; `None` when that overflows a usize.
fn partial_rows_for(lens: &[u32], q_lens: &[u32], num_q_heads: usize, chunk: u32) -> Option<usize> {
    lens.iter().zip(q_lens).try_fold(0usize, |acc, (&l, &q)| {
        let s = num_splits(l, chunk);
        let rows = if s > 1 { (s as usize).checked_mul(q as usize)?.checked_mul(num_q_heads)? } else { 0 };
        acc.checked_add(rows)
    })
}

/// The splits of every request for a chunk size, grown until the partials fit the workspace
/// (one split each always fits: it needs none): chunk, splits, partial bases, token requests.
/// `items` is left to the caller. Partial bases are u32, so at most `u32::MAX` rows of the
/// capacity are used.
fn plan_splits(lens: &[u32], q_lens: &[u32], num_q_heads: usize, chunk: u32, partial_capacity: usize) -> DecodePlan {
    let capacity = partial_capacity.min(u32::MAX as usize);
    let mut chunk = chunk.max(1);
    loop {
        let fits = partial_rows_for(lens, q_lens, num_q_heads, chunk).is_some_and(|rows| rows <= capacity);
        let splits_ok = lens.iter().all(|&l| num_splits(l, chunk) <= 0xffff);
        // A chunk of u32::MAX keys gives every request one split (no partials): it always fits.
        if (fits && splits_ok) || chunk == u32::MAX {
            break;
        }
        chunk = chunk.saturating_mul(2);
    }
    let mut plan = DecodePlan { chunk, ..DecodePlan::default() };
    for (r, (&len, &q)) in lens.iter().zip(q_lens).enumerate() {
        let splits = num_splits(len, chunk);
        plan.req_num_splits.push(splits);
        plan.req_partial_base.push(plan.partial_rows as u32);
        if splits > 1 {
            // In range: the loop above checked that the sum fits the capacity.
            plan.partial_rows += splits as usize * q as usize * num_q_heads;
        }
        plan.token_request.extend(std::iter::repeat_n(r as u32, q as usize));
    }
    plan
}

/// Which kernel runs a decode batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub enum DecodeKernel {
    /// Tensor cores, 16 query rows per CTA and the keys of each tile split across its warps
    /// (`decode_tc_<q>[_fp8]_d<d>`): up to 16 rows (query tokens x query heads) per kv head.
    /// Up to 8 rows run the same CTAs with the score tile transposed (`decode_kr_*`, keys on
    /// the MMA's rows: `attn_math::keys_rows`), from 16-bit caches and FP8 at head sizes 64/128.
    #[default]
    TensorCoreKeys,
    /// Tensor cores, 64 rows per CTA (the prefill kernel): more rows per kv head (MQA).
    TensorCoreRows,
    /// MLA's latent attention (`host::mla::mla_attention`; its plans carry this tag).
    Mla,
}

impl DecodeKernel {
    /// The tensor-core shape for a batch: keys split across warps up to 16 rows per kv head.
    pub fn tensor_cores(rows_per_kv_head: u32) -> DecodeKernel {
        if rows_per_kv_head <= block_m(0, 0, true, false) {
            DecodeKernel::TensorCoreKeys
        } else {
            DecodeKernel::TensorCoreRows
        }
    }

    pub fn keys_split(self) -> bool {
        self == DecodeKernel::TensorCoreKeys
    }
}

/// What the tensor-core planner needs of a kernel: its query rows and keys per tile, and the
/// CTAs of one work item (kv heads x MLA's V slices).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TcShape {
    pub block_m: u32,
    pub block_n: u32,
    pub ctas_per_item: u32,
}

impl TcShape {
    /// The attention kernel's shape for these head sizes, CTA shape and cache format.
    pub const fn attention(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool, ctas_per_item: u32) -> TcShape {
        TcShape {
            block_m: block_m(head_size_qk, head_size_v, keys_split, fp8),
            block_n: block_n(head_size_qk, head_size_v, keys_split, fp8),
            ctas_per_item,
        }
    }
}

/// Plans a batch for the tensor-core kernels: a chunk of whole key tiles, and work items
/// `[request, row_tile << 16 | split]` (flattened in `items`). `group`: query heads per kv head.
/// `slots`: the CTAs the GPU holds at once, for splitting batches of equal requests into even
/// waves (`attn_math::split::even_waves_chunk`); 0 leaves that out ([`TcKernel::slots`]).
///
/// Never panics: it takes the batch as given (decreasing start locations count as empty
/// requests, negative lengths as 0, a zero tile size as 1). Row tiles are encoded in 16 bits, so
/// a request gets at most 65536 of them: the callers refuse batches with more rows
/// ([`crate::mla::mla_attention`], [`validate_batch`]) before planning.
#[allow(clippy::too_many_arguments)]
pub fn plan_decode_tc(
    batch: &DecodeBatch<'_>,
    num_q_heads: usize,
    group: u32,
    shape: TcShape,
    ctas_target: u64,
    slots: u64,
    mode: SplitMode,
    partial_capacity: usize,
) -> DecodePlan {
    let n = batch.seq_lens.len().min(batch.query_start_loc.len().saturating_sub(1));
    let qsl = batch.query_start_loc;
    let q_lens: Vec<u32> = (0..n).map(|r| (qsl[r + 1] as i64 - qsl[r] as i64).clamp(0, u32::MAX as i64) as u32).collect();
    let lens: Vec<u32> = batch.seq_lens[..n].iter().map(|&l| l.max(0) as u32).collect();
    let TcShape { block_m, block_n, ctas_per_item } = shape;
    let (bm, bn) = (block_m.max(1), block_n.max(1));
    // A request's row tiles, in 16 bits (see above).
    let tiles_of = |q: u32| (q as u64 * group as u64).div_ceil(bm as u64).min(1 << 16) as u32;
    let row_tiles = tiles_of(q_lens.iter().copied().max().unwrap_or(1)).max(1);
    let forced = match mode {
        SplitMode::Auto => None,
        SplitMode::Fixed(n) => Some(n),
    };
    let ctas_per_split = ctas_per_item.saturating_mul(row_tiles);
    let chunk = plan_chunk(&lens, ctas_per_split, ctas_target, bn, MIN_CHUNK, forced);
    let chunk = if forced.is_none() { even_waves_chunk(&lens, ctas_per_split, slots, bn, MIN_CHUNK, chunk) } else { chunk };
    let mut plan = plan_splits(&lens, &q_lens, num_q_heads, chunk, partial_capacity);
    plan.rows_per_cta = bm;
    plan.row_groups = row_tiles;
    for (r, (&splits, &q)) in plan.req_num_splits.iter().zip(&q_lens).enumerate() {
        for tile in 0..tiles_of(q) {
            for s in 0..splits {
                plan.items.extend([r as u32, tile << 16 | s]);
            }
        }
    }
    plan
}

/// Checks host metadata: sorted start locations that cover the tokens, 0..=8 queries per
/// request (a request with none is an empty decode: it attends nothing and writes nothing, as
/// in [`crate::metadata::is_decode`]), non-negative lengths that hold their queries and fit the
/// block table, a positive block size. Differences of start locations are taken in i64, so no
/// pair of i32s wraps.
pub fn validate_batch(batch: &DecodeBatch<'_>, num_tokens: usize, block_size: usize, block_table_stride: usize) -> Result<()> {
    let n = batch.seq_lens.len();
    let qsl = batch.query_start_loc;
    ensure(block_size > 0, "block_size", || "must be at least 1".into())?;
    ensure(qsl.len() == n + 1, "query_start_loc", || format!("has {} entries for {n} requests (needs {})", qsl.len(), n + 1))?;
    ensure(qsl[0] == 0, "query_start_loc", || format!("starts at {}, not 0", qsl[0]))?;
    ensure(qsl[n] as i64 == num_tokens as i64, "query_start_loc", || format!("ends at {}, but q has {num_tokens} tokens", qsl[n]))?;
    ensure(n < 1 << 16, "seq_lens", || format!("{n} requests exceed the 65535 a launch takes"))?;
    for r in 0..n {
        let q = qsl[r + 1] as i64 - qsl[r] as i64;
        ensure((0..=MAX_QUERY_LEN as i64).contains(&q), "query_start_loc", || {
            format!("request {r} has {q} query tokens ({} -> {}; decode takes 0..={MAX_QUERY_LEN})", qsl[r], qsl[r + 1])
        })?;
        let len = batch.seq_lens[r];
        ensure(len >= 0, "seq_lens", || format!("request {r} has negative length {len}"))?;
        ensure(len == 0 || len as i64 >= q, "seq_lens", || format!("request {r} has length {len} < its {q} query tokens"))?;
        let blocks = (len as usize).div_ceil(block_size);
        ensure(blocks <= block_table_stride, "block_table", || {
            format!("request {r} needs {blocks} blocks, rows hold {block_table_stride}")
        })?;
    }
    Ok(())
}

/// Device memory for split-K partials and the plan. Allocate once for the largest batch.
pub struct DecodeWorkspace {
    partial_out: CudaSlice<f32>,
    partial_lse: CudaSlice<f32>,
    /// A call's plan, its arrays packed into one buffer (`metadata::plan_words`) that one
    /// copy fills (four copies cost 2.6 us more a call on the H100, BENCHMARKS.md).
    plan_device: CudaSlice<u32>,
    plan_words: Vec<u32>,
    /// Split-K merged in pass 1: an arrival counter per split work item (zero between launches;
    /// `attn_math::params::merge_counter_index`, below `partial_rows / 2`).
    merge_counters: CudaSlice<u32>,
    max_items: usize,
    max_reqs: usize,
    max_tokens: usize,
    head_size: usize,
    /// The stream every call that uses this workspace runs on (`crate::stream_check`).
    stream: Arc<CudaStream>,
}

impl DecodeWorkspace {
    /// Device bytes [`new`](Self::new) allocates.
    /// Device bytes [`new`](Self::new) allocates (saturating: sizes that overflow are ones
    /// `new` refuses).
    pub fn bytes(partial_rows: usize, head_size: usize, max_items: usize, max_reqs: usize, max_tokens: usize) -> usize {
        let padded = |n: usize| (n as u128).next_multiple_of(ALIGN_WORDS as u128);
        let plan = padded(max_items) + 2 * padded(max_reqs) + padded(max_tokens) + padded(4);
        let rows = partial_rows as u128;
        let total = rows * (head_size as u128 + 1) + plan + rows / 2 + 1;
        usize::try_from(4 * total).unwrap_or(usize::MAX)
    }

    /// A workspace for up to `max_reqs` requests and `max_tokens` query tokens; `partial_rows`
    /// bounds the split-K partials (a good size: `4 * sm_count * 8 * num_q_heads / num_kv_heads`).
    /// Every call that uses it must run on `stream`: one workspace per stream.
    pub fn new(stream: &Arc<CudaStream>, partial_rows: usize, head_size: usize, max_reqs: usize, max_tokens: usize) -> Result<Self> {
        // The kernels index partial rows, items and tokens with 32-bit words.
        for (arg, n) in [("partial_rows", partial_rows), ("head_size", head_size), ("max_reqs", max_reqs), ("max_tokens", max_tokens)] {
            ensure(n <= i32::MAX as usize, arg, || format!("{n} is past what a launch indexes ({})", i32::MAX))?;
        }
        ensure(partial_rows.max(1).checked_mul(head_size).is_some_and(|n| n <= u32::MAX as usize), "partial_rows", || {
            format!("{partial_rows} rows of {head_size} floats are past what a launch indexes")
        })?;
        // Tensor-core items are two words, and MQA rows can take several row tiles.
        let max_items = 4 * (max_reqs + partial_rows);
        let words = plan_words(max_items, max_reqs, max_tokens);
        Ok(DecodeWorkspace {
            partial_out: stream.alloc_zeros(partial_rows.max(1) * head_size)?,
            partial_lse: stream.alloc_zeros(partial_rows.max(1))?,
            plan_device: stream.alloc_zeros(words)?,
            plan_words: Vec::with_capacity(words),
            merge_counters: stream.alloc_zeros(merge_counters(partial_rows))?,
            max_items,
            max_reqs,
            max_tokens,
            head_size,
            stream: stream.clone(),
        })
    }

    /// Refuses a call on another stream than the workspace's.
    pub(crate) fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        check_stream("workspace", &self.stream, stream)
    }

    pub fn partial_rows(&self) -> usize {
        self.partial_lse.len()
    }

    /// The partial buffers alone: a plan the kernel derives from its CTA index (uniform splits).
    fn partials_ptrs(&mut self, stream: &Arc<CudaStream>) -> WorkspacePtrs {
        WorkspacePtrs {
            partial_out: self.partial_out.device_ptr_mut(stream).0,
            partial_lse: self.partial_lse.device_ptr_mut(stream).0,
            ..WorkspacePtrs::default()
        }
    }

    /// The counters of split-K merged in pass 1.
    pub(crate) fn merge_counters_ptr(&mut self, stream: &Arc<CudaStream>) -> u64 {
        self.merge_counters.device_ptr_mut(stream).0
    }

    /// Whether a plan for a batch of `num_reqs` requests and `num_tokens` query tokens fits.
    pub(crate) fn check_plan(&self, plan: &DecodePlan, num_reqs: usize, num_tokens: usize) -> Result<()> {
        ensure(plan.items.len() <= self.max_items && plan.items.len() < i32::MAX as usize, "workspace", || {
            format!("the plan has {} work items, the workspace holds {}", plan.items.len(), self.max_items)
        })?;
        ensure(plan.partial_rows <= self.partial_rows(), "workspace", || {
            format!("the plan needs {} partial rows, the workspace holds {}", plan.partial_rows, self.partial_rows())
        })?;
        self.check_batch(num_reqs, num_tokens)?;
        ensure(plan.req_num_splits.len() == num_reqs && plan.token_request.len() == num_tokens, "workspace", || {
            format!(
                "a plan of {} requests / {} tokens for a batch of {num_reqs} / {num_tokens}",
                plan.req_num_splits.len(),
                plan.token_request.len()
            )
        })
    }

    /// Whether a batch of `num_reqs` requests and `num_tokens` query tokens fits.
    fn check_batch(&self, num_reqs: usize, num_tokens: usize) -> Result<()> {
        ensure(num_reqs <= self.max_reqs && num_tokens <= self.max_tokens, "workspace", || {
            format!("holds {} requests / {} tokens, the batch has {num_reqs} / {num_tokens}", self.max_reqs, self.max_tokens)
        })
    }
}

pub(crate) fn f32_values(b: &DevIn<'_>, arg: &'static str, len: usize) -> Result<u64> {
    ensure(b.dtype == DType::F32 && b.len >= len, arg, || format!("must be {len} f32 values, got {} x {:?}", b.len, b.dtype))?;
    Ok(b.ptr)
}

pub(crate) fn optional_f32(buf: &Option<DevIn<'_>>, arg: &'static str, len: usize) -> Result<u64> {
    buf.as_ref().map_or(Ok(0), |b| f32_values(b, arg, len))
}

/// The heads and head size of a layer, which a plan's offsets depend on: a request's partial
/// rows are `splits x query tokens x num_q_heads` rows of `head_size` floats, and a launch has
/// one CTA per work item and kv head. A plan used with more heads would index past its partials.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct LayerShape {
    pub num_q_heads: usize,
    pub num_kv_heads: usize,
    pub head_size: usize,
}

/// A tensor-core kernel for a kind of batch, and the CTA count its split plans aim at.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct TcKernel {
    pub kernel: DecodeKernel,
    pub id: KernelId,
    /// The layer it runs (MLA: one kv head of the latent width).
    pub layer: LayerShape,
    pub smem: u32,
    pub shape: TcShape,
    /// Threads per CTA.
    pub threads: u32,
    /// Query heads per kv head (MLA: every head).
    pub group: u32,
    /// CTAs the split plan aims at.
    pub target: u64,
    /// CTAs the GPU holds at once (`plan_decode_tc`'s even waves); 0: no even waves (MLA, or
    /// [`Tuning::decode_even_waves`] off).
    pub slots: u64,
    /// The kernel merges its splits itself (`decode_kr_*`: the last CTA of a work item, through
    /// the workspace's counters): no merge kernel, and a plan of uniform splits stays on the host.
    pub fused_merge: bool,
}

impl TcKernel {
    /// The most work items a plan of `num_reqs` requests of `q_len` query tokens can have
    /// (`plan_decode_tc`: at most `target` CTAs unless one split per request is already more,
    /// and then up to `EVEN_WAVES_MAX_SPLITS` splits each;
    /// `SplitMode::Fixed(n)`: `n` splits each at most).
    pub fn max_items(&self, num_reqs: usize, q_len: u32, mode: SplitMode) -> usize {
        let bm = self.shape.block_m;
        let per_split = num_reqs * (q_len * self.group).div_ceil(bm).max(1) as usize;
        match mode {
            // Even waves split each request up to EVEN_WAVES_MAX_SPLITS times.
            SplitMode::Auto => (per_split * EVEN_WAVES_MAX_SPLITS as usize).max((self.target / self.shape.ctas_per_item as u64) as usize),
            SplitMode::Fixed(n) => per_split * n.max(1) as usize,
        }
    }
}

/// The longest request's keys (0 for an empty batch or negative lengths).
pub(crate) fn max_len(seq_lens: &[i32]) -> u32 {
    seq_lens.iter().copied().max().unwrap_or(0).max(0) as u32
}

/// The tensor-core decode kernel for `max_q` query tokens per request (`max_len` keys in the
/// longest), and its CTA target under `tuning`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn decode_tc_kernel(
    dev: &AttnDevice,
    q_dtype: DType,
    fp8: bool,
    d: usize,
    hq: usize,
    num_kv_heads: usize,
    max_q: u32,
    max_len: u32,
    tuning: &Tuning,
) -> Result<TcKernel> {
    let group = (hq / num_kv_heads) as u32;
    let (kernel, id, smem) = decode_kernel_id(q_dtype, fp8, d as u32, group, max_q, max_len);
    let waves = tuning.decode_waves.unwrap_or(measured_waves(d as u32)).max(1);
    let resident = dev.resident_ctas(id, attn_math::prefill::THREADS, smem)?;
    let slots = dev.sm_count() as u64 * resident as u64;
    let target = waves * slots;
    // No slots: `plan_decode_tc` leaves the even waves out.
    let slots = if tuning.decode_even_waves { slots } else { 0 };
    let shape = TcShape::attention(d as u32, d as u32, kernel.keys_split(), fp8, num_kv_heads as u32);
    let layer = LayerShape { num_q_heads: hq, num_kv_heads, head_size: d };
    // The keys-as-rows kernels merge their splits themselves.
    let fused_merge = matches!(id, KernelId::DecodeKr { .. });
    Ok(TcKernel { kernel, id, layer, smem, shape, threads: attn_math::prefill::THREADS, group, target, slots, fused_merge })
}

/// The tensor-core decode kernel for `group` query heads per kv head at head size `d`, `max_q`
/// query tokens per request and `max_len` keys in the longest, and its shared memory.
pub(crate) fn decode_kernel_id(q: DType, fp8: bool, d: u32, group: u32, max_q: u32, max_len: u32) -> (DecodeKernel, KernelId, u32) {
    let kernel = DecodeKernel::tensor_cores(max_q * group);
    // Up to 8 rows per kv head (FP8 caches at head sizes 64 and 128): the same CTAs with the
    // score tile transposed (`decode_kr_*`: keys on the MMA's rows; half the math per tile).
    let keys_rows =
        kernel == DecodeKernel::TensorCoreKeys && (!fp8 || keys_rows::FP8_HEAD_SIZES.contains(&d)) && max_q * group <= keys_rows::MAX_ROWS;
    let long = max_len >= keys_rows::FP8_LONG_KEYS;
    let id = match kernel {
        // FP8 batches with long requests: the deep-pipeline kernels (`keys_rows::FP8_LONG_KEYS`).
        DecodeKernel::TensorCoreKeys if keys_rows => KernelId::DecodeKr { q, fp8, long: fp8 && long, head_size: d },
        DecodeKernel::TensorCoreKeys => KernelId::DecodeTc { q, fp8, head_size: d },
        _ => KernelId::Prefill { q, fp8, head_size_qk: d, head_size_v: d },
    };
    let smem = if keys_rows {
        keys_rows::layout(d, fp8, keys_rows::ctas_per_sm(d, fp8, long)).total
    } else {
        shared_layout(d, d, kernel.keys_split(), fp8).total
    };
    (kernel, id, smem)
}

/// Waves of resident CTAs a decode plan aims at by default: splits short enough to fill every
/// SM, few enough that the per-CTA start (work item, first address tables, pipeline fill) and
/// the merge stay small, measured per head size on the H100 (BENCHMARKS.md): one wave at
/// d96/d128 (2 CTAs per SM), two at d256 (1 per SM), four at d64 (short tiles: more CTAs in
/// flight). [`Tuning::decode_waves`] overrides it.
pub(crate) fn measured_waves(d: u32) -> u64 {
    match d {
        0..=64 => 4,
        65..=128 => 1,
        _ => 2,
    }
}

/// A split plan already on the device (a CUDA-graph step's, [`crate::forward`]): its arrays,
/// and the header `[num_items, chunk]` the kernel reads, so that its grid can cover
/// `capacity_items` whatever the step's plan.
#[derive(Clone, Debug)]
pub(crate) struct DevicePlan {
    /// The kernel it was planned for (`TcKernel::id`).
    pub kernel: KernelId,
    /// The layer shape its offsets were computed for (its kernel's).
    pub layer: LayerShape,
    pub items: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    pub token_request: u64,
    pub header: u64,
    pub capacity_items: usize,
    /// Whether the merge is launched: a graph's always (a replay's plan may split where the
    /// capture's did not), an eager step's when a request has several splits.
    pub needs_merge: bool,
    /// [`DecodePlan::cluster`].
    pub cluster: u32,
}

impl DevicePlan {
    /// Refuses a call whose kernel (which names the dtypes, cache format and head size) or
    /// layer shape is not the one planned.
    pub(crate) fn check_layer(&self, tc: &TcKernel) -> Result<()> {
        ensure(self.kernel == tc.id, "plan", || format!("was made for kernel {}, the call runs {}", self.kernel, tc.id))?;
        ensure(self.layer == tc.layer, "plan", || format!("was made for {:?}, the call has {:?}", self.layer, tc.layer))
    }

    pub(crate) fn workspace_ptrs(&self, ws: &mut DecodeWorkspace, stream: &Arc<CudaStream>) -> WorkspacePtrs {
        WorkspacePtrs {
            items: self.items,
            req_num_splits: self.req_num_splits,
            req_partial_base: self.req_partial_base,
            token_request: self.token_request,
            partial_out: ws.partial_out.device_ptr_mut(stream).0,
            partial_lse: ws.partial_lse.device_ptr_mut(stream).0,
        }
    }
}

/// Where a call's split plan comes from: planned here from the host metadata and uploaded
/// (eager calls), or already on the device (graph steps: nothing is copied, and the launches
/// are the same whatever the plan).
#[derive(Clone, Copy)]
pub(crate) enum PlanSource<'p> {
    Host(PlanOptions),
    Device(&'p DevicePlan),
}

/// How the attention kernel's grid is sized.
#[derive(Clone, Copy)]
enum Launch<'p> {
    /// One CTA per item (and kv head) of the uploaded plan.
    Planned,
    /// The device plan's capacity; CTAs past the step's items exit.
    Fixed(&'p DevicePlan),
}

/// Paged decode: validates everything, plans, uploads the plan, launches pass 1 and (when a
/// request has several splits) the merge. Enqueued on `stream`; block ids outside the cache are
/// skipped and raise `BLOCK_OUT_OF_RANGE` in `status`.
///
/// Ordering on Hopper (programmatic dependent launch, `ATTN_DISABLE_PDL=1` turns it off): the
/// kernel may start while the kernel launched just before it on `stream` still runs, and reads
/// the queries, block tables, sequence lengths and, on the keys-as-rows kernels, the cache rows
/// of each request's context before its new tokens (positions below `seq_len - q_len`) before
/// waiting for it. Those must have been written before that kernel started, as they are in an
/// engine step (QKV projection, then the cache write of the new tokens, then decode). The new
/// tokens' rows are read, and everything is written, after the wait.
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
    let spec = &a.spec;
    // Its fields are public: a spec built without `KvCacheSpec::new` is checked here.
    spec.validate("spec")?;
    let (nt, hq, d) = (a.q_rows.num_tokens, a.q_rows.num_heads, a.q_rows.head_size);
    let q_dtype = a.q.dtype;
    let cache_dtype = a.cache.dtype;
    ensure(matches!(q_dtype, DType::F16 | DType::BF16), "q", || format!("dtype {q_dtype:?}: decode takes f16 or bf16 queries"))?;
    ensure(cache_dtype == q_dtype || cache_dtype == DType::Fp8E4m3, "cache", || format!("dtype {cache_dtype:?} with {q_dtype:?} queries"))?;
    ensure(cache_dtype != DType::Fp8E4m3 || a.scales.is_some(), "scales", || "an fp8 cache needs k/v scales".into())?;
    ensure(HEAD_SIZES.contains(&(d as u32)), "head_size", || format!("{d} (kernels exist for {HEAD_SIZES:?})"))?;
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
    if causal {
        validate_batch(batch, nt, spec.block_size, a.block_table_stride)?;
    } else {
        let pb = crate::prefill::PrefillBatch { query_start_loc: batch.query_start_loc, seq_lens: batch.seq_lens, key_start_loc: None };
        crate::prefill::validate_prefill_batch(&pb, nt, false, Some((spec.block_size, a.block_table_stride)))?;
    }
    let need = crate::prefill::block_table_reach(batch.seq_lens, spec.block_size, a.block_table_stride);
    ensure(a.block_table.dtype == DType::I32 && a.block_table.len >= need, "block_table", || {
        format!("must hold {need} i32 ({num_reqs} rows of {}), got {} x {:?}", a.block_table_stride, a.block_table.len, a.block_table.dtype)
    })?;
    meta.check(num_reqs)?;
    if let Some(l) = &a.lse {
        ensure(l.dtype == DType::F32 && l.len >= nt * hq, "lse", || format!("must be {nt} x {hq} f32"))?;
    }
    let alibi = optional_f32(&a.alibi_slopes, "alibi_slopes", hq)?;
    let sinks = optional_f32(&a.sinks, "sinks", hq)?;
    let (k_scale, v_scale) = match &a.scales {
        Some(s) if cache_dtype == DType::Fp8E4m3 => (f32_values(&s.k, "scales.k", 1)?, f32_values(&s.v, "scales.v", 1)?),
        _ => (0, 0),
    };
    ensure(ws.head_size == d, "workspace", || format!("made for head_size {}, not {d}", ws.head_size))?;
    ws.check_batch(num_reqs, nt)?;
    if num_reqs == 0 || nt == 0 {
        return Ok(DecodePlan::default());
    }

    let max_q = batch.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as u32).max().unwrap_or(1);
    let fp8 = cache_dtype == DType::Fp8E4m3;
    // The kernel variant that depends on the lengths (FP8's deep pipeline) is the plan's for a
    // device plan (a graph's runs whatever lengths its steps have).
    let planned_len = match source {
        PlanSource::Device(dp) if matches!(dp.kernel, KernelId::DecodeKr { long: true, .. }) => u32::MAX,
        PlanSource::Device(_) => 0,
        PlanSource::Host(_) => max_len(batch.seq_lens),
    };
    // A device plan's kernel was chosen when it was planned; the tuning changes only the CTA
    // target and the even waves, which it does not use.
    let tuning = match source {
        PlanSource::Host(p) => p.tuning,
        PlanSource::Device(_) => Tuning::DEFAULT,
    };
    let tc = decode_tc_kernel(dev, q_dtype, fp8, d, hq, spec.num_kv_heads, max_q, planned_len, &tuning)?;
    let kernel = tc.kernel;
    let (plan, wp, launch) = match source {
        PlanSource::Device(dp) => {
            dp.check_layer(&tc)?;
            (DecodePlan { kernel, ..DecodePlan::default() }, dp.workspace_ptrs(ws, stream), Launch::Fixed(dp))
        }
        PlanSource::Host(p) => {
            let plan =
                DecodePlan { kernel, ..plan_decode_tc(batch, hq, tc.group, tc.shape, tc.target, tc.slots, p.split, ws.partial_rows()) };
            let wp = if !plan.needs_device_plan() {
                WorkspacePtrs::default()
            } else if tc.fused_merge && plan.uniform_splits().is_some() {
                // Derived from the CTA index and merged in pass 1: only the partials' room.
                ws.check_plan(&plan, num_reqs, nt)?;
                ws.partials_ptrs(stream)
            } else {
                ws.upload(stream, &plan, num_reqs, nt)?
            };
            (plan, wp, Launch::Planned)
        }
    };
    let (status_ptr, _o7) = status.word.device_ptr_mut(stream);
    let (k_origin, v_origin) = spec.kv_origins();
    let cb = cache_dtype.size_bytes() as u64;
    let lse_ptr = a.lse.as_ref().map_or(0, |l| l.ptr);
    let tp = PrefillParams {
        q: a.q.ptr,
        q_token_stride: a.q_rows.token_stride as u64,
        q_head_stride: a.q_rows.head_stride as u64,
        k: a.cache.ptr + k_origin as u64 * cb,
        v: a.cache.ptr + v_origin as u64 * cb,
        k_strides: spec.strides(),
        v_strides: spec.strides(),
        block_table: a.block_table.ptr,
        block_table_stride: a.block_table_stride as u64,
        seq_lens: meta.seq_lens.ptr,
        key_start_loc: 0,
        query_start_loc: meta.query_start_loc.ptr,
        out: a.out.ptr,
        out_token_stride: a.out_rows.token_stride as u64,
        out_head_stride: a.out_rows.head_stride as u64,
        lse: lse_ptr,
        partial_out: wp.partial_out,
        partial_lse: wp.partial_lse,
        req_num_splits: wp.req_num_splits,
        req_partial_base: wp.req_partial_base,
        work_items: wp.items,
        alibi_slopes: alibi,
        sinks,
        k_scale,
        v_scale,
        status: status_ptr,
        scale_log2: opts.softmax_scale * LOG2_E,
        softcap: opts.softcap.unwrap_or(0.0),
        window: opts.window.unwrap_or(0),
        num_blocks: spec.num_blocks as u32,
        block_size: spec.block_size as u32,
        chunk: plan.chunk,
        num_q_heads: hq as u32,
        group: (hq / spec.num_kv_heads) as u32,
        causal: causal as u32,
        v_slices: 0,
        v_row: 0,
        cluster: 0,
        plan: 0,
        sched: 0,
        ctas: 0,
        ..PrefillParams::default()
    };
    let (items, tp) = match launch {
        Launch::Planned => {
            let uniform = if wp.items == 0 { plan.uniform_splits().unwrap_or(0) } else { 0 };
            (plan.items.len() / 2, PrefillParams { uniform_splits: uniform, ..tp })
        }
        Launch::Fixed(dp) => (dp.capacity_items, PrefillParams { chunk: 0, plan: dp.header, ..tp }),
    };
    let tp = if tc.fused_merge { PrefillParams { merge_counters: ws.merge_counters_ptr(stream), ..tp } } else { tp };
    let ctas = items * spec.num_kv_heads;
    ensure(ctas < i32::MAX as usize, "workspace", || format!("{ctas} CTAs exceed a launch"))?;
    dev.launch_pdl(stream, tc.id, (ctas as u32, 1, 1), tc.threads, tc.smem, tp)?;
    let merge = match launch {
        Launch::Planned => plan.needs_merge(),
        Launch::Fixed(dp) => dp.needs_merge,
    };
    if merge && !tc.fused_merge {
        launch_merge(dev, stream, &wp, meta.query_start_loc.ptr, (&a.out, &a.out_rows), lse_ptr, sinks, q_dtype)?;
    }
    Ok(plan)
}

/// Counters a workspace of `partial_rows` rows needs for split-K merged in pass 1.
fn merge_counters(partial_rows: usize) -> usize {
    partial_rows / 2 + 1
}

/// Device addresses of an uploaded plan in a [`DecodeWorkspace`]; all 0 for a launch that
/// needs no plan on the device (its CTAs derive their items from their index).
#[derive(Default)]
pub(crate) struct WorkspacePtrs {
    pub items: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    pub token_request: u64,
    pub partial_out: u64,
    pub partial_lse: u64,
}

impl DecodeWorkspace {
    /// Uploads a plan's arrays (one copy enqueued on `stream`) after checking they fit.
    pub(crate) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &DecodePlan,
        num_reqs: usize,
        num_tokens: usize,
    ) -> Result<WorkspacePtrs> {
        self.check_plan(plan, num_reqs, num_tokens)?;
        let mut words = std::mem::take(&mut self.plan_words);
        words.clear();
        let r = append_plan(&mut words, plan);
        // One pageable copy: the driver sends a small one with the stream's commands, which
        // measured 8 us a call cheaper than a copy-engine transfer from pinned memory.
        let uploaded = stream.memcpy_htod(&words[..], &mut self.plan_device.slice_mut(..words.len()));
        self.plan_words = words;
        uploaded?;
        // The buffers live as long as the workspace, which the caller keeps past the launches.
        let base = self.plan_device.device_ptr(stream).0;
        let at = |r: Region| base + r.byte_offset() as u64;
        Ok(WorkspacePtrs {
            items: at(r.items),
            req_num_splits: at(r.req_num_splits),
            req_partial_base: at(r.req_partial_base),
            token_request: at(r.token_request),
            partial_out: self.partial_out.device_ptr_mut(stream).0,
            partial_lse: self.partial_lse.device_ptr_mut(stream).0,
        })
    }

    pub(crate) fn head_size(&self) -> usize {
        self.head_size
    }
}

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
    pub prefix_out: DevIn<'a>,
    pub prefix_lse: DevIn<'a>,
    pub suffix_out: DevIn<'a>,
    pub suffix_lse: DevIn<'a>,
    pub out: DevOut<'a>,
    pub out_lse: Option<DevOut<'a>>,
    /// Shape and strides of the three outputs.
    pub rows: RowsDesc,
    /// Element strides (token, head) of the three LSE tensors: `(num_heads, 1)` for
    /// `[num_tokens, num_heads]`, `(1, num_tokens)` for vLLM's `[num_heads, num_tokens]`.
    pub lse_strides: (usize, usize),
}

/// `out = merge(prefix, suffix)` weighted by their LSEs; an empty side (LSE -inf) contributes
/// nothing. f16, bf16 or f32 outputs.
pub fn merge_attn_states(dev: &AttnDevice, stream: &CudaStream, a: MergeArgs<'_>) -> Result<()> {
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

#[cfg(test)]
mod tests {
    use super::*;

    /// The decode kernel of each kind of batch: keys as rows up to 8 rows per kv head (FP8 at
    /// head sizes 64 and 128 only, the deep pipeline from `FP8_LONG_KEYS` keys), keys split
    /// across warps up to 16, the prefill kernel above.
    #[test]
    fn decode_kernel_choice() {
        let name = |fp8, d, group, max_q, max_len| decode_kernel_id(DType::BF16, fp8, d, group, max_q, max_len).1.entry_name();
        let long = keys_rows::FP8_LONG_KEYS;
        assert_eq!(name(false, 128, 4, 1, 100), "decode_kr_bf16_d128");
        assert_eq!(name(false, 128, 4, 1, long), "decode_kr_bf16_d128");
        assert_eq!(name(false, 256, 8, 1, 100), "decode_kr_bf16_d256");
        assert_eq!(name(true, 128, 4, 2, long - 1), "decode_kr_bf16_fp8_d128");
        assert_eq!(name(true, 64, 4, 2, long), "decode_kr_bf16_fp8_long_d64");
        assert_eq!(name(true, 96, 4, 1, long), "decode_tc_bf16_fp8_d96");
        assert_eq!(name(false, 128, 4, 3, 100), "decode_tc_bf16_d128");
        assert_eq!(name(true, 128, 16, 1, long), "decode_tc_bf16_fp8_d128");
        assert_eq!(name(false, 128, 8, 3, 100), "prefill_bf16_dk128_dv128");
        assert_eq!(name(true, 64, 32, 1, long), "prefill_bf16_fp8_dk64_dv64");
        let f16 = decode_kernel_id(DType::F16, false, 96, 2, 1, 10);
        assert_eq!(f16.1.entry_name(), "decode_kr_f16_d96");
        assert_eq!(f16.0, DecodeKernel::TensorCoreKeys);

        // Shared memory: the keys-as-rows layout for its CTAs per SM, else the tile kernel's.
        let (kernel, _, smem) = decode_kernel_id(DType::BF16, true, 128, 4, 1, long);
        assert_eq!(kernel, DecodeKernel::TensorCoreKeys);
        assert_eq!(smem, keys_rows::layout(128, true, keys_rows::ctas_per_sm(128, true, true)).total);
        let (kernel, _, smem) = decode_kernel_id(DType::BF16, false, 128, 4, 3, 100);
        assert_eq!((kernel, smem), (DecodeKernel::TensorCoreKeys, shared_layout(128, 128, true, false).total));
        let (kernel, _, smem) = decode_kernel_id(DType::BF16, false, 128, 32, 1, 100);
        assert_eq!((kernel, smem), (DecodeKernel::TensorCoreRows, shared_layout(128, 128, false, false).total));
    }

    #[test]
    fn measured_waves_by_head_size() {
        assert_eq!([64, 96, 128, 256].map(measured_waves), [4, 1, 1, 2]);
    }
}
