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
    /// Device u32 status word (see [`crate::status`]).
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
