//! Prefill on Hopper's warpgroup MMA (sm_90a only), from 16-bit caches: [`prefill_specialized`]
//! (`prefill_wgs_*`), persistent CTAs with a producer warpgroup, its key step's pieces in
//! [`steps`].

mod e4m3_stages;
pub(crate) mod half_mma;
pub(crate) mod prefill_specialized;
mod steps;

use crate::attention::config::{AttnConfig, Bits16};
use crate::blocks::mma::MmaHalf;
use attn_math::hopper_prefill::BLOCK_N;

/// What the helpers shared with the `mma.sync` kernels see of these ([`AttnConfig`]): prefill
/// from a 16-bit cache at head size `D` on `BLOCK_N`-key tiles, a warp's scores `KW` keys wide
/// at a time. The one helper given it, `Logits::apply`, reads only `KW` (and the masks), so the
/// QK 192 / V 128 kernel passes its QK width for both.
pub(crate) struct Wgmma<Q, const D: usize, const KW: usize>(core::marker::PhantomData<Q>);

impl<Q: MmaHalf, const D: usize, const KW: usize> AttnConfig for Wgmma<Q, D, KW> {
    type Q = Q;
    type M = Q;
    type Cache = Bits16;
    const DK: usize = D;
    const DV: usize = D;
    const KEYS: bool = false;
    const BN: usize = BLOCK_N as usize;
    const KW: usize = KW;
    const MT: usize = 1;
}
