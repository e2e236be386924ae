//! e4m3 stages of the Hopper prefill kernel (`attn_math::hopper_prefill::StageFormat::Fp8`):
//! an FP8 cache's rows as operands of `wgmma`'s e4m3 MMAs, whose 8-bit operands must both be
//! K-major.
//!
//! - **K** (S = Q K^T: K is B, the head size its K) is K-major as the cache holds it: the
//!   producer copies its 128-byte rows straight into the stage's 128-byte-swizzled layout.
//! - **V** (O += P V: V is B, the keys its K) is not: the producer copies its rows into a raw
//!   slot, then writes them transposed into the stage, a row a V column ([`transpose_v`], on
//!   `ldmatrix.trans` and `stmatrix`).
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
use crate::blocks::device::{self, opaque, shfl_xor, static_for, sync_warp};
use crate::blocks::mma::{
    byte_perm, cp_async_16, cp_async_halves_or_whole, fence_proxy_async_shared, ld_shared_u32, ld_shared_u64x2, ld_shared_v4,
    ldmatrix_x4_trans, st_shared_f32, st_shared_v4, stmatrix_x4, MmaHalf,
};
use crate::blocks::wgmma::e4m3x4;
use attn_math::fp8::E4M3_MAX;
use attn_math::hopper_prefill::{swizzled, E4M3_RAW_ROW};
use attn_math::prefill::TABLE_ENTRY;

/// The key of column `col` of a 32-key P fragment (and of V^T): within each 16 columns, column
/// 4t + e holds key 2t + (e & 1) + 8 (e >> 1).
const fn key_of_column(col: u32) -> u32 {
    let (base, c) = (col & !15, col & 15);
    let (t, e) = (c / 4, c % 4);
    base + 2 * t + (e & 1) + 8 * (e >> 1)
}

/// The selectors of `prmt` that take, from two registers of `ldmatrix.trans` results (keys k,
/// k + 1 and k + 8, k + 9 of V columns n, n + 1), V column n's four bytes ([`EVEN`]) or column
/// n + 1's ([`ODD`]), in key order k, k + 1, k + 8, k + 9.
const EVEN: u32 = 0x6420;
const ODD: u32 = 0x7531;

/// For lane `lane` of producer warp `w`, the V^T row and 16-byte column chunk that row `rho`
/// (= lane % 8) of matrix `i` (= lane / 8) of its `stmatrix` at V column block 0 is stored to
/// ([`transpose_v`]): matrices (A, keys 0-15), (B, 0-15), (A, 16-31), (B, 16-31) of the warp's 32
/// keys, where register A of lane 4g + t holds V column 2g's bytes for g < 4 and 2g + 1's for
/// g >= 4, and B the other. So a matrix's eight rows are 2 rho + 1 for half of them: rows
/// {0, 2, 4, 6, 9, 11, 13, 15} and {1, 3, 5, 7, 8, 10, 12, 14}, whose swizzle sends them to eight
/// bank groups (rows 0-14 even alone would meet four, twice each).
const fn store_row(w: u32, lane: u32) -> (u32, u32) {
    let (i, rho) = (lane / 8, lane % 8);
    let odd = if i % 2 == 0 { rho >= 4 } else { rho < 4 };
    (2 * rho + odd as u32, 2 * w + i / 2)
}

/// Whether [`transpose_v`] writes each V^T byte from the V byte [`key_of_column`] names, once:
/// `ldmatrix.trans` gives lane 4g + t, of each 8x8 matrix of 16-bit pairs (8 keys, 16 V
/// columns), keys 2t and 2t + 1 of pair g; `stmatrix` stores lane 4g + t's register i as the
/// 4 bytes at 4t of row g of matrix i, whose row addresses lanes 8i..8i+7 give.
const fn transpose_follows_columns() -> bool {
    let mut seen = [0u8; 128 * 128];
    let mut w = 0;
    while w < 4 {
        let mut m = 0;
        while m < 8 {
            let mut lane = 0;
            while lane < 32 {
                let (g, t) = (lane / 4, lane % 4);
                let mut i = 0;
                while i < 4 {
                    // Register i: the pair (A or B) of keys 16 (i / 2) on.
                    let odd = if i % 2 == 0 { g >= 4 } else { g < 4 };
                    let col = 16 * m + 2 * g + odd as u32;
                    let (row, chunk) = store_row(w, 8 * i + g);
                    if 16 * m + row != col {
                        return false;
                    }
                    let mut e = 0;
                    while e < 4 {
                        let key = 32 * w + 16 * (i / 2) + 2 * t + (e & 1) + 8 * (e >> 1);
                        let at = 16 * chunk + 4 * t + e;
                        if key_of_column(at) != key {
                            return false;
                        }
                        seen[(col * 128 + at) as usize] += 1;
                        e += 1;
                    }
                    i += 1;
                }
                lane += 1;
            }
            m += 1;
        }
        w += 1;
    }
    let mut x = 0;
    while x < seen.len() {
        if seen[x] != 1 {
            return false;
        }
        x += 1;
    }
    true
}
const _: () = assert!(transpose_follows_columns());

/// Copies a 128-key tile of e4m3 K and V rows (entry r of the address table at `table`: row r's
/// two addresses, the first 0 where the row is zero-filled): K into the swizzled stage at `k`, V
/// into the raw slot at `v_raw` (rows [`E4M3_RAW_ROW`] bytes apart). Producer warp w copies rows
/// 32w..32w+31, which [`transpose_v`] then reads in the same warp: lane 8q + c copies chunk c of
/// rows 32w + 4j + q, so that each copy instruction reads four whole 128-byte rows. Only the
/// first `live` units of a row are read (the launch's head size, in `K`'s
/// [`CacheFormat::live_units`]); a zero-filled chunk keeps its address (a copy of 0 bytes reads
/// nothing), where only the 8-byte halves (`K::HALVES`) name a `fallback`.
#[inline(always)]
pub(crate) unsafe fn copy_tile<K: CacheFormat>(k: u32, v_raw: u32, t: u32, live: u32, fallback: u64, table: u32) {
    let (w, q, c) = (t / 32, (t % 32) / 8, t % 8);
    let row0 = 32 * w + q;
    let read = c < live;
    // Row 4j of the lane's rows: the table entry 64j bytes on, the raw V row 4j rows on, K
    // 1024 (j / 2) bytes on from the base of row 0 or 4 (the swizzle's XOR takes two values).
    let entries = opaque(table + row0 * TABLE_ENTRY);
    let v_base = opaque(v_raw + row0 * E4M3_RAW_ROW + 16 * c);
    let k_base = [opaque(k + swizzled(64, row0, c)), opaque(k + swizzled(64, row0 + 4, c))];
    static_for::<4>(|g| {
        let rows = [2 * g, 2 * g + 1];
        // Two rows' sources before their copies, as `copy_row_pairs`.
        let srcs = rows.map(|j| unsafe { ld_shared_u64x2(entries + 4 * j as u32 * TABLE_ENTRY) });
        static_for::<2>(|x| {
            let (a, b) = srcs[x];
            let j = rows[x] as u32;
            let (kd, vd) = (k_base[x] + 1024 * (j / 2), v_base + 4 * j * E4M3_RAW_ROW);
            if K::HALVES {
                unsafe {
                    cp_async_halves_or_whole(kd, a, c, live, fallback);
                    cp_async_halves_or_whole(vd, if a != 0 { b } else { 0 }, c, live, fallback);
                }
                return;
            }
            let bytes = if a != 0 && read { 16 } else { 0 };
            unsafe {
                cp_async_16(kd, a.wrapping_add(16 * c as u64), bytes);
                cp_async_16(vd, b.wrapping_add(16 * c as u64), bytes);
            }
        });
    });
}

/// Whether [`copy_tile`]'s K destinations are its two bases plus constants: row 32w + 4j + q at
/// the base of row 32w + q (j even) or 32w + q + 4 (j odd), plus 1024 (j / 2).
const fn k_rows_are_bases_plus_constants() -> bool {
    let mut t = 0;
    while t < 128 {
        let (w, q, c) = (t / 32, (t % 32) / 8, t % 8);
        let mut j = 0;
        while j < 8 {
            let row = 32 * w + 4 * j + q;
            if swizzled(64, row, c) != swizzled(64, 32 * w + q + 4 * (j % 2), c) + 1024 * (j / 2) {
                return false;
            }
            j += 1;
        }
        t += 1;
    }
    true
}
const _: () = assert!(k_rows_are_bases_plus_constants());

/// Writes the V rows producer warp `t / 32` copied ([`copy_tile`]: rows 32w..32w+31, landed in
/// each copying lane's view) into the stage's V^T at `vt`: 128 rows (V's columns) of 128 key
/// bytes in [`key_of_column`]'s order, in the same 128-byte-swizzled layout as K. Per 16 V
/// columns, one `ldmatrix.trans` of the warp's 32 keys (four 8x8 matrices of 16-bit pairs), four
/// `prmt` and one `stmatrix` ([`transpose_follows_columns`]); the eight loads first, since a
/// load after a store to shared memory waits for it. Raw rows [`E4M3_RAW_ROW`] bytes apart put
/// eight consecutive rows' same 16 bytes in eight bank groups. V^T's 16 rows from 16 `ones`
/// on (`ones` < 8; 8 for none) are `one` (four 1s of V's format) instead: the column of ones
/// the P V chain sums the rows' weights against (`wgmma::pv_blocks_fp8`), past the kernel's width.
#[inline(always)]
pub(crate) unsafe fn transpose_v(v_raw: u32, vt: u32, t: u32, ones: usize, one: u32) {
    let (w, lane) = (t / 32, t % 32);
    // The lanes' copies, each landed in its own lane's view, visible to the whole warp.
    sync_warp();
    let src = opaque(v_raw + t * E4M3_RAW_ROW);
    let (row, chunk) = store_row(w, lane);
    let dst = opaque(vt + swizzled(64, row, chunk));
    let (a, b) = if lane / 4 < 4 { (EVEN, ODD) } else { (ODD, EVEN) };
    let r: [[u32; 4]; 8] = core::array::from_fn(|m| if m == ones { [one; 4] } else { unsafe { ldmatrix_x4_trans(src + 16 * m as u32) } });
    static_for::<8>(|m| {
        let r = r[m];
        let out = if m == ones {
            r
        } else {
            [byte_perm(r[0], r[1], a), byte_perm(r[0], r[1], b), byte_perm(r[2], r[3], a), byte_perm(r[2], r[3], b)]
        };
        // Columns 16 m on: rows 16 m on, two swizzle groups of 1024 bytes.
        unsafe { stmatrix_x4(dst + 2048 * m as u32, out) };
    });
}

/// Quantises warpgroup `wg`'s 64 query rows (16-bit, `W = 128` columns, at `q16`) to e4m3 rows
/// at `q8` (same swizzle, 128 bytes a row) with one scale: the largest magnitude maps to 448.
/// `tid`: the thread's index among the 256 compute threads, `wg` its warpgroup (`tid / 128`,
/// warp-uniform to `ptxas`: see below); `scratch`: 8 words, one a compute warp. Returns the
/// scale the e4m3 values are to be multiplied by. Ends with the warpgroup's stores visible to
/// its `wgmma`s.
///
/// The warpgroup's barrier is chosen by a branch on `wg`. Derived from `tid` here, that branch
/// was divergent to `ptxas`, and so was everything after it in the item loop: the key loop's
/// ring position and `wgmma` descriptors were built in vector registers and moved across
/// (24 `R2UR` and 4 `WARPSYNC` a tile at width 128). With the caller's broadcast value they
/// stay in uniform registers, as in the 16-bit kernels.
#[inline(always)]
pub(crate) unsafe fn quantise_queries<Q: MmaHalf>(q16: u32, q8: u32, scratch: u32, wg: u32, tid: u32) -> f32 {
    let i = tid % 128;
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

/// This thread's A fragments of S's queries, from the warpgroup's 64 rows at `q8` as
/// [`quantise_queries`] wrote them: `[ks]` is k-step `ks` (columns 32ks..32ks+31) in `wgmma`'s
/// register layout of an 8-bit A, rows 16w + g and 16w + g + 8 of the warpgroup's warp `w`,
/// columns 4t4..4t4+3 of each half of the k-step. Read once an item, so that the S chains read
/// no queries from shared memory and take no query descriptors.
#[inline(always)]
pub(crate) unsafe fn query_frags(q8: u32, warp: u32, lane: u32) -> [[u32; 4]; 4] {
    let (g, t4) = (lane / 4, lane % 4);
    let row = 16 * (warp % 4) + g;
    let at = |r: u32, chunk: u32| unsafe { ld_shared_u32(q8 + swizzled(64, r, chunk) + 4 * t4) };
    core::array::from_fn(|ks| {
        let c = 2 * ks as u32;
        [at(row, c), at(row + 8, c), at(row, c + 1), at(row + 8, c + 1)]
    })
}

/// Named barrier of compute warpgroup `wg` (ids 2 and 3; 0 is the CTA's, 1 the producer's).
#[inline(always)]
fn warpgroup_barrier(wg: u32) {
    device::warpgroup_barrier::<2, 3>(wg)
}
