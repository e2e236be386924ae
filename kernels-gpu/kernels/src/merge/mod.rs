//! Merging partial attention results by their LSEs.
//!
//! - [`lse_merge`] and [`entry`]: the `merge` family's kernels, split-K's pass 2
//!   (`decode_merge_*`) and `merge_attn_states_*`.
//! - [`split_merge`]: the same merge done inside pass 1 by the keys-split decode kernels, built
//!   into the `attention` family.

#[cfg(kernels = "merge")]
mod entry;
#[cfg(kernels = "merge")]
mod lse_merge;
#[cfg(kernels = "attention")]
pub(crate) mod split_merge;
