//! A tile's two matrix products for a warp on `mma.sync`: S = Q K^T and O += P V, from the
//! padded 16-bit tiles in shared memory (`ldmatrix`).

use crate::attention::config::AttnConfig;
use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::mma::{ldmatrix_x4, ldmatrix_x4_trans, MmaHalf};
use attn_math::prefill::ROW_PAD;

/// S = Q K^T for a warp: `MT` tiles of 16 rows x `C::KW` keys starting at `key_off` of the K
/// tile at `k_tile`; every K fragment feeds the `MT` row tiles. `q_frag(mt, ks)`: the A
/// fragment.
#[inline(always)]
pub(crate) fn scores<C: AttnConfig, const MT: usize>(
    q_frag: impl Fn(usize, usize) -> [u32; 4],
    k_tile: u32,
    key_off: u32,
) -> [[[f32; 4]; 8]; MT] {
    let lane = thread_idx_x() % 32;
    let k_pitch = (C::DK as u32 + ROW_PAD) * 2;
    let mut s = [[[0.0f32; 4]; 8]; MT];
    let k_base = k_tile + (key_off + (lane % 8) + 8 * (lane / 16)) * k_pitch + 16 * ((lane / 8) % 2);
    let mut k_step = |ks: usize| {
        let mut a = [[0u32; 4]; MT];
        static_for::<2>(|mt| {
            if mt < MT {
                a[mt] = q_frag(mt, ks);
            }
        });
        static_for::<4>(|np| {
            if np < C::KW / 16 {
                let b = unsafe { ldmatrix_x4(k_base + np as u32 * 16 * k_pitch + ks as u32 * 32) };
                static_for::<2>(|mt| {
                    if mt < MT {
                        s[mt][2 * np] = C::M::mma(a[mt], b[0], b[1], s[mt][2 * np]);
                        s[mt][2 * np + 1] = C::M::mma(a[mt], b[2], b[3], s[mt][2 * np + 1]);
                    }
                });
            }
        });
    };
    if C::DK / 16 <= 16 {
        // Unrolled: `q_frag` may index a register array by `ks`.
        static_for::<16>(|ks| {
            if ks < C::DK / 16 {
                k_step(ks)
            }
        });
    } else {
        // MLA's 36 k-steps: a loop (the query fragments come from shared memory then).
        for ks in 0..C::DK / 16 {
            k_step(ks);
        }
    }
    s
}

/// O += P V for a warp's `MT` row tiles: P (16 rows x `C::KW` keys each, in the score registers:
/// the C layout of one mma is the A layout of the next) times the V rows `key_off..` of the tile
/// at `v_tile` (row pitch `v_pitch` bytes); every V fragment feeds the `MT` row tiles.
#[inline(always)]
pub(crate) fn accumulate_pv<C: AttnConfig, const MT: usize>(
    s: &[[[f32; 4]; 8]; MT],
    o: &mut [[[f32; 4]; 32]; MT],
    v_tile: u32,
    v_pitch: u32,
    key_off: u32,
) {
    let lane = thread_idx_x() % 32;
    let v_base = v_tile + (key_off + (lane % 8) + 8 * ((lane / 8) % 2)) * v_pitch + 16 * (lane / 16);
    static_for::<4>(|kk| {
        if kk < C::KW / 16 {
            let mut a = [[0u32; 4]; MT];
            static_for::<2>(|mt| {
                if mt < MT {
                    let s = &s[mt];
                    a[mt] = [
                        C::M::pack2(s[2 * kk][0], s[2 * kk][1]),
                        C::M::pack2(s[2 * kk][2], s[2 * kk][3]),
                        C::M::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                        C::M::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
                    ];
                }
            });
            static_for::<16>(|dp| {
                if dp < C::DV / 16 {
                    let b = unsafe { ldmatrix_x4_trans(v_base + kk as u32 * 16 * v_pitch + dp as u32 * 32) };
                    static_for::<2>(|mt| {
                        if mt < MT {
                            o[mt][2 * dp] = C::M::mma(a[mt], b[0], b[1], o[mt][2 * dp]);
                            o[mt][2 * dp + 1] = C::M::mma(a[mt], b[2], b[3], o[mt][2 * dp + 1]);
                        }
                    });
                }
            });
        }
    });
}
