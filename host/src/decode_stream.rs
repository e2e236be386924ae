//! Stream-K decode on the host: whether a batch runs on the persistent `decode_st_*` kernels
//! (`attn_math::stream`), and the little they need: the line's length, the grid, and for a batch
//! of unequal requests where each group of warps starts.
//!
//! The kernels take batches of up to 16 query rows per kv head, no empty request, 16-bit caches
//! at head sizes 64, 96 and 128, when the caller asks for them
//! (`SplitMode::StreamK`). Everything else (forced splits, which must not depend on the batch;
//! MQA; d256; CUDA-graph plans whose batch is not known when they are made) runs on the split-K
//! kernels.

use crate::decode::SplitMode;
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::Result;
use attn_math::stream::{pair_tiles, range_begin, shared_bytes, WARPS};

/// The most warps a stream launch uses (the workspace's counters and start table).
pub const MAX_STREAM_WORKERS: usize = 4096;

/// A batch's stream-K launch.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StreamPlan {
    pub kernel: String,
    pub smem: u32,
    /// CTAs (all resident at once), their warps, and the groups of a warp per kv head.
    pub grid: u32,
    pub workers: u32,
    pub groups: u32,
    /// Tiles of the line, and of every pair when they are all equal (else 0).
    pub tiles: u32,
    pub pair_tiles: u32,
    /// Rows of a partial slot: the batch's most query rows per kv head.
    pub rows: u32,
    /// The window the line was laid out for (0: none).
    pub window: u32,
    /// Per group `[request, tiles before it]`; empty when `pair_tiles` is set.
    pub starts: Vec<u32>,
}

impl StreamPlan {
    /// Partial rows (head size f32 each) the launch may write: two slots per warp.
    pub fn partial_rows(&self) -> usize {
        2 * self.workers as usize * self.rows as usize
    }
}

/// Whether a split mode asks for stream-K: `SplitMode::StreamK`, or `Auto` with
/// `ATTN_DECODE_STREAM=1` (for comparisons on the benchmark).
pub fn stream_wanted(mode: SplitMode) -> bool {
    match mode {
        SplitMode::StreamK => true,
        SplitMode::Auto => std::env::var("ATTN_DECODE_STREAM").is_ok_and(|v| v == "1"),
        SplitMode::Fixed(_) => false,
    }
}

/// The stream kernel's name for these types and head size, if there is one (16-bit caches).
pub fn stream_kernel_name(q: DType, fp8: bool, head_size: usize) -> Option<String> {
    (!fp8 && [64, 96, 128].contains(&head_size)).then(|| format!("decode_st_{}_d{head_size}", q.kernel_name()))
}

/// What the plan needs of the batch and the layer.
#[derive(Clone, Copy, Debug)]
pub struct StreamBatch<'a> {
    pub seq_lens: &'a [i32],
    pub query_start_loc: &'a [i32],
    pub num_kv_heads: u32,
    pub group: u32,
    pub window: u32,
}

/// Lays a batch out for the stream kernel on `groups` groups of warps; `None` when it does not
/// fit the kernel (an empty request, more than 16 rows per kv head, nothing to do), or when a
/// request would be cut among more than [`MAX_SHARES`] groups (its partials' merge, one warp's
/// work, would then be longer than what the line saves: those batches stay on split-K).
pub fn layout_line(b: &StreamBatch<'_>, groups: u32, max_shares: Option<u32>) -> Option<(u32, u32, u32, u32, Vec<u32>)> {
    let n = b.seq_lens.len();
    if n == 0 || groups == 0 || b.group == 0 || b.query_start_loc.len() != n + 1 || b.seq_lens.iter().any(|&l| l <= 0) {
        return None;
    }
    // In i64, so that no pair of start locations wraps; a request without query tokens (or
    // with a negative count) has no rows for the kernel to write: such batches stay on split-K.
    let qsl = b.query_start_loc;
    let q_lens: Vec<i64> = (0..n).map(|r| qsl[r + 1] as i64 - qsl[r] as i64).collect();
    if q_lens.iter().any(|&q| q <= 0 || q * b.group as i64 > 16) {
        return None;
    }
    let q_len = |r: usize| q_lens[r] as u32;
    let rows = (0..n).map(|r| q_len(r) * b.group).max().unwrap_or(0);
    let tiles: Vec<u32> = (0..n).map(|r| pair_tiles(b.seq_lens[r] as u32, q_len(r), b.window).1).collect();
    let total: u64 = tiles.iter().map(|&t| t as u64).sum::<u64>();
    if total == 0 || total > u32::MAX as u64 / 2 {
        return None;
    }
    let total = total as u32;
    let longest = tiles.iter().copied().max().unwrap_or(0) as u64;
    if max_shares.is_some_and(|m| longest * groups as u64 > m as u64 * total as u64) {
        return None;
    }
    let uniform = tiles.iter().all(|&t| t == tiles[0]) && (0..n).all(|r| q_len(r) == q_len(0));
    if uniform {
        return Some((total, tiles[0], rows, aligned_groups(n as u32, groups), Vec::new()));
    }
    Some((total, 0, rows, groups, group_starts(&tiles, total, groups)))
}

/// For `requests` equal requests, the number of groups (at most `groups`) whose ranges end
/// where requests end: a multiple of the requests, or a divisor of them, when that keeps at
/// least 15/16 of the groups; else `groups`. A request cut at an arbitrary tile costs a partial
/// and a merge on each side (measured on the H100: 64 x 4096 on 132 groups 90%, on 128 groups
/// the 66 x 4096 figure, 94%).
pub fn aligned_groups(requests: u32, groups: u32) -> u32 {
    if requests == 0 || groups == 0 {
        return groups;
    }
    let aligned = if requests <= groups {
        groups / requests * requests
    } else {
        (1..=groups).rev().find(|g| requests.is_multiple_of(*g)).unwrap_or(1)
    };
    if aligned as u64 * 16 >= groups as u64 * 15 {
        aligned
    } else {
        groups
    }
}

/// The most groups a request may be cut among (see [`layout_line`]).
pub const MAX_SHARES: u32 = 4;

/// For each group, the request holding its first tile and the tiles of the requests before it;
/// a group with an empty range gets the last request.
pub fn group_starts(req_tiles: &[u32], total: u32, groups: u32) -> Vec<u32> {
    let mut out = Vec::with_capacity(2 * groups as usize);
    let (mut r, mut before) = (0usize, 0u32);
    for w in 0..groups {
        let x = range_begin(w, total, groups);
        // Move on while the request ends at or before x (and a later one exists).
        while r + 1 < req_tiles.len() && before as u64 + req_tiles[r] as u64 <= x as u64 {
            before += req_tiles[r];
            r += 1;
        }
        out.extend([r as u32, before]);
    }
    out
}

/// The stream launch for a batch on this device, if the batch and the workspace allow it.
pub(crate) fn plan_stream(
    dev: &AttnDevice,
    q: DType,
    fp8: bool,
    head_size: usize,
    b: &StreamBatch<'_>,
    partial_rows: usize,
    mode: SplitMode,
) -> Result<Option<StreamPlan>> {
    let Some(kernel) = stream_kernel_name(q, fp8, head_size) else { return Ok(None) };
    if !stream_wanted(mode) {
        return Ok(None);
    }
    let smem = shared_bytes(head_size as u32);
    let threads = 32 * WARPS;
    let grid = dev.sm_count() * dev.resident_ctas(&kernel, threads, smem)?;
    let workers = grid * WARPS;
    let groups = workers / b.num_kv_heads.max(1);
    if workers as usize > MAX_STREAM_WORKERS || groups == 0 {
        return Ok(None);
    }
    let Some((tiles, pair_tiles, rows, groups, starts)) =
        layout_line(b, groups, if mode == SplitMode::StreamK { None } else { Some(MAX_SHARES) })
    else {
        return Ok(None);
    };
    let plan = StreamPlan { kernel, smem, grid, workers, groups, tiles, pair_tiles, rows, window: b.window, starts };
    Ok((plan.partial_rows() <= partial_rows).then_some(plan))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn group_starts_land_in_the_request_holding_the_first_tile() {
        let tiles = [3u32, 1, 7, 2, 9];
        let total = tiles.iter().sum::<u32>();
        for groups in [1u32, 2, 5, 17, 40, 200] {
            let s = group_starts(&tiles, total, groups);
            for w in 0..groups as usize {
                let x = range_begin(w as u32, total, groups);
                let (r, before) = (s[2 * w] as usize, s[2 * w + 1]);
                assert_eq!(before, tiles[..r].iter().sum::<u32>());
                if x < total {
                    assert!(before <= x && x < before + tiles[r], "group {w} of {groups}");
                }
            }
        }
    }

    #[test]
    fn layout_refuses_empty_requests_wide_rows_and_long_cuts_and_spots_uniform_batches() {
        let b = |seq: &'static [i32], qsl: &'static [i32], group| StreamBatch {
            seq_lens: seq,
            query_start_loc: qsl,
            num_kv_heads: 8,
            group,
            window: 0,
        };
        assert!(layout_line(&b(&[5, 0], &[0, 1, 2], 4), 100, None).is_none());
        assert!(layout_line(&b(&[5, 9], &[0, 5, 10], 4), 100, None).is_none());
        let (tiles, pair, rows, groups, starts) = layout_line(&b(&[4096, 4096], &[0, 1, 2], 4), 2, Some(MAX_SHARES)).unwrap();
        assert_eq!((tiles, pair, rows, groups, starts.len()), (2 * 256, 256, 4, 2, 0));
        // One request over 132 groups: cut too finely.
        assert!(layout_line(&b(&[131072], &[0, 1], 4), 132, Some(MAX_SHARES)).is_none());
        assert!(layout_line(&b(&[131072], &[0, 1], 4), 132, None).is_some());
        let (tiles, pair, _, groups, starts) = layout_line(&b(&[4096, 17, 4096, 4096], &[0, 1, 2, 3, 4], 4), 8, Some(MAX_SHARES)).unwrap();
        assert_eq!((tiles, pair, groups, starts.len()), (3 * 256 + 2, 0, 8, 16));
    }

    #[test]
    fn equal_requests_get_groups_whose_ranges_end_with_them() {
        assert_eq!(aligned_groups(64, 132), 128);
        assert_eq!(aligned_groups(256, 132), 128);
        assert_eq!(aligned_groups(33, 132), 132);
        assert_eq!(aligned_groups(1, 132), 132);
        // 100 of 132 would idle a quarter of the warps.
        assert_eq!(aligned_groups(100, 132), 132);
        assert_eq!(aligned_groups(1000, 132), 125);
        assert_eq!(aligned_groups(1001, 132), 132);
    }
}
