//! GPU kernels, compiled to PTX with rustc's `nvptx64-nvidia-cuda` target by
//! `cargo xtask build-ptx`. Entry points are `extern "ptx-kernel"` functions taking one
//! `#[repr(C)]` parameter block from `attn_math::params`.
#![no_std]
#![feature(abi_ptx, asm_experimental_arch, core_intrinsics, gpu_intrinsics, gpu_launch_sized_workgroup_mem)]
#![allow(internal_features)]

mod cache_write;
mod decode;
mod device;
mod elem;
mod entry;
mod merge;
mod vec_io;

#[panic_handler]
fn panic(_: &core::panic::PanicInfo) -> ! {
    // Bounds checks that fail end the kernel with an error the host sees at its next sync.
    device::trap()
}
