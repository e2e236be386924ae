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
//! columns (m64n256k16, V read N-major from the same rows), so that one's softmax runs under the
//! other's MMAs. Over an FP8 cache the wide shape's warpgroups split each tile's keys for Q K^T
//! (m64n32k16) and its columns for P V, each tile's S issued right behind the last tile's P V;
//! elsewhere, and for the narrow shape, `mma.sync` with `ldmatrix` (conflict-free in that
//! layout) does both. An FP8 cache's raw rows land in the ring as they
//! are (`attn_math::mla::raw_offset`). The narrow shape converts its fragments from them in
//! registers, on f16 MMAs (bf16 queries scaled by 2^-8 into f16's range); the wide shape
//! converts a tile at a time into 16-bit rows of Q's type: in place on sm_90a (the raw rows land
//! in the upper half of 16-bit slots), into separate 16-bit slots elsewhere. The scales fold into
//! the score and output factors.
//!
//! Dense and sparse MLA are the same kernel over a [`keys::KeySource`]: key j of a work item is
//! position j of the request (dense, causal among the new tokens) or entry j of the query
//! token's index list (sparse: one token per work item, entries that are padding or outside the
//! request masked out instead of the causal mask).
//!
//! [`kernel`] is the kernel; [`keys`] where its keys come from; [`tile`] its matrix products, [`slots`] its copies into the
//! swizzled slots, [`seesaw`] (sm_90a) the wide shape's seesaw order, and [`combine`] (sm_90a) the
//! cluster combine of a request's splits.

#[cfg(wgmma)]
mod combine;
pub(crate) mod kernel;
pub(crate) mod keys;
#[cfg(wgmma)]
mod seesaw;
mod slots;
mod tile;
