//! Where finished rows go: the output or the split-K workspace ([`RowOut`]), and the keys-split
//! epilogue that adds up the four warps' partial rows before writing them.

use crate::attention::config::AttnConfig;
use crate::attention::fp8_direct;
use crate::attention::variants::Sinks;
use crate::attention::work::{RowInfo, Work};
use crate::blocks::device::{shfl_xor, static_for, sync_threads, thread_idx_x};
use crate::blocks::mma::{ld_shared_f32x2, st_shared_f32, st_shared_f32x2, MmaHalf};
use crate::blocks::vec_io::{store4, store8, store_f32};
#[cfg(wgmma)]
use crate::blocks::{
    device::{shfl_idx, sync_warp},
    mma::{ld_shared_v4, stmatrix_x4},
    vec_io::store16,
};
use attn_math::params::AttnParams;
use attn_math::prefill::THREADS;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// Where a finished row goes: the output (one split) or the split-K workspace, and the factor
/// its accumulator takes. Writes the row's LSE when `write_lse`. `dv`: the row's width (without
/// `p.mla.v_row`): the launch's head size, below which columns are stored.
#[derive(Clone, Copy)]
pub(crate) struct RowOut {
    addr: u64,
    partial: bool,
    inv: f32,
    cols: u32,
}

impl RowOut {
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn new(
        p: &AttnParams,
        w: &Work,
        row: &RowInfo,
        st: OnlineSoftmax,
        num_splits: u32,
        write_lse: bool,
        v_scale: f32,
        dv: u32,
    ) -> RowOut {
        if num_splits == 1 {
            let mut scale = 1.0;
            let mut st = st;
            let sinks = Sinks::of(p);
            if sinks.on() {
                scale = unsafe { sinks.fold(&mut st, row.head) };
            }
            if write_lse && w.slice == 0 && p.output.lse != 0 {
                unsafe { store_f32(p.output.lse + (row.token as u64 * p.shape.num_q_heads as u64 + row.head as u64) * 4, st.lse()) };
            }
            let addr = p.output.out
                + (row.token as u64 * p.output.out_token_stride + row.head as u64 * p.output.out_head_stride + w.v_col0 as u64) * 2;
            RowOut { addr, partial: false, inv: if st.sum > 0.0 { v_scale * scale / st.sum } else { 0.0 }, cols: dv }
        } else {
            let base = unsafe { w.partial_base(p) };
            let t = (row.token - w.q_start) as u64;
            let index = base + (w.split as u64 * w.q_len as u64 + t) * p.shape.num_q_heads as u64 + row.head as u64;
            if write_lse && w.slice == 0 {
                unsafe { store_f32(p.split.partial_lse + index * 4, st.lse()) };
            }
            let row_width = if p.mla.v_row != 0 { p.mla.v_row as u64 } else { dv as u64 };
            let addr = p.split.partial_out + (index * row_width + w.v_col0 as u64) * 4;
            RowOut { addr, partial: true, inv: if st.sum > 0.0 { v_scale / st.sum } else { 0.0 }, cols: dv }
        }
    }

    /// A row that is not stored (past the tile's live rows), for [`Self::store_warp_rows_staged`].
    #[cfg(wgmma)]
    pub const NONE: RowOut = RowOut { addr: 0, partial: false, inv: 0.0, cols: 0 };

    /// Whether every output row starts 16-byte aligned, as [`Self::store_warp_rows_staged`]
    /// needs (the output's address and both its strides in bytes).
    #[cfg(wgmma)]
    #[inline(always)]
    pub fn output_aligned16(p: &AttnParams) -> bool {
        (p.output.out | (p.output.out_token_stride * 2) | (p.output.out_head_stride * 2)) & 15 == 0
    }

    /// A warp's 16 finished output rows (`rows[h]`: its fragment's rows g + 8h, [`Self::NONE`]
    /// where not stored) of `blocks` 8-column blocks (8, 16 or 32; of at most `N`), the first
    /// `cols` columns of each stored (the launch's head size: every lane's, since a lane
    /// stores other lanes' rows), through
    /// `stage`: 16 rows of `16 blocks` bytes of shared memory that only this warp uses.
    /// `stmatrix` puts each block in place (16-byte chunks XOR-swizzled by the row, so that
    /// neither side conflicts on banks), then each lane stores 16 contiguous bytes of a row,
    /// `32 / blocks` rows at a time. Storing each pair from its fragment, a warp's store
    /// instruction writes 16 bytes of each of 8 rows (32 four-byte stores a thread at width 128);
    /// here it writes whole rows (8 of 16 bytes). The rows must be the output's, not a split's
    /// partials, and 16-byte aligned ([`Self::output_aligned16`]).
    #[cfg(wgmma)]
    #[inline(always)]
    pub unsafe fn store_warp_rows_staged<Q: MmaHalf, const N: usize>(
        rows: [RowOut; 2],
        blocks: usize,
        cols: u32,
        stage: u32,
        lane: u32,
        pair: impl Fn(usize, usize) -> (f32, f32),
    ) {
        debug_assert!(blocks == 8 || blocks == 16 || blocks == 32);
        let row_bytes = 16 * blocks as u32;
        // stmatrix: lanes 8m..8m+7 give the rows of matrix m, which is block n + m / 2 of the
        // fragment's rows 8 (m % 2) + 0..8.
        let (m, r8) = (lane / 8, lane % 8);
        let s_row = stage + (8 * (m % 2) + r8) * row_bytes;
        static_for::<N>(|n| {
            if n % 2 == 0 && n < blocks {
                let pack = |n: usize, h: usize| {
                    let (a, b) = pair(n, h);
                    Q::pack2(a * rows[h].inv, b * rows[h].inv)
                };
                let chunk = n as u32 + m / 2;
                unsafe { stmatrix_x4(s_row + (chunk ^ r8) * 16, [pack(n, 0), pack(n, 1), pack(n + 1, 0), pack(n + 1, 1)]) };
            }
        });
        sync_warp();
        // `32 / blocks` rows an instruction, all of one half (h), lane `lane % blocks` taking
        // chunk c; the row's address from the lane that holds it (4 (row % 8): t4 = 0).
        let per = 32 / blocks;
        let (sub, c) = (lane / blocks as u32, lane % blocks as u32);
        static_for::<16>(|i| {
            if i < 16 / per {
                let row = (i * per) as u32 + sub;
                let addr = rows[(i * per) / 8].addr;
                let src = 4 * (row % 8);
                let dst = ((shfl_idx((addr >> 32) as u32, src) as u64) << 32) | shfl_idx(addr as u32, src) as u64;
                let v = unsafe { ld_shared_v4(stage + row * row_bytes + ((c ^ (row % 8)) * 16)) };
                if dst != 0 && c * 8 < cols {
                    unsafe { store16(dst + c as u64 * 16, v) };
                }
            }
        });
    }

    /// Columns `8n + c0` and `8n + c0 + 1` of each block `n < blocks` (of at most `N`), the pair
    /// `pair(n)` (unnormalised accumulator values); nothing past the row's width (`c0` is even).
    /// One address a row, each block's store at a constant offset from it: computed per store
    /// (as [`Self::store_pair`] does), each address went into the register the store before
    /// still held (1.0-1.2 us a work item of the FP8 d128 prefill's epilogue in a profile;
    /// removing it gained 0-2%, docs/prefill.md "Where an item's time goes").
    #[cfg(wgmma)]
    #[inline(always)]
    pub unsafe fn store_blocks<Q: MmaHalf, const N: usize>(&self, c0: u32, blocks: usize, pair: impl Fn(usize) -> (f32, f32)) {
        if self.partial {
            let base = self.addr + c0 as u64 * 4;
            static_for::<N>(|n| {
                if n < blocks && n as u32 * 8 + c0 < self.cols {
                    let (a, b) = pair(n);
                    unsafe { store8(base + n as u64 * 32, [(a * self.inv).to_bits(), (b * self.inv).to_bits()]) };
                }
            });
        } else {
            let base = self.addr + c0 as u64 * 2;
            static_for::<N>(|n| {
                if n < blocks && n as u32 * 8 + c0 < self.cols {
                    let (a, b) = pair(n);
                    unsafe { store4(base + n as u64 * 16, Q::pack2(a * self.inv, b * self.inv)) };
                }
            });
        }
    }

    /// Columns `col`, `col + 1` (unnormalised accumulator values); nothing past the row's
    /// width (`col` is even and the width a multiple of 8).
    #[inline(always)]
    pub unsafe fn store_pair<Q: MmaHalf>(&self, col: u32, a: f32, b: f32) {
        if col >= self.cols {
            return;
        }
        if self.partial {
            unsafe { store8(self.addr + col as u64 * 4, [(a * self.inv).to_bits(), (b * self.inv).to_bits()]) };
        } else {
            unsafe { store4(self.addr + col as u64 * 2, Q::pack2(a * self.inv, b * self.inv)) };
        }
    }
}

/// Keys-split epilogue: the four warps hold partial states of the same 16 rows; each publishes
/// its (max, sum), rescales its accumulators to the common max and stores them, then all threads
/// add the four up, 8 threads per row, and write the rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn finish_keys_split<C: AttnConfig>(
    p: &AttnParams,
    w: &Work,
    smem: u32,
    merge: u32,
    pitch: u32,
    stats: u32,
    mut state: [OnlineSoftmax; 2],
    o: &[[f32; 4]; 32],
    num_splits: u32,
    v_scale: f32,
    permuted: bool,
) {
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let (merge, stats) = (smem + merge, smem + stats);
    let stat = |wp: u32, r: u32| unsafe {
        let (max, sum) = ld_shared_f32x2(stats + (wp * 16 + r) * 8);
        OnlineSoftmax { max, sum }
    };
    // The K/V stages are free once every warp is past the loop.
    sync_threads();
    static_for::<2>(|h| {
        state[h].sum += shfl_xor(state[h].sum, 1);
        state[h].sum += shfl_xor(state[h].sum, 2);
        if t4 == 0 {
            unsafe { st_shared_f32x2(stats + (warp * 16 + g + 8 * h as u32) * 8, state[h].max, state[h].sum) };
        }
    });
    sync_threads();
    static_for::<2>(|h| {
        let r = g + 8 * h as u32;
        let mut max = f32::NEG_INFINITY;
        static_for::<4>(|wp| max = max.max(stat(wp as u32, r).max));
        let f = if state[h].max == f32::NEG_INFINITY { 0.0 } else { exp2(state[h].max - max) };
        static_for::<32>(|n| {
            if n < C::DV / 8 {
                let row = merge + (warp * 16 + r) * pitch * 4;
                if permuted {
                    // `fp8_direct`'s accumulator columns.
                    static_for::<2>(|e| unsafe {
                        st_shared_f32(row + fp8_direct::out_col::<C>(n as u32, e as u32) * 4, o[n][2 * h + e] * f)
                    });
                } else {
                    let col = n as u32 * 8 + 2 * t4;
                    unsafe { st_shared_f32x2(row + col * 4, o[n][2 * h] * f, o[n][2 * h + 1] * f) };
                }
            }
        });
    });
    sync_threads();
    unsafe { store_merged_rows::<C, 16>(p, w, merge, pitch, stats, num_splits, v_scale) };
}

/// The keys-split epilogue's last step: the warps' partial rows (`R` rows of `C::DV` columns
/// each, f32 at
/// `merge + ((warp * R + r) * pitch + col) * 4`, already at their common max) and (max, sum)
/// pairs (`stats + (warp * R + r) * 8`) added up, `THREADS / R` threads per row, and each row
/// written. After a barrier that publishes them.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn store_merged_rows<C: AttnConfig, const R: u32>(
    p: &AttnParams,
    w: &Work,
    merge: u32,
    pitch: u32,
    stats: u32,
    num_splits: u32,
    v_scale: f32,
) {
    let tid = thread_idx_x();
    let per_row = THREADS / R;
    let (r, t) = (tid / per_row, tid % per_row);
    if r >= w.live {
        return;
    }
    let mut total = OnlineSoftmax::EMPTY;
    static_for::<4>(|wp| {
        let (max, sum) = unsafe { ld_shared_f32x2(stats + (wp as u32 * R + r) * 8) };
        total.merge(OnlineSoftmax { max, sum });
    });
    let row = unsafe { w.row(p, r) };
    let out = unsafe { RowOut::new(p, w, &row, total, num_splits, t == 0, v_scale, p.dims.v_or(C::DV as u32)) };
    static_for::<16>(|i| {
        if (i as u32) < C::DV as u32 / (2 * per_row) {
            let col = 2 * (t + per_row * i as u32);
            let (mut a, mut b) = (0.0, 0.0);
            static_for::<4>(|wp| {
                let (x, y) = unsafe { ld_shared_f32x2(merge + ((wp as u32 * R + r) * pitch + col) * 4) };
                a += x;
                b += y;
            });
            unsafe { out.store_pair::<C::Q>(col, a, b) };
        }
    });
}
