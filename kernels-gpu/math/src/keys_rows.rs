//! Shape and shared-memory layout of the keys-as-rows decode kernel (`decode_kr_*`): the
//! keys-split CTA of `crate::prefill` (4 warps, each its own 16 keys of every 64-key tile and its
//! own copy pipeline), with the score tile transposed. S^T = K Q^T puts a warp's 16 keys on the
//! MMA's 16 rows and up to 8 query rows (query tokens x query heads of one kv head) on its 8
//! columns, so GQA up to 8 uses every row the tensor cores compute: half the MMAs, accumulators
//! and softmax work of a 16-row S tile, which leaves the memory pipeline more of each tile's time.

use crate::prefill::{ROW_PAD, WARPS};

/// Query rows a CTA takes (the MMA's n): query tokens x query heads per kv head.
pub const MAX_ROWS: u32 = 8;
/// Keys a warp takes of each tile (the MMA's m).
pub const WARP_KEYS: u32 = 16;
/// Keys of a CTA's tile (every warp's 16).
pub const TILE_KEYS: u32 = WARP_KEYS * WARPS;

/// Bytes of one staged row (padded so that `ldmatrix`'s 8 rows fall in different banks).
pub const fn row_pitch(d: u32) -> u32 {
    (d + ROW_PAD) * 2
}

/// Bytes of one warp's stage: its 16 K rows, then its 16 V rows.
pub const fn stage_bytes(d: u32) -> u32 {
    2 * WARP_KEYS * row_pitch(d)
}

/// A warp's pipeline depth: as many stages as fit in about 104 KiB per CTA (two CTAs per SM) up
/// to head size 128, at most 6; three at 256 (one CTA per SM).
pub const fn stages(d: u32) -> u32 {
    if d > 128 {
        return 3;
    }
    let s = 106_496 / (WARPS * stage_bytes(d));
    if s > 6 {
        6
    } else {
        s
    }
}

/// Byte offsets in dynamic shared memory: warp w's stages at `w * stages * stage_bytes`; after
/// the loop the same bytes hold the warps' partial outputs (f32 `[WARPS][MAX_ROWS][d + 8]`) and
/// their (max, sum) pairs (`[WARPS][MAX_ROWS]`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub ring: u32,
    pub merge: u32,
    pub merge_pitch: u32,
    pub stats: u32,
    pub total: u32,
}

pub const fn layout(d: u32) -> Layout {
    let ring = WARPS * stages(d) * stage_bytes(d);
    let merge_pitch = d + 8;
    let stats = WARPS * MAX_ROWS * merge_pitch * 4;
    let merge_end = stats + WARPS * MAX_ROWS * 8;
    Layout { ring: 0, merge: 0, merge_pitch, stats, total: if merge_end > ring { merge_end } else { ring } }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefill::DECODE_HEAD_SIZES;

    #[test]
    fn two_ctas_per_sm_up_to_head_size_128() {
        for d in DECODE_HEAD_SIZES {
            let l = layout(d);
            assert!(stages(d) >= 3, "d{d}");
            assert!(l.total <= 227 * 1024, "d{d}: {}", l.total);
            assert!(l.stats.is_multiple_of(16) && stage_bytes(d).is_multiple_of(16));
            if d <= 128 {
                assert!(2 * (l.total + 1024) <= 228 * 1024, "d{d}: {}", l.total);
            }
        }
    }
}
