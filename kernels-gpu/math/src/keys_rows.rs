//! Shape and shared-memory layout of the keys-as-rows decode kernel (`decode_kr_*`): the
//! keys-split CTA of `crate::prefill` (4 warps, each its own 16 keys of every 64-key tile and its
//! own copy pipeline), with the score tile transposed. S^T = K Q^T puts a warp's 16 keys on the
//! MMA's 16 rows and up to 8 query rows (query tokens x query heads of one kv head) on its 8
//! columns, so GQA up to 8 uses every row the tensor cores compute: half the MMAs, accumulators
//! and softmax work of a 16-row S tile, which leaves the memory pipeline more of each tile's time.
//! 9 to 16 rows per kv head (GQA 16) take the `_r16` kernels (16-bit caches up to head size 128,
//! FP8 at 64 and 128, named as the long FP8 kernels; FP8 runs up to 8 rows at 256 too): two column groups of 8 rows over each staged slab, each K and V
//! fragment loaded once for both, so the keys are read once for 16 rows. (Two 8-row CTAs per kv head reading the same keys through L2 measured 20% slower than
//! the 16-row `decode_tc` CTA: each of the pair must stream the whole rate.)

use crate::prefill::{ROW_PAD, WARPS};

/// Query rows a CTA takes (the MMA's n; a row tile): query tokens x query heads of one kv head.
pub const MAX_ROWS: u32 = 8;
/// Query rows a CTA of the `_r16` kernels takes (two column groups).
pub const WIDE_ROWS: u32 = 16;
/// The head sizes the `_r16` kernels run at from 16-bit caches (FP8: [`FP8_HEAD_SIZES`]): their
/// two groups' accumulators fit the registers of two CTAs per SM up to head size 128 (three at
/// 64, [`ctas_per_sm`]).
pub const WIDE_HEAD_SIZES: [u32; 3] = [64, 96, 128];
/// Keys a warp takes of each tile (the MMA's m).
pub const WARP_KEYS: u32 = 16;
/// Keys of a CTA's tile (every warp's 16).
pub const TILE_KEYS: u32 = WARP_KEYS * WARPS;

/// Bytes of one staged 16-bit row (padded so that `ldmatrix`'s 8 rows fall in different banks).
pub const fn row_pitch(d: u32) -> u32 {
    (d + ROW_PAD) * 2
}

/// Bytes of one warp's 16 staged K (or V) rows: padded 16-bit rows, or swizzled FP8 rows.
pub const fn plane_bytes(d: u32, fp8: bool) -> u32 {
    if fp8 {
        WARP_KEYS * d
    } else {
        WARP_KEYS * row_pitch(d)
    }
}

/// Bytes of one warp's stage: its K plane, then its V plane.
pub const fn stage_bytes(d: u32, fp8: bool) -> u32 {
    2 * plane_bytes(d, fp8)
}

/// An FP8 batch at width 128 whose longest request has at least this many keys runs the
/// deep-pipeline FP8 kernel (`decode_kr_<q>_fp8_long_d128`: two CTAs per SM, six stages); shorter
/// ones the three-CTA kernels (four stages), whose CTAs start and drain beside more neighbours.
/// Measured on the H100 (docs/decode.md): 64 x 4096 201 us deep against 211-214 us; 256 x 1024
/// 211 us deep against 204 us. Width 64 has no such kernel ([`fp8_long`]).
pub const FP8_LONG_KEYS: u32 = 2048;

/// A 16-bit batch at width 128 whose longest request has at least this many keys runs the
/// two-CTA kernels (`decode_kr_<q>_long_d128`, three stages); shorter ones the three-CTA kernels
/// (two stages), whose CTAs start and drain beside more neighbours. Measured on an H200
/// (docs/decode.md): three CTAs 1.18x at 64 x 256, 1.06x at 512 x 512, 1.015x at 256 x 1024, but
/// 0.97x at 64 x 2048 (the planner splits it for the 396 slots) and 0.99x at 64 x 4096.
pub const HALF_LONG_KEYS: u32 = 2048;

/// CTAs per SM a kernel of `rows` query rows is built for: two (one at 16-bit head size 256);
/// three for the short batches' kernels at width 128 (FP8, and 16-bit at 8 rows a CTA: two
/// stages, H200 1.06-1.23x below 1024 keys, docs/decode.md); four at width 64 for FP8 short
/// batches and 16-bit rows at 8 rows a CTA, whose small slabs (2 and 4 KB) set their pace by the
/// per-slab work more than by the bytes (H200: 16-bit 1.03x at 64 x 4096, 1.15x at 256 x 1024,
/// 1.5x at 64 x 256; FP8 1.17x, 1.21x at 512 x 512, 1.5x). The `_r16` kernels (16 rows) take
/// three at 16-bit width 64 (H200, 32 q / 2 kv heads: 1.22-1.28x per call, 0.99-1.10x alone),
/// two elsewhere: at three, width 96 and FP8 width 128 spilled a little and gained per call
/// but not alone (0.89-1.05x), 16-bit width 128 spilled in its key loop and lost a quarter
/// (docs/decode.md). `xtask`'s launch bounds cap their registers.
pub const fn ctas_per_sm(d: u32, fp8: bool, long: bool, rows: u32) -> u32 {
    if rows > MAX_ROWS {
        return if !fp8 && d <= 64 { 3 } else { 2 };
    }
    match (fp8, long) {
        // FP8: the deep pipeline (long requests), else short batches'.
        (true, true) => 2,
        (true, false) if d <= 64 => 4,
        (true, false) => 3,
        // 16-bit: width 256 alone; four at width 64, three for short batches at 128.
        (false, _) if d > 128 => 1,
        (false, _) if d <= 64 => 4,
        (false, false) if d == 128 => 3,
        (false, _) => 2,
    }
}

/// A warp's pipeline depth for `ctas` CTAs per SM: as many stages as fit the CTA's share of
/// shared memory (104 KiB of two, 72 KiB of three, 54 KiB of four), at most 6; three at 16-bit
/// head size 256 (one CTA per SM).
pub const fn stages(d: u32, fp8: bool, ctas: u32) -> u32 {
    if ctas == 1 {
        return 3;
    }
    let budget = if ctas == 4 {
        55_296
    } else if ctas == 3 {
        73_728
    } else {
        106_496
    };
    let s = budget / (WARPS * stage_bytes(d, fp8));
    if s > 6 {
        6
    } else {
        s
    }
}

/// Byte offsets in dynamic shared memory: warp w's stages at `w * stages * stage_bytes`; after
/// the loop the same bytes hold the warps' partial outputs (f32 `[WARPS][rows][d + 8]`) and
/// their (max, sum) pairs (`[WARPS][rows]`), `rows` being the CTA's query rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    pub ring: u32,
    pub merge: u32,
    pub merge_pitch: u32,
    pub stats: u32,
    pub total: u32,
}

pub const fn layout(d: u32, fp8: bool, ctas: u32, rows: u32) -> Layout {
    let ring = WARPS * stages(d, fp8, ctas) * stage_bytes(d, fp8);
    let merge_pitch = d + 8;
    let stats = WARPS * rows * merge_pitch * 4;
    let merge_end = stats + WARPS * rows * 8;
    Layout { ring: 0, merge: 0, merge_pitch, stats, total: if merge_end > ring { merge_end } else { ring } }
}

/// The head sizes an FP8 cache runs at up to 8 rows a CTA (its fragments need runs of D/4 and
/// D/16 bytes in 16-byte units). 64 and 128 in the short batches' form and with 16 rows
/// ([`FP8_SHORT_AND_R16_HEAD_SIZES`]), 128 in the deep-pipeline form too; 256 in the
/// deep-pipeline form only (`decode_kr_<q><fp8>_long_d256`): its queries' fragments and
/// accumulators (96 registers a thread) leave room for neither three CTAs an SM nor two column
/// groups, so GQA 16 at 256 takes the 16-row score tiles.
pub const FP8_HEAD_SIZES: [u32; 3] = [64, 128, 256];
/// The FP8 head sizes with keys-as-rows kernels for 16 rows a CTA (`_long_r16`), and for up to
/// 8 in the short batches' form (three or four CTAs an SM).
pub const FP8_SHORT_AND_R16_HEAD_SIZES: [u32; 2] = [64, 128];
/// The FP8 head sizes with a deep-pipeline kernel for up to 8 rows (`_long`: two CTAs an SM, six
/// stages): 128 for long requests, 256 at every length. Width 64 has none: its four-CTA kernels
/// read long requests as fast or faster ([`fp8_long`]).
pub const FP8_DEEP_HEAD_SIZES: [u32; 2] = [128, 256];

/// Whether `d` is one of `sizes`.
pub(crate) const fn listed(sizes: &[u32], d: u32) -> bool {
    let mut i = 0;
    while i < sizes.len() {
        if sizes[i] == d {
            return true;
        }
        i += 1;
    }
    false
}

/// Whether an FP8 cache at width `d` has keys-as-rows kernels for `wide` (9 to 16) rows a CTA.
pub const fn fp8_keys_rows(d: u32, wide: bool) -> bool {
    listed(if wide { &FP8_SHORT_AND_R16_HEAD_SIZES } else { &FP8_HEAD_SIZES }, d)
}

/// Whether an FP8 batch at width `d` runs the deep-pipeline kernel: at width 128 when its
/// longest request has `max_len` keys (from [`FP8_LONG_KEYS`]; 0 where the device runs the short
/// batches' kernels at every length), with 16 rows a CTA, or where the width has no other form.
/// Width 64 takes its four-CTA kernels at every length (H100, 64 x 4096: 1.05x at head size 64,
/// 1.03-1.27x at 32 to 56, long requests within 1-4%; docs/decode.md, "FP8 at width 64 without
/// the deep pipeline").
pub const fn fp8_long(d: u32, max_len: u32, wide: bool) -> bool {
    wide || !listed(&FP8_SHORT_AND_R16_HEAD_SIZES, d) || (max_len >= FP8_LONG_KEYS && listed(&FP8_DEEP_HEAD_SIZES, d))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prefill::DECODE_HEAD_SIZES;

    #[test]
    fn ctas_fit_per_sm() {
        for (fp8, sizes) in [(false, &DECODE_HEAD_SIZES[..]), (true, &FP8_HEAD_SIZES[..])] {
            for &d in sizes {
                for (long, rows) in [(false, MAX_ROWS), (true, MAX_ROWS), (fp8, WIDE_ROWS)] {
                    if rows == WIDE_ROWS && !fp8 && !WIDE_HEAD_SIZES.contains(&d) {
                        continue;
                    }
                    if fp8
                        && (!fp8_keys_rows(d, rows == WIDE_ROWS)
                            || long != fp8_long(d, if long { FP8_LONG_KEYS } else { 0 }, rows == WIDE_ROWS))
                    {
                        continue;
                    }
                    let ctas = ctas_per_sm(d, fp8, long, rows);
                    let l = layout(d, fp8, ctas, rows);
                    assert!(stages(d, fp8, ctas) >= 2, "d{d}");
                    assert!(l.stats.is_multiple_of(16) && stage_bytes(d, fp8).is_multiple_of(16));
                    // 228 KiB per SM, 1 KiB reserved per CTA; 227 KiB per CTA at most.
                    assert!(l.total <= 227 * 1024, "d{d}: {}", l.total);
                    assert!(ctas * (l.total + 1024) <= 228 * 1024, "d{d} fp8 {fp8}: {}", l.total);
                }
            }
        }
        assert_eq!(stages(128, true, ctas_per_sm(128, true, true, MAX_ROWS)), 6);
        assert_eq!(stages(128, true, ctas_per_sm(128, true, false, MAX_ROWS)), 4);
        assert_eq!(stages(64, false, ctas_per_sm(64, false, false, MAX_ROWS)), 3);
        assert_eq!(stages(64, true, ctas_per_sm(64, true, false, MAX_ROWS)), 6);
        assert_eq!(ctas_per_sm(64, false, false, WIDE_ROWS), 3);
        assert_eq!(stages(256, true, ctas_per_sm(256, true, true, MAX_ROWS)), 3);
        assert!(fp8_keys_rows(256, false) && !fp8_keys_rows(256, true) && !fp8_keys_rows(96, false));
        assert!(fp8_long(256, 0, false) && !fp8_long(128, FP8_LONG_KEYS - 1, false) && fp8_long(64, 0, true));
        assert!(fp8_long(128, FP8_LONG_KEYS, false) && !fp8_long(64, u32::MAX, false));
        for d in FP8_SHORT_AND_R16_HEAD_SIZES {
            assert!(FP8_HEAD_SIZES.contains(&d) && fp8_keys_rows(d, true));
        }
        // (head size, FP8, long, rows) -> CTAs per SM.
        for (d, fp8, long, rows, ctas) in [
            (64, true, false, MAX_ROWS, 4),
            (128, true, false, MAX_ROWS, 3),
            (64, true, true, MAX_ROWS, 2),
            (128, true, true, WIDE_ROWS, 2),
            (64, true, true, WIDE_ROWS, 2),
            (96, false, false, WIDE_ROWS, 2),
            (64, false, false, MAX_ROWS, 4),
            (96, false, false, MAX_ROWS, 2),
            (128, false, false, MAX_ROWS, 3),
            (128, false, true, MAX_ROWS, 2),
            (128, false, false, WIDE_ROWS, 2),
            (256, false, false, MAX_ROWS, 1),
            (256, true, true, MAX_ROWS, 2),
        ] {
            assert_eq!(ctas_per_sm(d, fp8, long, rows), ctas, "d{d} fp8 {fp8} long {long} rows {rows}");
        }
    }
}
