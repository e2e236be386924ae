//! The MLA kernel's matrix products: S = Q K^T over the 576 columns and O += P V, on
//! `mma.sync`, or (the wide shape on sm_90a) on `wgmma`.

use crate::blocks::device::static_for;
use crate::blocks::mma::{ldmatrix_x4, ldmatrix_x4_trans, MmaHalf};
#[cfg(wgmma)]
use attn_math::mla::{self, swizzled, SLOT_KEYS};
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

/// The wide shape's scores of this warp (16 rows x `nkt * 8` keys): on sm_90a the warpgroup's
/// `wgmma` over its 64 rows (Q at `q`) and 32 keys (rows `key_row..` of the slot at `slot`); else
/// `mma.sync` (`q_frag`, `k_at` as for [`scores`]).
#[inline(always)]
#[allow(unused_variables)]
pub(super) fn wide_scores<Q: MmaHalf>(
    nkt: usize,
    q_frag: impl Fn(usize) -> [u32; 4],
    k_at: impl Fn(u32, u32) -> u32,
    q: u32,
    slot: u32,
    key_row: u32,
) -> [[f32; 4]; 4] {
    #[cfg(wgmma)]
    {
        const { assert!(mla::WIDE.keys_per_warp() == 32 && mla::WIDE.s_row_tiles == 4) };
        let a = crate::blocks::mma::wgmma_desc(q, 16, mla::GROUP_BYTES, true);
        let b = crate::blocks::mma::wgmma_desc(slot + swizzled(key_row, 0), 16, mla::GROUP_BYTES, true);
        unsafe { Q::wgmma_64x32_k576(a, b) }
    }
    #[cfg(not(wgmma))]
    {
        scores::<Q, true>(nkt, q_frag, k_at)
    }
}

/// The wide shape's `O += P V` on sm_90a: the warpgroup's 64 rows x 256 columns over the tile's
/// 64 keys, P at `p` (8-row groups `p_group` bytes apart), V's keys 0-31 and 32-63 from the slots
/// at `v0` and `v1` (their first 64-column atom of the warpgroup's columns).
#[inline(always)]
#[allow(unused_variables)]
pub(super) unsafe fn wide_pv<Q: MmaHalf>(o: &mut [[f32; 4]; 32], p: u32, p_group: u32, v0: u32, v1: u32) {
    #[cfg(wgmma)]
    {
        const { assert!(mla::WIDE.block_n == 2 * SLOT_KEYS && mla::WIDE.block_m == 64) };
        let a = crate::blocks::mma::wgmma_desc(p, 128, p_group, false);
        let b0 = crate::blocks::mma::wgmma_desc(v0, 1024, mla::GROUP_BYTES, true);
        let b1 = crate::blocks::mma::wgmma_desc(v1, 1024, mla::GROUP_BYTES, true);
        unsafe { Q::wgmma_pv_64x256_k64(o, a, b0, b1) };
    }
    #[cfg(not(wgmma))]
    unreachable!()
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
