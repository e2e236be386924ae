//! Pure math shared by the GPU kernels (built for `nvptx64-nvidia-cuda`) and the host library.
//!
//! Everything here compiles for both targets, so the host's tests exercise exactly the code the
//! kernels run: number-format conversions, paged-cache index math, and the `#[repr(C)]` parameter
//! blocks that the host passes to each kernel by value.
#![no_std]

pub mod fp8;
pub mod paging;
pub mod params;
pub mod status;
