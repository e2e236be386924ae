//! Split-K planning for decode (flash-decoding): how many tokens each split of a request covers.
//!
//! One chunk size serves the whole batch, so a long request gets many splits and a short one
//! few, and the number of CTAs (splits x kv heads x row groups) is about `target_ctas`: the
//! smallest chunk (a multiple of `tile`) whose CTA count does not exceed the target, found by
//! binary search. A request that fits in one chunk writes its output directly.

/// Splits of a request of `len` tokens with chunks of `chunk` tokens (an empty request: 1).
#[inline(always)]
pub fn num_splits(len: u32, chunk: u32) -> u32 {
    if len == 0 {
        1
    } else {
        len.div_ceil(chunk)
    }
}

/// CTAs a chunk size gives: `ctas_per_split` per split of every request.
pub fn ctas_for_chunk(seq_lens: &[u32], chunk: u32, ctas_per_split: u32) -> u64 {
    seq_lens.iter().map(|&l| num_splits(l, chunk) as u64).sum::<u64>() * ctas_per_split as u64
}

/// The chunk size (tokens per split) for a batch.
///
/// - `forced_splits`: `Some(1)` gives one split per request (results independent of the batch:
///   deterministic mode); `Some(n)` splits the longest request into `n`.
/// - otherwise the smallest multiple of `tile` whose CTA count stays within `target_ctas`
///   (typically 2 waves of the GPU); never smaller than `min_chunk` (splits shorter than that
///   cost more in merging than they gain).
pub fn plan_chunk(seq_lens: &[u32], ctas_per_split: u32, target_ctas: u64, tile: u32, min_chunk: u32, forced_splits: Option<u32>) -> u32 {
    let max_len = seq_lens.iter().copied().max().unwrap_or(0).max(1);
    let tiles_max = max_len.div_ceil(tile);
    if let Some(n) = forced_splits {
        return tiles_max.div_ceil(n.max(1)).max(1) * tile;
    }
    // Smallest k (chunk = k tiles) with ctas <= target; the CTA count only falls as k grows.
    // If even one split per request is over the target, that is the best there is.
    let (mut lo, mut hi) = (min_chunk.div_ceil(tile).clamp(1, tiles_max), tiles_max);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ctas_for_chunk(seq_lens, mid * tile, ctas_per_split) <= target_ctas {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo * tile
}
