//! The MLA kernel's matrix products where it does not take the seesaw order (`super::seesaw`):
//! S = Q K^T over the 576 columns and O += P V on `mma.sync`; for the narrow shape over an FP8
//! cache, with the fragments converted in registers from the raw rows.

use crate::attention::fp8_direct::mma_value_runs;
use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::elem::{Fp8Format, F16};
use crate::blocks::mma::{ld_shared_u64, ld_shared_v4, ldmatrix_x4, ldmatrix_x4_trans, MmaHalf};
use attn_math::mla::{self, SLOT_KEYS};
use attn_math::prefill::MLA_QK;

/// 16-column k-steps of a 576-wide row.
pub(super) const K_STEPS: u32 = MLA_QK / 16;

/// S = Q K^T for one warp: 16 query rows times `nkt * 8` keys, over all 576 columns. `q(ks)`:
/// the query fragment of k-step `ks`; `k_at(rows, chunks)`: this lane's `ldmatrix` address in the
/// K slot, `rows` and `chunks` past its own (see [`score_k_lane`]). Two k-steps per iteration, in
/// two accumulator chains; `UNROLL`: fully unrolled (so that `q` may index a register array).
#[inline(always)]
pub(super) fn scores<Q: MmaHalf, const UNROLL: bool>(
    nkt: usize,
    q: impl Fn(usize) -> [u32; 4],
    k_at: impl Fn(u32, u32) -> u32,
) -> [[f32; 4]; 4] {
    let mut even = [[0.0f32; 4]; 4];
    let mut odd = [[0.0f32; 4]; 4];
    let mut step = |ks: usize| {
        let (a0, a1) = (q(ks), q(ks + 1));
        let ks = ks as u32;
        if nkt == 1 {
            // 8 keys x 32 columns: matrices 0, 1 are k-step ks, 2, 3 are ks + 1.
            let b = unsafe { ldmatrix_x4(k_at(0, 2 * ks)) };
            even[0] = Q::mma(a0, b[0], b[1], even[0]);
            odd[0] = Q::mma(a1, b[2], b[3], odd[0]);
        } else {
            // 16 keys x 16 columns per load: matrices 0, 1 are keys 0-7, 2, 3 keys 8-15.
            static_for::<2>(|np| {
                if np < nkt / 2 {
                    let b0 = unsafe { ldmatrix_x4(k_at(16 * np as u32, 2 * ks)) };
                    let b1 = unsafe { ldmatrix_x4(k_at(16 * np as u32, 2 * ks + 2)) };
                    even[2 * np] = Q::mma(a0, b0[0], b0[1], even[2 * np]);
                    even[2 * np + 1] = Q::mma(a0, b0[2], b0[3], even[2 * np + 1]);
                    odd[2 * np] = Q::mma(a1, b1[0], b1[1], odd[2 * np]);
                    odd[2 * np + 1] = Q::mma(a1, b1[2], b1[3], odd[2 * np + 1]);
                }
            });
        }
    };
    if UNROLL {
        static_for::<{ K_STEPS as usize / 2 }>(|i| step(2 * i));
    } else {
        let mut ks = 0;
        while ks < K_STEPS as usize {
            step(ks);
            ks += 2;
        }
    }
    static_for::<4>(|n| static_for::<4>(|e| even[n][e] += odd[n][e]));
    even
}

/// This lane's (row, chunk) for [`scores`]' K loads from a slot, its warp's keys starting at row
/// `key_row`: 8-key loads span 4 chunks (2 k-steps), 16-key loads 2 (1 k-step).
#[inline(always)]
pub(super) fn score_k_lane(nkt: usize, lane: u32, key_row: u32) -> (u32, u32) {
    if nkt == 1 {
        (key_row + lane % 8, lane / 8)
    } else {
        (key_row + lane % 8 + 8 * (lane / 16), (lane / 8) % 2)
    }
}

/// O += P V for one warp: `mt` 16-row tiles of P (`p_at(m, kk)`: this lane's `ldmatrix` address
/// for row tile m, keys `16 kk ..`) times the tile's `bn` keys of V, `nct * 8` columns. `v_at(kk, dp)`:
/// this lane's transposed `ldmatrix` address for keys `16 kk ..` and the warp's columns
/// `16 dp ..`.
#[inline(always)]
pub(super) fn accumulate_pv<Q: MmaHalf>(
    o: &mut [[[f32; 4]; 32]; 2],
    mt: usize,
    nct: usize,
    bn: usize,
    p_at: impl Fn(u32, u32) -> u32,
    v_at: impl Fn(u32, u32) -> u32,
) {
    static_for::<4>(|kk| {
        if kk < bn / 16 {
            let mut a = [[0u32; 4]; 2];
            static_for::<2>(|m| {
                if m < mt {
                    a[m] = unsafe { ldmatrix_x4(p_at(m as u32, kk as u32)) };
                }
            });
            static_for::<8>(|dp| {
                if dp < nct / 2 {
                    let b = unsafe { ldmatrix_x4_trans(v_at(kk as u32, dp as u32)) };
                    static_for::<2>(|m| {
                        if m < mt {
                            o[m][2 * dp] = Q::mma(a[m], b[0], b[1], o[m][2 * dp]);
                            o[m][2 * dp + 1] = Q::mma(a[m], b[2], b[3], o[m][2 * dp + 1]);
                        }
                    });
                }
            });
        }
    });
}

/// The narrow shape's query A fragments for [`scores_fp8`]: rows `g` and `g + 8` of the queries
/// (type `Q`) at `q` ([`mla::swizzled`] layout) as f16 times `conv`, k-step `ks` holding, in
/// thread `t4`'s k slots (2t4, 2t4 + 1, 2t4 + 8, 2t4 + 9), columns
/// `16 (4 (ks / 4) + t4) + 4 (ks % 4) ..+ 4`: the columns of that thread's K bytes in the same
/// k-step.
#[inline(always)]
pub(super) unsafe fn query_fragments_fp8<Q: MmaHalf>(q: u32, conv: f32) -> [[u32; 4]; K_STEPS as usize] {
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let mut f = [[0u32; 4]; K_STEPS as usize];
    static_for::<{ K_STEPS as usize / 4 }>(|j| {
        static_for::<4>(|w| {
            let col = 16 * (4 * j as u32 + t4) + 4 * w as u32;
            let at = |h: u32| q + mla::swizzled(g + 8 * h, col / 8) + (col % 8) * 2;
            let (w0, w1) = unsafe { (ld_shared_u64(at(0)), ld_shared_u64(at(1))) };
            let f16 = |word: u64| {
                if Q::IS_BF16 {
                    let (lo, hi) = Q::unpack2(word as u32);
                    F16::pack2(lo * conv, hi * conv)
                } else {
                    word as u32
                }
            };
            f[4 * j + w] = [f16(w0), f16(w1), f16(w0 >> 32), f16(w1 >> 32)];
        });
    });
    f
}

/// S = Q K^T for one warp's 8 keys, rows `key_row ..` of the raw FP8 slot at `raw`
/// ([`mla::raw_offset`]), converted in registers: thread `t4`'s bytes of key `g` are chunks
/// `4j + t4`, one 16-byte load for four k-steps, and `q` comes permuted to match
/// ([`query_fragments_fp8`]). On f16 MMAs: one conversion instruction per pair of bytes (bf16
/// would take four). Two accumulator chains (four spill); the result in `scores`' shape.
#[inline(always)]
pub(super) unsafe fn scores_fp8<F: Fp8Format>(q: &[[u32; 4]; K_STEPS as usize], raw: u32, key_row: u32) -> [[f32; 4]; 4] {
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let mut chains = [[0.0f32; 4]; 2];
    static_for::<{ K_STEPS as usize / 4 }>(|j| {
        let v = unsafe { ld_shared_v4(raw + mla::raw_offset(key_row + g, 4 * j as u32 + t4)) };
        static_for::<4>(|w| {
            let [b0, b1] = F16::from_fp8x4::<F>(v[w]);
            chains[w % 2] = F16::mma(q[4 * j + w], b0, b1, chains[w % 2]);
        });
    });
    let mut s = [[0.0f32; 4]; 4];
    static_for::<4>(|e| s[0][e] = chains[0][e] + chains[1][e]);
    s
}

/// O += P V for the narrow shape from the tile's raw FP8 slots (`raw(i)`: slot i), converted in
/// registers, on f16 MMAs. P's f16 A fragments come from shared memory (`p_at(kk)`: this lane's
/// `ldmatrix` address for keys `16 kk ..`) in natural key order; thread `g`'s bytes of a key are
/// the 8 at columns `col0 + 8g ..` (one 8-byte load), so column `g` of accumulator tile `i` is
/// `col0 + 8g + i` ([`fp8_pairs`] regroups them for the output).
#[inline(always)]
pub(super) unsafe fn accumulate_pv_fp8<F: Fp8Format>(
    o: &mut [[f32; 4]; 32],
    p_at: impl Fn(u32) -> u32,
    raw: impl Fn(u32) -> u32,
    col0: u32,
) {
    const { assert!(mla::NARROW.block_n == 2 * SLOT_KEYS && mla::NARROW.cols_per_warp() == 64) };
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let col = col0 + 8 * g;
    static_for::<4>(|kk| {
        let a = unsafe { ldmatrix_x4(p_at(kk as u32)) };
        let mut run = [[0u32; 4]; 4];
        static_for::<4>(|k| {
            let r = 16 * (kk % 2) as u32 + 2 * t4 + (k % 2) as u32 + 8 * (k / 2) as u32;
            let v = unsafe { ld_shared_u64(raw(kk as u32 / 2) + mla::raw_offset(r, col / 16) + col % 16) };
            run[k][0] = v as u32;
            run[k][1] = (v >> 32) as u32;
        });
        mma_value_runs::<F16, F>(a, &run, 2, o);
    });
}

/// [`accumulate_pv_fp8`]'s accumulators regrouped as pairs of adjacent columns, as the `mma`
/// C layout holds them: entry `n` (0-7) is (row g: columns c, c + 1; row g + 8: the same) with
/// c = [`fp8_pair_column`]`(n)`, taken from tiles `i`, `i + 1` (columns `col0 + 16 t4 + 8e + i`).
#[inline(always)]
pub(super) fn fp8_pairs(o: &[[f32; 4]; 32]) -> [[f32; 4]; 32] {
    let mut pairs = [[0.0f32; 4]; 32];
    static_for::<8>(|n| {
        let (i, e) = (2 * (n % 4), n / 4);
        pairs[n] = [o[i][e], o[i + 1][e], o[i][2 + e], o[i + 1][2 + e]];
    });
    pairs
}

/// The first column of [`fp8_pairs`]' entry `n`.
#[inline(always)]
pub(super) fn fp8_pair_column(n: u32, col0: u32) -> u32 {
    col0 + 16 * (thread_idx_x() % 4) + 8 * (n / 4) + 2 * (n % 4)
}
