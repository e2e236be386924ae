//! A compute warpgroup's MMAs over one 64-key step, per stage format: 16-bit operands
//! ([`Mma16`]) or FP8 ones ([`MmaFp8`], `crate::attention::hopper::e4m3_stages`). The key loop
//! of `prefill_specialized` is written once over this.

use crate::attention::hopper::e4m3_stages::query_frags;
use crate::blocks::mma::wgmma_desc;
use crate::blocks::wgmma::{e4m3x4, pv_blocks_fp8, wait_frags, wait_pv64, wait_pv64_e4m3, Acc, WgmmaFp8, WgmmaTiles};
use attn_math::hopper_prefill::group_bytes;
use core::marker::PhantomData;

pub(crate) trait HalfMma {
    /// The stages hold e4m3 rows (`StageFormat::Fp8`).
    const E4M3: bool;
    /// P of a step as the P V chain's A fragments.
    type P: Copy;
    const P_ZERO: Self::P;
    /// S's query operand: Q's descriptor, or (e4m3 stages) this thread's A fragments.
    type Queries: Copy;
    /// Descriptors of Q and K (K-major) and V in the stage's layout, rows of `W` columns.
    fn desc_qk<const W: usize>(addr: u32) -> u64;
    fn desc_v<const W: usize>(addr: u32) -> u64;
    /// The query operand of an item from the warpgroup's query rows at `rows` (16-bit: Q's
    /// descriptor; e4m3 stages: this thread's fragments of the quantised rows, read once they
    /// are written; `warp`, `lane`: this thread's).
    unsafe fn queries<const W: usize>(rows: u32, warp: u32, lane: u32) -> Self::Queries;
    /// S = Q K^T over 64 keys, not waited for (`wait_scores64` retires it).
    unsafe fn scores<const D: usize>(q: Self::Queries, desc_k: u64) -> [[f32; 4]; 8];
    /// S = Q K^T over a whole tile of 128 keys whose K rows are contiguous (a whole-tile stage,
    /// width 64), not waited for (`wait_scores128` retires it). 16-bit operands only: e4m3
    /// stages step over half tiles.
    unsafe fn scores_tile<const D: usize>(q: Self::Queries, desc_k: u64) -> [[f32; 4]; 16];
    /// Blocks of O [`Self::pv`] writes at width `D`: `D / 8`, or one more that holds the rows'
    /// sums of P (e4m3 stages, `wgmma::pv_blocks_fp8`).
    fn pv_blocks<const D: usize>() -> usize;
    /// O += P V over 64 keys, not waited for ([`Self::wait_pv`] retires it); `desc_ones`: the
    /// block of ones some chains sum the rows' weights against ([`Self::pv_blocks`]).
    unsafe fn pv<const D: usize>(o: &mut Acc, p: &Self::P, desc_v: u64, desc_ones: u64);
    /// Waits until at most `N` chains are pending; `o` and `p` are operands, as in `wait_pv64`.
    unsafe fn wait_pv<const N: u32, const D: usize>(o: &mut Acc, p: &Self::P);
    /// Waits until at most `N` chains are pending, `p` the A fragments of one that has
    /// retired by then: its registers are the chain's until here, free after.
    unsafe fn wait_frags<const N: u32>(p: &Self::P);
    /// The weights of a 64-key S block as A fragments.
    fn pack(s: &[[f32; 4]; 8]) -> Self::P;
}

/// 16-bit Q, K and V of type `Q`: V read N-major from its rows, P packed in `mma.sync`'s A layout.
pub(crate) struct Mma16<Q>(PhantomData<Q>);

impl<Q: WgmmaTiles> HalfMma for Mma16<Q> {
    const E4M3: bool = false;
    type P = [[u32; 4]; 4];
    const P_ZERO: Self::P = [[0; 4]; 4];
    type Queries = u64;

    #[inline(always)]
    fn desc_qk<const W: usize>(addr: u32) -> u64 {
        wgmma_desc(addr, 16, group_bytes(W as u32), true)
    }

    #[inline(always)]
    fn desc_v<const W: usize>(addr: u32) -> u64 {
        wgmma_desc(addr, 1024, group_bytes(W as u32), true)
    }

    #[inline(always)]
    unsafe fn queries<const W: usize>(rows: u32, _: u32, _: u32) -> u64 {
        Self::desc_qk::<W>(rows)
    }

    #[inline(always)]
    unsafe fn scores<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 8] {
        unsafe { Q::scores_64x64_async::<D>(desc_q, desc_k) }
    }

    #[inline(always)]
    unsafe fn scores_tile<const D: usize>(desc_q: u64, desc_k: u64) -> [[f32; 4]; 16] {
        unsafe { Q::scores_64x128_async::<D>(desc_q, desc_k) }
    }

    #[inline(always)]
    fn pv_blocks<const D: usize>() -> usize {
        D / 8
    }

    #[inline(always)]
    unsafe fn pv<const D: usize>(o: &mut Acc, p: &Self::P, desc_v: u64, _: u64) {
        unsafe { Q::pv_64xd_k64_async::<D>(o, p, desc_v) }
    }

    #[inline(always)]
    unsafe fn wait_pv<const N: u32, const D: usize>(o: &mut Acc, p: &Self::P) {
        unsafe { wait_pv64::<N, D>(o, p) }
    }

    #[inline(always)]
    unsafe fn wait_frags<const N: u32>(p: &Self::P) {
        unsafe { wait_frags::<N, 4>(p) }
    }

    #[inline(always)]
    fn pack(s: &[[f32; 4]; 8]) -> Self::P {
        core::array::from_fn(|kk| {
            [
                Q::pack2(s[2 * kk][0], s[2 * kk][1]),
                Q::pack2(s[2 * kk][2], s[2 * kk][3]),
                Q::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                Q::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            ]
        })
    }
}

/// e4m3 Q, K and V^T of FP8 format `B` (the cache's), rows of 128 bytes: P rounded to e4m3,
/// each register four weights of one row in the column order V^T follows
/// (`e4m3_stages::key_of_column`).
pub(crate) struct MmaFp8<B>(PhantomData<B>);

impl<B: WgmmaFp8> HalfMma for MmaFp8<B> {
    const E4M3: bool = true;
    type P = [[u32; 4]; 2];
    const P_ZERO: Self::P = [[0; 4]; 2];
    type Queries = [[u32; 4]; 4];

    #[inline(always)]
    fn desc_qk<const W: usize>(addr: u32) -> u64 {
        // Rows of 128 bytes: 8-row groups of 1024.
        wgmma_desc(addr, 16, 1024, true)
    }

    #[inline(always)]
    fn desc_v<const W: usize>(addr: u32) -> u64 {
        wgmma_desc(addr, 16, 1024, true)
    }

    #[inline(always)]
    unsafe fn queries<const W: usize>(rows: u32, warp: u32, lane: u32) -> Self::Queries {
        unsafe { query_frags(rows, warp, lane) }
    }

    #[inline(always)]
    unsafe fn scores<const D: usize>(q: Self::Queries, desc_k: u64) -> [[f32; 4]; 8] {
        unsafe { B::scores_64x64::<D>(&q, desc_k) }
    }

    #[inline(always)]
    unsafe fn scores_tile<const D: usize>(_: Self::Queries, _: u64) -> [[f32; 4]; 16] {
        // e4m3 stages step over half tiles (`attn_math::hopper_prefill::ws_whole_tiles`): never
        // reached.
        [[0.0; 4]; 16]
    }

    #[inline(always)]
    fn pv_blocks<const D: usize>() -> usize {
        pv_blocks_fp8(D)
    }

    #[inline(always)]
    unsafe fn pv<const D: usize>(o: &mut Acc, p: &Self::P, desc_v: u64, desc_ones: u64) {
        unsafe { B::pv_64xd_k64::<D>(o, p, desc_v, desc_ones) }
    }

    #[inline(always)]
    unsafe fn wait_pv<const N: u32, const D: usize>(o: &mut Acc, p: &Self::P) {
        unsafe { wait_pv64_e4m3::<N, D>(o, p) }
    }

    #[inline(always)]
    unsafe fn wait_frags<const N: u32>(p: &Self::P) {
        unsafe { wait_frags::<N, 2>(p) }
    }

    #[inline(always)]
    fn pack(s: &[[f32; 4]; 8]) -> Self::P {
        // k-step kc: column blocks 4kc..4kc+3; registers: (row g, keys 0-15), (row g + 8, 0-15),
        // (row g, 16-31), (row g + 8, 16-31) of the 32, each from two 8-key blocks.
        core::array::from_fn(|kc| {
            let b = 4 * kc;
            [
                e4m3x4(s[b][0], s[b][1], s[b + 1][0], s[b + 1][1]),
                e4m3x4(s[b][2], s[b][3], s[b + 1][2], s[b + 1][3]),
                e4m3x4(s[b + 2][0], s[b + 2][1], s[b + 3][0], s[b + 3][1]),
                e4m3x4(s[b + 2][2], s[b + 2][3], s[b + 3][2], s[b + 3][3]),
            ]
        })
    }
}
