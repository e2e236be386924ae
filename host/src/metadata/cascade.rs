//! Cascade attention, host side: [`common_prefix`] finds the whole blocks every request of a
//! step starts with (a shared system prompt), [`use_cascade`] decides whether attending them once
//! for the whole batch pays (vLLM's `use_cascade_attention`, FlashInfer's shared-prefix cascade).
//!
//! Cascade splits each request's keys into the shared prefix and its own suffix: the prefix is
//! attended once by all query tokens of the batch as one non-causal request, each suffix as
//! usual (causal), and the two partials are merged row by row by their LSEs
//! (`merge_attn_states`). The result equals attention over the whole context because the prefix
//! ends before every request's first query token, so no query token needs a causal mask there.

use super::input::StepInput;

/// Whether steps use cascade attention.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CascadeMode {
    /// Decided per step by [`use_cascade`]'s heuristic.
    #[default]
    Auto,
    /// Whenever the step has a shared prefix (at least one block).
    On,
    /// Never.
    Off,
}

/// A step's shared prefix, in whole blocks.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct CommonPrefix {
    /// Block-table entries every request starts with.
    pub blocks: usize,
    /// `blocks * block_size`.
    pub tokens: usize,
}

/// The longest run of whole blocks that every request's block-table row starts with, capped so
/// that for every request `r` the prefix lies entirely before its first query token:
/// `blocks * block_size <= seq_lens[r] - query_len(r)` (every query token of every request then
/// sees the whole prefix, without a causal mask). 0 blocks when there are no requests.
///
/// Meant for validated input, but never panics: a request with a negative length or query
/// length, or a row the block table does not hold, shares nothing (0 blocks), and the prefix
/// stops at the first block id of request 0 that is outside the cache. Reads only entries the
/// requests use: at most the first `min over r of (seq_lens[r] - query_len(r)) / block_size` of
/// each row. Cost: one pass over the lengths, then one comparison of each row's candidate prefix
/// with request 0's, the candidate shrinking at each mismatch.
pub fn common_prefix(input: &StepInput<'_>) -> CommonPrefix {
    let n = input.num_reqs();
    let (bs, stride, table) = (input.block_size, input.block_table_stride, input.block_table);
    if n == 0 || bs == 0 || stride == 0 || input.query_start_loc.len() <= n {
        return CommonPrefix::default();
    }
    // Whole blocks every request has before its first query token, within its row.
    let mut cand = stride;
    for r in 0..n {
        let q = input.query_start_loc[r + 1] as i64 - input.query_start_loc[r] as i64;
        let len = input.seq_lens[r] as i64;
        if q < 0 || len < q {
            return CommonPrefix::default();
        }
        let row_len = table.len().saturating_sub(r * stride).min(stride);
        cand = cand.min(((len - q) as u64 / bs as u64) as usize).min(row_len);
        if cand == 0 {
            return CommonPrefix::default();
        }
    }
    // Request 0's blocks, up to the first one outside the cache.
    let first = &table[..cand];
    cand = first.iter().position(|&b| b < 0 || b as usize >= input.num_blocks).unwrap_or(cand);
    // Each row's prefix against request 0's, shrinking at the first mismatch.
    for r in 1..n {
        if cand == 0 {
            break;
        }
        let row = &table[r * stride..][..cand];
        if row != &first[..cand] {
            cand = row.iter().zip(first).position(|(a, b)| a != b).unwrap_or(cand);
        }
    }
    CommonPrefix { blocks: cand, tokens: cand * bs }
}

/// Smallest shared prefix, in tokens, for which [`CascadeMode::Auto`] uses cascade (vLLM's
/// threshold).
pub const MIN_CASCADE_PREFIX_TOKENS: usize = 256;
/// Fewest requests for which [`CascadeMode::Auto`] uses cascade.
pub const MIN_CASCADE_REQS: usize = 8;
/// Most query rows per request per kv head (`num_query_tokens * group / num_reqs`) for which
/// [`CascadeMode::Auto`] uses cascade.
pub const MAX_CASCADE_ROWS_PER_REQ: usize = 64;

/// What [`use_cascade`] looks at.
#[derive(Clone, Copy, Debug)]
pub struct CascadeStep {
    /// The step's shared prefix.
    pub prefix: CommonPrefix,
    /// Requests of the step.
    pub num_reqs: usize,
    /// Query tokens of the step.
    pub num_query_tokens: usize,
    /// Query heads per kv head.
    pub group: usize,
}

impl CascadeStep {
    /// The step `input` with its [`common_prefix`] and `group` query heads per kv head.
    pub fn new(input: &StepInput<'_>, group: usize) -> Self {
        CascadeStep { prefix: common_prefix(input), num_reqs: input.num_reqs(), num_query_tokens: input.num_actual_tokens, group }
    }
}

/// Whether a step uses cascade attention.
///
/// - With [`CascadeMode::Off`], never.
/// - With no shared block (`prefix.blocks == 0`), never: there is nothing to attend once.
/// - With [`CascadeMode::On`], whenever there is a shared block.
/// - With [`CascadeMode::Auto`], only when all three hold:
///   1. `prefix.tokens >= MIN_CASCADE_PREFIX_TOKENS` (256, vLLM's threshold): below it the extra
///      launches and the merge cost more than attending a short prefix once saves.
///   2. `num_reqs >= MIN_CASCADE_REQS` (8): the plain path re-reads the prefix once per request,
///      so with few requests there is little re-reading to remove.
///   3. The plain path's work over the prefix is memory-bound: the query rows per request per
///      kv head, `num_query_tokens * group / num_reqs`, are at most `MAX_CASCADE_ROWS_PER_REQ`
///      (64). Each key of the prefix costs `4 * head_size` bytes (K and V in bf16) and
///      `4 * head_size * rows` flops per request (QK and PV, 2 flops a multiply-add), so the
///      arithmetic intensity is about `rows` flops per byte; below ~64 rows the plain path is
///      bound by reading the prefix again for every request, which cascade removes. Above it
///      (long prefills) the plain path is compute-bound, the flops are the same either way, and
///      cascade saves nothing. Compared exactly as `num_query_tokens * group <= 64 * num_reqs`.
pub fn use_cascade(mode: CascadeMode, step: &CascadeStep) -> bool {
    match mode {
        CascadeMode::Off => false,
        _ if step.prefix.blocks == 0 => false,
        CascadeMode::On => true,
        CascadeMode::Auto => {
            step.prefix.tokens >= MIN_CASCADE_PREFIX_TOKENS
                && step.num_reqs >= MIN_CASCADE_REQS
                && step.num_query_tokens.saturating_mul(step.group) <= MAX_CASCADE_ROWS_PER_REQ.saturating_mul(step.num_reqs)
        }
    }
}
