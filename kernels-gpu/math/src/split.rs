//! Split-K planning for decode (flash-decoding): how many tokens each split of a request covers.
//!
//! One chunk size serves the whole batch, so a long request gets many splits and a short one
//! few, and the number of CTAs (splits x kv heads x row groups) is about `target_ctas`: the
//! smallest chunk (a multiple of `tile`) whose CTA count does not exceed the target, found by
//! binary search. A request that fits in one chunk writes its output directly.

/// Splits of a request of `len` tokens with chunks of `chunk` tokens (an empty request: 1; a
/// chunk of 0 counts as 1).
#[inline(always)]
pub fn num_splits(len: u32, chunk: u32) -> u32 {
    if len == 0 {
        1
    } else {
        len.div_ceil(chunk.max(1))
    }
}

/// CTAs a chunk size gives: `ctas_per_split` per split of every request.
pub fn ctas_for_chunk(seq_lens: &[u32], chunk: u32, ctas_per_split: u32) -> u64 {
    // Saturating: the callers compare it with a target, and a count past u64 is past any target.
    seq_lens.iter().map(|&l| num_splits(l, chunk) as u64).fold(0u64, |a, s| a.saturating_add(s)).saturating_mul(ctas_per_split as u64)
}

/// The chunk size (tokens per split) for a batch.
///
/// - `forced_splits`: `Some(1)` gives one split per request (results independent of the batch:
///   deterministic mode); `Some(n)` splits the longest request into `n`.
/// - otherwise the smallest multiple of `tile` whose CTA count stays within `target_ctas`
///   (typically 2 waves of the GPU); never smaller than `min_chunk` (splits shorter than that
///   cost more in merging than they gain).
///
/// A `tile` of 0 counts as 1; chunks saturate at `u32::MAX` rather than wrap.
pub fn plan_chunk(seq_lens: &[u32], ctas_per_split: u32, target_ctas: u64, tile: u32, min_chunk: u32, forced_splits: Option<u32>) -> u32 {
    let tile = tile.max(1);
    let max_len = seq_lens.iter().copied().max().unwrap_or(0).max(1);
    let tiles_max = max_len.div_ceil(tile);
    if let Some(n) = forced_splits {
        return (tiles_max.div_ceil(n.max(1)).max(1)).saturating_mul(tile);
    }
    // Smallest k (chunk = k tiles) with ctas <= target; the CTA count only falls as k grows.
    // If even one split per request is over the target, that is the best there is.
    let (mut lo, mut hi) = (min_chunk.div_ceil(tile).clamp(1, tiles_max), tiles_max);
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        if ctas_for_chunk(seq_lens, mid.saturating_mul(tile), ctas_per_split) <= target_ctas {
            hi = mid;
        } else {
            lo = mid + 1;
        }
    }
    lo.saturating_mul(tile)
}

/// Most splits [`even_waves_chunk`] gives a request.
pub const EVEN_WAVES_MAX_SPLITS: u32 = 4;
/// Estimated cost of starting a CTA (work item, first address tables, pipeline fill), in the
/// time one CTA takes to stream that many keys.
const CTA_START_KEYS: u64 = 64;
/// Estimated cost of splitting (partials written, the merge kernel), in the same unit: measured
/// on the H100, 256 requests of 1024 keys in two splits took 19% longer than in one, where a
/// cost of 128 keys had predicted 1% shorter.
const MERGE_KEYS: u64 = 512;

/// Refines [`plan_chunk`]'s `chunk` for a batch whose requests each have one split and still
/// make more CTAs than `slots` (the CTAs the GPU holds at once), when the requests have about
/// the same length (the shortest non-empty one at least 4/5 of the longest). Their CTAs then
/// run in rounds of `slots`, and a last round that is mostly empty takes as long as a full one
/// (64 requests x 8 kv heads on 396 slots: 1.3 rounds cost 2). Picks the number of splits of
/// 1..=[`EVEN_WAVES_MAX_SPLITS`] with the least estimated time, rounds x (chunk + CTA start),
/// plus the merge when split, as FlashAttention's split heuristic weighs its waves' efficiency.
/// Other batches keep `chunk`: CTAs of mixed lengths fill the last round by themselves.
pub fn even_waves_chunk(seq_lens: &[u32], ctas_per_split: u32, slots: u64, tile: u32, min_chunk: u32, chunk: u32) -> u32 {
    let max_len = seq_lens.iter().copied().max().unwrap_or(0);
    let min_len = seq_lens.iter().copied().filter(|&l| l > 0).min().unwrap_or(0);
    let one_split = chunk >= max_len;
    if max_len == 0 || !one_split || slots == 0 || (min_len as u64) * 5 < (max_len as u64) * 4 {
        return chunk;
    }
    if ctas_for_chunk(seq_lens, chunk, ctas_per_split) <= slots {
        return chunk;
    }
    let tile = tile.max(1);
    let tiles_max = max_len.div_ceil(tile);
    let cost = |c: u32| {
        let rounds = ctas_for_chunk(seq_lens, c, ctas_per_split).div_ceil(slots);
        let merge = if c < max_len { MERGE_KEYS } else { 0 };
        rounds.saturating_mul(c.min(max_len) as u64 + CTA_START_KEYS).saturating_add(merge)
    };
    let mut best = chunk;
    for n in 2..=EVEN_WAVES_MAX_SPLITS {
        let c = tiles_max.div_ceil(n).saturating_mul(tile);
        if c < min_chunk || c >= max_len {
            continue;
        }
        if cost(c) < cost(best) {
            best = c;
        }
    }
    best
}
