//! Kernel parameter blocks, passed by value (one `.param` aggregate per launch).
//!
//! Pointers are plain `u64` device addresses so that the host (which holds `CUdeviceptr`s) and
//! the kernels (which cast them) agree on the layout byte for byte. Strides are in elements.

use crate::paging::CacheStrides;
use crate::softmax::LOG2_E;

/// `reshape_and_cache`: write K and V rows `[num_tokens, num_heads, head_size]` into a paged cache.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct CacheWriteParams {
    pub key: u64,
    pub value: u64,
    pub key_token_stride: u64,
    pub key_head_stride: u64,
    pub value_token_stride: u64,
    pub value_head_stride: u64,
    pub k_cache: u64,
    pub v_cache: u64,
    pub k_strides: CacheStrides,
    pub v_strides: CacheStrides,
    /// `[num_tokens]` i64; negative = padding.
    pub slot_mapping: u64,
    /// Device f32 scales (FP8 caches only; 0 otherwise): stored value = x / scale, head `h`'s
    /// at `k_scale + 4 * h * scale_head_stride`.
    pub k_scale: u64,
    pub v_scale: u64,
    /// Device status block, `STATUS_WORDS` u32 (see [`crate::status`]).
    pub status: u64,
    /// `num_blocks * block_size`: slots at or past this are refused.
    pub num_slots: u64,
    pub num_tokens: u32,
    pub num_heads: u32,
    pub head_size: u32,
    pub block_size: u32,
    /// 0: one scale per tensor; 1: one per kv head.
    pub scale_head_stride: u32,
    /// Unused; keeps the block a whole number of 8-byte words with no implicit padding.
    pub reserved: u32,
}

/// `concat_and_cache_mla`: write `kv_c [T, latent]` and `k_pe [T, rope]` as one row of the MLA
/// cache `[num_blocks, block_size, latent + rope]`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MlaCacheWriteParams {
    pub kv_c: u64,
    pub k_pe: u64,
    pub kv_c_token_stride: u64,
    pub k_pe_token_stride: u64,
    pub cache: u64,
    /// Strides of the cache (head stride unused: one latent "head").
    pub cache_strides: CacheStrides,
    pub slot_mapping: u64,
    pub scale: u64,
    pub status: u64,
    pub num_slots: u64,
    pub num_tokens: u32,
    pub latent_dim: u32,
    pub rope_dim: u32,
    pub block_size: u32,
}

/// Threads of a split-K merge CTA.
pub const MERGE_THREADS: u32 = 128;
/// The largest head size the split-K merge takes (MLA's 512: a 16-byte chunk a thread; any
/// multiple of 4 up to this).
pub const MAX_MERGE_HEAD_SIZE: u32 = 4 * MERGE_THREADS;
/// Shared memory of a split-K merge CTA: a sum per thread and dimension chunk.
pub const MERGE_SHARED_BYTES: u32 = 16 * MERGE_THREADS;

/// Pass 2 of split-K: merge each multi-split request's partials (and the sink) into the output.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct DecodeMergeParams {
    pub partial_out: u64,
    pub partial_lse: u64,
    /// `[num_reqs + 1]` i32 of the plan's batch, or 0: every token is its own request (sparse
    /// MLA plans per query token), and `token_request` is not read.
    pub query_start_loc: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    /// `[num_tokens]` i32: the request of each query token.
    pub token_request: u64,
    pub out: u64,
    pub out_token_stride: u64,
    pub out_head_stride: u64,
    pub lse: u64,
    pub sinks: u64,
    pub num_tokens: u32,
    pub num_q_heads: u32,
    pub head_size: u32,
}

/// `merge_attn_states`: out = merge of (prefix_out, prefix_lse) and (suffix_out, suffix_lse).
/// Outputs `[num_tokens, num_heads, head_size]` with strides; LSEs f32 with strides.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MergeStatesParams {
    pub prefix_out: u64,
    pub suffix_out: u64,
    pub out: u64,
    pub prefix_lse: u64,
    pub suffix_lse: u64,
    /// Merged LSE, or 0.
    pub out_lse: u64,
    /// Element strides of the three outputs (token, head), shared.
    pub token_stride: u64,
    pub head_stride: u64,
    /// Strides of the three LSE tensors (token, head), shared.
    pub lse_token_stride: u64,
    pub lse_head_stride: u64,
    pub num_tokens: u32,
    pub num_heads: u32,
    pub head_size: u32,
}

/// Second word of a work item that does nothing (row tile 0xffff is past any request's rows):
/// pads a device plan's items up to its launch's grid.
pub const NO_WORK: u32 = 0xffff << 16;

/// The parameter block of every attention launch: the tensor-core kernels (`prefill_*`,
/// `decode_tc_*`), the keys-as-rows decode (`decode_kr_*`), the Hopper prefill (`prefill_wgs_*`)
/// and MLA (`mla_*`), launched by the decode, prefill and MLA calls (which
/// `forward` and cascade attention go through). One CTA per (work item, kv head); a work item
/// is a request, a tile of its query rows and a split of its keys. A request's query rows are
/// its `q_len` tokens x the `group` query heads of the kv head, row = token * group +
/// head-in-group, so GQA heads share each K/V tile.
///
/// The fields are grouped by concern; a group a kernel does not use is zero (its feature off).
/// Every kernel reads [`qkv`](Self::qkv), [`batch`](Self::batch), [`output`](Self::output),
/// [`split`](Self::split), [`per_head`](Self::per_head), [`status`](Self::status),
/// [`variant`](Self::variant), [`shape`](Self::shape) and [`mask`](Self::mask) (its work
/// items, K/V addresses and rows go through the same helpers); [`fp8`](Self::fp8) is read by
/// the kernels of FP8 caches (`*_fp8_*`), [`mla`](Self::mla) is set by the MLA kernels' launch
/// (the other kernels read it as 0), and [`schedule`](Self::schedule)'s fields each belong to
/// one path (see there).
///
/// The groups follow one another in the order of the flat block the kernels were built
/// against, every field at its offset there (the `const` assertions below hold them), so the
/// variant, whose fields were not adjacent, is three groups: its per-head vectors
/// ([`PerHead`]), its scalars ([`VariantParams`]) and the [`Mask`].
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct AttnParams {
    pub qkv: QkvTensors,
    pub batch: BatchMeta,
    pub output: OutputTensors,
    pub split: SplitK,
    pub per_head: PerHead,
    pub fp8: Fp8Scales,
    /// Device status block, `STATUS_WORDS` u32 (see [`crate::status`]): where a kernel reports
    /// a block id outside the cache.
    pub status: u64,
    pub variant: VariantParams,
    pub shape: Shape,
    pub mask: Mask,
    pub mla: MlaParams,
    pub schedule: Schedule,
    pub local: LocalMask,
    pub sparse: SparseIndices,
    pub scale_layout: ScaleLayout,
    pub dims: HeadDims,
}

/// The head sizes a launch runs at, when they are below the kernel's compiled tile widths
/// (`DK`, `DV`): a kernel built for width `D` serves every head size up to `D` that is a
/// multiple of 8, with the columns past the head size zero-filled in shared memory (never
/// read from global memory) and never stored. 0 = the kernel's own widths.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct HeadDims {
    /// Columns of each Q and K row.
    pub qk: u32,
    /// Columns of each V row and of each output (and split-K partial) row.
    pub v: u32,
}

impl HeadDims {
    /// The Q/K columns of a kernel of width `dk`.
    #[inline(always)]
    pub fn qk_or(&self, dk: u32) -> u32 {
        if self.qk == 0 {
            dk
        } else {
            self.qk
        }
    }

    /// The V columns of a kernel of width `dv`.
    #[inline(always)]
    pub fn v_or(&self, dv: u32) -> u32 {
        if self.v == 0 {
            dv
        } else {
            self.v
        }
    }
}

/// How the FP8 scales of [`Fp8Scales`] are laid out (kernels that read an FP8 cache; MLA's one
/// latent head takes the first).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct ScaleLayout {
    /// 0: one K and one V scale for the cache; 1: one per kv head, kv head `h`'s at
    /// `k_scale + 4 * h` (and `v_scale + 4 * h`).
    pub head_stride: u32,
    /// Unused; keeps the group a whole number of 8-byte words with no implicit padding.
    pub reserved: u32,
}

/// The queries and the keys and values (every kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct QkvTensors {
    /// `[num_tokens, num_q_heads, head_size_qk]` with the given strides (elements).
    pub q: u64,
    pub q_token_stride: u64,
    pub q_head_stride: u64,
    /// Keys and values: a paged cache (`block_table != 0`: strides of block, token-in-block,
    /// head) or packed `[total_keys, num_kv_heads, head_size]` tensors (`block_table == 0`:
    /// `block` stride unused, request r's keys are rows `key_start_loc[r]..key_start_loc[r+1]`;
    /// `prefill_*` and `prefill_wg*` only). MLA: both are the latent cache, V being the first
    /// columns of each K row.
    pub k: u64,
    pub v: u64,
    pub k_strides: CacheStrides,
    pub v_strides: CacheStrides,
}

/// The batch's requests: where each one's queries and keys are (every kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct BatchMeta {
    /// `[num_reqs, block_table_stride]` i32, or 0 for packed K/V.
    pub block_table: u64,
    pub block_table_stride: u64,
    /// `[num_reqs]` i32: keys of each request (cached context + new tokens); paged K/V only.
    pub seq_lens: u64,
    /// `[num_reqs + 1]` i32: packed K/V only (`cu_seqlens_k`).
    pub key_start_loc: u64,
    /// `[num_reqs + 1]` i32.
    pub query_start_loc: u64,
}

/// Where finished rows go (every kernel; split rows go to [`SplitK`]'s partials instead).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct OutputTensors {
    /// `[num_tokens, num_q_heads, head_size_v]`, the dtype of q.
    pub out: u64,
    pub out_token_stride: u64,
    pub out_head_stride: u64,
    /// `[num_tokens, num_q_heads]` f32 natural-log LSE, or 0.
    pub lse: u64,
}

/// Split-K and the device plan: the work items, each request's splits and the partials'
/// workspace. Every kernel takes its work item here (or derives it: [`Schedule`]); a request
/// with more than one split writes partials (but in an MLA cluster, [`MlaParams::cluster`]),
/// which the merge kernel or `decode_kr_*` itself ([`Schedule::merge_counters`]) merges.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SplitK {
    /// Split-K workspace: partial outputs (f32, head_size_v each; [`MlaParams::v_row`] when
    /// set) and LSEs, indexed by `req_partial_base[r] + (split * q_len + token_in_req) *
    /// num_q_heads + head`.
    pub partial_out: u64,
    pub partial_lse: u64,
    /// `[num_reqs]` u32 each, or 0 (no plan on the device: [`Schedule::uniform_splits`]).
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    /// `[num_items][2]` u32: `request`, `row_tile << 16 | split`; or 0 (no plan on the
    /// device): item i is split `i % cluster` of request `i / cluster` ([`MlaParams::cluster`],
    /// at least 1; or [`Schedule::uniform_splits`]), row tile 0.
    pub work_items: u64,
}

/// The variant's per-query-head vectors, `[num_q_heads]` f32 each, or 0 (off). Read by every
/// kernel but MLA's launch, which sets neither.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PerHead {
    /// ALiBi: the head's slope times the key's distance back from the query joins its logit.
    pub alibi_slopes: u64,
    /// Attention sinks: a logit per head (natural-log units) that joins the softmax's
    /// denominator as one more key with no value.
    pub sinks: u64,
}

/// Dequantisation scales of an FP8 E4M3 cache: device f32s, one per tensor or one per kv head
/// ([`ScaleLayout`]) (the kernels of FP8 caches, `*_fp8_*`; 0 otherwise). A cached value is
/// `x / scale`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Fp8Scales {
    pub k_scale: u64,
    pub v_scale: u64,
}

/// The variant's scalars (every kernel; MLA's launch sets only the scale).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct VariantParams {
    /// The softmax scale in base-2 units (times log2(e)).
    pub scale_log2: f32,
    /// Soft-capping of the scaled scores, `cap * tanh(x / cap)`; 0 = none.
    pub softcap: f32,
    /// A sliding window: a query sees the `window` keys up to its position; 0 = none.
    pub window: u32,
}

impl VariantParams {
    /// The scalars of softmax scale `softmax_scale` (natural units), with an optional soft-cap
    /// and window.
    pub fn new(softmax_scale: f32, softcap: Option<f32>, window: Option<u32>) -> VariantParams {
        VariantParams { scale_log2: softmax_scale * LOG2_E, softcap: softcap.unwrap_or(0.0), window: window.unwrap_or(0) }
    }
}

/// Sizes: the cache's, a split's and the heads' (every kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Shape {
    /// The paged cache's blocks (a block id at or past this is refused: `status`) and tokens
    /// per block; 0 and 1 for packed K/V.
    pub num_blocks: u32,
    pub block_size: u32,
    /// Keys per split (a multiple of the key tile), or 0 for one split.
    pub chunk: u32,
    pub num_q_heads: u32,
    /// Query heads per kv head.
    pub group: u32,
}

/// Which keys a query sees, besides the variant's window (every kernel).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Mask {
    /// 1 = causal (aligned to the end of the sequence), 0 = every query sees every key.
    pub causal: u32,
}

/// MLA (`mla_*`): set by MLA's launch; the other kernels read them as 0.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct MlaParams {
    /// V = the first columns of each K row: the CTAs of a tile split V's columns into
    /// `v_slices` slices of the kernel's head_size_v (the grid's fastest index); 0 or 1 = off.
    pub v_slices: u32,
    /// Width of a split-K partial row (head_size_v x v_slices); 0 = head_size_v.
    pub v_row: u32,
    /// MLA's narrow kernel on sm_90a: when > 1, the CTAs of a thread-block cluster of this size
    /// are the splits of one request (every request has this many) and combine their results
    /// through distributed shared memory, so no partials are written and no merge runs; 0 or 1
    /// = off.
    pub cluster: u32,
}

/// How work items reach the CTAs and how splits combine, each field for the kernels named
/// (0 for the others).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct Schedule {
    /// A plan on the device (CUDA-graph replays, whose arguments were fixed at capture):
    /// `[num_items, chunk]` u32, of which decode and MLA read `chunk` in place of
    /// [`Shape::chunk`] (prefill's is 0), and the persistent prefill kernels `num_items` (its
    /// tiles) in place of [`Schedule::ctas`]. The grid covers the most items a step can have;
    /// the items past the step's are [`NO_WORK`]. 0 = no such plan.
    pub plan: u64,
    /// Persistent kernels (`prefill_wgs_*`): two u32 in device memory, zero between launches:
    /// the next CTA index to take (past the grid's own), and the CTAs that have finished (the
    /// last one zeroes both). 0 for the other kernels.
    pub sched: u64,
    /// Persistent kernels: the CTAs of the plan (work items x kv heads), which the grid's CTAs
    /// take in turn (with a [`Schedule::plan`], its tiles x kv heads instead).
    pub ctas: u32,
    /// Split-K merged inside pass 1 (`decode_kr_*`): a u32 arrival counter per split work item
    /// (zero between launches, [`merge_counter_index`]); the CTA that arrives last combines
    /// the item's partials into the output, so no merge kernel runs. 0 = the merge kernel's job.
    pub merge_counters: u64,
    /// Decode with no plan on the device ([`SplitK::work_items`] 0): every request has this
    /// many splits (item i is split `i % n` of request `i / n`), and request r's partial rows
    /// start at `n * num_q_heads * query_start_loc[r]`. 0 or 1 = [`MlaParams::cluster`]'s rule.
    pub uniform_splits: u32,
}

/// Masks of the layer kinds past plain decoders (every kernel but MLA's, whose launch leaves
/// them 0 = off). A group of its own after the others, so that the offsets the existing kernels
/// read do not move.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct LocalMask {
    /// Chunked local attention (Llama 4): a query sees only the keys of its own chunk of `chunk`
    /// positions (`key / chunk == pos / chunk`), with causality as [`Mask::causal`] says; 0 = off.
    pub chunk: u32,
    /// A symmetric window (bidirectional encoders) plus one: a query sees the keys with
    /// `|key - pos| < symmetric`, i.e. at most `symmetric - 1` positions either side; 0 = off.
    pub symmetric: u32,
}

impl LocalMask {
    /// Chunks of `chunk` positions and a symmetric window of `symmetric_window` positions either
    /// side (each `None`: off).
    pub fn new(chunk: Option<u32>, symmetric_window: Option<u32>) -> LocalMask {
        LocalMask { chunk: chunk.unwrap_or(0), symmetric: symmetric_window.map_or(0, |w| w.saturating_add(1)) }
    }
}

/// Sparse MLA (`mla_sparse_*`, DeepSeek-V3.2's top-k attention): each query token attends only
/// the positions its row of the index tensor lists, over its request's paged latent cache. Work
/// items are per query token (the plan's requests are the tokens, each with `topk` keys), so
/// the request a token belongs to comes from `token_request`. A group of its own after the
/// others, so that no offset the other kernels read moves; zero for every other launch.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct SparseIndices {
    /// `[num_tokens, row_stride]` i32: token t's `topk` positions (0-based within its request,
    /// any order) at `t * row_stride ..`; -1 is padding (skipped), any other value outside
    /// `0..seq_len` of the request is skipped and reported (`INDEX_OUT_OF_RANGE`).
    pub indices: u64,
    /// Elements between consecutive tokens' rows of `indices`.
    pub row_stride: u64,
    /// `[num_tokens]` i32: each token's request in the batch (its block-table row and
    /// `seq_lens` entry); the library's upload (the plan's `token_request`) of the batch it
    /// checked.
    pub token_request: u64,
    /// Entries per token (k): the keys of each token's work.
    pub topk: u32,
    /// Unused; keeps the group a whole number of 8-byte words with no implicit padding.
    pub reserved: u32,
}

/// Asserts that each field of `$ty` (a path through its groups) is at the byte offset given.
macro_rules! assert_offsets {
    ($ty:ty { $($($field:ident).+ = $offset:literal),* $(,)? }) => {
        $(const _: () = assert!(core::mem::offset_of!($ty, $($field).+) == $offset);)*
    };
}

// The flat layout of the block the kernels are built against, field by field.
assert_offsets!(AttnParams {
    qkv.q = 0,
    qkv.q_token_stride = 8,
    qkv.q_head_stride = 16,
    qkv.k = 24,
    qkv.v = 32,
    qkv.k_strides = 40,
    qkv.v_strides = 64,
    batch.block_table = 88,
    batch.block_table_stride = 96,
    batch.seq_lens = 104,
    batch.key_start_loc = 112,
    batch.query_start_loc = 120,
    output.out = 128,
    output.out_token_stride = 136,
    output.out_head_stride = 144,
    output.lse = 152,
    split.partial_out = 160,
    split.partial_lse = 168,
    split.req_num_splits = 176,
    split.req_partial_base = 184,
    split.work_items = 192,
    per_head.alibi_slopes = 200,
    per_head.sinks = 208,
    fp8.k_scale = 216,
    fp8.v_scale = 224,
    status = 232,
    variant.scale_log2 = 240,
    variant.softcap = 244,
    variant.window = 248,
    shape.num_blocks = 252,
    shape.block_size = 256,
    shape.chunk = 260,
    shape.num_q_heads = 264,
    shape.group = 268,
    mask.causal = 272,
    mla.v_slices = 276,
    mla.v_row = 280,
    mla.cluster = 284,
    schedule.plan = 288,
    schedule.sched = 296,
    schedule.ctas = 304,
    schedule.merge_counters = 312,
    schedule.uniform_splits = 320,
    local.chunk = 328,
    local.symmetric = 332,
    sparse.indices = 336,
    sparse.row_stride = 344,
    sparse.token_request = 352,
    sparse.topk = 360,
    scale_layout.head_stride = 368,
    dims.qk = 376,
    dims.v = 380,
});
assert_offsets!(CacheStrides { block = 0, token = 8, head = 16 });
const _: () = assert!(core::mem::size_of::<CacheStrides>() == 24);
const _: () = assert!(core::mem::size_of::<AttnParams>() == 384 && core::mem::align_of::<AttnParams>() == 8);

/// The arrival counter of a split work item (kv head `kv_head` of a request whose partial rows
/// start at `partial_base`, a multiple of `num_q_heads`): distinct for every such pair, because
/// a split request holds at least 2 x num_q_heads partial rows, and below
/// `partial_rows / (2 * group)` for a workspace of `partial_rows` rows.
#[inline(always)]
pub fn merge_counter_index(partial_base: u64, num_q_heads: u32, group: u32, kv_head: u32) -> u64 {
    let kv_heads = (num_q_heads / group) as u64;
    partial_base / (2 * num_q_heads as u64) * kv_heads + kv_head as u64
}

/// From this many splits an item's merge in pass 1 runs in two levels
/// ([`merge_group_splits`]): the last CTA of each group of splits combines the group, and the
/// last group the groups. One CTA folding every partial reads them four at a time, one round
/// trip to L2 each: at 132 splits (one request, GQA 16) that tail was about 25 us of a 60 us
/// call on an H200 (docs/decode.md).
pub const TWO_LEVEL_MERGE_SPLITS: u32 = 16;

/// Splits per group of an item's merge in pass 1: all `num_splits` (one level) below
/// [`TWO_LEVEL_MERGE_SPLITS`], else ceil(sqrt(num_splits)), so that both levels fold about as
/// many partials.
#[inline(always)]
pub const fn merge_group_splits(num_splits: u32) -> u32 {
    if num_splits < TWO_LEVEL_MERGE_SPLITS {
        return num_splits;
    }
    let mut g = 4;
    while g * g < num_splits {
        g += 1;
    }
    g
}

/// The arrival counter of group `g` of a split work item's two-level merge: the `g + 1`-th
/// value after [`merge_counter_index`]'s in the item's own span. A request of `n` splits and
/// `q` query tokens holds `n q num_q_heads` partial rows, so the next split request's counter
/// lies at least `floor(n q / 2)` values on; its `ceil(n / ceil(sqrt n))` groups take fewer
/// than that from 16 splits on ([`TWO_LEVEL_MERGE_SPLITS`]), and stay below
/// `partial_rows / (2 group)` with the item's own counter.
#[inline(always)]
pub fn merge_group_counter_index(partial_base: u64, num_q_heads: u32, group: u32, kv_head: u32, g: u32) -> u64 {
    let kv_heads = (num_q_heads / group) as u64;
    (partial_base / (2 * num_q_heads as u64) + 1 + g as u64) * kv_heads + kv_head as u64
}

/// A TMA tensor map (the driver's `CUtensorMap`): 128 opaque bytes encoded on the host
/// (`cuTensorMapEncodeTiled`) and read by `cp.async.bulk.tensor` where they lie, here in the
/// kernel's parameters, at a 64-byte aligned address. rustc's nvptx kernel ABI takes no
/// parameter alignment above 16, so the maps sit at multiples of 64 from the start of the
/// parameter block (asserted below) and `cargo xtask build-ptx` declares the block 64-byte
/// aligned in the PTX.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default)]
pub struct TensorMap(pub [u64; 16]);

/// A paged 16-bit cache's K and V as TMA tensor maps, for the warp-specialised prefill kernel's
/// producer (`prefill_wgs_*`): it copies a stage with one copy per plane and box of `box_keys`
/// keys where every box is whole (keys of one block, all before the request's end, the first
/// at a multiple of `box_keys` in its block) and row by row otherwise.
///
/// Each map is 5-dimensional, innermost first: 64 columns (one 128-byte swizzle atom), 8 rows
/// (the cache's token stride), `W / 64` atoms (128 bytes apart), 8-row groups and heads, so that
/// a box of `{64, 8, W / 64, box_keys / 8, 1}` lands as `box_keys / 8` of a stage's 8-row groups
/// (`hopper_prefill::swizzled`).
/// Key `pos` of block `b` (`off = pos % block_size`) of kv head `h` is at group
/// `(b * slots_per_block + off) / 8` and head coordinate `b * heads_per_block + h`: a cache
/// whose blocks hold their tokens' rows for all heads together (`[blocks, block_size, heads, d]`)
/// has `slots_per_block = block_size`, `heads_per_block = 0`; one whose blocks hold a head's rows
/// together (`[blocks, heads, block_size, d]`) has `0` and the head count.
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default)]
pub struct PagedKvMaps {
    pub k: TensorMap,
    pub v: TensorMap,
    /// 0: no maps (another layout, a head size below the kernel's width, packed K/V, an FP8
    /// cache): every row is copied with `cp.async`.
    pub enabled: u32,
    /// Keys of a box: the block size or the stage's keys, whichever is smaller (a multiple of 8).
    pub box_keys: u32,
    pub slots_per_block: u32,
    pub heads_per_block: u32,
}

/// The parameters of `prefill_wgs_*`: the attention launch's, then the cache's tensor maps
/// (at offsets 384 and 512, multiples of 64 as `cp.async.bulk.tensor` needs).
#[repr(C, align(16))]
#[derive(Clone, Copy, Debug, Default)]
pub struct WgsParams {
    pub attn: AttnParams,
    pub kv_maps: PagedKvMaps,
}

const _: () = assert!(core::mem::size_of::<TensorMap>() == 128);
const _: () = assert!(core::mem::offset_of!(WgsParams, kv_maps) == 384 && core::mem::offset_of!(PagedKvMaps, v) == 128);
const _: () = assert!(core::mem::size_of::<WgsParams>() == 656);
