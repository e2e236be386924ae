//! Decode from an FP8 cache with the tensor cores' fragments converted straight from the staged
//! FP8 rows (head sizes 64 and 128), instead of converting whole tiles into a 16-bit copy in
//! shared memory that `ldmatrix` then reads.
//!
//! A dot product does not care in which order it sums, so the fragments are laid out to make
//! each thread's FP8 bytes contiguous:
//! - **S = Q K^T**: k-step `ks` of thread `t4` takes head dimensions `t4 * D/4 + 4 ks .. + 4`
//!   (in the `mma`'s k slots 2t4, 2t4+1, 2t4+8, 2t4+9). A thread's K bytes for a key are one
//!   run of D/4 bytes; its query fragments are loaded once, permuted the same way.
//! - **O += P V**: output column tile `i`, column `g` is head dimension `g * D/8 + i`, so a
//!   thread's V bytes for a key are one run of D/8 bytes. Two keys' runs interleave with one
//!   `prmt` into the (key, key + 1) pairs a B fragment holds. The accumulator columns are
//!   permuted; [`out_col`] maps them back when the rows are stored.
//!
//! The staged rows are swizzled in 16-byte units (unit `u` of 128-byte line `L` is stored at
//! `u ^ (L % 8)`) so that the eight threads of a shared-memory phase, which read different keys'
//! runs at the same offsets, hit different banks.

use crate::attention::config::{AttnConfig, CacheFormat};
use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::elem::{Fp8Format, HalfFloat};
use crate::blocks::mma::{byte_perm, ld_shared_u64, ld_shared_v4, MmaHalf};

/// Byte offset of byte `b` of row `r` (rows of `d` FP8 bytes) in a swizzled stage.
#[inline(always)]
pub(crate) fn swizzled(r: u32, b: u32, d: u32) -> u32 {
    let unit = r * (d / 16) + b / 16;
    let line = unit / 8;
    (line * 8 + ((unit % 8) ^ (line % 8))) * 16 + b % 16
}

/// The output column of accumulator tile `i`, register pair element `e` (0, 1) of this thread.
#[inline(always)]
pub(crate) fn out_col<C: AttnConfig>(i: u32, e: u32) -> u32 {
    let t4 = thread_idx_x() % 4;
    (2 * t4 + e) * (C::DV as u32 / 8) + i
}

/// The query A fragments of the warp's 16 rows (at `q`, 16-bit, row pitch `pitch` bytes) for
/// every k-step, in the permuted order of [`scores`], converted to `C::M` with factor `conv`.
#[inline(always)]
pub(crate) unsafe fn query_fragments<C: AttnConfig>(q: u32, pitch: u32, conv: f32) -> [[u32; 4]; 16] {
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    // Row g and row g + 8: D/4 elements from t4 * D/4, i.e. D/2 bytes, D/32 16-byte loads.
    let mut words = [[0u32; 32]; 2];
    static_for::<2>(|h| {
        let row = q + (g + 8 * h as u32) * pitch + t4 * (C::DK as u32 / 4) * 2;
        static_for::<4>(|c| {
            if c < C::DK / 32 {
                let v = unsafe { ld_shared_v4(row + c as u32 * 16) };
                static_for::<4>(|j| words[h][4 * c + j] = v[j]);
            }
        });
    });
    let convert = |w: u32| {
        if C::Q::IS_BF16 == C::M::IS_BF16 {
            w
        } else {
            let (lo, hi) = C::Q::unpack2(w);
            C::M::pack2(lo * conv, hi * conv)
        }
    };
    let mut f = [[0u32; 4]; 16];
    static_for::<16>(|ks| {
        if ks < C::DK / 16 {
            // Elements 4 ks, 4 ks + 1 (k slots 2t4, 2t4+1) and 4 ks + 2, + 3 (2t4+8, 2t4+9).
            f[ks] = [convert(words[0][2 * ks]), convert(words[1][2 * ks]), convert(words[0][2 * ks + 1]), convert(words[1][2 * ks + 1])];
        }
    });
    f
}

/// S = Q K^T for the warp's 16 keys `key_off ..` of the swizzled FP8 stage at `k_raw`: two
/// column tiles of 8 keys, each a chain of D/16 MMAs.
#[inline(always)]
pub(crate) unsafe fn scores<C: AttnConfig>(q: &[[u32; 4]; 16], k_raw: u32, key_off: u32) -> [[f32; 4]; 8] {
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let mut s = [[0.0f32; 4]; 8];
    // Both keys' runs first (D/4 bytes each), then the two chains.
    let mut run = [[0u32; 8]; 2];
    static_for::<2>(|j| {
        let r = key_off + 8 * j as u32 + g;
        static_for::<2>(|c| {
            if c < C::DK / 64 {
                let v = unsafe { ld_shared_v4(k_raw + swizzled(r, t4 * (C::DK as u32 / 4) + c as u32 * 16, C::DK as u32)) };
                static_for::<4>(|w| run[j][4 * c + w] = v[w]);
            }
        });
    });
    static_for::<16>(|ks| {
        if ks < C::DK / 16 {
            static_for::<2>(|j| {
                let [b0, b1] = C::M::from_fp8x4::<<C::Cache as CacheFormat>::Fp8>(run[j][ks]);
                s[j] = C::M::mma(q[ks], b0, b1, s[j]);
            });
        }
    });
    s
}

/// O += P V for the warp's 16 keys `key_off ..` of the swizzled FP8 stage at `v_raw`; P is in
/// the score registers, O's columns are permuted (see [`out_col`]).
#[inline(always)]
pub(crate) unsafe fn accumulate_pv<C: AttnConfig>(s: &[[f32; 4]; 8], o: &mut [[f32; 4]; 32], v_raw: u32, key_off: u32) {
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let a = [C::M::pack2(s[0][0], s[0][1]), C::M::pack2(s[0][2], s[0][3]), C::M::pack2(s[1][0], s[1][1]), C::M::pack2(s[1][2], s[1][3])];
    // Keys 2t4, 2t4 + 1 (b0) and 2t4 + 8, 2t4 + 9 (b1): D/8 bytes each from g * D/8.
    let mut run = [[0u32; 4]; 4];
    static_for::<4>(|k| {
        let r = key_off + 2 * t4 + (k % 2) as u32 + 8 * (k / 2) as u32;
        let at = v_raw + swizzled(r, g * (C::DV as u32 / 8), C::DV as u32);
        if C::DV == 128 {
            run[k] = unsafe { ld_shared_v4(at) };
        } else {
            let v = unsafe { ld_shared_u64(at) };
            run[k][0] = v as u32;
            run[k][1] = (v >> 32) as u32;
        }
    });
    mma_value_runs::<C::M, <C::Cache as CacheFormat>::Fp8>(a, &run, C::DV / 32, o);
}

/// `O += P V` for one 16-key k-step from each thread's FP8 value runs: `run[k]`, the bytes of
/// key `2t4 + k % 2 + 8 (k / 2)` (the B fragment's keys) at this thread's `4 * words` columns, word
/// m holding columns `4m .. 4m + 4` of its slice; column `g`'s slice byte `i` belongs to
/// accumulator tile `i` (`a`: P's A fragment for the same 16 keys).
#[inline(always)]
pub(crate) fn mma_value_runs<M: MmaHalf, F: Fp8Format>(a: [u32; 4], run: &[[u32; 4]; 4], words: usize, o: &mut [[f32; 4]; 32]) {
    static_for::<4>(|m| {
        if m < words {
            // (key 2t4, key 2t4 + 1) byte pairs of columns 4m, 4m + 1 and 4m + 2, 4m + 3.
            let low = [byte_perm(run[0][m], run[1][m], 0x5140), byte_perm(run[2][m], run[3][m], 0x5140)];
            let high = [byte_perm(run[0][m], run[1][m], 0x7362), byte_perm(run[2][m], run[3][m], 0x7362)];
            // Each word's two byte pairs converted as its 16-bit halves (`from_fp8x4`).
            let low = [M::from_fp8x4::<F>(low[0]), M::from_fp8x4::<F>(low[1])];
            let high = [M::from_fp8x4::<F>(high[0]), M::from_fp8x4::<F>(high[1])];
            static_for::<4>(|d| {
                let pairs = if d < 2 { low } else { high };
                let i = 4 * m + d;
                o[i] = M::mma(a, pairs[0][d % 2], pairs[1][d % 2], o[i]);
            });
        }
    });
}
