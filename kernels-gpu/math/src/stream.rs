//! Stream-K decode (`decode_st_*`): the batch's requests laid end to end as 16-key tiles, and
//! that line cut into equal contiguous ranges, one per *group* of warps of a persistent grid. A
//! group has a warp per kv head, and warp k takes kv head k of every tile of the group's range,
//! so the kv heads of a tile (rows of the same cache blocks) are read at about the same time, as
//! they would be by the CTAs of one split-K work item. A warp walks its range with one
//! continuous copy pipeline, so no warp starts, waits for a partial last wave or idles at the end
//! while others still run: every group streams the same number of tiles.
//!
//! A (request, kv head) pair inside a group's range is written directly. A request cut by range
//! ends is *split*: each of its groups' warps writes a partial result (f32 rows and their LSE) to
//! a slot of the workspace and adds its tiles to the pair's counter; the warp that completes the
//! count merges the partials and writes the output, then zeroes the counter for the next
//! launch. Everything a warp needs to find its requests, its slots and its counter is computed
//! from its index here, by the kernel and by the host's tests alike.

/// Keys per tile (one warp's MMA tile of keys); tiles are aligned to key 0.
pub const TILE_KEYS: u32 = 16;

/// Warps per CTA of the stream kernels.
pub const WARPS: u32 = 4;

/// Copy pipeline stages per warp (16-bit caches; two CTAs per SM in shared memory).
pub const STAGES: u32 = 3;

/// Bytes of one address-table slot: `TILE_KEYS` entries of (K row, V row) addresses, the
/// bad-block flag, and the [`SlotHeader`] words.
pub const SLOT_BYTES: u32 = TILE_KEYS * 16 + 64;
/// Offset of the flag and of the header words in a slot.
pub const SLOT_FLAG: u32 = TILE_KEYS * 16;
pub const SLOT_HEADER: u32 = TILE_KEYS * 16 + 16;
/// Words of a [`SlotHeader`].
pub const HEADER_WORDS: usize = 7;

/// Shared memory of one warp: its K and V stages (16-bit rows padded by 8 elements), then
/// `STAGES + 1` table slots. Returns (K stage bytes, V stage bytes, the whole warp's bytes).
pub const fn warp_layout(head_size: u32) -> (u32, u32, u32) {
    let stage = TILE_KEYS * (head_size + crate::prefill::ROW_PAD) * 2;
    (stage, stage, 2 * STAGES * stage + (STAGES + 1) * SLOT_BYTES)
}

/// Dynamic shared memory of a CTA.
pub const fn shared_bytes(head_size: u32) -> u32 {
    WARPS * warp_layout(head_size).2
}

/// The keys a decode pair attends, as tiles: `(first tile, tiles)`. The request's `q_len` new
/// tokens are its last; with a sliding window the earliest key any of them sees is
/// `seq_len - q_len + 1 - window`. An empty request has no tiles.
#[inline(always)]
pub fn pair_tiles(seq_len: u32, q_len: u32, window: u32) -> (u32, u32) {
    if seq_len == 0 {
        return (0, 0);
    }
    let begin = if window > 0 { (seq_len - q_len.min(seq_len) + 1).saturating_sub(window) } else { 0 };
    let first = begin / TILE_KEYS;
    (first, seq_len.div_ceil(TILE_KEYS) - first)
}

/// The first tile of group `w`'s range (`range_begin(w + 1)` is its end) when `total` tiles are
/// cut among `groups` groups.
#[inline(always)]
pub fn range_begin(w: u32, total: u32, groups: u32) -> u32 {
    ((w as u64 * total as u64) / groups as u64) as u32
}

/// The group whose range holds tile `x < total` (the last of those starting at or before it: a
/// range may be empty when there are fewer tiles than groups).
#[inline(always)]
pub fn worker_of(x: u32, total: u32, groups: u32) -> u32 {
    (((x as u64 + 1) * groups as u64 - 1) / total as u64) as u32
}

/// Whether group `w`'s range has tiles.
#[inline(always)]
pub fn has_tiles(w: u32, total: u32, groups: u32) -> bool {
    range_begin(w, total, groups) < range_begin(w + 1, total, groups)
}

/// How a request at tiles `at .. at + tiles` of the line is cut: its first and last group.
#[inline(always)]
pub fn pair_workers(at: u32, tiles: u32, total: u32, groups: u32) -> (u32, u32) {
    (worker_of(at, total, groups), worker_of(at + tiles - 1, total, groups))
}

/// The partial slot of kv head `k` (of `kv_heads`) in group `w`'s share of a split request
/// ending at tile `pair_end` (exclusive): each warp has two, one for the request that runs to
/// its range's end (or past it) and one for the request it starts inside of and finishes. Slot
/// rows: `slot * rows_per_slot ..`.
#[inline(always)]
pub fn partial_slot(w: u32, k: u32, kv_heads: u32, pair_end: u32, total: u32, groups: u32) -> u32 {
    (2 * w + (pair_end >= range_begin(w + 1, total, groups)) as u32) * kv_heads + k
}

/// The counter of kv head `k` of a split request at tile `at`: its first group's (a group holds
/// the first tile of at most one request that continues past its range).
#[inline(always)]
pub fn pair_counter(at: u32, k: u32, kv_heads: u32, total: u32, groups: u32) -> u32 {
    worker_of(at, total, groups) * kv_heads + k
}

/// The tiles of a request at `at .. at + tiles` that group range `begin .. end` holds.
#[inline(always)]
pub fn share(at: u32, tiles: u32, begin: u32, end: u32) -> u32 {
    (at + tiles).min(end).saturating_sub(at.max(begin))
}

/// What the address-table walker tells the compute step about a tile, through the table slot:
/// its pair and where the tile is in it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SlotHeader {
    pub req: u32,
    pub kv_head: u32,
    /// The tile's index in its pair (0 = the pair's first).
    pub tile: u32,
    /// The pair's tiles, and its first tile's key / 16.
    pub tiles: u32,
    pub first_tile: u32,
    /// The request's first tile on the line.
    pub at: u32,
    pub seq_len: u32,
}

impl SlotHeader {
    pub fn to_words(self) -> [u32; HEADER_WORDS] {
        [self.req, self.kv_head, self.tile, self.tiles, self.first_tile, self.at, self.seq_len]
    }

    pub fn from_words(w: [u32; HEADER_WORDS]) -> SlotHeader {
        let [req, kv_head, tile, tiles, first_tile, at, seq_len] = w;
        SlotHeader { req, kv_head, tile, tiles, first_tile, at, seq_len }
    }

    /// The tile's first key.
    #[inline(always)]
    pub fn key(&self) -> u32 {
        (self.first_tile + self.tile) * TILE_KEYS
    }
}

#[cfg(test)]
mod tests {
    extern crate std;
    use super::*;
    use std::vec::Vec;

    #[test]
    fn ranges_cover_the_line_and_worker_of_inverts_them() {
        for &(total, groups) in &[(1u32, 1u32), (7, 1056), (1056, 1056), (32768, 1056), (32769, 528), (5, 3), (808, 1056)] {
            let mut covered = 0;
            for w in 0..groups {
                let (a, b) = (range_begin(w, total, groups), range_begin(w + 1, total, groups));
                assert!(a <= b && b - a <= total.div_ceil(groups));
                assert_eq!(has_tiles(w, total, groups), a < b);
                for x in a..b {
                    assert_eq!(worker_of(x, total, groups), w, "total {total} groups {groups} tile {x}");
                }
                covered += b - a;
            }
            assert_eq!(covered, total);
        }
    }

    #[test]
    fn split_requests_have_distinct_slots_and_counters_and_shares_that_add_up() {
        // Requests of uneven lengths on a few groups (fewer tiles than groups too): each warp's
        // partial shares get distinct slots, distinct split pairs distinct counters, and the
        // shares of a request's groups add up to its tiles.
        let tiles: Vec<u32> = (0..40).map(|i| 1 + (i * 37 % 23)).collect();
        let total: u32 = tiles.iter().sum();
        let kv = 3;
        for groups in [1u32, 3, 7, 16, 64, 1000, 2000] {
            let mut slots = std::collections::BTreeSet::new();
            let mut counters = std::collections::BTreeSet::new();
            let mut at = 0;
            for &t in &tiles {
                let (w0, w1) = pair_workers(at, t, total, groups);
                let sum: u32 = (w0..=w1).map(|w| share(at, t, range_begin(w, total, groups), range_begin(w + 1, total, groups))).sum();
                assert_eq!(sum, t);
                if w0 != w1 {
                    for k in 0..kv {
                        assert!(counters.insert(pair_counter(at, k, kv, total, groups)));
                        for w in (w0..=w1).filter(|&w| has_tiles(w, total, groups)) {
                            assert!(slots.insert(partial_slot(w, k, kv, at + t, total, groups)), "slot reused");
                        }
                    }
                }
                at += t;
            }
        }
    }

    #[test]
    fn pair_tiles_follow_the_window() {
        assert_eq!(pair_tiles(0, 1, 0), (0, 0));
        assert_eq!(pair_tiles(1, 1, 0), (0, 1));
        assert_eq!(pair_tiles(33, 1, 0), (0, 3));
        // Window 8 at position 32: keys 25..=32, tiles 1 and 2.
        assert_eq!(pair_tiles(33, 1, 8), (1, 2));
        // Two query tokens at 31, 32, window 4: keys 28..=32.
        assert_eq!(pair_tiles(33, 2, 4), (1, 2));
        assert_eq!(pair_tiles(100, 1, 1000), (0, 7));
    }

    #[test]
    fn header_words_round_trip() {
        let h = SlotHeader { req: 1, kv_head: 2, tile: 3, tiles: 4, first_tile: 5, at: 6, seq_len: 7 };
        assert_eq!(SlotHeader::from_words(h.to_words()), h);
        assert_eq!(h.key(), 8 * 16);
    }
}
