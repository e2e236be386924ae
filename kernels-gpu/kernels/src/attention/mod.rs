//! The `attention` family: every attention kernel (prefill, decode, MLA), built on one
//! tensor-core core.
//!
//! The shared core (FlashAttention-2's tiled online softmax on `mma.sync`), which the other
//! kernels reuse in parts:
//! - [`work`]: a CTA's work item (request, split, tile of query rows) and its rows;
//! - [`kv`]: where the keys come from (paged cache or packed K/V), the per-tile address tables,
//!   the asynchronous row copies and the FP8 conversion in shared memory;
//! - [`tile_mma`]: a warp's S = Q K^T and O += P V;
//! - [`logits`]: scores to logits (scale, soft-cap, ALiBi, masks) and the online-softmax step;
//! - [`output`]: where finished rows go (output or split-K workspace), and the keys-split
//!   epilogue;
//! - [`mainloop`]: the kernel itself (`prefill_*`, `decode_tc_*`), with [`fp8_direct`]'s
//!   fragments for FP8 decode at head sizes 64 and 128.
//!
//! The other kernels: [`keys_rows`] (`decode_kr_*`), [`mla`] (`mla_*`) and, on sm_90a,
//! [`hopper`] (`prefill_wgs_*`). [`entry`] exports them all. The split-K merge
//! inside pass 1 is `crate::merge::split_merge`.

pub(crate) mod config;
mod entry;
pub(crate) mod fp8_direct;
#[cfg(wgmma)]
mod hopper;
#[cfg(wgmma)]
mod keys_m;
mod keys_rows;
pub(crate) mod kv;
mod lazy_rescale;
pub(crate) mod logits;
mod mainloop;
mod mla;
pub(crate) mod output;
mod slab_copy;
mod tile_mma;
pub(crate) mod variants;
pub(crate) mod work;
