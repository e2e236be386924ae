//! GPU kernels, compiled to PTX with rustc's `nvptx64-nvidia-cuda` target by
//! `cargo xtask build-ptx`. Entry points are `extern "ptx-kernel"` functions taking one
//! `#[repr(C)]` parameter block from `attn_math::params`.
//!
//! The kernels come in families, each built into its own PTX module (`--cfg kernels="..."`), so
//! that the host loads (and the driver JIT-compiles) only the families a program uses:
//! - `cache_write` ([`cache_write`]): the paged KV-cache writes;
//! - `attention` ([`attention`]): the attention kernels (prefill, decode, MLA);
//! - `merge` ([`merge`]): split-K's pass 2 and `merge_attn_states`.
//!
//! [`blocks`] holds the building blocks they share.
#![no_std]
#![feature(abi_ptx, asm_experimental_arch, core_intrinsics, gpu_intrinsics, gpu_launch_sized_workgroup_mem, stdarch_nvptx)]
#![allow(internal_features)]

#[cfg(kernels = "attention")]
mod attention;
mod blocks;
#[cfg(kernels = "cache_write")]
mod cache_write;
#[cfg(any(kernels = "merge", kernels = "attention"))]
mod merge;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // Bounds checks that fail end the kernel with an error the host sees at its next sync.
    blocks::device::trap()
}
