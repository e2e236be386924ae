//! Which head sizes the attention kernels take and the width each runs at, shared by the
//! kernels and the host.
//!
//! A kernel is built for a width `D` (its tiles, registers and shared memory). It runs every
//! head size up to `D` that is a multiple of 8 (`crate::params::HeadDims`): Q, K and V columns
//! past the head size are zero-filled in shared memory, never read from global memory, add
//! nothing to the scores or the accumulators, and are not stored. So a model with head size
//! 80 runs on the width-96 kernels, 112 on the width-128 ones.

/// The widths with standard (QK = V) kernels: decode, prefill and the local masks.
pub const HEAD_SIZES: [u32; 4] = [64, 96, 128, 256];
/// The smallest and largest head size taken.
pub const MIN_HEAD_SIZE: u32 = 32;
pub const MAX_HEAD_SIZE: u32 = 256;

/// Whether the kernels take head size `d` (QK = V), with a 16-bit or an FP8 cache: a multiple
/// of 8 from [`MIN_HEAD_SIZE`] to [`MAX_HEAD_SIZE`]. (FP8 rows of an odd multiple of 8 can start
/// off a 16-byte boundary: the `_fp8_a8` kernels copy them in 8-byte halves.)
pub const fn takes_head_size(d: u32) -> bool {
    d >= MIN_HEAD_SIZE && d <= MAX_HEAD_SIZE && d.is_multiple_of(8)
}

/// The width head size `d` runs at: the smallest of [`HEAD_SIZES`] at least `d` (`None` past
/// the largest). Whether `d` is taken at all is [`takes_head_size`]'s question.
pub const fn width(d: u32) -> Option<u32> {
    width_in(d, &HEAD_SIZES)
}

/// The smallest of `widths` (ascending) at least `d`: the width of a kernel family that is
/// built for those (the Hopper prefill's, the FP8 keys-as-rows decode's).
pub const fn width_in(d: u32, widths: &[u32]) -> Option<u32> {
    let mut i = 0;
    while i < widths.len() {
        if widths[i] >= d {
            return Some(widths[i]);
        }
        i += 1;
    }
    None
}

/// The width decode runs head size `d` at: with an FP8 cache the keys-as-rows kernels' (64,
/// 128, 256: `crate::keys_rows::FP8_HEAD_SIZES`), whose fragments convert straight from the
/// staged FP8 rows (the width-96 kernel converts whole tiles through shared memory and is
/// compute-bound); else [`width`].
pub const fn decode_width(d: u32, fp8: bool) -> Option<u32> {
    match (fp8, width_in(d, &crate::keys_rows::FP8_HEAD_SIZES)) {
        (true, Some(w)) => Some(w),
        _ => width(d),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_multiple_of_8_has_a_width() {
        for d in (MIN_HEAD_SIZE..=MAX_HEAD_SIZE).step_by(8) {
            let w = width(d).unwrap();
            assert!(w >= d && HEAD_SIZES.contains(&w), "{d} -> {w}");
            assert!(takes_head_size(d));
        }
        assert_eq!((decode_width(80, true), decode_width(96, true), decode_width(136, true)), (Some(128), Some(128), Some(256)));
        assert_eq!((decode_width(80, false), decode_width(40, true)), (Some(96), Some(64)));
        assert_eq!(width(80), Some(96));
        assert_eq!(width(112), Some(128));
        assert_eq!(width(136), Some(256));
        assert_eq!(width(264), None);
        assert!(!takes_head_size(24) && !takes_head_size(260) && !takes_head_size(84));
    }
}
