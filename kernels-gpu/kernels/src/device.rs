//! The device-side basics that Rust-CUDA's `cuda_std` would give: thread and block indices,
//! barriers, atomics, and the PTX instructions the kernels need, through inline `asm!`.
#![allow(dead_code)]

use core::arch::asm;

macro_rules! special_register {
    ($name:ident, $reg:literal) => {
        #[inline(always)]
        pub fn $name() -> u32 {
            let r: u32;
            unsafe { asm!(concat!("mov.u32 {0}, ", $reg, ";"), out(reg32) r, options(pure, nomem, nostack)) };
            r
        }
    };
}

special_register!(thread_idx_x, "%tid.x");
special_register!(block_idx_x, "%ctaid.x");
special_register!(block_idx_y, "%ctaid.y");
special_register!(block_dim_x, "%ntid.x");
special_register!(grid_dim_x, "%nctaid.x");
special_register!(lane_id, "%laneid");

/// Ends the kernel with an error (the launch fails with an illegal-instruction error).
#[inline(always)]
pub fn trap() -> ! {
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}

/// Barrier for all threads of the CTA.
#[inline(always)]
pub fn sync_threads() {
    unsafe { asm!("bar.sync 0;", options(nostack)) }
}

/// Atomically OR `bits` into a global u32 (no return value: a reduction).
#[inline(always)]
pub unsafe fn atomic_or_global(addr: u64, bits: u32) {
    unsafe { asm!("red.global.or.b32 [{0}], {1};", in(reg64) addr, in(reg32) bits, options(nostack)) }
}
