//! Head sizes of the paged decode kernels, shared by the kernels and the host.

/// Head sizes with kernels.
pub const HEAD_SIZES: [u32; 4] = [64, 96, 128, 256];
