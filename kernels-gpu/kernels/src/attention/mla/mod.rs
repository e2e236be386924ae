//! MLA latent attention on tensor cores: Q K^T once per key tile, P shared through shared
//! memory by warps that each own a slice of the output (`attn_math::mla` describes the CTA's
//! two warp grids and the shapes).
//!
//! Per tile: the K rows (576 columns) land in shared memory in 32-row slots through a ring of
//! `cp.async` groups, their addresses looked up a tile ahead into per-slot tables; each warp
//! scores its 16 rows x its keys, masks, publishes its rows' maxima (barrier), turns its scores
//! into weights under the tile's row maxima and stores them as 16-bit P (barrier); then each
//! warp rescales its accumulators by the same maxima and adds P V for its rows and columns, V
//! being the first 512 columns of the K rows already in shared memory. Each latent row is read
//! from global memory once per CTA.
//!
//! Q and K rows sit in `wgmma`'s 128-byte-swizzled K-major layout (`attn_math::mla::swizzled`).
//! On sm_90a the wide shape over a 16-bit cache takes the seesaw order ([`seesaw`]): the two
//! warpgroups score alternate whole tiles (m64n64k16) and each adds P V for its half of the
//! columns (m64n256k16, V read N-major from the same rows), so that one's softmax runs under
//! the other's MMAs. Over an FP8 cache on sm_90a both shapes run e4m3 `wgmma` with the operands
//! swapped, keys on M, the cache's bytes as they are ([`narrow_e4m3`]: 16 rows, the warpgroups
//! taking alternate tiles; [`wide_e4m3`]: each warpgroup 32 of the rows through every tile),
//! each with its own layout. Elsewhere `mma.sync` with `ldmatrix` (conflict-free in that layout)
//! does both products. An FP8 cache's raw rows land in the ring as they are
//! (`attn_math::mla::raw_offset`): on sm_80 the narrow shape converts its fragments from them in
//! registers, on f16 MMAs (bf16 queries scaled by 2^-8 into f16's range), and the wide shape a
//! tile at a time into separate 16-bit slots of Q's type. The scales fold into the score and
//! output factors.
//!
//! Dense and sparse MLA are the same kernel over a [`keys::KeySource`]: key j of a work item is
//! position j of the request (dense, causal among the new tokens) or entry j of the query
//! token's index list (sparse: one token per work item, entries that are padding or outside the
//! request masked out instead of the causal mask).
//!
//! [`kernel`] is the kernel; [`keys`] where its keys come from; [`tile`] its matrix products, [`slots`] its copies into the
//! swizzled slots, [`narrow_e4m3`] and [`wide_e4m3`] (sm_90a) the shapes over an FP8 cache (what both do around their products in [`e4m3_operands`], their softmax step in [`e4m3_softmax`]), [`seesaw`] (sm_90a) the wide shape's
//! seesaw order, and [`combine`] (sm_90a) the cluster combine of a request's splits.

#[cfg(wgmma)]
mod combine;
#[cfg(wgmma)]
mod e4m3_operands;
#[cfg(wgmma)]
mod e4m3_softmax;
pub(crate) mod kernel;
pub(crate) mod keys;
#[cfg(wgmma)]
mod narrow_e4m3;
#[cfg(wgmma)]
mod seesaw;
mod slots;
mod tile;
#[cfg(wgmma)]
mod wide_e4m3;
