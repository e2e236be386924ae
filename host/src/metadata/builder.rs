//! [`MetadataBuilder`]: builds every step's metadata and packed words into buffers it keeps,
//! so a step allocates nothing once the buffers have grown to the largest step.

use super::input::{blocks_for, StepInput};
use super::split::{given_split, is_decode, BatchSplit};
use super::staging::{pack_into, pack_words, StagingLayout};
use super::tensor_core::{build_into, fill_into, PlanConfig, TensorCoreMetadata};
use crate::error::Result;

/// One step's result, borrowed from the builder until its next build.
#[derive(Clone, Copy, Debug)]
pub struct BuiltStep<'b> {
    /// The step's split and parts.
    pub metadata: &'b TensorCoreMetadata,
    /// Where each array lies in `words`.
    pub layout: &'b StagingLayout,
    /// The packed words one copy sends to the GPU.
    pub words: &'b [u32],
}

/// Builds metadata step after step (validate, split, pack) into vectors it reuses, with
/// exactly the results (metadata, words and errors) of
/// [`build_tensor_core_metadata`](super::build_tensor_core_metadata) followed by
/// [`pack`](super::pack).
///
/// How it is faster: the block-id and slot range checks run while the arrays are copied (one
/// pass over them instead of two), and only the blocks a request uses are read. Whenever this
/// path finds anything wrong it hands the step to the plain path (`validate`, `split_decodes`,
/// `pack`), which names the error.
#[derive(Clone, Debug)]
pub struct MetadataBuilder {
    config: PlanConfig,
    /// Takes requests of length 0 with query tokens (a context-parallel rank's view).
    empty_contexts: bool,
    metadata: TensorCoreMetadata,
    layout: StagingLayout,
    words: Vec<u32>,
}

impl MetadataBuilder {
    /// Refuses a config the decode kernels do not take (naming the argument).
    pub fn new(config: PlanConfig) -> Result<Self> {
        config.validate()?;
        Ok(MetadataBuilder {
            config,
            empty_contexts: false,
            metadata: TensorCoreMetadata::default(),
            layout: StagingLayout::default(),
            words: Vec::new(),
        })
    }

    /// Takes requests of length 0 with query tokens from now on: a context-parallel rank's view
    /// of a step has them (`validate`'s `empty_contexts`).
    pub(crate) fn take_empty_contexts(&mut self) {
        self.empty_contexts = true;
    }

    /// The numbers the builder checks steps against.
    pub fn config(&self) -> &PlanConfig {
        &self.config
    }

    /// Builds `input`'s metadata and words. After an error the builder holds no step (empty
    /// metadata and words) until the next build succeeds.
    pub fn build(&mut self, input: &StepInput<'_>) -> Result<BuiltStep<'_>> {
        self.build_with(input, None)
    }

    /// As [`build`](Self::build), with the decode and prefill parts given instead of found from
    /// the query lengths (checked: the decodes are within the threshold, the counts the
    /// batch's): a local batch's, whose prefill pieces may be as short as decodes.
    pub fn build_split(&mut self, input: &StepInput<'_>, split: BatchSplit) -> Result<BuiltStep<'_>> {
        self.build_with(input, Some(split))
    }

    fn build_with(&mut self, input: &StepInput<'_>, given: Option<BatchSplit>) -> Result<BuiltStep<'_>> {
        if !self.build_fast(input, given) {
            if let Err(e) = self.build_plain(input, given) {
                self.metadata = TensorCoreMetadata::default();
                self.layout = StagingLayout::default();
                self.words.clear();
                return Err(e);
            }
        }
        Ok(BuiltStep { metadata: &self.metadata, layout: &self.layout, words: &self.words })
    }

    /// The plain path: the free functions' steps, into the reused buffers.
    fn build_plain(&mut self, input: &StepInput<'_>, given: Option<BatchSplit>) -> Result<()> {
        build_into(&mut self.metadata, input, &self.config, self.empty_contexts, given)?;
        self.layout = pack_into(&self.metadata, input, &mut self.words);
        Ok(())
    }

    /// The fast path; `false` if it found anything wrong (then nothing it wrote counts).
    fn build_fast(&mut self, input: &StepInput<'_>, given: Option<BatchSplit>) -> bool {
        let Some(split) = quick_checks(input, self.config.decode_threshold, self.empty_contexts, given) else { return false };
        fill_into(&mut self.metadata, input, split);
        match pack_words::<true>(&self.metadata, input, &mut self.words) {
            Some(layout) => {
                self.layout = layout;
                true
            }
            None => false,
        }
    }
}

/// Everything `validate` and `split_decodes` check except the block-id and slot ranges (those
/// are checked while packing), without messages: the split (`given`'s, checked) if all is well.
fn quick_checks(input: &StepInput<'_>, decode_threshold: usize, empty_contexts: bool, given: Option<BatchSplit>) -> Option<BatchSplit> {
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
        bad |= len < 0 || (q != 0 && len < q && !(empty_contexts && len == 0));
        max_len = max_len.max(len);
    }
    if bad || blocks_for(max_len, input.block_size) > stride {
        return None;
    }
    if let Some(split) = given {
        return given_split(input, decode_threshold, split).ok().filter(|s| s.num_decodes < 1 << 16);
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
