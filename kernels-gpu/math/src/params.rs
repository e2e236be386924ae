//! Kernel parameter blocks, passed by value (one `.param` aggregate per launch).
//!
//! Pointers are plain `u64` device addresses so that the host (which holds `CUdeviceptr`s) and
//! the kernels (which cast them) agree on the layout byte for byte. Strides are in elements.

use crate::paging::CacheStrides;

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
    /// Device f32 scalars (FP8 caches only; 0 otherwise): stored value = x / scale.
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

/// Tiled attention on tensor cores (prefill; chunked prefill; encoders). One CTA per (work
/// item, kv head); a work item is a request, a tile of its query rows and a split of its keys.
/// A request's query rows are its `q_len` tokens x the `group` query heads of the kv head,
/// row = token * group + head-in-group, so GQA heads share each K/V tile.
/// Second word of a work item that does nothing (row tile 0xffff is past any request's rows):
/// pads a device plan's items up to its launch's grid.
pub const NO_WORK: u32 = 0xffff << 16;

#[repr(C)]
#[derive(Clone, Copy, Debug, Default)]
pub struct PrefillParams {
    /// `[num_tokens, num_q_heads, head_size_qk]` with the given strides (elements).
    pub q: u64,
    pub q_token_stride: u64,
    pub q_head_stride: u64,
    /// Keys and values: a paged cache (`block_table != 0`: strides of block, token-in-block,
    /// head) or packed `[total_keys, num_kv_heads, head_size]` tensors (`block_table == 0`:
    /// `block` stride unused, request r's keys are rows `key_start_loc[r]..key_start_loc[r+1]`).
    pub k: u64,
    pub v: u64,
    pub k_strides: CacheStrides,
    pub v_strides: CacheStrides,
    /// `[num_reqs, block_table_stride]` i32, or 0 for packed K/V.
    pub block_table: u64,
    pub block_table_stride: u64,
    /// `[num_reqs]` i32: keys of each request (cached context + new tokens); paged K/V only.
    pub seq_lens: u64,
    /// `[num_reqs + 1]` i32: packed K/V only (`cu_seqlens_k`).
    pub key_start_loc: u64,
    /// `[num_reqs + 1]` i32.
    pub query_start_loc: u64,
    /// `[num_tokens, num_q_heads, head_size_v]`, the dtype of q.
    pub out: u64,
    pub out_token_stride: u64,
    pub out_head_stride: u64,
    /// `[num_tokens, num_q_heads]` f32 natural-log LSE, or 0.
    pub lse: u64,
    /// Split-K workspace: partial outputs (f32, head_size_v each; `v_row` when set) and LSEs,
    /// indexed by `req_partial_base[r] + (split * q_len + token_in_req) * num_q_heads + head`.
    pub partial_out: u64,
    pub partial_lse: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    /// `[num_items][2]` u32: `request`, `row_tile << 16 | split`; or 0 (no plan on the
    /// device): item i is split `i % cluster` of request `i / cluster` (`cluster` as below, at
    /// least 1), row tile 0.
    pub work_items: u64,
    pub alibi_slopes: u64,
    pub sinks: u64,
    pub k_scale: u64,
    pub v_scale: u64,
    pub status: u64,
    pub scale_log2: f32,
    pub softcap: f32,
    pub window: u32,
    pub num_blocks: u32,
    pub block_size: u32,
    /// Keys per split (a multiple of the key tile), or 0 for one split.
    pub chunk: u32,
    pub num_q_heads: u32,
    pub group: u32,
    /// 1 = causal (aligned to the end of the sequence), 0 = every query sees every key.
    pub causal: u32,
    /// MLA (V = the first columns of each K row): the CTAs of a tile split V's columns into
    /// `v_slices` slices of the kernel's head_size_v (the grid's fastest index); 0 or 1 = off.
    pub v_slices: u32,
    /// Width of a split-K partial row (head_size_v x v_slices); 0 = head_size_v.
    pub v_row: u32,
    /// MLA's narrow kernel on sm_90a: when > 1, the CTAs of a thread-block cluster of this size
    /// are the splits of one request (every request has this many) and combine their results
    /// through distributed shared memory, so no partials are written and no merge runs; 0 or 1
    /// = off.
    pub cluster: u32,
    /// A split plan on the device (CUDA-graph replays, whose arguments were fixed at capture):
    /// `[num_items, chunk]` u32, of which the kernel reads `chunk` in place of the field above.
    /// The grid covers the most items a step can have; the items past the step's are
    /// [`NO_WORK`]. 0 = no such plan.
    pub plan: u64,
    /// Persistent kernels (`prefill_wgs_*`): two u32 in device memory, zero between launches:
    /// the next CTA index to take (past the grid's own), and the CTAs that have finished (the
    /// last one zeroes both). 0 for the other kernels.
    pub sched: u64,
    /// Persistent kernels: the CTAs of the plan (work items x kv heads), which the grid's CTAs
    /// take in turn.
    pub ctas: u32,
    /// Split-K merged inside pass 1 (`decode_kr_*`): a u32 arrival counter per split work item
    /// (zero between launches, [`merge_counter_index`]); the CTA that arrives last combines
    /// the item's partials into the output, so no merge kernel runs. 0 = the merge kernel's job.
    pub merge_counters: u64,
    /// With no plan on the device (`work_items` 0): every request has this many splits (item i
    /// is split `i % n` of request `i / n`), and request r's partial rows start at
    /// `n * num_q_heads * query_start_loc[r]`. 0 or 1 = `cluster`'s rule.
    pub uniform_splits: u32,
}

/// The arrival counter of a split work item (kv head `kv_head` of a request whose partial rows
/// start at `partial_base`, a multiple of `num_q_heads`): distinct for every such pair, because
/// a split request holds at least 2 x num_q_heads partial rows, and below
/// `partial_rows / (2 * group)` for a workspace of `partial_rows` rows.
#[inline(always)]
pub fn merge_counter_index(partial_base: u64, num_q_heads: u32, group: u32, kv_head: u32) -> u64 {
    let kv_heads = (num_q_heads / group) as u64;
    partial_base / (2 * num_q_heads as u64) * kv_heads + kv_head as u64
}
