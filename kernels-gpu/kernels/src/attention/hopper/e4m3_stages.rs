//! e4m3 stages of the Hopper prefill kernel (`attn_math::hopper_prefill::StageFormat::Fp8`):
//! an FP8 cache's rows as operands of `wgmma`'s e4m3 MMAs, whose 8-bit operands must both be
//! K-major.
//!
//! - **K** (S = Q K^T: K is B, the head size its K) is K-major as the cache holds it: the
//!   producer copies its 128-byte rows straight into the stage's 128-byte-swizzled layout.
//! - **V** (O += P V: V is B, the keys its K) is not: the producer copies its rows into a raw
//!   slot, then writes them transposed into the stage, a row a V column ([`transpose_v`]).
//! - **P** goes from the S accumulators into A fragments without moving between threads: in
//!   a k32 A fragment thread t of a quad holds columns 4t..4t+3 (and 16 on), while its S
//!   accumulators hold keys 2t, 2t + 1, 8 + 2t, 9 + 2t (and 16 on). So column 4t + e of the
//!   fragment is key `2t + (e & 1) + 8 (e >> 1)` ([`key_of_column`]), and V^T's columns follow
//!   that order: a permutation of the keys that P and V share, which the sum over keys does not
//!   see.
//! - **Q** is quantised by the compute warps at an item's start ([`quantise_queries`]), with one
//!   scale a warpgroup (its largest magnitude to 448, e4m3's largest), folded into the score
//!   scale.

use crate::attention::config::CacheFormat;
use crate::blocks::device::{named_barrier, opaque, shfl_xor, static_for};
use crate::blocks::mma::{
    byte_perm, cp_async_16, cp_async_halves_or_whole, fence_proxy_async_shared, ld_shared_u32, ld_shared_u64x2, ld_shared_v4,
    st_shared_f32, st_shared_u32, st_shared_v4, MmaHalf,
};
use crate::blocks::wgmma::e4m3x4;
use attn_math::hopper_prefill::swizzled;
use attn_math::prefill::TABLE_ENTRY;

/// Bytes of an e4m3 row (whole 128-byte swizzle atoms of one byte a column).
const ROW: u32 = 128;
/// e4m3's largest finite magnitude.
const E4M3_MAX: f32 = 448.0;

/// The key of column `col` of a 32-key P fragment (and of V^T): within each 16 columns, column
/// 4t + e holds key 2t + (e & 1) + 8 (e >> 1).
const fn key_of_column(col: u32) -> u32 {
    let (base, c) = (col & !15, col & 15);
    let (t, e) = (c / 4, c % 4);
    base + 2 * t + (e & 1) + 8 * (e >> 1)
}

/// Whether [`transpose_v`] writes each key where [`key_of_column`] puts it: pass `p`'s row
/// `i + 2p` (i in 0, 1, 4, 5) of thread share `o` goes to byte `4p + k` (k the index of i) of
/// the share's 8 columns 8o..8o+7.
const fn transpose_follows_columns() -> bool {
    let mut o = 0;
    while o < 16 {
        let mut pass = 0;
        while pass < 2 {
            let rows = [0, 1, 4, 5];
            let mut k = 0;
            while k < 4 {
                let i = rows[k] + 2 * pass;
                if key_of_column(8 * o + 4 * pass + k as u32) != share_row(o, i) {
                    return false;
                }
                k += 1;
            }
            pass += 1;
        }
        o += 1;
    }
    true
}
const _: () = assert!(transpose_follows_columns());

/// A producer thread's share of a tile's V rows (and, with them, its K rows): raw chunk `c`
/// (head-size columns 16c..16c+15) of the 8 keys that fill output bytes 8o..8o+7 of every V^T
/// row. Columns 8o..8o+7 of V^T (16-key block o / 2, half o % 2) are keys
/// 16 (o / 2) + 4 (o % 2) + {0, 1, 8, 9, 2, 3, 10, 11} ([`key_of_column`]); the thread's i-th row
/// is key 16 (o / 2) + 4 (o % 2) + (i & 3) + 8 (i >> 2).
#[derive(Clone, Copy)]
struct VShare {
    o: u32,
    chunk: u32,
}

impl VShare {
    /// For 128 producers over a 128-key tile of 128-byte rows.
    #[inline(always)]
    fn of(t: u32) -> Self {
        VShare { o: t % 16, chunk: t / 16 }
    }

    #[inline(always)]
    fn row(&self, i: usize) -> u32 {
        share_row(self.o, i as u32)
    }
}

/// Row `i` of share `o` ([`VShare`]).
const fn share_row(o: u32, i: u32) -> u32 {
    16 * (o / 2) + 4 * (o % 2) + (i & 3) + 8 * (i >> 2)
}

/// Byte offset of (row, chunk) in a raw V slot: rows of 128 bytes in key order, chunk c of row r
/// at chunk `c ^ f(r)`, f(r) = bit 2 of r and bits 4-5 of r above it. The eight threads of a
/// shared-memory phase in [`transpose_v`] read one chunk of eight rows that differ in exactly
/// those bits, so their reads fall in eight different bank groups.
#[inline(always)]
const fn raw_v_offset(row: u32, chunk: u32) -> u32 {
    let f = ((row >> 2) & 1) | ((row >> 3) & 6);
    row * ROW + 16 * (chunk ^ f)
}

/// Row `i` of a share counted from its row 0: `(i & 3) + 8 (i >> 2)` ([`share_row`]).
const fn row_step(i: usize) -> u32 {
    (i as u32 & 3) + 8 * (i as u32 >> 2)
}

/// Whether a share's rows and their V^T columns lie at a few bases plus constants, which the
/// copies and stores below take as immediate offsets (with each offset a register of its own,
/// the producer spilled at 88 registers):
/// - raw V: row i at `raw_v_offset(row 0) + 128 row_step(i)` (f of the rows is the share's);
/// - K: row i at the base of row `row 0 + (i & 3)` plus 1024 (i >> 2): four bases;
/// - V^T: column `16 chunk + 4 word + y` at the base of column `16 chunk + 4 (word & 1) + y`
///   plus 1024 (word >> 1): eight bases.
const fn share_offsets_are_bases_plus_constants() -> bool {
    let mut t = 0;
    while t < 128 {
        let (o, c) = (t % 16, t / 16);
        let row0 = share_row(o, 0);
        let mut i = 0;
        while i < 8 {
            let r = share_row(o, i as u32);
            if r != row0 + row_step(i)
                || raw_v_offset(r, c) != raw_v_offset(row0, c) + ROW * row_step(i)
                || swizzled(64, r, c) != swizzled(64, row0 + (i as u32 & 3), c) + 1024 * (i as u32 >> 2)
            {
                return false;
            }
            i += 1;
        }
        let mut col = 16 * c;
        while col < 16 * c + 16 {
            let (word, y) = ((col % 16) / 4, col % 4);
            if swizzled(64, col, o / 2) != swizzled(64, 16 * c + 4 * (word & 1) + y, o / 2) + 1024 * (word >> 1) {
                return false;
            }
            col += 1;
        }
        t += 1;
    }
    true
}
const _: () = assert!(share_offsets_are_bases_plus_constants());

/// Copies a 128-key tile of e4m3 K and V rows (entry r of the address table at `table`: row r's
/// two addresses, the first 0 where the row is zero-filled): K into the swizzled stage at `k`, V
/// into the raw slot at `v_raw` ([`raw_v_offset`]). Each of the 128 producers (`t`) copies the
/// chunks it will transpose itself ([`VShare`]), so [`transpose_v`] needs only its own copies to
/// have landed. Only the first `live` units of a row are read (the launch's head size, in `K`'s
/// [`CacheFormat::live_units`]); a zero-filled chunk keeps its address (a copy of 0 bytes reads
/// nothing), where only the 8-byte halves (`K::HALVES`) name a `fallback`.
#[inline(always)]
pub(crate) unsafe fn copy_tile<K: CacheFormat>(k: u32, v_raw: u32, t: u32, live: u32, fallback: u64, table: u32) {
    let share = VShare::of(t);
    let c = share.chunk;
    let read = c < live;
    let row0 = share.row(0);
    let entries = opaque(table + row0 * TABLE_ENTRY);
    let v_base = opaque(v_raw + raw_v_offset(row0, c));
    let k_base: [u32; 4] = core::array::from_fn(|x| opaque(k + swizzled(64, row0 + x as u32, c)));
    // Two rows' sources before their copies, as `copy_row_pairs` (the table is in shared memory).
    static_for::<4>(|g| {
        let rows = [2 * g, 2 * g + 1];
        let srcs = rows.map(|i| unsafe { ld_shared_u64x2(entries + row_step(i) * TABLE_ENTRY) });
        static_for::<2>(|k2| {
            let (a, b) = srcs[k2];
            let i = rows[k2];
            let (kd, vd) = (k_base[i & 3] + 1024 * (i as u32 >> 2), v_base + ROW * row_step(i));
            if K::HALVES {
                unsafe {
                    cp_async_halves_or_whole(kd, a, c, live, fallback);
                    cp_async_halves_or_whole(vd, if a != 0 { b } else { 0 }, c, live, fallback);
                }
                return;
            }
            let bytes = if a != 0 && read { 16 } else { 0 };
            unsafe {
                cp_async_16(kd, a.wrapping_add(c as u64 * 16), bytes);
                cp_async_16(vd, b.wrapping_add(c as u64 * 16), bytes);
            }
        });
    });
}

/// Four words' bytes transposed: word y of the result holds byte y of `a`, `b`, `c`, `d` (in
/// that order from the low byte).
#[inline(always)]
fn transpose4(a: u32, b: u32, c: u32, d: u32) -> [u32; 4] {
    let ab_lo = byte_perm(a, b, 0x5140);
    let ab_hi = byte_perm(a, b, 0x7362);
    let cd_lo = byte_perm(c, d, 0x5140);
    let cd_hi = byte_perm(c, d, 0x7362);
    [byte_perm(ab_lo, cd_lo, 0x5410), byte_perm(ab_lo, cd_lo, 0x7632), byte_perm(ab_hi, cd_hi, 0x5410), byte_perm(ab_hi, cd_hi, 0x7632)]
}

/// Writes the V rows this thread copied ([`copy_tile`], landed) into the stage's V^T at `vt`:
/// 128 rows (V's columns) of 128 key bytes in [`key_of_column`]'s order, in the same
/// 128-byte-swizzled layout as K. In two passes of four rows (rows i = 0, 1, 4, 5 fill the
/// first four of the thread's 8 bytes of a V^T row, rows 2, 3, 6, 7 the last four), so that
/// only four rows are held at a time.
#[inline(always)]
pub(crate) unsafe fn transpose_v(v_raw: u32, vt: u32, t: u32) {
    let share = VShare::of(t);
    let v_base = opaque(v_raw + raw_v_offset(share.row(0), share.chunk));
    let at = 8 * (share.o % 2);
    let out_base: [u32; 8] = core::array::from_fn(|x| opaque(vt + swizzled(64, 16 * share.chunk + x as u32, share.o / 2) + at));
    static_for::<2>(|pass| {
        let rows = [0, 1, 4, 5].map(|i| i + 2 * pass);
        let w: [[u32; 4]; 4] = rows.map(|i| unsafe { ld_shared_v4(v_base + ROW * row_step(i)) });
        static_for::<4>(|word| {
            let out = transpose4(w[0][word], w[1][word], w[2][word], w[3][word]);
            static_for::<4>(|y| {
                let base = out_base[4 * (word % 2) + y];
                unsafe { st_shared_u32(base + 1024 * (word as u32 / 2) + 4 * pass as u32, out[y]) };
            });
        });
    });
}

/// Quantises warpgroup `wg`'s 64 query rows (16-bit, `W = 128` columns, at `q16`) to e4m3 rows
/// at `q8` (same swizzle, 128 bytes a row) with one scale: the largest magnitude maps to 448.
/// `tid`: the thread's index among the 256 compute threads; `scratch`: 8 words, one a compute
/// warp. Returns the scale the e4m3 values are to be multiplied by. Ends with the warpgroup's
/// stores visible to its `wgmma`s.
#[inline(always)]
pub(crate) unsafe fn quantise_queries<Q: MmaHalf>(q16: u32, q8: u32, scratch: u32, tid: u32) -> f32 {
    let (wg, i) = (tid / 128, tid % 128);
    // Two threads a row, 64 columns (eight 16-bit chunks) each.
    let row = 64 * wg + i / 2;
    let half = i % 2;
    let w: [[u32; 4]; 8] = core::array::from_fn(|j| unsafe { ld_shared_v4(q16 + swizzled(128, row, 8 * half + j as u32)) });
    let mut m = 0.0f32;
    static_for::<8>(|j| {
        static_for::<4>(|k| {
            let (a, b) = Q::unpack2(w[j][k]);
            m = m.max(a.abs()).max(b.abs());
        });
    });
    static_for::<5>(|s| m = m.max(shfl_xor(m, 1 << s)));
    let warp = tid / 32;
    if tid & 31 == 0 {
        unsafe { st_shared_f32(scratch + 4 * warp, m) };
    }
    warpgroup_barrier(wg);
    let mut amax = 0.0f32;
    static_for::<4>(|k| amax = amax.max(f32::from_bits(unsafe { ld_shared_u32(scratch + 16 * wg + 4 * k as u32) })));
    let scale = if amax > 0.0 { amax / E4M3_MAX } else { 1.0 };
    let inv = 1.0 / scale;
    static_for::<4>(|c| {
        let mut out = [0u32; 4];
        static_for::<4>(|k| {
            // 16-bit chunk 2c + k / 2, words 2 (k % 2) and 2 (k % 2) + 1.
            let src = w[2 * c + k / 2];
            let (a, b) = Q::unpack2(src[2 * (k % 2)]);
            let (cc, d) = Q::unpack2(src[2 * (k % 2) + 1]);
            out[k] = e4m3x4(a * inv, b * inv, cc * inv, d * inv);
        });
        unsafe { st_shared_v4(q8 + swizzled(64, row, 4 * half + c as u32), out) };
    });
    fence_proxy_async_shared();
    warpgroup_barrier(wg);
    scale
}

/// Named barrier of compute warpgroup `wg` (ids 2 and 3; 0 is the CTA's, 1 the producer's).
#[inline(always)]
fn warpgroup_barrier(wg: u32) {
    if wg == 0 {
        named_barrier::<2, 128>();
    } else {
        named_barrier::<3, 128>();
    }
}
