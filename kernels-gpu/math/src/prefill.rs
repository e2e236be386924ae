//! Launch geometry of the tensor-core prefill kernel, shared by the kernel and the host.

/// Threads per CTA: 4 warps, each owning 16 query rows of the tile.
pub const THREADS: u32 = 128;
pub const WARPS: u32 = THREADS / 32;
/// Query rows per CTA.
pub const BLOCK_M: u32 = 16 * WARPS;
/// Shared-memory rows are padded by 8 elements (16 bytes) so that the 8 rows one `ldmatrix`
/// reads fall in 8 different bank groups (row pitch an odd number of 16-byte units).
pub const ROW_PAD: u32 = 8;

/// (head_size_qk, head_size_v) pairs with kernels.
pub const HEAD_SIZES: [(u32, u32); 5] = [(64, 64), (96, 96), (128, 128), (256, 256), (192, 128)];

/// Keys per K/V tile.
pub const fn block_n(head_size_qk: u32, head_size_v: u32) -> u32 {
    if head_size_qk > 128 || head_size_v > 128 {
        32
    } else {
        64
    }
}

/// K/V tiles in flight (cp.async pipeline depth).
pub const fn stages(head_size_qk: u32, head_size_v: u32) -> u32 {
    let _ = (head_size_qk, head_size_v);
    2
}

/// Byte offsets in dynamic shared memory: (K stage 0, V stage 0, total), Q at 0. Stage s of K is
/// at `k + s * k_stage_bytes`.
pub const fn shared_layout(dk: u32, dv: u32) -> SharedLayout {
    let bn = block_n(dk, dv);
    let q_bytes = BLOCK_M * (dk + ROW_PAD) * 2;
    let k_stage = bn * (dk + ROW_PAD) * 2;
    let v_stage = bn * (dv + ROW_PAD) * 2;
    let st = stages(dk, dv);
    SharedLayout { k: q_bytes, k_stage, v: q_bytes + st * k_stage, v_stage, total: q_bytes + st * (k_stage + v_stage) }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedLayout {
    pub k: u32,
    pub k_stage: u32,
    pub v: u32,
    pub v_stage: u32,
    pub total: u32,
}
