//! [`TensorCoreMetadata`]: one step's metadata for the `tensor-core` backend. Its decode part's
//! split plan is left to the decode calls, which plan for their kernel
//! ([`crate::batch_plan::BatchPlan`], `forward`'s step planner).

use super::input::StepInput;
use super::split::{given_split, split_decodes, BatchSplit};
use super::validate::validate_with;
use crate::batch::MAX_QUERY_LEN;
use crate::decode::DecodePlan;
use crate::error::{ensure, Result};
use crate::kernels::head_width;

/// The most query heads a [`PlanConfig`] takes.
pub(crate) const MAX_PLAN_HEADS: usize = 1 << 16;

/// The model numbers a step's metadata is checked against (fixed for a run).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct PlanConfig {
    /// Requests with at most this many query tokens are decodes (1..=[`MAX_QUERY_LEN`]).
    pub decode_threshold: usize,
    /// Query heads.
    pub num_q_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Elements per head (a decode kernel's: 64, 96, 128 or 256).
    pub head_size: usize,
}

impl PlanConfig {
    /// Refuses numbers the decode kernels do not take, naming the argument (among them more
    /// than 65536 query heads, which keeps the decode plans' row counts inside their u32
    /// arithmetic).
    pub fn validate(&self) -> Result<()> {
        let t = self.decode_threshold;
        ensure((1..=MAX_QUERY_LEN).contains(&t), "decode_threshold", || format!("{t} (decode takes 1..={MAX_QUERY_LEN} query tokens)"))?;
        ensure(self.num_kv_heads > 0, "num_kv_heads", || "must be at least 1".into())?;
        ensure(self.num_q_heads > 0 && self.num_q_heads.is_multiple_of(self.num_kv_heads), "num_q_heads", || {
            format!("{} is not a positive multiple of num_kv_heads {}", self.num_q_heads, self.num_kv_heads)
        })?;
        // Bounds the plan's row counts (query tokens x heads) well inside its u32 arithmetic.
        ensure(self.num_q_heads <= MAX_PLAN_HEADS, "num_q_heads", || format!("{} exceeds {MAX_PLAN_HEADS}", self.num_q_heads))?;
        // Any head size a 16-bit cache takes; an FP8 cache's narrower set is checked at the call.
        head_width("head_size", self.head_size)?;
        Ok(())
    }
}

/// The decode requests `0..num_decodes` (tokens `0..num_decode_tokens`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct DecodePart {
    /// Not planned here (the decode calls plan for their kernel): no work items and no token
    /// requests, and a zero for each decode's splits and partial base.
    pub plan: DecodePlan,
    /// The most query tokens a decode has.
    pub max_query_len: usize,
    /// The longest decode context.
    pub max_seq_len: usize,
}

/// The prefill requests `num_decodes..num_reqs` (tokens `num_decode_tokens..`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PrefillPart {
    /// `[num_prefills + 1]`: the part's start locations, rebased to start at 0.
    pub query_start_loc: Vec<i32>,
    /// `[num_prefills]`.
    pub seq_lens: Vec<i32>,
    /// The most query tokens a prefill has.
    pub max_query_len: usize,
    /// The longest prefill context.
    pub max_seq_len: usize,
}

/// One step's metadata for the `tensor-core` backend.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TensorCoreMetadata {
    /// The decode and prefill parts' sizes.
    pub split: BatchSplit,
    /// Tokens of the step.
    pub num_actual_tokens: usize,
    /// The decodes.
    pub decode: DecodePart,
    /// The prefills.
    pub prefill: PrefillPart,
}

impl TensorCoreMetadata {
    /// Requests of the step.
    pub fn num_reqs(&self) -> usize {
        self.split.num_reqs()
    }

    /// The longest context of the step.
    pub fn max_seq_len(&self) -> usize {
        self.decode.max_seq_len.max(self.prefill.max_seq_len)
    }
}

/// Validates the step ([`validate`](super::validate)) and splits it (it must be ordered decodes
/// first: [`split_decodes`]).
pub fn build_tensor_core_metadata(
    input: &StepInput<'_>,
    decode_threshold: usize,
    num_q_heads: usize,
    num_kv_heads: usize,
    head_size: usize,
) -> Result<TensorCoreMetadata> {
    let config = PlanConfig { decode_threshold, num_q_heads, num_kv_heads, head_size };
    let mut meta = TensorCoreMetadata::default();
    build_into(&mut meta, input, &config, false, None)?;
    Ok(meta)
}

/// Fills `meta` for `input`, reusing its vectors.
pub(crate) fn build_into(
    meta: &mut TensorCoreMetadata,
    input: &StepInput<'_>,
    config: &PlanConfig,
    empty_contexts: bool,
    given: Option<BatchSplit>,
) -> Result<()> {
    config.validate()?;
    validate_with(input, empty_contexts)?;
    let split = match given {
        Some(s) => given_split(input, config.decode_threshold, s)?,
        None => split_decodes(input, config.decode_threshold)?,
    };
    let nd = split.num_decodes;
    ensure(nd < 1 << 16, "seq_lens", || format!("{nd} decode requests exceed the 65535 a launch takes"))?;
    fill_into(meta, input, split);
    Ok(())
}

/// The part of [`build_into`] after the checks and the split: fills `meta` for a valid step.
pub(crate) fn fill_into(meta: &mut TensorCoreMetadata, input: &StepInput<'_>, split: BatchSplit) {
    let nd = split.num_decodes;
    let (qsl, seq_lens) = (input.query_start_loc, input.seq_lens);
    meta.split = split;
    meta.num_actual_tokens = input.num_actual_tokens;

    (meta.decode.max_query_len, meta.decode.max_seq_len) = part_maxima(&qsl[..=nd], &seq_lens[..nd]);
    no_plan(&mut meta.decode.plan, nd);

    let p = &mut meta.prefill;
    let base = qsl[nd];
    p.query_start_loc.clear();
    p.query_start_loc.extend(qsl[nd..].iter().map(|&s| s - base));
    p.seq_lens.clear();
    p.seq_lens.extend_from_slice(&seq_lens[nd..]);
    (p.max_query_len, p.max_seq_len) = part_maxima(&qsl[nd..], &seq_lens[nd..]);
}

/// `(max query length, max sequence length)` of a part (0 for an empty one).
fn part_maxima(qsl: &[i32], seq_lens: &[i32]) -> (usize, usize) {
    let max_q = qsl.windows(2).map(|w| w[1] - w[0]).max().unwrap_or(0);
    let max_len = seq_lens.iter().copied().max().unwrap_or(0);
    (max_q.max(0) as usize, max_len.max(0) as usize)
}

/// The decode part's plan (see [`DecodePart::plan`]) for `num_decodes` requests, in `plan`'s
/// vectors.
fn no_plan(plan: &mut DecodePlan, num_decodes: usize) {
    clear_plan(plan);
    plan.req_num_splits.resize(num_decodes, 0);
    plan.req_partial_base.resize(num_decodes, 0);
}

/// An empty plan that keeps its vectors' memory.
fn clear_plan(plan: &mut DecodePlan) {
    plan.chunk = 0;
    plan.rows_per_cta = 0;
    plan.row_groups = 0;
    plan.items.clear();
    plan.req_num_splits.clear();
    plan.req_partial_base.clear();
    plan.token_request.clear();
    plan.partial_rows = 0;
}
