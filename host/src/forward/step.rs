//! [`StepMetadata`]: one step's metadata, built once and shared by every layer's
//! [`forward`](super::Attention::forward): checked, split into decodes and prefills, planned and
//! (on the GPU) uploaded in one copy by the existing builder ([`crate::metadata`]).

use super::config::ForwardConfig;
use super::graph_plan::{GraphBucket, GraphPlanner};
use super::held::Held;
use super::step_plan::{StepPlanner, StepPlans};
use crate::buffer::KeepAlive;
use crate::context_parallel::{CpShard, ShardedStep};
use crate::decode::DevicePlan;
use crate::error::{ensure, Result};
use crate::kernels::KernelId;
use crate::metadata::{
    given_split, split_decodes, upload, use_cascade, validate, BatchSplit, CascadeMode, CascadeStep, CommonPrefix, LocalBatch,
    MetadataBuilder, StagingLayout, StepInput,
};
use crate::prefill::DevicePrefillPlan;
use crate::stream_check::refuse_foreign_capture;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
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
    /// Requests of the step as given (a graph step's padding adds more).
    step_reqs: usize,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    prefill_query_start_loc: Vec<i32>,
    /// Host copies for the CPU backend: each request's used blocks, rows of `block_table_stride`.
    block_table: Vec<i32>,
    block_table_stride: usize,
    slot_mapping: Vec<i64>,
    /// The step's shared prefix when it runs as cascade attention (`tensor-core` steps), and
    /// each request's length past it.
    cascade: Option<CommonPrefix>,
    cascade_suffix_lens: Vec<i32>,
    /// Shared with the graphs captured with this step, which read it at every replay.
    device: Option<Held<DeviceStep>>,
    /// The tensor-core step's split plans (and cascade arrays), on the GPU.
    step_planner: Option<StepPlanner>,
    /// For each chunk size of the model's chunked local layers that run as local batches
    /// ([`ForwardConfig::local_batch_chunks`]), the step cut at chunk starts and its own
    /// metadata, built with this step (eager tensor-core steps).
    local: Vec<LocalStep>,
}

/// A step's local batch ([`LocalBatch`]) and its metadata: what a chunked local layer runs.
pub(crate) struct LocalStep {
    batch: LocalBatch,
    step: StepMetadata,
}

impl LocalStep {
    pub(crate) fn new(batch: LocalBatch, step: StepMetadata) -> Self {
        LocalStep { batch, step }
    }
}

/// How the step is planned: the tensor-core builder (split-K plan, packed words), the plain
/// checks and split for the backends without a GPU plan (CPU, MLA), or a CUDA-graph step's
/// fixed layout and padding ([`super::graph`]).
enum Planner {
    TensorCore(Box<MetadataBuilder>),
    Plain,
    Graph(Box<GraphPlanner>),
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
    pub(crate) fn new(
        owner: u64,
        config: ForwardConfig,
        builder: Option<MetadataBuilder>,
        device: Option<DeviceStep>,
        step_planner: Option<StepPlanner>,
    ) -> Self {
        let planner = builder.map_or(Planner::Plain, |b| Planner::TensorCore(Box::new(b)));
        Self { step_planner, ..Self::with_planner(owner, config, planner, device) }
    }

    /// A CUDA-graph step: `device` must hold `planner.total_words()`.
    pub(crate) fn new_graph(owner: u64, config: ForwardConfig, planner: GraphPlanner, device: DeviceStep) -> Self {
        Self::with_planner(owner, config, Planner::Graph(Box::new(planner)), Some(device))
    }

    fn with_planner(owner: u64, config: ForwardConfig, planner: Planner, device: Option<DeviceStep>) -> Self {
        StepMetadata {
            owner,
            config,
            planner,
            built: false,
            split: BatchSplit::default(),
            num_actual_tokens: 0,
            step_reqs: 0,
            query_start_loc: Vec::new(),
            seq_lens: Vec::new(),
            prefill_query_start_loc: Vec::new(),
            block_table: Vec::new(),
            block_table_stride: 0,
            slot_mapping: Vec::new(),
            cascade: None,
            cascade_suffix_lens: Vec::new(),
            device: device.map(Held::new),
            step_planner: None,
            local: Vec::new(),
        }
    }

    /// The same step, also cutting each step into the local batches of `local` (their
    /// metadata made like this step's, by the same `Attention`).
    pub(crate) fn with_local_steps(self, local: Vec<LocalStep>) -> Self {
        StepMetadata { local, ..self }
    }

    /// Builds this step's metadata from the engine's arrays (ordered decodes first): checks them
    /// ([`crate::metadata::validate`]: start locations, lengths, block ids, slots) and the
    /// limits, splits decodes from prefills, plans, and on the GPU enqueues the one upload.
    /// After an error the metadata holds no step (`forward` refuses it) until a build succeeds.
    pub fn build(&mut self, input: &StepInput<'_>) -> Result<BatchSplit> {
        self.build_with(input, None)
    }

    /// [`build`](Self::build), with the split given (a local batch's) or found.
    fn build_with(&mut self, input: &StepInput<'_>, given: Option<BatchSplit>) -> Result<BatchSplit> {
        self.built = false;
        if let Some(dev) = &self.device {
            // The upload would be recorded into a graph that does not hold this step.
            refuse_foreign_capture(&dev.stream, "stream", "a step's build")?;
        }
        self.check_limits(input)?;
        if let Planner::Graph(g) = &mut self.planner {
            self.split = g.build(input, given)?;
            let dev = &mut **self.device.as_mut().expect("a graph step has a device part");
            upload(&dev.stream, &mut dev.staging, &mut dev.words, g.words())?;
            dev.layout = *g.layout();
            let (qsl, seq_lens) = g.padded();
            self.num_actual_tokens = g.bucket().num_tokens();
            self.step_reqs = g.step_reqs();
            self.query_start_loc.clear();
            self.query_start_loc.extend_from_slice(qsl);
            self.seq_lens.clear();
            self.seq_lens.extend_from_slice(seq_lens);
            self.prefill_query_start_loc.clear();
            let base = qsl[self.split.num_decodes];
            self.prefill_query_start_loc.extend(qsl[self.split.num_decodes..].iter().map(|&s| s - base));
            if !self.local.is_empty() {
                // The step's own split (the padded one counts a mixed step's padding).
                let split = split_decodes(input, self.config.decode_threshold)?;
                self.build_local(input, split)?;
            }
            self.built = true;
            return Ok(self.split);
        }
        // A context-parallel rank builds its view of the step: its slots, its local lengths.
        let rank_step = match self.config.context_parallel {
            Some(shard) => Some(RankStep::new(&shard, input, self.config.decode_threshold)?),
            None => None,
        };
        let local = rank_step.as_ref().map(|r| r.input(input));
        let input = local.as_ref().unwrap_or(input);
        match &mut self.planner {
            Planner::TensorCore(builder) => {
                let step = match given {
                    Some(split) => builder.build_split(input, split)?,
                    None => builder.build(input)?,
                };
                let dev = &mut **self.device.as_mut().expect("a tensor-core step has a device part");
                upload(&dev.stream, &mut dev.staging, &mut dev.words, step.words)?;
                dev.layout = *step.layout;
                self.cascade = None;
                let c = &self.config;
                let standard = matches!(c.model.kind, crate::backend::AttentionKind::Standard);
                // Whether Auto picks cascade depends on the rest of the batch, so the
                // deterministic mode (`SplitMode::Fixed(1)`) keeps it off unless forced on.
                let deterministic = c.split_mode == crate::options::SplitMode::Fixed(1) && c.cascade == CascadeMode::Auto;
                let sharded = c.context_parallel.is_some();
                if standard && c.cascade != CascadeMode::Off && c.every_layer_takes_cascade() && !deterministic && !sharded {
                    let m = &self.config.model;
                    let shared = CascadeStep::new(input, m.num_q_heads / m.num_kv_heads);
                    if use_cascade(self.config.cascade, &shared) {
                        self.cascade = Some(shared.prefix);
                        self.cascade_suffix_lens.clear();
                        self.cascade_suffix_lens.extend(input.seq_lens.iter().map(|&l| l - shared.prefix.tokens as i32));
                    }
                }
                if let Some(p) = &mut self.step_planner {
                    p.build(input, step.metadata.split, self.cascade)?;
                }
                self.split = step.metadata.split;
                self.prefill_query_start_loc.clear();
                self.prefill_query_start_loc.extend_from_slice(&step.metadata.prefill.query_start_loc);
            }
            Planner::Graph(_) => unreachable!("built above"),
            Planner::Plain => {
                validate(input)?;
                let split = match given {
                    Some(split) => given_split(input, self.config.decode_threshold, split)?,
                    None => split_decodes(input, self.config.decode_threshold)?,
                };
                self.split = split;
                let base = input.query_start_loc[split.num_decodes];
                self.prefill_query_start_loc.clear();
                self.prefill_query_start_loc.extend(input.query_start_loc[split.num_decodes..].iter().map(|&s| s - base));
                self.copy_host_arrays(input);
            }
        }
        self.num_actual_tokens = input.num_actual_tokens;
        self.step_reqs = input.num_reqs();
        self.query_start_loc.clear();
        self.query_start_loc.extend_from_slice(input.query_start_loc);
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(input.seq_lens);
        self.build_local(input, self.split)?;
        self.built = true;
        Ok(self.split)
    }

    /// Cuts `input` (split as `split`) into each local batch and builds its step.
    fn build_local(&mut self, input: &StepInput<'_>, split: BatchSplit) -> Result<()> {
        for l in &mut self.local {
            l.batch.build(input, split);
            l.step.build_with(&l.batch.input(input), Some(l.batch.split()))?;
        }
        Ok(())
    }

    fn check_limits(&self, input: &StepInput<'_>) -> Result<()> {
        if let Some(shard) = self.config.context_parallel {
            ensure(!matches!(self.planner, Planner::Graph(_)), "context_parallel", || format!("{shard:?}: graph steps are not sharded"))?;
        }
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
}

/// A context-parallel rank's view of a step: its slots, and its requests as the decode kernels
/// take them. A step of one-token decodes keeps its requests, with their local lengths; a step
/// with speculative tokens is decoded as a request a token, each over the keys of its request
/// that it may see (`ShardedStep::token_seq_lens`), its request's row repeated.
struct RankStep {
    sharded: ShardedStep,
    /// A request a token: `0..=num_tokens`, and the expanded table (none for one-token steps).
    per_token: Option<(Vec<i32>, Vec<i32>)>,
}

impl RankStep {
    fn new(shard: &CpShard, input: &StepInput<'_>, decode_threshold: usize) -> Result<Self> {
        let qsl = input.query_start_loc;
        if let Some(r) = qsl.windows(2).position(|w| !(1..=decode_threshold as i32).contains(&(w[1] - w[0]))) {
            return Err(crate::error::AttnError::invalid(
                "query_start_loc",
                format!(
                    "request {r} has {} query tokens: context-parallel steps are decodes of 1..={decode_threshold} (the decode threshold)",
                    qsl[r + 1] - qsl[r]
                ),
            ));
        }
        let sharded =
            shard.shard_step(qsl, input.seq_lens, input.block_table, input.block_table_stride, input.block_size, input.num_blocks)?;
        let per_token = qsl.windows(2).any(|w| w[1] - w[0] > 1).then(|| {
            let tokens: Vec<i32> = (0..=sharded.token_seq_lens.len() as i32).collect();
            (tokens, sharded.expand_block_table(qsl, input.block_table, input.block_table_stride))
        });
        Ok(RankStep { sharded, per_token })
    }

    /// The step the rank's builder takes.
    fn input<'a>(&'a self, global: &StepInput<'a>) -> StepInput<'a> {
        let s = &self.sharded;
        match &self.per_token {
            None => StepInput { slot_mapping: &s.slot_mapping, seq_lens: &s.local_seq_lens, ..*global },
            Some((qsl, table)) => StepInput {
                query_start_loc: qsl,
                seq_lens: &s.token_seq_lens,
                block_table: table,
                slot_mapping: &s.slot_mapping,
                ..*global
            },
        }
    }
}

impl StepMetadata {
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

    /// Tokens of the step as built (rows past it are padding).
    pub fn num_actual_tokens(&self) -> usize {
        self.num_actual_tokens
    }

    /// Requests of the step as built (a graph step's include its padding requests).
    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Requests of the step as given to [`build`](Self::build): the first ones of
    /// [`num_reqs`](Self::num_reqs), the rest a graph step's padding.
    pub(crate) fn step_reqs(&self) -> usize {
        self.step_reqs
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

    /// Bytes uploaded to the GPU for this step (0 on the CPU), its local batches' included.
    pub fn upload_bytes(&self) -> usize {
        let own = self.device.as_ref().map_or(0, |d| d.layout.total_bytes());
        own + self.local.iter().map(|l| l.step.upload_bytes()).sum::<usize>()
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

    /// The shared prefix when the step runs as cascade attention (see
    /// [`ForwardConfig::cascade`](super::ForwardConfig::cascade)).
    pub fn cascade_prefix(&self) -> Option<CommonPrefix> {
        self.cascade
    }

    /// Each request's length past the shared prefix (a cascade step's).
    pub(crate) fn cascade_suffix_lens(&self) -> &[i32] {
        &self.cascade_suffix_lens
    }

    pub(crate) fn device_step(&self) -> Option<&DeviceStep> {
        self.device.as_deref()
    }

    /// A handle keeping the step's device buffer alive (a graph captured with it reads it).
    pub(crate) fn device_keep_alive(&self) -> Option<KeepAlive> {
        self.device.as_ref().map(Held::keep_alive)
    }

    /// Whether `handle` is this step's [`device_keep_alive`](Self::device_keep_alive): the step
    /// a graph was captured with.
    pub(crate) fn is_device(&self, handle: &KeepAlive) -> bool {
        self.device.as_ref().is_some_and(|d| d.is(handle))
    }

    /// The split plans (and cascade arrays) made for this step, if its backend plans per step.
    pub(crate) fn step_plans(&self) -> Option<&StepPlans> {
        self.step_planner.as_ref().map(StepPlanner::plans)
    }

    /// The bucket of a CUDA-graph step (made by
    /// [`Attention::new_graph_step`](super::Attention::new_graph_step)); `None` for others.
    pub fn graph_bucket(&self) -> Option<GraphBucket> {
        match &self.planner {
            Planner::Graph(g) => Some(g.bucket()),
            _ => None,
        }
    }

    /// The local batch's metadata a chunked local layer of this step runs on (see
    /// [`LocalStep`]), if the step has one for the layer's chunk.
    pub(crate) fn local_step(&self, ls: &super::layers::LayerSpec) -> Option<&StepMetadata> {
        let chunk = ls.opts.chunk_size.filter(|_| ls.attn_type == super::layers::AttentionType::Decoder)? as usize;
        self.local.iter().find(|l| l.batch.chunk() == chunk).map(|l| &l.step).filter(|s| s.built)
    }

    /// A graph step's split plan in its device buffer.
    pub(crate) fn device_plan(&self) -> Option<DevicePlan> {
        let (Planner::Graph(g), Some(dev)) = (&self.planner, &self.device) else { return None };
        let (base, _sync) = dev.words.device_ptr(&dev.stream);
        Some(g.device_plan(base))
    }

    /// A mixed graph step's prefill tiles in its device buffer (`None` for other steps).
    pub(crate) fn device_prefill_plan(&self) -> Option<DevicePrefillPlan> {
        let (Planner::Graph(g), Some(dev)) = (&self.planner, &self.device) else { return None };
        let (base, _sync) = dev.words.device_ptr(&dev.stream);
        g.device_prefill_plan(base)
    }

    /// A graph step's tiles of the whole step for `kernel` in its device buffer (`None` for
    /// other steps, or a kernel the graph step was not made for).
    pub(crate) fn device_whole_step_plan(&self, kernel: KernelId) -> Option<DevicePrefillPlan> {
        let (Planner::Graph(g), Some(dev)) = (&self.planner, &self.device) else { return None };
        let (base, _sync) = dev.words.device_ptr(&dev.stream);
        g.device_whole_step_plan(base, kernel)
    }
}
