//! [`StepMetadata`]: one step's metadata, built once and shared by every layer's
//! [`forward`](super::Attention::forward): checked, split into decodes and prefills, planned and
//! (on the GPU) uploaded in one copy by the existing builder ([`crate::metadata`]).

use super::config::ForwardConfig;
use crate::error::{ensure, Result};
use crate::metadata::{split_decodes, upload, validate, BatchSplit, MetadataBuilder, StagingLayout, StepInput};
use cudarc::driver::{CudaSlice, CudaStream, PinnedHostSlice};
use std::sync::Arc;

/// Per-step metadata for one [`Attention`](super::Attention) (made by
/// [`Attention::new_step_metadata`](super::Attention::new_step_metadata)); rebuild it every
/// step with [`build`](Self::build), then pass it to every layer's `forward`.
pub struct StepMetadata {
    pub(crate) owner: u64,
    config: ForwardConfig,
    planner: Planner,
    built: bool,
    split: BatchSplit,
    num_actual_tokens: usize,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    prefill_query_start_loc: Vec<i32>,
    /// Host copies for the CPU backend: each request's used blocks, rows of `block_table_stride`.
    block_table: Vec<i32>,
    block_table_stride: usize,
    slot_mapping: Vec<i64>,
    device: Option<DeviceStep>,
}

/// How the step is planned: the tensor-core builder (split-K plan, packed words), or the plain
/// checks and split for the backends without a GPU plan (CPU, MLA).
enum Planner {
    TensorCore(Box<MetadataBuilder>),
    Plain,
}

/// The step on the GPU: the packed words, uploaded through a pinned buffer.
pub(crate) struct DeviceStep {
    pub(crate) stream: Arc<CudaStream>,
    staging: PinnedHostSlice<u32>,
    pub(crate) words: CudaSlice<u32>,
    pub(crate) layout: StagingLayout,
}

impl DeviceStep {
    pub(crate) fn new(stream: Arc<CudaStream>, capacity_words: usize) -> Result<Self> {
        let capacity = capacity_words.max(4);
        // SAFETY: the staging buffer is written before each copy out of it (`upload`).
        let staging = unsafe { stream.context().alloc_pinned::<u32>(capacity)? };
        let words = stream.alloc_zeros::<u32>(capacity)?;
        Ok(DeviceStep { stream, staging, words, layout: StagingLayout::default() })
    }
}

impl StepMetadata {
    pub(crate) fn new(owner: u64, config: ForwardConfig, builder: Option<MetadataBuilder>, device: Option<DeviceStep>) -> Self {
        StepMetadata {
            owner,
            config,
            planner: builder.map_or(Planner::Plain, |b| Planner::TensorCore(Box::new(b))),
            built: false,
            split: BatchSplit::default(),
            num_actual_tokens: 0,
            query_start_loc: Vec::new(),
            seq_lens: Vec::new(),
            prefill_query_start_loc: Vec::new(),
            block_table: Vec::new(),
            block_table_stride: 0,
            slot_mapping: Vec::new(),
            device,
        }
    }

    /// Builds this step's metadata from the engine's arrays (ordered decodes first): checks them
    /// ([`crate::metadata::validate`]: start locations, lengths, block ids, slots) and the
    /// limits, splits decodes from prefills, plans, and on the GPU enqueues the one upload.
    /// After an error the metadata holds no step (`forward` refuses it) until a build succeeds.
    pub fn build(&mut self, input: &StepInput<'_>) -> Result<BatchSplit> {
        self.built = false;
        self.check_limits(input)?;
        match &mut self.planner {
            Planner::TensorCore(builder) => {
                let step = builder.build(input)?;
                let dev = self.device.as_mut().expect("a tensor-core step has a device part");
                upload(&dev.stream, &mut dev.staging, &mut dev.words, step.words)?;
                dev.layout = *step.layout;
                self.split = step.metadata.split;
                self.prefill_query_start_loc.clear();
                self.prefill_query_start_loc.extend_from_slice(&step.metadata.prefill.query_start_loc);
            }
            Planner::Plain => {
                validate(input)?;
                let split = split_decodes(input, self.config.decode_threshold)?;
                self.split = split;
                let base = input.query_start_loc[split.num_decodes];
                self.prefill_query_start_loc.clear();
                self.prefill_query_start_loc.extend(input.query_start_loc[split.num_decodes..].iter().map(|&s| s - base));
                self.copy_host_arrays(input);
            }
        }
        self.num_actual_tokens = input.num_actual_tokens;
        self.query_start_loc.clear();
        self.query_start_loc.extend_from_slice(input.query_start_loc);
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(input.seq_lens);
        self.built = true;
        Ok(self.split)
    }

    fn check_limits(&self, input: &StepInput<'_>) -> Result<()> {
        let l = &self.config.limits;
        let (nt, n) = (input.num_actual_tokens, input.num_reqs());
        ensure(nt <= l.max_num_tokens, "num_actual_tokens", || format!("{nt} exceeds the limit of {} tokens a step", l.max_num_tokens))?;
        ensure(n <= l.max_num_reqs, "seq_lens", || format!("{n} requests exceed the limit of {} a step", l.max_num_reqs))?;
        if let Some(r) = input.seq_lens.iter().position(|&len| len.max(0) as usize > l.max_model_len) {
            return Err(crate::error::AttnError::invalid(
                "seq_lens",
                format!("request {r} has length {}, past max_model_len {}", input.seq_lens[r], l.max_model_len),
            ));
        }
        let cache = (self.config.num_blocks, self.config.model.block_size);
        ensure((input.num_blocks, input.block_size) == cache, "num_blocks", || {
            format!("the step is for {} blocks of {}, the caches have {} of {}", input.num_blocks, input.block_size, cache.0, cache.1)
        })
    }

    /// Copies each request's used blocks and the slots (the CPU backend reads them).
    fn copy_host_arrays(&mut self, input: &StepInput<'_>) {
        let bs = input.block_size;
        let width = input.seq_lens.iter().map(|&l| (l.max(0) as usize).div_ceil(bs)).max().unwrap_or(0);
        self.block_table_stride = width;
        self.block_table.clear();
        for (r, &len) in input.seq_lens.iter().enumerate() {
            let used = (len.max(0) as usize).div_ceil(bs);
            let row = &input.block_table[r * input.block_table_stride..][..used];
            self.block_table.extend_from_slice(row);
            self.block_table.resize((r + 1) * width, 0);
        }
        self.slot_mapping.clear();
        self.slot_mapping.extend_from_slice(&input.slot_mapping[..input.num_actual_tokens]);
    }

    /// Whether the last [`build`](Self::build) succeeded.
    pub fn is_built(&self) -> bool {
        self.built
    }

    /// The decode and prefill parts of the step.
    pub fn split(&self) -> BatchSplit {
        self.split
    }

    pub fn num_actual_tokens(&self) -> usize {
        self.num_actual_tokens
    }

    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// `[num_reqs + 1]`, as built.
    pub fn query_start_loc(&self) -> &[i32] {
        &self.query_start_loc
    }

    /// `[num_reqs]`, as built.
    pub fn seq_lens(&self) -> &[i32] {
        &self.seq_lens
    }

    /// `[num_prefills + 1]`: the prefill part's start locations, from 0.
    pub fn prefill_query_start_loc(&self) -> &[i32] {
        &self.prefill_query_start_loc
    }

    /// Bytes uploaded to the GPU for this step (0 on the CPU).
    pub fn upload_bytes(&self) -> usize {
        self.device.as_ref().map_or(0, |d| d.layout.total_bytes())
    }

    /// Width of the block-table rows the kernels read: the uploaded table's on the GPU, the host
    /// copy's on the CPU (both as wide as the longest request's blocks).
    pub(crate) fn kernel_block_table_stride(&self) -> usize {
        self.device.as_ref().map_or(self.block_table_stride, |d| d.layout.block_table_stride)
    }

    pub(crate) fn host_block_table(&self) -> (&[i32], usize) {
        (&self.block_table, self.block_table_stride)
    }

    pub(crate) fn host_slot_mapping(&self) -> &[i64] {
        &self.slot_mapping
    }

    pub(crate) fn device_step(&self) -> Option<&DeviceStep> {
        self.device.as_ref()
    }
}
