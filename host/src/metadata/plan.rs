//! [`plan_decode_into`]: [`crate::decode::plan_decode`]'s plan, written into a reused
//! [`DecodePlan`] and without its integer divisions where they cannot change the result.
//!
//! It must give exactly what `plan_decode` gives (the tests compare the two on random batches):
//! the same rows per CTA (and the same `ATTN_DECODE_MAX_ROWS_PER_CTA` cap), the same chunk from
//! `attn_math::split::plan_chunk`, the same growth until the partials fit. Two shortcuts:
//! when even one split per request is over the CTA target, `plan_chunk`'s search ends at the
//! largest chunk, which is computed directly; and a chunk at least as long as every request
//! gives every request one split.

use super::tensor_core::{clear_plan, PlanConfig};
use crate::decode::{DecodeBatch, DecodePlan, SplitMode, CHUNK_TILE, MIN_CHUNK};
use attn_math::decode::rows_per_cta;
use attn_math::split::{num_splits, plan_chunk};

/// Plans `batch` (validated: non-negative lengths, non-decreasing start locations) into `plan`,
/// reusing its vectors; `lens` is scratch.
pub(crate) fn plan_decode_into(batch: &DecodeBatch<'_>, c: &PlanConfig, plan: &mut DecodePlan, lens: &mut Vec<u32>) {
    let n = batch.seq_lens.len();
    let qsl = batch.query_start_loc;
    let q_len = |r: usize| (qsl[r + 1] - qsl[r]) as u32;
    let group = (c.num_q_heads / c.num_kv_heads) as u32;
    // As in `plan_decode`: a part of empty requests plans as one query token a request.
    let max_q = (0..n).map(q_len).max().unwrap_or(1).max(1);
    let mut rows = rows_per_cta(max_q * group, c.head_size as u32);
    if let Some(cap) = std::env::var("ATTN_DECODE_MAX_ROWS_PER_CTA").ok().and_then(|v| v.parse::<u32>().ok()) {
        rows = rows.min(cap.max(1).next_power_of_two());
    }
    let row_groups = (max_q * group).div_ceil(rows);
    let ctas_per_split = c.num_kv_heads as u32 * row_groups;
    lens.clear();
    lens.extend(batch.seq_lens.iter().map(|&l| l as u32));
    let max_len = lens.iter().copied().max().unwrap_or(0);
    let forced = match c.mode {
        SplitMode::Auto | SplitMode::StreamK => None,
        SplitMode::Fixed(k) => Some(k),
    };
    let mut chunk = if forced.is_none() && n as u64 * ctas_per_split as u64 > c.ctas_target() {
        // Every chunk gives at least one split per request, over the target: plan_chunk's
        // binary search never succeeds and returns its upper end.
        max_len.max(1).div_ceil(CHUNK_TILE) * CHUNK_TILE
    } else {
        plan_chunk(lens, ctas_per_split, c.ctas_target(), CHUNK_TILE, MIN_CHUNK, forced)
    };
    let one_split = |chunk: u32| chunk >= max_len;
    // As in `plan_decode`: partial bases are u32, and the row count is taken without wrapping.
    let capacity = c.partial_capacity.min(u32::MAX as usize);
    let q_lens = (0..n).map(q_len);
    loop {
        if one_split(chunk) {
            break; // no partials, every split count 1
        }
        let rows = lens.iter().zip(q_lens.clone()).try_fold(0usize, |acc, (&l, q)| {
            let s = num_splits(l, chunk);
            let rows = if s > 1 { (s as usize).checked_mul(q as usize)?.checked_mul(c.num_q_heads)? } else { 0 };
            acc.checked_add(rows)
        });
        let splits_ok = lens.iter().all(|&l| num_splits(l, chunk) <= 0xffff);
        if rows.is_some_and(|rows| rows <= capacity) && splits_ok {
            break;
        }
        chunk = chunk.saturating_mul(2);
    }

    clear_plan(plan);
    plan.chunk = chunk;
    plan.rows_per_cta = rows;
    plan.row_groups = row_groups;
    if one_split(chunk) {
        // One split each: no partials; bulk fills instead of per-request pushes.
        plan.items.extend((0..n as u32).map(|r| r << 16));
        plan.req_num_splits.resize(n, 1);
        plan.req_partial_base.resize(n, 0);
    } else {
        for (r, &len) in lens.iter().enumerate() {
            let q = q_len(r);
            let splits = num_splits(len, chunk);
            plan.req_num_splits.push(splits);
            plan.req_partial_base.push(plan.partial_rows as u32);
            if splits > 1 {
                plan.partial_rows += splits as usize * q as usize * c.num_q_heads;
            }
            plan.items.extend((0..splits).map(|s| (r as u32) << 16 | s));
        }
    }
    if max_q == 1 && qsl[n] as usize == n {
        plan.token_request.extend(0..n as u32); // one query token each (none is empty)
    } else {
        for r in 0..n {
            plan.token_request.extend(std::iter::repeat_n(r as u32, q_len(r) as usize));
        }
    }
}
