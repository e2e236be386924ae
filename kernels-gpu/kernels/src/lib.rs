//! GPU kernels, compiled to PTX with rustc's `nvptx64-nvidia-cuda` target by
//! `cargo xtask build-ptx`. Entry points are `extern "ptx-kernel"` functions taking one
//! `#[repr(C)]` parameter block from `attn_math::params`.
//!
//! The kernels come in families, each built into its own PTX module (`--cfg kernels="..."`), so
//! that the host loads (and the driver JIT-compiles) only the families a program uses.
#![no_std]
#![feature(abi_ptx, asm_experimental_arch, core_intrinsics, gpu_intrinsics, gpu_launch_sized_workgroup_mem)]
#![allow(internal_features)]

#[cfg(kernels = "cache_write")]
mod cache_write;
#[cfg(all(kernels = "prefill", wgmma))]
mod cluster;
#[cfg(kernels = "attention")]
mod entry;
#[cfg(kernels = "prefill")]
mod fp8_direct;
#[cfg(all(kernels = "prefill", wgmma))]
mod hopper_steps;
#[cfg(kernels = "prefill")]
mod keys_rows;
#[cfg(all(kernels = "prefill", wgmma))]
mod mbarrier;
#[cfg(kernels = "attention")]
mod merge;
#[cfg(kernels = "prefill")]
mod mla;
#[cfg(kernels = "prefill")]
mod prefill;
#[cfg(kernels = "prefill")]
mod prefill_entry;
#[cfg(all(kernels = "prefill", wgmma))]
mod prefill_hopper;
#[cfg(all(kernels = "prefill", wgmma))]
mod prefill_specialized;
#[cfg(kernels = "prefill")]
mod split_merge;
#[cfg(all(kernels = "prefill", wgmma))]
mod wgmma;

// Building blocks shared by the families; each family uses a part of them.
#[allow(dead_code)]
mod device;
#[allow(dead_code)]
mod elem;
#[allow(dead_code)]
mod mma;
#[allow(dead_code)]
mod status;
#[allow(dead_code)]
mod vec_io;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // Bounds checks that fail end the kernel with an error the host sees at its next sync.
    device::trap()
}
