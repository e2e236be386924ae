//! Lazy rescaling of the output accumulators: a row's running max moves only when a block's max
//! passes it by more than a slack, so that most blocks leave O as it is (the Hopper prefill's
//! key step, the MLA seesaw's tiles).

use crate::blocks::device::vote_any;
use attn_math::softmax::OnlineSoftmax;

/// How far (base-2 units) a block's max may pass a row's running max before the row is
/// rescaled: the weights stay below 2^8, which 16-bit P and f32 sums hold exactly as well.
const RESCALE_SLACK: f32 = 8.0;

/// Whether the warp rescales O for this block: some row of the warp saw a block max more than
/// [`RESCALE_SLACK`] past its running max (the first block with any key, always). Otherwise
/// every row keeps its running max, and its weights, its sum and O stay relative to it, which
/// the epilogue's division and log-sum-exp accept as they are. Past the first blocks a row's
/// max rarely moves that far, so most blocks skip O's rescale (a multiply per accumulator
/// register: 64 a thread at width 128, 128 at 256 and in an MLA warpgroup's half of the
/// columns). Warp-uniform, so the branch costs no divergence.
#[inline(always)]
pub(crate) fn must_rescale(state: &[OnlineSoftmax; 2], block_max: [f32; 2], mult: f32) -> bool {
    vote_any(block_max[0] * mult > state[0].max + RESCALE_SLACK || block_max[1] * mult > state[1].max + RESCALE_SLACK)
}
