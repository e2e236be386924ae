//! The softmax step of the e4m3 kernels ([`super::narrow_e4m3`], [`super::wide_e4m3`]), between
//! S^T and P V: each warp's row maxima published, the tile's gathered from the four warps', the
//! lazy rescale, and the weights into P^T as e4m3 bytes; after the key loop, the row sums
//! gathered the same way.
//!
//! S^T's accumulators put keys on M and query rows on N: thread (warp, g, t4) holds, for each
//! 8-row block j, `s[j][e]` = key `16 warp + g + 8 (e >> 1)` of row `8 j + 2 t4 + (e & 1)` (R =
//! 2 J rows a thread, state index `2 j + (e & 1)`). Both kernels run the same instructions here;
//! only J (2 or 4) and the rows of P^T (16 or 32) differ. The wide kernel ran 749
//! warp-instructions a warp a tile at 6.4 cycles each, bound by its own instruction stream
//! (docs/mla.md), so this step is written for few instructions.

use super::narrow_e4m3::{warpgroup_barrier, P_SHIFT, SLACK};
use crate::blocks::device::{fma, shfl_xor, static_for};
use crate::blocks::mma::{byte_perm, ld_shared_v4, st_shared_f32, st_shared_u32};
use crate::blocks::vec_io::e4m3x2;
use attn_math::mla::e4m3_swizzled;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// Each of this thread's R rows' max over the warp's 16 keys of `s` (J blocks), stored by the
/// lanes of g 0 as the warp's entry (`at(r) + 4 warp`) of the row's four partial maxima.
#[inline(always)]
pub(super) fn publish_row_maxima<const J: usize, const R: usize>(s: &[[f32; 4]; J], at: impl Fn(usize) -> u32, warp: u32, g: u32) {
    const { assert!(R == 2 * J) };
    let mut m = [f32::NEG_INFINITY; R];
    static_for::<R>(|r| {
        let (j, e) = (r / 2, r % 2);
        m[r] = s[j][e].max(s[j][e + 2]);
    });
    static_for::<3>(|x| static_for::<R>(|r| m[r] = m[r].max(shfl_xor(m[r], 4 << x))));
    if g == 0 {
        static_for::<R>(|r| unsafe { st_shared_f32(at(r) + 4 * warp, m[r]) });
    }
}

/// The tile's maxima of this thread's R rows, times their score factors `mult`: row r's four
/// warps' partial maxima are the four f32 at `at(r)` (16-byte aligned).
#[inline(always)]
pub(super) fn tile_maxima<const R: usize>(at: impl Fn(usize) -> u32, mult: &[f32; R]) -> [f32; R] {
    core::array::from_fn(|r| {
        let all = unsafe { ld_shared_v4(at(r)) };
        let w = |k: usize| f32::from_bits(all[k]);
        w(0).max(w(1)).max(w(2).max(w(3))) * mult[r]
    })
}

/// The lazy rescale: a row's max moves (and O with it) only when the tile's rises more than
/// `SLACK` past it. Returns the factors for O's rows when some row of the warp moves (a
/// warp-uniform answer, from a vote over each thread's largest rise: one compare for the
/// common case, where none does), `None` when O stays as it is.
#[inline(always)]
pub(super) fn lazy_factors<const R: usize>(state: &mut [OnlineSoftmax; R], tile_max: &[f32; R]) -> Option<[f32; R]> {
    let rise: [f32; R] = core::array::from_fn(|r| tile_max[r] - state[r].max);
    let mut most = rise[0];
    static_for::<R>(|r| most = most.max(rise[r]));
    if !crate::blocks::device::vote_any(most > SLACK) {
        return None;
    }
    let mut factor = [1.0f32; R];
    static_for::<R>(|r| {
        if rise[r] > SLACK {
            factor[r] = state[r].rescale_to(tile_max[r]);
        }
    });
    Some(factor)
}

/// The weights of `s` (J blocks, R = 2 J rows), times `2^P_SHIFT` under the rows' maxima, into
/// their row sums and into P^T as e4m3 bytes, P^T having `rows` rows at `p_buf`. Scores are
/// -inf only in a `masked` tile, which takes them as 0 whatever the factor (a zero K scale
/// would make the product NaN); the others skip the test.
///
/// P^T column of key m: `attn_math::mla::e4m3_column_of`. Keys m and m + 8 of rows n0 and
/// n0 + 1 (n0 = 8 j + 2 t4) sit in columns c, c + 2 (g even) and c + 1, c + 3 (g odd: lane + 4),
/// c = 16 warp + 4 (g / 2). So lanes g and g ^ 1 swap half of their bytes, and each stores one
/// row's four columns as a word: even g row n0, odd g row n0 + 1.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn weights_into_p<const J: usize, const R: usize>(
    s: &mut [[f32; 4]; J],
    state: &mut [OnlineSoftmax; R],
    mult: &[f32; R],
    masked: bool,
    p_buf: u32,
    rows: u32,
    warp: u32,
    lane: u32,
) {
    const { assert!(R == 2 * J) };
    let neg: [f32; R] = core::array::from_fn(|r| if state[r].max == f32::NEG_INFINITY { 0.0 } else { P_SHIFT - state[r].max });
    let weight = |x: f32, r: usize| exp2(fma(x, mult[r], neg[r]));
    if masked {
        static_for::<J>(|j| static_for::<4>(|e| s[j][e] = if s[j][e] == f32::NEG_INFINITY { 0.0 } else { weight(s[j][e], 2 * j + e % 2) }));
    } else {
        static_for::<J>(|j| static_for::<4>(|e| s[j][e] = weight(s[j][e], 2 * j + e % 2)));
    }
    static_for::<J>(|j| static_for::<4>(|e| state[2 * j + e % 2].sum += s[j][e]));
    let (g, t4) = (lane / 4, lane % 4);
    let odd = g % 2;
    let sel = if odd == 0 { 0x6240 } else { 0x3715 };
    let at = p_buf + e4m3_swizzled(rows, 2 * t4 + odd, 16 * warp + 4 * (g / 2));
    static_for::<J>(|j| {
        // Bytes: (n0, m), (n0 + 1, m), (n0, m + 8), (n0 + 1, m + 8).
        let x = e4m3x2(s[j][0], s[j][1]) | e4m3x2(s[j][2], s[j][3]) << 16;
        let y = shfl_xor(f32::from_bits(x), 4).to_bits();
        // 8 rows on, the swizzle is the same: the offsets add.
        unsafe { st_shared_u32(at + 1024 * j as u32, byte_perm(x, y, sel)) };
    });
}

/// After the key loop: each of this thread's R rows' sum over its warp's keys, stored by the
/// lanes of g 0 as the warp's entry (`at(r) + 4 warp`) of the row's four, between two barriers
/// of warpgroup `wg` (the first keeps the last tile's maxima from being overwritten while read).
/// [`row_sum`] adds them up.
#[inline(always)]
pub(super) fn publish_row_sums<const R: usize>(state: &[OnlineSoftmax; R], at: impl Fn(usize) -> u32, warp: u32, g: u32, wg: u32) {
    let mut sum = [0.0f32; R];
    static_for::<R>(|r| {
        sum[r] = state[r].sum;
        static_for::<3>(|x| sum[r] += shfl_xor(sum[r], 4 << x));
    });
    warpgroup_barrier(wg);
    if g == 0 {
        static_for::<R>(|r| unsafe { st_shared_f32(at(r) + 4 * warp, sum[r]) });
    }
    warpgroup_barrier(wg);
}

/// A row's state over the whole loop: its max less `P_SHIFT` (P's scale out again) and the sum
/// of its four warps' sums at `at` ([`publish_row_sums`]).
#[inline(always)]
pub(super) fn final_state(state: &OnlineSoftmax, at: u32) -> OnlineSoftmax {
    let all = unsafe { ld_shared_v4(at) };
    OnlineSoftmax { max: state.max - P_SHIFT, sum: all.iter().fold(0.0, |a, &x| a + f32::from_bits(x)) }
}
