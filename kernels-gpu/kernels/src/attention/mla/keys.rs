//! Where the MLA kernel's key j comes from: the one thing dense and sparse MLA differ in, besides
//! the causal mask. The kernel looks each slot's row addresses up a tile ahead, one lane a key,
//! in up to three steps so that each global load has a tile of math to land behind:
//! [`KeySource::early`] two tiles ahead (sparse: the token's index entry), [`KeySource::locate`]
//! a tile ahead (the block-table entry), [`KeySource::address`] when the slot's table entry is
//! written (no load). A key whose address is 0 is not read (its row is zero-filled) and is
//! masked out.

use crate::attention::kv::KvSource;
use crate::attention::work::{load_i32, plan_item_at, work_item, PlanItem, Work};
use crate::blocks::device::{atomic_or_global, block_idx_x};
use crate::blocks::status::report_bad_index;
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::status::BLOCK_OUT_OF_RANGE;

/// The keys of a CTA's work item, as the MLA kernel fetches them.
pub(crate) trait KeySource: Copy {
    /// What the first step of a key's lookup loads (nothing for dense).
    type Early: Copy;
    /// What the second step loads (dense: the block id).
    type Loc: Copy;
    /// The lookups of keys that are not fetched.
    const NO_EARLY: Self::Early;
    const NO_LOC: Self::Loc;
    /// Whether `p.mask.causal` applies: key j is position j of the sequence (dense), not an
    /// entry of a list that is its own mask (sparse).
    const CAUSAL: bool;

    /// The CTA's work item and its keys' source; `None` when its tile has no rows. The work
    /// item's `seq_len` is the number of keys (the sequence, or the index list).
    unsafe fn work(p: &AttnParams, bm: u32) -> Option<(Work, Self)>;

    /// The first step of key `key`'s lookup (`key` below the work item's keys).
    unsafe fn early(&self, p: &AttnParams, key: u32) -> Self::Early;

    /// The second step, from the first's result.
    unsafe fn locate(&self, p: &AttnParams, key: u32, early: Self::Early) -> Self::Loc;

    /// The byte address of the key's row (`elem_bytes` per element), or 0 when it is not read:
    /// padding, or input outside the cache or the request, which this raises in `p.status`.
    unsafe fn address(&self, p: &AttnParams, key: u32, loc: Self::Loc, elem_bytes: u64) -> u64;

    /// Whether the narrow shape copies rows before waiting for the kernel ahead
    /// ([`PdlGate`](crate::blocks::device::PdlGate)).
    const READS_AHEAD: bool;

    /// Keys `0..n` whose rows may be copied before waiting for the kernel ahead: rows written
    /// before it started.
    fn ready_before_wait(&self, w: &Work) -> u32;
}

/// Dense MLA: key j is position `j` of the request's sequence, through its block table.
#[derive(Clone, Copy)]
pub(crate) struct PagedKeys(KvSource);

impl KeySource for PagedKeys {
    type Early = ();
    type Loc = u32;
    const NO_EARLY: () = ();
    const NO_LOC: u32 = u32::MAX;
    const CAUSAL: bool = true;
    const READS_AHEAD: bool = true;

    #[inline(always)]
    unsafe fn work(p: &AttnParams, bm: u32) -> Option<(Work, Self)> {
        let w = unsafe { work_item(p, bm, MLA_V) }?;
        let block_row = p.batch.block_table + w.req as u64 * p.batch.block_table_stride * 4;
        Some((w, PagedKeys(KvSource { block_row, key_base: 0, kv_head: 0 })))
    }

    #[inline(always)]
    unsafe fn early(&self, _: &AttnParams, _: u32) {}

    #[inline(always)]
    unsafe fn locate(&self, p: &AttnParams, key: u32, _: ()) -> u32 {
        unsafe { self.0.block_of(p, key) }
    }

    #[inline(always)]
    unsafe fn address(&self, p: &AttnParams, key: u32, loc: u32, elem_bytes: u64) -> u64 {
        let a = self.0.addresses(p, key, self.0.located(key, loc), elem_bytes).0;
        if a == 0 {
            unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
        }
        a
    }

    /// The context before the request's new tokens (the cache write ahead writes only those).
    #[inline(always)]
    fn ready_before_wait(&self, w: &Work) -> u32 {
        w.seq_len.saturating_sub(w.q_len)
    }
}

/// Sparse MLA: key j is entry j of the token's index row (`p.sparse`), a position of the
/// token's request, through the request's block table. The work item's request is the token
/// (the plan's batch has one request of `topk` keys per token).
///
/// It holds 32-bit indices only and derives the row addresses from the parameters (constant
/// memory) where it uses them: registers are what the narrow shape runs short of.
#[derive(Clone, Copy)]
pub(crate) struct IndexedKeys {
    token: u32,
    /// The token's request (its block-table row).
    req: u32,
    /// The request's length: positions at or past it are refused.
    seq_len: u32,
}

impl KeySource for IndexedKeys {
    /// The index entry.
    type Early = i32;
    /// The index entry, and its block id (-1 when the entry is not a position of the request).
    type Loc = (i32, i32);
    const NO_EARLY: i32 = -1;
    const NO_LOC: (i32, i32) = (-1, -1);
    const CAUSAL: bool = false;
    /// An index list may name the new tokens' rows, anywhere in it.
    const READS_AHEAD: bool = false;

    #[inline(always)]
    unsafe fn work(p: &AttnParams, bm: u32) -> Option<(Work, Self)> {
        let PlanItem { req: token, row_tile, split, slice, .. } = unsafe { plan_item_at(p, block_idx_x()) };
        // One query token of `group` heads: its rows are its heads.
        let n_rows = p.shape.group;
        let row0 = row_tile * bm;
        if row0 >= n_rows {
            return None;
        }
        let req = unsafe { load_i32(p.sparse.token_request + token as u64 * 4) } as u32;
        let seq_len = unsafe { load_i32(p.batch.seq_lens + req as u64 * 4) }.max(0) as u32;
        let w = Work {
            req: token,
            split,
            q_start: token,
            q_len: 1,
            seq_len: p.sparse.topk,
            row0,
            live: (n_rows - row0).min(bm),
            kv_head: 0,
            slice,
            v_col0: slice * MLA_V,
        };
        Some((w, IndexedKeys { token, req, seq_len }))
    }

    #[inline(always)]
    unsafe fn early(&self, p: &AttnParams, key: u32) -> i32 {
        unsafe { load_i32(p.sparse.indices + (self.token as u64 * p.sparse.row_stride + key as u64) * 4) }
    }

    #[inline(always)]
    unsafe fn locate(&self, p: &AttnParams, _: u32, index: i32) -> (i32, i32) {
        // Only a position of the request reads its block-table row (which the host sized for
        // `seq_len` keys).
        let block = if index >= 0 && (index as u32) < self.seq_len {
            let entry = self.req as u64 * p.batch.block_table_stride + (index as u32 / p.shape.block_size) as u64;
            unsafe { load_i32(p.batch.block_table + entry * 4) }
        } else {
            -1
        };
        (index, block)
    }

    #[inline(always)]
    unsafe fn address(&self, p: &AttnParams, key: u32, (index, block): (i32, i32), elem_bytes: u64) -> u64 {
        if index == -1 {
            0
        } else if index < 0 || index as u32 >= self.seq_len {
            unsafe { report_bad_index(p.status, self.token, key, index, self.seq_len) };
            0
        } else if block < 0 || block as u32 >= p.shape.num_blocks {
            unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            0
        } else {
            let pos = index as u32;
            p.qkv.k + p.qkv.k_strides.offset(block as u64, (pos % p.shape.block_size) as u64, 0, 0) * elem_bytes
        }
    }

    #[inline(always)]
    fn ready_before_wait(&self, _: &Work) -> u32 {
        0
    }
}
