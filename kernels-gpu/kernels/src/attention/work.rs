//! A CTA's work item: which request, split and tile of query rows it takes (from the device
//! plan, or uniform splits without one), and what each of its query rows needs.

use crate::blocks::device::block_idx_x;
use crate::blocks::vec_io::{load_f32_nc, load_u32_nc};
use attn_math::params::AttnParams;
use attn_math::softmax::LOG2_E;

#[inline(always)]
pub(crate) unsafe fn load_i32(addr: u64) -> i32 {
    unsafe { load_u32_nc(addr) as i32 }
}

/// One query row of a thread.
#[derive(Clone, Copy)]
pub(crate) struct RowInfo {
    pub token: u32,
    pub head: u32,
    /// Keys `..= pos` are visible (causal); the window counts back from it.
    pub pos: u32,
    pub slope_log2: f32,
}

/// The CTA's request, split and row tile, with what its rows need.
#[derive(Clone, Copy)]
pub(crate) struct Work {
    pub req: u32,
    pub split: u32,
    pub q_start: u32,
    pub q_len: u32,
    pub seq_len: u32,
    pub row0: u32,
    /// Rows of the tile that exist (the rest repeat the last one and are never written).
    pub live: u32,
    pub kv_head: u32,
    /// MLA: which slice of V's columns this CTA produces (0 otherwise), and its first column.
    pub(super) slice: u32,
    pub(super) v_col0: u32,
}

impl Work {
    /// The fields as words, for a CTA's threads to pass a work item through shared memory.
    #[cfg(wgmma)]
    #[inline(always)]
    pub fn to_words(self) -> [u32; 10] {
        [self.req, self.split, self.q_start, self.q_len, self.seq_len, self.row0, self.live, self.kv_head, self.slice, self.v_col0]
    }

    #[cfg(wgmma)]
    #[inline(always)]
    pub fn from_words(w: [u32; 10]) -> Work {
        let [req, split, q_start, q_len, seq_len, row0, live, kv_head, slice, v_col0] = w;
        Work { req, split, q_start, q_len, seq_len, row0, live, kv_head, slice, v_col0 }
    }

    /// The keys `begin..end` the CTA attends, for rows at positions `min_pos..=max_pos`: its
    /// split (keys per split: the launch's, or the device plan's header's), cut by causality
    /// and the window.
    #[inline(always)]
    pub unsafe fn key_range(&self, p: &AttnParams, min_pos: u32, max_pos: u32) -> (u32, u32) {
        let chunk = if p.schedule.plan != 0 { unsafe { load_u32_nc(p.schedule.plan + 4) } } else { p.shape.chunk };
        let mut begin = if chunk > 0 { self.split * chunk } else { 0 };
        let mut end = if chunk > 0 { (begin + chunk).min(self.seq_len) } else { self.seq_len };
        if p.mask.causal != 0 {
            end = end.min(max_pos + 1);
        }
        if p.variant.window > 0 {
            begin = begin.max((min_pos + 1).saturating_sub(p.variant.window));
        }
        (begin, end)
    }

    /// `range` (from [`Self::key_range`]) cut further by the local masks of `p.local`, for rows
    /// at positions `min_pos..=max_pos`: the earliest row's chunk start, and the symmetric
    /// window's reach on both sides. Only the kernels built for local masks call it.
    #[inline(always)]
    pub fn local_range(&self, p: &AttnParams, min_pos: u32, max_pos: u32, (mut begin, mut end): (u32, u32)) -> (u32, u32) {
        if p.local.chunk > 0 {
            begin = begin.max(min_pos - min_pos % p.local.chunk);
        }
        if p.local.symmetric > 0 {
            begin = begin.max((min_pos + 1).saturating_sub(p.local.symmetric));
            end = end.min(max_pos.saturating_add(p.local.symmetric));
        }
        (begin, end)
    }

    /// The request's splits: the plan's, or `uniform_splits` with no plan on the device (1 when
    /// neither: a request with one split writes its output directly).
    #[inline(always)]
    pub unsafe fn num_splits(&self, p: &AttnParams) -> u32 {
        if p.split.req_num_splits != 0 {
            unsafe { load_u32_nc(p.split.req_num_splits + self.req as u64 * 4) }
        } else {
            p.schedule.uniform_splits.max(1)
        }
    }

    /// The first partial row of the request (split-K): the plan's, or with uniform splits and
    /// no plan on the device, `uniform_splits` rows per query row of the requests before.
    #[inline(always)]
    pub unsafe fn partial_base(&self, p: &AttnParams) -> u64 {
        if p.split.req_partial_base != 0 {
            (unsafe { load_u32_nc(p.split.req_partial_base + self.req as u64 * 4) }) as u64
        } else {
            p.schedule.uniform_splits as u64 * p.shape.num_q_heads as u64 * self.q_start as u64
        }
    }

    #[inline(always)]
    pub unsafe fn row(&self, p: &AttnParams, r: u32) -> RowInfo {
        let gr = self.row0 + r.min(self.live - 1);
        let t = gr / p.shape.group;
        let head = self.kv_head * p.shape.group + (gr - t * p.shape.group);
        RowInfo {
            token: self.q_start + t,
            head,
            // The request's q_len new tokens are the last ones of its sequence.
            pos: (self.seq_len + t).saturating_sub(self.q_len),
            slope_log2: if p.per_head.alibi_slopes != 0 {
                (unsafe { load_f32_nc(p.per_head.alibi_slopes + head as u64 * 4) }) * LOG2_E
            } else {
                0.0
            },
        }
    }
}

/// Reads the CTA's work item and the request's lengths; `None` when the tile has no rows.
#[inline(always)]
pub(crate) unsafe fn work_item(p: &AttnParams, bm: u32, dv: u32) -> Option<Work> {
    unsafe { work_item_at(p, block_idx_x(), bm, dv) }
}

/// The plan's item of the CTA at grid index `x`: which request (of the plan's batch), row tile
/// and split, for which kv head and slice of V's columns.
#[derive(Clone, Copy)]
pub(crate) struct PlanItem {
    pub req: u32,
    pub row_tile: u32,
    pub split: u32,
    pub kv_head: u32,
    pub slice: u32,
}

/// Reads the plan's item of the CTA at grid index `x` (or derives it with no plan on the device).
#[inline(always)]
pub(crate) unsafe fn plan_item_at(p: &AttnParams, x: u32) -> PlanItem {
    // Grid x = (work item * kv heads + kv head) * V slices + slice: the slices and kv heads of
    // one tile run together (they share its K/V tiles in L2), and the items' longest-first
    // order holds across them.
    let slices = p.mla.v_slices.max(1);
    let cta = x / slices;
    let slice = x - cta * slices;
    let kv_heads = p.shape.num_q_heads / p.shape.group;
    let item_idx = cta / kv_heads;
    let kv_head = cta - item_idx * kv_heads;
    let (req, tile_split) = if p.split.work_items != 0 {
        let item = p.split.work_items + item_idx as u64 * 8;
        unsafe { (load_u32_nc(item), load_u32_nc(item + 4)) }
    } else {
        // No plan on the device: `uniform_splits` or `cluster` splits a request (row tile 0).
        let splits = if p.schedule.uniform_splits > 1 { p.schedule.uniform_splits } else { p.mla.cluster.max(1) };
        (item_idx / splits, item_idx % splits)
    };
    PlanItem { req, row_tile: tile_split >> 16, split: tile_split & 0xffff, kv_head, slice }
}

/// [`work_item`] of the CTA at grid index `x` (persistent kernels take several in turn).
#[inline(always)]
pub(crate) unsafe fn work_item_at(p: &AttnParams, x: u32, bm: u32, dv: u32) -> Option<Work> {
    let PlanItem { req, row_tile, split, kv_head, slice } = unsafe { plan_item_at(p, x) };
    let q_start = unsafe { load_i32(p.batch.query_start_loc + req as u64 * 4) } as u32;
    let q_len = unsafe { load_i32(p.batch.query_start_loc + req as u64 * 4 + 4) } as u32 - q_start;
    let seq_len = if p.batch.block_table != 0 {
        unsafe { load_i32(p.batch.seq_lens + req as u64 * 4) }.max(0) as u32
    } else {
        let k0 = unsafe { load_i32(p.batch.key_start_loc + req as u64 * 4) } as u32;
        unsafe { load_i32(p.batch.key_start_loc + req as u64 * 4 + 4) as u32 - k0 }
    };
    let n_rows = q_len * p.shape.group;
    let row0 = row_tile * bm;
    if row0 >= n_rows {
        return None;
    }
    Some(Work { req, split, q_start, q_len, seq_len, row0, live: (n_rows - row0).min(bm), kv_head, slice, v_col0: slice * dv })
}
