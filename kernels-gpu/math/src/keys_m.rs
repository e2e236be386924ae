//! Shape and shared-memory layout of the decode kernels on Hopper's `wgmma` with the keys on M
//! (`decode_km_*`): the keys of a 64-key tile on M, the CTA's 8 or 16 query rows on N, the
//! operands straight from the staged cache rows.
//!
//! - S^T = K Q^T over the width, K from its rows in shared memory, the queries staged once a CTA
//!   (FP8 caches: quantised to e4m3, one scale a row);
//! - O^T += V^T P^T: the width's M blocks of 64 head dimensions over the tile's keys, P^T
//!   stored in shared memory (FP8: e4m3, V^T's A fragments from the rows by `ldmatrix.trans`
//!   and a `prmt` a register; 16-bit: the queries' type, V^T read transposed from the rows).
//!
//! Two kinds: FP8 caches at widths 128 and 256 (every FP8 head size from 72 to 256 on sm_90a),
//! where the keys-as-rows kernels ([`crate::keys_rows`]) convert every byte pair of the cache to
//! 16 bits before its MMA (`mma.sync` has no FP8 form on sm_90a), and those conversions and the
//! per-key softmax set their pace below width 128; and 16-bit caches at 16 rows a kv head (GQA
//! 16) at widths 64 and 128, where the keys-as-rows kernel's two column groups a slab hold it
//! under the read ceiling, and at width 64 up to 8 rows too, whose 128-byte rows take four CTAs
//! an SM as FP8 width 128's do. Each warp still copies its own 16 keys of every tile, so a bad block
//! stays a warp's matter; the four warps' scores meet once a tile, for the row max the tile's
//! weights share. Rows are 128 or 256 bytes either way (one or two 128-byte swizzle atoms).

use crate::prefill::WARPS;

/// Keys of a tile (the M of S^T, the K of O^T), and those a warp copies and scores of each (its
/// 16 M rows of S^T): the keys-as-rows kernels' tiles and slabs, whose copies these kernels share.
pub use crate::keys_rows::{TILE_KEYS, WARP_KEYS};
/// The widths of the FP8 kernels ([`crate::decode::decode_width`] takes every FP8 head size from
/// 72 to 256 to them; 64 stays on the keys-as-rows kernels, which read it near the ceiling).
pub const FP8_WIDTHS: [u32; 2] = [128, 256];
/// The widths of the 16-bit kernels, for 16 rows a kv head, and at 64 for fewer too (width 96's
/// rows, 192 bytes, are not whole swizzle atoms: it keeps the keys-as-rows kernel).
pub const HALF_WIDTHS: [u32; 2] = [64, 128];
/// Query rows a CTA takes: 8, or 16 in the `_r16` kernels (the N of both products).
pub const ROWS: [u32; 2] = [8, 16];

/// Whether width `d` of a cache with FP8 rows (`fp8`) or 16-bit ones has these kernels for up
/// to `rows` query rows a kv head (16-bit: width 64 up to 16, width 128 9 to 16 only).
pub const fn takes(d: u32, fp8: bool, rows: u32) -> bool {
    if fp8 {
        rows <= ROWS[1] && (d == FP8_WIDTHS[0] || d == FP8_WIDTHS[1])
    } else {
        rows <= ROWS[1] && (d == HALF_WIDTHS[0] || (d == HALF_WIDTHS[1] && rows > ROWS[0]))
    }
}

/// CTAs an SM for staged rows of `row_bytes` and `rows` query rows a CTA: two at 256 bytes;
/// at 128 (a 16 KB stage) four for 8 rows (FP8 width 128, 16-bit width 64), three for 16 (FP8
/// width 128's `_r16`, 16-bit width 64's). A tile is a chain of dependent steps (S^T, the max exchange, the
/// weights, P V) that three CTAs' warps did not cover at 8 rows: four CTAs of three stages
/// keep as many tiles in flight an SM, with a third more warps (docs/decode.md). `xtask`'s
/// launch bounds hold those to 128 registers, which they fit without spills; the 16-row kernels
/// lost 2% there (FP8 GQA 16 at d128, 16-bit at d64) and keep three.
pub const fn ctas_per_sm(row_bytes: u32, rows: u32) -> u32 {
    if row_bytes > 128 {
        2
    } else if rows <= ROWS[0] {
        4
    } else {
        3
    }
}

/// Bytes of one stage: the tile's K rows, then its V rows.
pub const fn stage_bytes(row_bytes: u32) -> u32 {
    2 * TILE_KEYS * row_bytes
}

/// Byte offsets in dynamic shared memory. `q`, `p` and the stages hold `wgmma` operands (1024-byte
/// aligned).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// The staged queries: `rows` rows of the row bytes (the B operand of S^T).
    pub q: u32,
    /// P^T: `rows` x 64 weights in rows of 128 bytes (the B operand of O^T; e4m3 in the first 64).
    pub p: u32,
    /// The stages: `stages` x ([`stage_bytes`]).
    pub ring: u32,
    pub stages: u32,
    /// Each warp's row maxima of a tile (f32 `[rows][WARPS]`); after the loop, the row sums.
    pub maxima: u32,
    /// Each row's factor from quantised scores to true ones (f32 `[rows]`; FP8 only).
    pub dequant: u32,
    /// The stages' `mbarrier`s (8 bytes each).
    pub bars: u32,
    pub total: u32,
}

const fn round_up(x: u32, to: u32) -> u32 {
    x.div_ceil(to) * to
}

/// The layout of the kernel of staged rows of `row_bytes` and `rows` query rows, copied in 8-byte
/// halves or not (`halves`: FP8 rows of an odd multiple of 8, the `_a8` kernels): as many stages
/// as the CTA's share of shared memory holds (`ctas_per_sm`: 54 KiB of four, 72 KiB of three,
/// 104 KiB of two), at most 6. Rows of 128 bytes copied in halves take 54 KiB at three CTAs too
/// (three stages): their 8-byte `cp.async`s go through L1, which three CTAs of four stages
/// leave about 18 KB (GQA 16 at head size 120 ran 1.09x the keys-as-rows kernel with three
/// stages, 0.91x with four; docs/decode.md).
pub const fn layout(row_bytes: u32, rows: u32, halves: bool) -> Layout {
    let q = 0;
    let p = round_up(q + rows * row_bytes, 1024);
    let ring = round_up(p + rows * 128, 1024);
    let maxima_bytes = rows * WARPS * 4;
    let tail = maxima_bytes + rows * 4 + 6 * 8;
    let budget = match ctas_per_sm(row_bytes, rows) {
        4 => 55_296,
        3 if halves => 55_296,
        3 => 73_728,
        _ => 106_496,
    };
    let fit = (budget - ring - tail) / stage_bytes(row_bytes);
    let stages = if fit > 6 { 6 } else { fit };
    let maxima = ring + stages * stage_bytes(row_bytes);
    let dequant = maxima + maxima_bytes;
    let bars = round_up(dequant + rows * 4, 8);
    let total = bars + stages * 8;
    Layout { q, p, ring, stages, maxima, dequant, bars, total }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::mla::{e4m3_column_of, e4m3_rho, e4m3_swizzled};

    #[test]
    fn layouts_fit_and_align() {
        for (row_bytes, halves) in [(128, false), (128, true), (256, false), (256, true)] {
            for rows in ROWS {
                let l = layout(row_bytes, rows, halves);
                assert!(l.stages >= 3, "{row_bytes} B r{rows} halves {halves}: {l:?}");
                for o in [l.q, l.p, l.ring, stage_bytes(row_bytes), TILE_KEYS * row_bytes] {
                    assert!(o.is_multiple_of(1024), "{row_bytes} B r{rows}: {l:?}");
                }
                assert!(l.bars.is_multiple_of(8) && l.maxima.is_multiple_of(16));
                // 228 KiB an SM, 1 KiB reserved and 1 KiB of static shared memory a CTA.
                assert!(ctas_per_sm(row_bytes, rows) * (l.total + 2048) <= 228 * 1024, "{row_bytes} B r{rows}: {l:?}");
            }
        }
        assert_eq!(
            (layout(128, 8, false).stages, layout(128, 16, false).stages, layout(256, 8, false).stages, layout(256, 16, false).stages),
            (3, 4, 3, 3)
        );
        assert_eq!((layout(128, 8, true).stages, layout(128, 16, true).stages, layout(256, 16, true).stages), (3, 3, 3));
        assert!(takes(128, true, 8) && takes(256, true, 16) && !takes(64, true, 8) && !takes(96, true, 8));
        assert!(takes(128, false, 16) && takes(64, false, 9) && !takes(128, false, 8) && !takes(96, false, 16));
        assert!(takes(64, false, 1) && takes(64, false, 8) && !takes(64, false, 17));
    }

    /// The FP8 kernels' `ldmatrix.trans` of a warp's chunks meets the V rows' bytes once each,
    /// and the key order it hands out is P^T's column order.
    #[test]
    fn value_fragments_cover_each_byte_once() {
        for d in FP8_WIDTHS {
            let blocks = d / 64;
            let mut seen = std::collections::HashSet::new();
            for warp in 0..WARPS {
                for b in 0..blocks {
                    let chunk = blocks * warp + b;
                    for key in 0..TILE_KEYS {
                        for byte in 0..16 {
                            assert!(seen.insert(e4m3_swizzled(TILE_KEYS, key, 16 * chunk + byte)));
                        }
                    }
                }
            }
            assert_eq!(seen.len() as u32, TILE_KEYS * d);
        }
        for k in 0..TILE_KEYS {
            assert_eq!(e4m3_column_of(e4m3_rho(k)), k);
        }
    }
}
