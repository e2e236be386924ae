//! The Tensor Memory Accelerator (sm_90): one thread's copy of a box of a tensor, described by a
//! tensor map the host encoded, into shared memory, completing on an `mbarrier`'s transaction
//! count ([`crate::blocks::mbarrier::expect_tx`]).

use core::arch::asm;

/// Copies the box at coordinates `c` (innermost first) of the 5-dimensional tensor map at
/// generic address `map` into shared memory at `dst`, counting its bytes on the barrier at
/// `bar`. Coordinates outside the map's dimensions read as zeros; the copy never leaves them.
#[inline(always)]
pub unsafe fn load_5d(dst: u32, map: u64, c: [u32; 5], bar: u32) {
    unsafe {
        asm!(
            "cp.async.bulk.tensor.5d.shared::cluster.global.tile.mbarrier::complete_tx::bytes [{dst}], [{map}, {{{c0}, {c1}, {c2}, {c3}, {c4}}}], [{bar}];",
            dst = in(reg32) dst,
            map = in(reg64) map,
            c0 = in(reg32) c[0],
            c1 = in(reg32) c[1],
            c2 = in(reg32) c[2],
            c3 = in(reg32) c[3],
            c4 = in(reg32) c[4],
            bar = in(reg32) bar,
            options(nostack)
        )
    }
}
