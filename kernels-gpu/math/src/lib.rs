//! Pure math shared by the GPU kernels (built for `nvptx64-nvidia-cuda`) and the host library.
//!
//! Everything here compiles for both targets, so the host's tests exercise exactly the code the
//! kernels run: number-format conversions, paged-cache index math, and the `#[repr(C)]` parameter
//! blocks that the host passes to each kernel by value.
#![no_std]
// The GPU build (nightly) reaches a few PTX instructions through `asm!`.
#![cfg_attr(target_arch = "nvptx64", feature(asm_experimental_arch))]

// The host build has std (for exp2/log2); the GPU build is core only.
#[cfg(not(target_arch = "nvptx64"))]
extern crate std;

pub mod decode;
pub mod fp8;
pub mod hopper_prefill;
pub mod keys_m;
pub mod keys_rows;
pub mod mla;
pub mod paging;
pub mod params;
pub mod prefill;
pub mod softmax;
pub mod split;
pub mod status;
