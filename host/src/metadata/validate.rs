//! [`validate`]: refuses a step whose host metadata would make a kernel read or write outside
//! its buffers, naming the field.

use super::input::{blocks_for, StepInput};
use crate::error::{ensure, AttnError, Result};

/// Checks a step:
///
/// - `query_start_loc`: `num_reqs + 1` entries, starting at 0, non-decreasing, ending at
///   `num_actual_tokens`;
/// - `seq_lens`: not negative, and at least the query length of every non-empty request;
/// - `block_table`: `num_reqs` rows of `block_table_stride`, each request's
///   `ceil(seq_len / block_size)` blocks fit its row and are ids in `0..num_blocks`;
/// - `slot_mapping`: at least `num_actual_tokens` entries, each -1 (padding) or a slot in
///   `0..num_blocks * block_size`.
pub fn validate(input: &StepInput<'_>) -> Result<()> {
    validate_with(input, false)
}

/// [`validate`], where `empty_contexts` also takes a request of length 0 with query tokens (an
/// empty context: they attend nothing). A context-parallel rank's view of a step has such
/// requests (the rank holds none of their keys yet); an engine's own steps never do.
pub(crate) fn validate_with(input: &StepInput<'_>, empty_contexts: bool) -> Result<()> {
    ensure(input.block_size > 0, "block_size", || "must be at least 1".into())?;
    validate_query_start_loc(input)?;
    validate_seq_lens(input, empty_contexts)?;
    validate_block_table(input)?;
    validate_slot_mapping(input)
}

/// The `query_start_loc` part of [`validate`] (the split needs it too).
pub(crate) fn validate_query_start_loc(input: &StepInput<'_>) -> Result<()> {
    let (qsl, n) = (input.query_start_loc, input.num_reqs());
    ensure(qsl.len() == n + 1, "query_start_loc", || format!("has {} entries for {n} requests (needs {})", qsl.len(), n + 1))?;
    ensure(qsl[0] == 0, "query_start_loc", || format!("starts at {}, not 0", qsl[0]))?;
    // Branch-free scan first (vectorises); find the offender only when there is one.
    let decreasing = qsl.windows(2).fold(false, |bad, w| bad | (w[1] < w[0]));
    if decreasing {
        let r = qsl.windows(2).position(|w| w[1] < w[0]).expect("a decreasing pair");
        return Err(AttnError::invalid("query_start_loc", format!("decreases at request {r}: {} then {}", qsl[r], qsl[r + 1])));
    }
    ensure(qsl[n] as i64 == input.num_actual_tokens as i64, "query_start_loc", || {
        format!("ends at {}, but the step has {} tokens", qsl[n], input.num_actual_tokens)
    })
}

fn validate_seq_lens(input: &StepInput<'_>, empty_contexts: bool) -> Result<()> {
    for (r, &len) in input.seq_lens.iter().enumerate() {
        // In i64: `validate_query_start_loc` ran first, but no pair of i32s may wrap here.
        let q = input.query_len(r);
        ensure(len >= 0, "seq_lens", || format!("request {r} has negative length {len}"))?;
        ensure(q == 0 || len as i64 >= q || (empty_contexts && len == 0), "seq_lens", || {
            format!("request {r} has length {len} < its {q} query tokens")
        })?;
    }
    Ok(())
}

fn validate_block_table(input: &StepInput<'_>) -> Result<()> {
    let (n, stride) = (input.num_reqs(), input.block_table_stride);
    let rows = n.checked_mul(stride);
    ensure(rows.is_some_and(|rows| input.block_table.len() >= rows), "block_table", || {
        format!("has {} entries, {n} rows of {stride} need {}", input.block_table.len(), n.saturating_mul(stride))
    })?;
    let limit = input.num_blocks.min(1 << 31) as i64;
    for (r, &len) in input.seq_lens.iter().enumerate() {
        let blocks = blocks_for(len, input.block_size);
        ensure(blocks <= stride, "block_table", || format!("request {r} needs {blocks} blocks, rows hold {stride}"))?;
        let row = &input.block_table[r * stride..][..blocks];
        if range_acc(row, limit) < 0 {
            let i = row.iter().position(|&b| !(0..limit).contains(&(b as i64))).expect("an id outside");
            return Err(AttnError::invalid(
                "block_table",
                format!("request {r} entry {i} is block {}, the cache has {} blocks", row[i], input.num_blocks),
            ));
        }
    }
    Ok(())
}

fn validate_slot_mapping(input: &StepInput<'_>) -> Result<()> {
    let nt = input.num_actual_tokens;
    ensure(input.slot_mapping.len() >= nt, "slot_mapping", || format!("has {} entries for {nt} tokens", input.slot_mapping.len()))?;
    let slots = &input.slot_mapping[..nt];
    // -1..num_slots maps to 0..=num_slots; everything else (other negatives too) lands above.
    let limit = input.num_slots() as u64;
    let ok = |s: i64| (s.wrapping_add(1) as u64) <= limit;
    let outside = slots.iter().fold(false, |bad, &s| bad | !ok(s));
    if outside {
        let t = slots.iter().position(|&s| !ok(s)).expect("a slot outside");
        return Err(AttnError::invalid(
            "slot_mapping",
            format!("token {t} has slot {}, the cache has {} slots (-1 is padding)", slots[t], input.num_slots()),
        ));
    }
    Ok(())
}

/// Negative iff a value of `ids` is outside `0..limit` (`limit` at most 2^31). Branch-free and
/// without 32-bit min/max (SSE2 has none): `b` is inside iff neither `b` nor `limit - 1 - b` is
/// negative.
fn range_acc(ids: &[i32], limit: i64) -> i32 {
    let last = (limit - 1) as i32;
    ids.iter().fold(0, |acc, &b| acc | b | last.wrapping_sub(b))
}
