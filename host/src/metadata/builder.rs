//! [`MetadataBuilder`]: builds every step's metadata and packed words into buffers it keeps,
//! so a step allocates nothing once the buffers have grown to the largest step.

use super::input::{blocks_for, StepInput};
use super::plan::plan_decode_into;
use super::split::{is_decode, BatchSplit};
use super::staging::{pack_into, pack_words, StagingLayout};
use super::tensor_core::{build_into, clear_plan, fill_into, PlanConfig, TensorCoreMetadata};
use crate::decode::{plan_decode, DecodePlan};
use crate::error::Result;

/// One step's result, borrowed from the builder until its next build.
#[derive(Clone, Copy, Debug)]
pub struct BuiltStep<'b> {
    pub metadata: &'b TensorCoreMetadata,
    pub layout: &'b StagingLayout,
    /// What [`upload`](super::upload) sends.
    pub words: &'b [u32],
}

/// Builds metadata step after step (validate, split, plan, pack) into vectors it reuses, with
/// exactly the results (metadata, words and errors) of
/// [`build_tensor_core_metadata`](super::build_tensor_core_metadata) followed by
/// [`pack`](super::pack).
///
/// How it is faster: the block-id and slot range checks run while the arrays are copied (one
/// pass over them instead of two), only the blocks a request uses are read, and the decode plan
/// is written into reused vectors with `plan_decode`'s divisions skipped where they cannot
/// change it. Whenever this path finds anything wrong it hands the step to the plain path
/// (`validate`, `split_decodes`, `plan_decode`, `pack`), which names the error.
#[derive(Clone, Debug)]
pub struct MetadataBuilder {
    config: PlanConfig,
    metadata: TensorCoreMetadata,
    layout: StagingLayout,
    words: Vec<u32>,
    lens: Vec<u32>,
    /// Whether the CUDA-core decode plan is made (`without_decode_plan` turns it off).
    decode_plan: bool,
}

impl MetadataBuilder {
    /// Refuses a config the decode kernels do not take (naming the argument).
    pub fn new(config: PlanConfig) -> Result<Self> {
        config.validate()?;
        Ok(MetadataBuilder {
            config,
            metadata: TensorCoreMetadata::default(),
            layout: StagingLayout::default(),
            words: Vec::new(),
            lens: Vec::new(),
            decode_plan: true,
        })
    }

    /// A builder that leaves the decode plan empty (no work items; zeros for each decode's
    /// splits and partial base): for callers that plan decode themselves (`host::forward` plans
    /// for the tensor cores per step).
    pub fn without_decode_plan(mut self) -> Self {
        self.decode_plan = false;
        self
    }

    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    /// Builds `input`'s metadata and words. After an error the builder holds no step (empty
    /// metadata and words) until the next build succeeds.
    pub fn build(&mut self, input: &StepInput<'_>) -> Result<BuiltStep<'_>> {
        if !self.build_fast(input) {
            if let Err(e) = self.build_plain(input) {
                self.metadata = TensorCoreMetadata::default();
                self.layout = StagingLayout::default();
                self.words.clear();
                return Err(e);
            }
        }
        Ok(BuiltStep { metadata: &self.metadata, layout: &self.layout, words: &self.words })
    }

    /// The plain path: the free functions' steps, into the reused buffers.
    fn build_plain(&mut self, input: &StepInput<'_>) -> Result<()> {
        let decode_plan = self.decode_plan;
        build_into(&mut self.metadata, input, &self.config, |batch, c, out| {
            if decode_plan {
                *out = plan_decode(batch, c.num_q_heads, c.num_kv_heads, c.head_size, c.ctas_target(), c.mode, c.partial_capacity)?;
            } else {
                no_plan(out, batch.seq_lens.len());
            }
            Ok(())
        })?;
        self.layout = pack_into(&self.metadata, input, &mut self.words);
        Ok(())
    }

    /// The fast path; `false` if it found anything wrong (then nothing it wrote counts).
    fn build_fast(&mut self, input: &StepInput<'_>) -> bool {
        let Some(split) = quick_checks(input, self.config.decode_threshold) else { return false };
        let (lens, decode_plan) = (&mut self.lens, self.decode_plan);
        let filled = fill_into(&mut self.metadata, input, split, &self.config, |batch, c, out| {
            if decode_plan {
                plan_decode_into(batch, c, out, lens);
            } else {
                no_plan(out, batch.seq_lens.len());
            }
            Ok(())
        });
        if filled.is_err() {
            return false;
        }
        match pack_words::<true>(&self.metadata, input, &mut self.words) {
            Some(layout) => {
                self.layout = layout;
                true
            }
            None => false,
        }
    }
}

/// The plan of a builder made `without_decode_plan`: no work items, and zeros (not planned) for
/// each of the `num_decodes` requests' splits and partial bases.
fn no_plan(plan: &mut DecodePlan, num_decodes: usize) {
    clear_plan(plan);
    plan.req_num_splits.resize(num_decodes, 0);
    plan.req_partial_base.resize(num_decodes, 0);
}

/// Everything `validate` and `split_decodes` check except the block-id and slot ranges (those
/// are checked while packing), without messages: the split if all is well.
fn quick_checks(input: &StepInput<'_>, decode_threshold: usize) -> Option<BatchSplit> {
    let (qsl, seq_lens, n) = (input.query_start_loc, input.seq_lens, input.num_reqs());
    let stride = input.block_table_stride;
    let shapes_ok = input.block_size > 0
        && qsl.len() == n + 1
        && qsl[0] == 0
        && qsl[n] as i64 == input.num_actual_tokens as i64
        && n.checked_mul(stride).is_some_and(|rows| input.block_table.len() >= rows)
        && input.slot_mapping.len() >= input.num_actual_tokens;
    if !shapes_ok || qsl.windows(2).fold(false, |bad, w| bad | (w[1] < w[0])) {
        return None;
    }
    let mut bad = false;
    let mut max_len = 0;
    for (w, &len) in qsl.windows(2).zip(seq_lens) {
        let q = w[1] - w[0];
        bad |= len < 0 || (q != 0 && len < q);
        max_len = max_len.max(len);
    }
    if bad || blocks_for(max_len, input.block_size) > stride {
        return None;
    }
    let is_dec = |r: usize| is_decode(input.query_len(r), decode_threshold);
    let num_decodes = (0..n).position(|r| !is_dec(r)).unwrap_or(n);
    if num_decodes >= 1 << 16 || (num_decodes..n).any(is_dec) {
        return None;
    }
    let num_decode_tokens = qsl[num_decodes] as usize;
    Some(BatchSplit {
        num_decodes,
        num_decode_tokens,
        num_prefills: n - num_decodes,
        num_prefill_tokens: input.num_actual_tokens - num_decode_tokens,
    })
}
