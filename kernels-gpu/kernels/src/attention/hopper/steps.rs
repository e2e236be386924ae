//! The pieces of the warp-specialised Hopper prefill's key step
//! ([`crate::attention::hopper::prefill_specialized`]): rows copied into the swizzled `wgmma`
//! layout, and the half-tile softmax (row max, rescale factor, weights), written for a 64-key S
//! block of a thread's two rows.

use crate::attention::config::CacheFormat;
use crate::attention::lazy_rescale::must_rescale;
use crate::blocks::device::{fma, shfl_xor, static_for};
use crate::blocks::elem::Fp8Format;
use crate::blocks::mma::{cp_async_16, cp_async_halves, ld_shared_v4, st_shared_v4, MmaHalf};
use crate::blocks::wgmma::{Acc, ACC_BLOCKS};
use attn_math::hopper_prefill::{group_bytes, swizzled};
use attn_math::softmax::{exp2, OnlineSoftmax};

/// Copies `ROWS` rows of `D` 16-bit columns into the [`swizzled`] layout at `dst` by `NT`
/// threads (`t`: this one's index among them); `src(r)`: row r's address, 0 to zero-fill.
/// Only the first `live` 16-byte chunks of a row are read (the launch's head size), the rest
/// are zero-filled. A zero-filled chunk is a copy of source size 0, which reads nothing: it
/// keeps the address it would have had (0 plus the chunk's offset, or past the head size)
/// rather than a stand-in selected per copy, which took the producer 64 instructions a key
/// tile (prefill +0.4-1.7% on an H200, docs/prefill.md). Thread t always takes chunk `t % (D / 8)` of rows
/// `t / (D / 8) + i * NT / (D / 8)`: the rows a thread copies are a whole number of 8-row
/// groups apart (or, at width 256, 4 rows: then every other one is), so their shared-memory
/// addresses and table entries differ by constants. Rows whose chunks do not divide the
/// threads (192 columns) are copied a 64-column atom at a time ([`copy_row_pairs`]).
#[inline(always)]
pub(crate) unsafe fn copy_rows<const D: usize, const ROWS: u32, const NT: u32>(dst: u32, t: u32, live: u32, src: impl Fn(u32) -> u64) {
    unsafe { copy_row_pairs::<D, D, ROWS, NT, 1>([dst, dst], t, [live, 0], |r| (src(r), 0), false) }
}

/// [`copy_rows`] of two tiles at once (`dst[0]`, `dst[1]`; K of `DK` columns and V of `DV`)
/// whose rows `src(r)` gives together, zero-filled together when the first is 0; only the first
/// when `!both`. `live`: K's and V's chunks read (one head size where `DK == DV`). `BATCH` rows'
/// sources are taken before any of their copies is issued (below).
///
/// Where `DK == DV` and the threads are a whole number of rows' chunks, a thread copies the
/// same chunk of each of its rows ([`copy_rows`]); otherwise (QK 192 / V 128) the same chunk of
/// each 64-column atom of each of its rows: chunk `t % 8` of every atom of rows
/// `t / 8 + i * NT / 8`, so that a row's table entry serves its K and V atoms alike.
#[inline(always)]
pub(crate) unsafe fn copy_row_pairs<const DK: usize, const DV: usize, const ROWS: u32, const NT: u32, const BATCH: usize>(
    dst: [u32; 2],
    t: u32,
    live: [u32; 2],
    src: impl Fn(u32) -> (u64, u64),
    both: bool,
) {
    if DK == DV && NT.is_multiple_of(DK as u32 / 8) {
        unsafe { copy_same_width::<DK, ROWS, NT, BATCH>(dst, t, live[0], src, both) }
    } else {
        unsafe { copy_by_atom::<DK, DV, ROWS, NT, BATCH>(dst, t, live, src, both) }
    }
}

/// [`copy_row_pairs`] where a thread copies the same chunk of each of its rows.
#[inline(always)]
unsafe fn copy_same_width<const D: usize, const ROWS: u32, const NT: u32, const BATCH: usize>(
    dst: [u32; 2],
    t: u32,
    live: u32,
    src: impl Fn(u32) -> (u64, u64),
    both: bool,
) {
    let chunks = D as u32 / 8;
    // Checked where the caller routes here (a width whose chunks divide the threads).
    const {
        assert!(
            !NT.is_multiple_of(D as u32 / 8)
                || (((NT / (D as u32 / 8)).is_multiple_of(8) || NT / (D as u32 / 8) == 4)
                    && ROWS.is_multiple_of(NT / (D as u32 / 8))
                    && ROWS / (NT / (D as u32 / 8)) <= 32)
        )
    };
    let (c, r0) = (t % chunks, t / chunks);
    // This thread's chunk is the same in every row.
    let read = c < live;
    let step = NT / chunks;
    // Rows 8 apart are a group apart; rows 4 apart (when `step` is 4) swizzle differently.
    let (period, per_group) = if step.is_multiple_of(8) { (1, step / 8) } else { (2, 1) };
    let offs = [swizzled(D as u32, r0, c), swizzled(D as u32, r0 + step % 8, c)];
    // The rows' sources are taken a batch at a time before any of the batch's copies: `src`
    // may read shared memory (the producer's address table), and with each row's entry read
    // just before its copies the producer stalled on every read (its samples sat at the test
    // after each read, while the `wgmma`s read their operands): a round trip a row instead of
    // one a batch.
    static_for::<32>(|g| {
        if g % BATCH != 0 {
            return;
        }
        let mut rows = [(0u64, 0u64); BATCH];
        static_for::<BATCH>(|k| {
            let i = g + k;
            if (i as u32) < ROWS / step {
                rows[k] = src(r0 + i as u32 * step);
            }
        });
        static_for::<BATCH>(|k| {
            let i = g + k;
            if (i as u32) < ROWS / step {
                let (a, b) = rows[k];
                let valid = a != 0 && read;
                let bytes = if valid { 16 } else { 0 };
                let off = offs[i % period as usize] + (i as u32 / period) * per_group * group_bytes(D as u32);
                unsafe { cp_async_16(dst[0] + off, a.wrapping_add(c as u64 * 16), bytes) };
                if both {
                    unsafe { cp_async_16(dst[1] + off, b.wrapping_add(c as u64 * 16), bytes) };
                }
            }
        });
    });
}

/// [`copy_row_pairs`] a 64-column atom at a time: chunk `t % 8` of each atom of K's and V's rows
/// `t / 8 + i * NT / 8` (rows a whole number of 8-row groups apart, so their shared-memory
/// addresses differ by constants).
#[inline(always)]
unsafe fn copy_by_atom<const DK: usize, const DV: usize, const ROWS: u32, const NT: u32, const BATCH: usize>(
    dst: [u32; 2],
    t: u32,
    live: [u32; 2],
    src: impl Fn(u32) -> (u64, u64),
    both: bool,
) {
    const {
        assert!(
            DK.is_multiple_of(64)
                && DV.is_multiple_of(64)
                && (NT / 8).is_multiple_of(8)
                && ROWS.is_multiple_of(NT / 8)
                && ROWS / (NT / 8) <= 32
        )
    };
    let (c, r0) = (t % 8, t / 8);
    let step = NT / 8;
    // This thread's chunk of row r0's first atom in K's and V's tiles; atom x is 1024 bytes on.
    let offs = [swizzled(DK as u32, r0, c), swizzled(DV as u32, r0, c)];
    static_for::<32>(|g| {
        if g % BATCH != 0 {
            return;
        }
        // A batch's sources before its copies, as in `copy_same_width`.
        let mut rows = [(0u64, 0u64); BATCH];
        static_for::<BATCH>(|k| {
            let i = g + k;
            if (i as u32) < ROWS / step {
                rows[k] = src(r0 + i as u32 * step);
            }
        });
        static_for::<BATCH>(|k| {
            let i = g + k;
            if (i as u32) < ROWS / step {
                let (a, b) = rows[k];
                let groups = i as u32 * (step / 8);
                static_for::<4>(|x| {
                    let chunk = 8 * x as u32 + c;
                    if x < DK / 64 {
                        let bytes = if a != 0 && chunk < live[0] { 16 } else { 0 };
                        let off = offs[0] + 1024 * x as u32 + groups * group_bytes(DK as u32);
                        unsafe { cp_async_16(dst[0] + off, a.wrapping_add(chunk as u64 * 16), bytes) };
                    }
                    if both && x < DV / 64 {
                        let bytes = if a != 0 && chunk < live[1] { 16 } else { 0 };
                        let off = offs[1] + 1024 * x as u32 + groups * group_bytes(DV as u32);
                        unsafe { cp_async_16(dst[1] + off, b.wrapping_add(chunk as u64 * 16), bytes) };
                    }
                });
            }
        });
    });
}

/// A thread's share of `ROWS` raw FP8 rows of `BYTES` bytes (in row order, no swizzle) for
/// `NT` threads: chunk `t % (BYTES / 16)` of rows `t / (BYTES / 16) + i * step`. The copy and
/// the conversion ([`copy_raw_row_pairs`], [`convert_fp8_rows`]) give each thread the same
/// chunks, so a thread converts only what its own copies wrote.
#[derive(Clone, Copy)]
struct RawShare<const BYTES: usize, const ROWS: u32, const NT: u32> {
    chunk: u32,
    row0: u32,
}

impl<const BYTES: usize, const ROWS: u32, const NT: u32> RawShare<BYTES, ROWS, NT> {
    const CHUNKS: u32 = BYTES as u32 / 16;
    /// Rows between a thread's rows, and how many it has.
    const STEP: u32 = NT / Self::CHUNKS;
    const COUNT: usize = (ROWS / Self::STEP) as usize;

    #[inline(always)]
    fn of(t: u32) -> Self {
        // Rows of 192 bytes, whose chunks do not divide the threads, come only from the 16-bit
        // QK 192 / V 128 kernel, which compiles its FP8 paths without running them
        // (`prefill_specialized`'s check).
        const {
            assert!(
                BYTES == 192
                    || (NT.is_multiple_of(BYTES as u32 / 16)
                        && ROWS.is_multiple_of(NT / (BYTES as u32 / 16))
                        && ROWS / (NT / (BYTES as u32 / 16)) <= 16)
            )
        };
        RawShare { chunk: t % Self::CHUNKS, row0: t / Self::CHUNKS }
    }

    #[inline(always)]
    fn row(&self, i: usize) -> u32 {
        self.row0 + i as u32 * Self::STEP
    }

    /// Byte offset of the thread's chunk of its `i`-th row.
    #[inline(always)]
    fn offset(&self, i: usize) -> u32 {
        self.row(i) * BYTES as u32 + self.chunk * 16
    }
}

/// Copies `ROWS` raw FP8 rows of K and V (`src(r)`: row r's two addresses, the first 0 to
/// zero-fill both, `fallback` named then) into `dst[0]` and `dst[1]` in row order, `BYTES`
/// bytes a row of which the first `live` units are read (the rest zero-filled; 16-byte chunks,
/// or `K`'s 8-byte halves: [`CacheFormat::live_units`]). As [`copy_row_pairs`], a batch of
/// rows' sources is taken before their copies.
#[inline(always)]
pub(crate) unsafe fn copy_raw_row_pairs<K: CacheFormat, const BYTES: usize, const ROWS: u32, const NT: u32, const BATCH: usize>(
    dst: [u32; 2],
    t: u32,
    live: u32,
    fallback: u64,
    src: impl Fn(u32) -> (u64, u64),
) {
    let share = RawShare::<BYTES, ROWS, NT>::of(t);
    let read = share.chunk < live;
    static_for::<16>(|g| {
        if g % BATCH != 0 {
            return;
        }
        let mut rows = [(0u64, 0u64); BATCH];
        static_for::<BATCH>(|k| {
            if g + k < RawShare::<BYTES, ROWS, NT>::COUNT {
                rows[k] = src(share.row(g + k));
            }
        });
        static_for::<BATCH>(|k| {
            let i = g + k;
            if i < RawShare::<BYTES, ROWS, NT>::COUNT {
                let (a, b) = rows[k];
                if K::HALVES {
                    unsafe {
                        cp_async_halves(dst[0] + share.offset(i), a, share.chunk, live, fallback);
                        cp_async_halves(dst[1] + share.offset(i), if a != 0 { b } else { 0 }, share.chunk, live, fallback);
                    }
                    return;
                }
                let valid = a != 0 && read;
                let bytes = if valid { 16 } else { 0 };
                let c = share.chunk as u64 * 16;
                unsafe {
                    cp_async_16(dst[0] + share.offset(i), if valid { a + c } else { fallback }, bytes);
                    cp_async_16(dst[1] + share.offset(i), if valid { b + c } else { fallback }, bytes);
                }
            }
        });
    });
}

/// Converts the raw FP8 rows (format `F`) of K and V this thread copied ([`copy_raw_row_pairs`], at
/// `raw[0]`, `raw[1]`, `BYTES` bytes a row) into the 16-bit tiles `tile[0]`, `tile[1]` of the
/// [`swizzled`] layout (`BYTES` columns a row), exactly (`MmaHalf::from_fp8x2`): a 16-byte raw
/// chunk becomes 16-bit chunks `2c` and `2c + 1`. Of the eight threads of a shared-memory
/// phase those with raw chunks 4 to 7 store their odd chunk first, so that the phase's eight
/// stores fall in eight different 16-byte bank groups (at 128 bytes a row; at 64 the phase
/// covers two rows, whose swizzles differ in the low bit).
#[inline(always)]
pub(crate) unsafe fn convert_fp8_rows<M: MmaHalf, F: Fp8Format, const BYTES: usize, const ROWS: u32, const NT: u32>(
    raw: [u32; 2],
    tile: [u32; 2],
    t: u32,
) {
    let share = RawShare::<BYTES, ROWS, NT>::of(t);
    // The odd chunk first: the raw chunk's two halves swapped before the conversion (selects
    // on four words; indexing the converted words by a run-time half put them in local memory).
    let swap = (share.chunk / 4) % 2 == 1;
    let first = 2 * share.chunk + swap as u32;
    let second = first ^ 1;
    static_for::<16>(|i| {
        if i >= RawShare::<BYTES, ROWS, NT>::COUNT {
            return;
        }
        static_for::<2>(|plane| {
            let w = unsafe { ld_shared_v4(raw[plane] + share.offset(i)) };
            let w = if swap { [w[2], w[3], w[0], w[1]] } else { w };
            let mut h = [0u32; 8];
            static_for::<4>(|j| {
                h[2 * j] = M::from_fp8x2::<F>(w[j] & 0xffff);
                h[2 * j + 1] = M::from_fp8x2::<F>(w[j] >> 16);
            });
            let r = share.row(i);
            unsafe {
                st_shared_v4(tile[plane] + swizzled(BYTES as u32, r, first), [h[0], h[1], h[2], h[3]]);
                st_shared_v4(tile[plane] + swizzled(BYTES as u32, r, second), [h[4], h[5], h[6], h[7]]);
            }
        });
    });
}

/// The max of each of a thread's two rows over a 64-row S block of `NB` column blocks (its
/// values of each, then the quad's 4 lanes), as four independent chains so that the
/// comparisons overlap. Each chain starts at its first pair: from -inf, every chain took one
/// more `FMNMX` a row (8 a warp a 64-key block), which `ptxas` does not fold.
#[inline(always)]
pub(crate) fn row_max<const NB: usize>(s: &[[f32; 4]; NB]) -> [f32; 2] {
    const { assert!(NB >= 4) };
    core::array::from_fn(|h| {
        let mut m = [0.0f32; 4];
        static_for::<NB>(|n| {
            let pair = s[n][2 * h].max(s[n][2 * h + 1]);
            m[n % 4] = if n < 4 { pair } else { m[n % 4].max(pair) };
        });
        let mut m = m[0].max(m[1]).max(m[2].max(m[3]));
        m = m.max(shfl_xor(m, 1));
        m.max(shfl_xor(m, 2))
    })
}

/// Raises the row's running max to cover the block's `block_max` (base-2 units); returns the
/// accumulator's rescale factor. Selects, no branches (an S chain is in flight).
#[inline(always)]
pub(crate) fn raise_max(st: &mut OnlineSoftmax, block_max: f32) -> f32 {
    let new_max = st.max.max(block_max);
    // exp2(-inf) = 0 for a row that had seen nothing; a row that still sees nothing keeps 1.
    let factor = if new_max == f32::NEG_INFINITY { 1.0 } else { exp2(st.max - new_max) };
    st.sum *= factor;
    st.max = new_max;
    factor
}

/// Raises each of a thread's two rows' running max to cover the block's `m` (scaled by
/// `mult`) and rescales the row's O accumulators (the first `blocks`: the P V chain's, row sums
/// included where it carries them) by the factor; with `lazy`, only where some row of the warp
/// moved past the slack ([`must_rescale`]).
#[inline(always)]
pub(crate) fn rescale_o(o: &mut Acc, state: &mut [OnlineSoftmax; 2], m: [f32; 2], mult: f32, lazy: bool, blocks: usize) {
    if !lazy || must_rescale(state, m, mult) {
        static_for::<2>(|r| {
            let factor = raise_max(&mut state[r], m[r] * mult);
            static_for::<ACC_BLOCKS>(|n| {
                if n < blocks {
                    o[n][2 * r] *= factor;
                    o[n][2 * r + 1] *= factor;
                }
            });
        });
    }
}

/// The block's weights `2^(s * mult - max)` in place, added to the rows' denominators (four
/// partial sums a row) unless the P V chain sums them (`summed`, `wgmma::pv_blocks_fp8`).
#[inline(always)]
pub(crate) fn weights<const NB: usize>(s: &mut [[f32; 4]; NB], state: &mut [OnlineSoftmax; 2], mult: f32, summed: bool) {
    if summed {
        static_for::<2>(|h| {
            let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
            static_for::<NB>(|n| static_for::<2>(|e| s[n][2 * h + e] = exp2(fma(s[n][2 * h + e], mult, neg_max))));
        });
        return;
    }
    static_for::<2>(|h| {
        // A row that has seen nothing yet keeps max -inf: its weights are all 0.
        let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
        // Four partial sums, each starting at its first weight: `0.0 + w` is an `FADD` that
        // the compiler keeps (it is not `w` when w is -0.0), 8 a warp a 64-key block.
        let mut sum = [0.0f32; 4];
        static_for::<NB>(|n| {
            static_for::<2>(|e| {
                let w = exp2(fma(s[n][2 * h + e], mult, neg_max));
                s[n][2 * h + e] = w;
                sum[n % 4] = if n < 4 && e == 0 { w } else { sum[n % 4] + w };
            });
        });
        state[h].sum += (sum[0] + sum[1]) + (sum[2] + sum[3]);
    });
}
