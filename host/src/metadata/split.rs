//! Decodes first, then prefills: [`split_decodes`] counts the two parts of an ordered batch,
//! [`decode_first_order`] gives the order that makes a batch so.

use super::input::StepInput;
use super::validate::validate_query_start_loc;
use crate::error::{AttnError, Result};

/// The two parts of a batch ordered decodes first: requests `0..num_decodes` (tokens
/// `0..num_decode_tokens`) are decodes, the rest prefills.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BatchSplit {
    /// Decode requests (at most `decode_threshold` query tokens each), first in the batch.
    pub num_decodes: usize,
    /// Query tokens of the decodes.
    pub num_decode_tokens: usize,
    /// Prefill requests, after the decodes.
    pub num_prefills: usize,
    /// Query tokens of the prefills.
    pub num_prefill_tokens: usize,
}

impl BatchSplit {
    /// Requests of both parts.
    pub fn num_reqs(&self) -> usize {
        self.num_decodes + self.num_prefills
    }
}

/// Whether a request of `q_len` query tokens is a decode: `q_len <= decode_threshold` (an empty
/// request, `q_len == 0`, is one too, as in vLLM).
#[inline]
pub fn is_decode(q_len: i64, decode_threshold: usize) -> bool {
    q_len <= decode_threshold as i64
}

/// Splits a batch that is already ordered decodes first (vLLM's `split_decodes_and_prefills`):
/// a decode has at most `decode_threshold` query tokens. Refuses (naming `query_start_loc`)
/// start locations that [`validate`](super::validate) would refuse, and a decode that follows a
/// prefill; [`decode_first_order`] gives the order the engine should put its batch in.
pub fn split_decodes(input: &StepInput<'_>, decode_threshold: usize) -> Result<BatchSplit> {
    validate_query_start_loc(input)?;
    let n = input.num_reqs();
    let qsl = input.query_start_loc;
    let num_decodes = (0..n).position(|r| !is_decode(input.query_len(r), decode_threshold)).unwrap_or(n);
    if let Some(r) = (num_decodes..n).find(|&r| is_decode(input.query_len(r), decode_threshold)) {
        return Err(AttnError::invalid(
            "query_start_loc",
            format!(
                "request {r} is a decode ({} query tokens, threshold {decode_threshold}) after the prefill request {num_decodes} \
                 ({} tokens): order the batch decodes first (decode_first_order)",
                input.query_len(r),
                input.query_len(num_decodes),
            ),
        ));
    }
    let num_decode_tokens = qsl[num_decodes] as usize;
    Ok(BatchSplit {
        num_decodes,
        num_decode_tokens,
        num_prefills: n - num_decodes,
        num_prefill_tokens: input.num_actual_tokens - num_decode_tokens,
    })
}

/// `split` checked against `input` (validated start locations): requests `0..num_decodes` are
/// decodes of at most `decode_threshold` query tokens, and the counts are the batch's. The
/// split of a batch whose parts are known from elsewhere (a local batch's pieces: a prefill's
/// last piece may be as short as a decode).
pub(crate) fn given_split(input: &StepInput<'_>, decode_threshold: usize, split: BatchSplit) -> Result<BatchSplit> {
    let (n, nd) = (input.num_reqs(), split.num_decodes);
    let consistent = nd <= n
        && split.num_reqs() == n
        && split.num_decode_tokens == input.query_start_loc[nd] as usize
        && split.num_decode_tokens + split.num_prefill_tokens == input.num_actual_tokens;
    if !consistent {
        return Err(AttnError::invalid(
            "split",
            format!("{split:?} is not a split of {n} requests and {} tokens", input.num_actual_tokens),
        ));
    }
    if let Some(r) = (0..nd).find(|&r| !is_decode(input.query_len(r), decode_threshold)) {
        return Err(AttnError::invalid(
            "split",
            format!("request {r} of the decode part has {} query tokens, past the threshold {decode_threshold}", input.query_len(r)),
        ));
    }
    Ok(split)
}

/// The stable order that puts a batch's decodes (`q_len <= decode_threshold`) first: entry `i`
/// is the index of the request that goes to place `i`. Requests keep their relative order
/// within each part (vLLM reorders its persistent batch likewise before building metadata).
/// Reads `query_start_loc` only, and expects it valid.
pub fn decode_first_order(input: &StepInput<'_>, decode_threshold: usize) -> Vec<usize> {
    let n = input.query_start_loc.len().saturating_sub(1);
    let mut order = Vec::with_capacity(n);
    order.extend((0..n).filter(|&r| is_decode(input.query_len(r), decode_threshold)));
    order.extend((0..n).filter(|&r| !is_decode(input.query_len(r), decode_threshold)));
    order
}
