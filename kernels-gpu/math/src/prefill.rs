//! Launch geometry of the tensor-core attention kernel (prefill, and decode on tensor cores),
//! shared by the kernel and the host.
//!
//! A CTA has 4 warps and one of two shapes:
//! - *rows* (prefill): each warp owns 16 of the CTA's 64 query rows and sees every key of a tile;
//! - *keys* (decode): the CTA has 16 query rows (the query heads of a kv head, times the query
//!   tokens), every warp holds all 16 and takes a quarter of each key tile; the four partial
//!   softmax states are merged through shared memory at the end. Decode is memory-bound, so the
//!   CTA is small and many of them stream the cache.

/// Threads per CTA: 4 warps.
pub const THREADS: u32 = 128;
pub const WARPS: u32 = THREADS / 32;
/// Shared-memory rows are padded by 8 elements (16 bytes) so that the 8 rows one `ldmatrix`
/// reads fall in 8 different bank groups (row pitch an odd number of 16-byte units).
pub const ROW_PAD: u32 = 8;
/// Bytes per key in the address table: the K and the V row addresses (u64 each).
pub const TABLE_ENTRY: u32 = 16;
/// Bytes of a table slot: `block_n` entries, then one u32 flag per warp that filled it (set when
/// one of its keys' blocks is outside the cache), padded to 16 bytes.
pub const fn table_slot_bytes(block_n: u32) -> u32 {
    block_n * TABLE_ENTRY + 16
}

/// (head_size_qk, head_size_v) pairs with prefill kernels.
pub const HEAD_SIZES: [(u32, u32); 5] = [(64, 64), (96, 96), (128, 128), (256, 256), (192, 128)];
/// MLA's latent row: 512 compressed KV + 64 rope; V is its first 512 columns.
pub const MLA_QK: u32 = 576;
pub const MLA_V: u32 = 512;
/// Head sizes with decode (keys-split) kernels.
pub const DECODE_HEAD_SIZES: [u32; 4] = [64, 96, 128, 256];

/// 16-row tiles each warp owns on the prefill shape: 2 up to head size 128 with a 16-bit cache
/// (each K/V fragment read from shared memory then feeds twice the MMAs), else 1 (registers;
/// the FP8 staging buffers' shared memory).
pub const fn m_tiles(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool) -> u32 {
    if !keys_split && !fp8 && head_size_qk <= 128 && head_size_v <= 128 {
        2
    } else {
        1
    }
}

/// Query rows per CTA.
pub const fn block_m(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool) -> u32 {
    if keys_split {
        16
    } else {
        16 * WARPS * m_tiles(head_size_qk, head_size_v, keys_split, fp8)
    }
}

/// The fewest query rows a CTA of the prefill shape takes (for sizing tile lists).
pub const MIN_BLOCK_M: u32 = 16 * WARPS;

/// Keys per K/V tile: 64, or 32 where the score registers must shrink (two row tiles per warp
/// above head size 64; head sizes over 128).
pub const fn block_n(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool) -> u32 {
    let two_row_tiles = m_tiles(head_size_qk, head_size_v, keys_split, fp8) == 2;
    let small = if two_row_tiles { head_size_qk <= 64 && head_size_v <= 64 } else { head_size_qk <= 128 && head_size_v <= 128 };
    if keys_split || small {
        64
    } else {
        32
    }
}

/// Whether the kernel converts its MMA fragments straight from the staged FP8 rows (decode from
/// an FP8 cache at head size 64 or 128; the kernels' `fp8_direct`), with no 16-bit tiles in
/// shared memory.
pub const fn fp8_direct(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool) -> bool {
    keys_split && fp8 && head_size_qk == head_size_v && (head_size_qk == 64 || head_size_qk == 128)
}

/// K/V tiles in flight (cp.async pipeline depth): 3 where shared memory allows two CTAs per SM
/// with them (decode's 16-row CTAs; FP8 staging, half the bytes of a 16-bit tile; the prefill
/// shape's 32-key tiles), else 2. [`fp8_direct`] decode takes 4: its tiles carry half the bytes
/// of a 16-bit one, and without the 16-bit tiles three CTAs per SM still fit (its kernels are
/// built for three: `xtask`'s launch bounds).
pub const fn stages(head_size_qk: u32, head_size_v: u32, keys_split: bool, fp8: bool) -> u32 {
    let two_row_tiles = m_tiles(head_size_qk, head_size_v, keys_split, fp8) == 2;
    if fp8_direct(head_size_qk, head_size_v, keys_split, fp8) {
        4
    } else if (keys_split || fp8 || two_row_tiles) && head_size_qk <= 128 && head_size_v <= 128 {
        3
    } else {
        2
    }
}

/// Byte offsets in dynamic shared memory. Q at 0; stage s of K at `k + s * k_stage` (16-bit
/// tiles, or FP8 staging rows of `dk` bytes with the 16-bit tiles at `k_tile` / `v_tile`); the key
/// address table (`stages + 1` slots of `block_n` entries) after V; the keys-split merge area
/// (f32 `[WARPS][16][dv + 8]`, then `[WARPS][16]` (max, sum) pairs) reuses K/V once the loop is done.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SharedLayout {
    pub k: u32,
    pub k_stage: u32,
    pub v: u32,
    pub v_stage: u32,
    /// FP8 only (not [`fp8_direct`]): the converted 16-bit K and V tiles.
    pub k_tile: u32,
    pub v_tile: u32,
    pub table: u32,
    pub merge: u32,
    pub merge_pitch: u32,
    pub stats: u32,
    pub total: u32,
}

pub const fn shared_layout(dk: u32, dv: u32, keys_split: bool, fp8: bool) -> SharedLayout {
    shared_layout_mla(dk, dv, keys_split, fp8, false)
}

/// [`shared_layout`], or with `v_in_k` (MLA: V is read from the K tile) without V buffers.
pub const fn shared_layout_mla(dk: u32, dv: u32, keys_split: bool, fp8: bool, v_in_k: bool) -> SharedLayout {
    let bn = block_n(dk, dv, keys_split, fp8);
    let st = stages(dk, dv, keys_split, fp8);
    let q_bytes = block_m(dk, dv, keys_split, fp8) * (dk + ROW_PAD) * 2;
    let k_tile_bytes = bn * (dk + ROW_PAD) * 2;
    let v_tile_bytes = if v_in_k { 0 } else { bn * (dv + ROW_PAD) * 2 };
    let (k_stage, v_stage) = if fp8 { (bn * dk, if v_in_k { 0 } else { bn * dv }) } else { (k_tile_bytes, v_tile_bytes) };
    let k = q_bytes;
    let v = k + st * k_stage;
    let (k_tile, v_tile, tiles_end) = if fp8 && !fp8_direct(dk, dv, keys_split, fp8) {
        let k_tile = v + st * v_stage;
        (k_tile, k_tile + k_tile_bytes, k_tile + k_tile_bytes + v_tile_bytes)
    } else {
        (0, 0, v + st * v_stage)
    };
    let table = tiles_end;
    let table_end = table + (st + 1) * table_slot_bytes(bn);
    let merge_pitch = dv + 8;
    let merge = k;
    let stats = merge + WARPS * 16 * merge_pitch * 4;
    let merge_end = if keys_split { stats + WARPS * 16 * 8 } else { 0 };
    let total = if merge_end > table_end { merge_end } else { table_end };
    SharedLayout { k, k_stage, v, v_stage, k_tile, v_tile, table, merge, merge_pitch, stats, total }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn layouts_fit_two_ctas_per_sm_where_meant_to() {
        // 227 KiB per CTA at most on sm_90; two CTAs of the d128 shapes share an SM.
        for fp8 in [false, true] {
            for keys in [false, true] {
                for (dk, dv) in HEAD_SIZES {
                    let l = shared_layout(dk, dv, keys, fp8);
                    assert!(l.total <= 227 * 1024, "{dk}/{dv} keys={keys}: {}", l.total);
                    for offset in [l.table, l.k, l.v, l.k_tile, l.v_tile, l.merge, l.stats] {
                        assert!(offset.is_multiple_of(16));
                    }
                }
            }
            assert!(2 * shared_layout(128, 128, true, fp8).total <= 226 * 1024, "{}", shared_layout(128, 128, true, fp8).total);
            if fp8 {
                // Three FP8 decode CTAs per SM (228 KiB, 1 KiB reserved per CTA).
                assert!(3 * (shared_layout(128, 128, true, fp8).total + 1024) <= 228 * 1024);
            }
            assert!(2 * shared_layout(128, 128, false, fp8).total <= 226 * 1024);
        }
    }
}
