//! attn-rs's paged KV-cache writes and attention on [candle](https://docs.rs/candle-core)
//! tensors: on CPU tensors through attn-rs's CPU backend, on CUDA tensors (the `cuda` feature)
//! through its GPU kernels, enqueued on candle's own stream for the device.
//!
//! | op | what |
//! | --- | --- |
//! | [`reshape_and_cache`] | writes a step's keys and values into a [`KvCache`] at their slots |
//! | [`concat_and_cache_mla`] | writes a step's MLA latents (`kv_c`, `k_pe`) into an [`MlaCache`] |
//! | [`PagedAttention`] | one model's attention: [`begin_step`](PagedAttention::begin_step) once per step with the batch, then per layer [`forward`](PagedAttention::forward) (cache write + attention for a batch mixing decodes and prefills) or [`forward_mla`](PagedAttention::forward_mla) |
//! | [`paged_attention`] | decode of one token per sequence, block tables and context lengths as tensors |
//!
//! # Caches
//!
//! A [`KvCache`] is one tensor holding a layer's K and V planes, in the shape its
//! [`KvCacheSpec`] gives (`[2, num_blocks, block_size, num_kv_heads, head_size]` for
//! [`KvLayout::FlashNhd`], the other layouts likewise); an [`MlaCache`] is `[num_blocks,
//! block_size, latent_dim + rope_dim]`. The cache tensor's dtype is the cache's: f16, bf16, f32
//! or `DType::F8E4M3`, whose K/V scales are one-element f32 tensors held by the cache.
//!
//! # Layouts
//!
//! Queries, keys and values are `[tokens, heads, head_size]` or `[tokens, heads * head_size]`
//! tensors with any token and head strides and a contiguous head dimension: their candle
//! strides become attn-rs's row strides and the op gets a view of their storage from the
//! layout's start offset, without a copy (so `narrow`s of a fused QKV projection go straight
//! in). A layout the kernels cannot index (a strided head dimension, interleaved or overlapping
//! heads and tokens, a broadcast) is refused with an error naming the argument and saying to
//! call `.contiguous()`. Caches must be contiguous (from any start offset).
//!
//! # Errors
//!
//! Every function returns [`candle_core::Result`], as candle's ops do, so that the ops compose
//! with `?` in a candle model. attn-rs's refusals keep their message, which names the argument
//! and the value, inside `candle_core::Error::Wrapped` (as text: candle's wrapper cannot be
//! downcast); this crate's own refusals read the same way (``invalid argument `q`: ...``).
//!
//! # Devices
//!
//! On a CUDA device the ops take the `CudaSlice` inside candle's storage, run on candle's stream
//! for the device (`CudaDevice::cuda_stream`) and synchronise nothing; the device's attn-rs
//! kernels ([`attn_rs::AttnDevice`], from candle's own CUDA context) are loaded once per candle
//! device and kept. Slots or block ids past the cache are skipped by the kernels and reported
//! by [`check_device_status`] (or [`PagedAttention::check_status`]) when the caller chooses to
//! wait; on the CPU they are errors at once.

mod attention;
mod cache;
mod cache_write;
#[cfg(feature = "cuda")]
mod cuda;
mod decode;
mod error;
mod host;
mod layout;
mod reorder;

pub use attention::{LayerExtras, PagedAttention, StepBatch};
pub use attn_rs;
pub use attn_rs::forward::{CacheSpec, ForwardConfig, ForwardLimits};
pub use attn_rs::metadata::BatchSplit;
pub use attn_rs::{KvCacheSpec, KvLayout, MlaCacheSpec};
pub use cache::{KvCache, MlaCache};
pub use cache_write::{concat_and_cache_mla, reshape_and_cache};
pub use decode::paged_attention;

/// Waits for `device`'s stream and reports any slot past the cache (`SlotOutOfRange`) or block id
/// outside it (`BlockOutOfRange`) that the standalone ops ([`reshape_and_cache`],
/// [`concat_and_cache_mla`], [`paged_attention`]) met on it since the last check. A no-op on the
/// CPU, where those are errors of the call itself.
pub fn check_device_status(device: &candle_core::Device) -> candle_core::Result<()> {
    match device {
        #[cfg(feature = "cuda")]
        candle_core::Device::Cuda(d) => {
            use error::AttnResult;
            let state = cuda::device_state(d)?;
            let mut status = state.status.lock().expect("status poisoned");
            status.check(&state.stream).c()
        }
        _ => Ok(()),
    }
}
