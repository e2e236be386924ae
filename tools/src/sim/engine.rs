//! The engine loop: every step the scheduler's batch, its metadata built once, then
//! `forward_layer` on every layer with that layer's settings and random activations (there is
//! no model: each layer takes its q/k/v rows from a pool of random rows at a pseudo-random
//! offset; a KV-sharing layer takes only q and reads its target's cache), timed, sampled against
//! the f64 reference, and logged.
//!
//! An encoder-decoder model's step has up to three metadata, all of the one `Attention`: the
//! encoder step over the requests admitted in it (whole requests, slots in the encoder pool's
//! blocks), which runs the encoder layers and fills each cross-attention layer's own cache
//! (`Attention::write_kv`); the decoder step, for the decoder self-attention layers; and the
//! cross-attention step (the decoder step's tokens over each request's encoder blocks), for the
//! cross-attention layers, which take `NewKv::None` and their own cache.

use super::allocator::{AllocError, BlockAllocator, BlockTable};
use super::check::Checker;
use super::model::SimModel;
use super::report::{progress_line, SimReport};
use super::requests::Workload;
use super::rng::SplitMix;
use super::scheduler::{Batch, Scheduler, SchedulerConfig};
use attn_rs::backend::GraphSupport;
use attn_rs::backend::Selection;
use attn_rs::forward::{
    Attention, AttentionType, ForwardConfig, ForwardLimits, GpuHandles, GraphBucket, HostElement, KvCacheWrite, KvWriteIo, Layer, LayerIo,
    NewKv, StepGraph, StepMetadata,
};
use attn_rs::metadata::StepInput;
use attn_rs::AttnError;
use attn_rs::DType;
use attn_rs::RowsDesc;
use attn_rs::SharedBuf;
use attn_rs::{DevIn, DevOut};
use cudarc::driver::{CudaSlice, CudaStream, DriverError};
use half::{bf16, f16};
use std::io::Write;
use std::sync::Arc;
use std::time::Instant;

/// What can stop a simulation.
#[derive(Debug, thiserror::Error)]
pub enum SimError {
    #[error(transparent)]
    Attn(#[from] AttnError),
    #[error(transparent)]
    Alloc(#[from] AllocError),
    #[error("CUDA driver: {0}")]
    Driver(#[from] DriverError),
    #[error("output: {0}")]
    Io(#[from] std::io::Error),
    #[error("configuration: {0}")]
    Config(String),
}

/// The simulation's sizes.
#[derive(Clone, Debug, PartialEq)]
pub struct SimConfig {
    pub workload: Workload,
    pub max_running: usize,
    /// Tokens a step computes (chunked prefill fills what decodes leave).
    pub token_budget: usize,
    /// Blocks per layer; `None`: three quarters of what `max_running` requests of the longest
    /// length would take (so admission waits for blocks at times). Of an encoder-decoder model,
    /// the decoder pool's (the self-attention caches'); its encoder pool takes three quarters
    /// of what `max_running` encoder inputs take.
    pub num_blocks: Option<usize>,
    /// Layers run; `None`: the model's (of an encoder-decoder model: encoder layers, and as
    /// many decoder blocks).
    pub num_layers: Option<usize>,
    /// The sliding window of a model's windowed layers; `None`: the model's.
    pub window: Option<u32>,
    /// The soft-cap of a model's soft-capped layers; `None`: the model's.
    pub softcap: Option<f32>,
    /// The chunk of a model's chunked local layers; `None`: the model's.
    pub chunk: Option<u32>,
    /// Tokens of each request's encoder input, for a model with an encoder; `None`: the
    /// model's.
    pub encoder_len: Option<usize>,
    /// Tokens an encoder step may take (whole requests, at least one; vLLM's encoder budget).
    pub encoder_budget: usize,
    /// Stop after this many steps even if requests remain.
    pub max_steps: usize,
    /// Check every this many steps (0: never) ...
    pub check_every: usize,
    /// ... these layers (`None`: the first and the last) ...
    pub check_layers: Option<Vec<usize>>,
    /// ... this many requests, this many query tokens each.
    pub check_reqs: usize,
    pub check_tokens: usize,
    /// A progress line every this many steps (0: none).
    pub progress_every: usize,
    pub decode_threshold: usize,
    pub seed: u64,
    /// Replay the decoder steps from CUDA graphs (GPU backends; an encoder-decoder model's
    /// encoder steps run eagerly): one graph a bucket, captured the first time a step takes it
    /// ([`Graphs`]).
    pub graphs: bool,
}

impl SimConfig {
    /// Sizes for the CPU backend (the f64 reference is slow): a few short requests, two layers,
    /// a window (64) and soft-cap (0.5) that change the outputs at these contexts and with the
    /// random activations (see [`SimModel::gemma2_2b`]), chunks of 40 positions that the
    /// contexts cross (see [`SimModel::llama4_scout`]), and encoder inputs of 75 tokens (not a
    /// whole number of blocks), two to an encoder step.
    pub fn cpu_default() -> Self {
        SimConfig {
            workload: Workload { num_requests: 16, prompt_len: (16, 96), gen_len: (4, 24), initial: 4, max_arrivals_per_step: 2 },
            max_running: 8,
            token_budget: 48,
            num_blocks: None,
            num_layers: Some(2),
            window: Some(64),
            softcap: Some(0.5),
            chunk: Some(40),
            encoder_len: Some(75),
            encoder_budget: 150,
            max_steps: 10_000,
            check_every: 4,
            check_layers: None,
            check_reqs: 2,
            check_tokens: 2,
            progress_every: 5,
            decode_threshold: 1,
            seed: 1,
            graphs: false,
        }
    }

    /// Sizes for a GPU: a busy server's mix of long prompts and generations (an encoder-decoder
    /// model's encoder inputs of the model's length, up to four to an encoder step).
    pub fn gpu_default() -> Self {
        SimConfig {
            workload: Workload { num_requests: 256, prompt_len: (128, 2048), gen_len: (16, 256), initial: 32, max_arrivals_per_step: 4 },
            max_running: 64,
            token_budget: 2048,
            num_blocks: None,
            num_layers: None,
            window: None,
            softcap: None,
            chunk: None,
            encoder_len: None,
            encoder_budget: 6000,
            max_steps: 100_000,
            check_every: 25,
            check_layers: None,
            check_reqs: 3,
            check_tokens: 2,
            progress_every: 25,
            decode_threshold: 1,
            seed: 1,
            graphs: false,
        }
    }

    pub fn layers(&self, model: &SimModel) -> usize {
        self.num_layers.unwrap_or(model.num_layers)
    }

    /// `model` as this run plays it: with this config's window, soft-cap, chunk and encoder
    /// length, if it has them.
    pub fn run_model(&self, model: &SimModel) -> SimModel {
        let model = model.with_window_and_softcap(self.window, self.softcap).with_chunk(self.chunk);
        SimModel { encoder_len: model.encoder_len.map(|len| self.encoder_len.unwrap_or(len)), ..model }
    }

    /// The same sizes, with the decoder prompts of a few tokens (1 to 8: Whisper's
    /// start-of-transcript, language and task tokens, and a few more) where `model` has an
    /// encoder.
    pub fn with_encoder_decoder_prompts(mut self, model: &SimModel) -> Self {
        if model.is_encoder_decoder() {
            self.workload.prompt_len = (1, 8);
        }
        self
    }

    /// Tokens of the largest encoder step of `model` (as this config plays it): as many whole
    /// encoder inputs as the encoder budget and the running requests allow, at least one; 0
    /// without an encoder.
    pub fn max_encoder_step(&self, model: &SimModel) -> usize {
        self.run_model(model).encoder_len.map_or(0, |len| len * (self.encoder_budget / len).clamp(1, self.max_running.max(1)))
    }

    /// Blocks of the encoder pool of `model` (as this config plays it), `None` without an
    /// encoder: three quarters of what `max_running` encoder inputs take, at least one's.
    pub fn encoder_blocks(&self, model: &SimModel, block_size: usize) -> Option<usize> {
        let per_req = BlockTable::blocks_for(self.run_model(model).encoder_len?, block_size);
        Some((self.max_running * per_req * 3 / 4).max(per_req))
    }

    /// The same sizes, with prompts of up to one and a half windows (or chunks) where no
    /// context would pass the sliding window (or the first chunk) of `model` (as this config
    /// plays it): otherwise the window or the chunks would never hide a key, and the check would
    /// not see whether they are applied.
    pub fn with_contexts_past_window(mut self, model: &SimModel) -> Self {
        let run = self.run_model(model);
        if let Some(w) = run.window.into_iter().chain(run.chunk).max().map(|w| w as usize) {
            if self.workload.max_model_len() <= w {
                self.workload.prompt_len.1 = w + w / 2;
            }
        }
        self
    }

    pub fn blocks(&self, block_size: usize) -> usize {
        let per_req = BlockTable::blocks_for(self.workload.max_model_len(), block_size);
        self.num_blocks.unwrap_or((self.max_running * per_req * 3 / 4).max(per_req))
    }

    /// The checked attention layers of a run of `model` with `num_layers` model layers.
    fn checked_layers(&self, model: &SimModel, num_layers: usize) -> Result<Vec<usize>, SimError> {
        let layers = model.attention_layers(num_layers);
        let mut l = self.check_layers.clone().unwrap_or_else(|| model.default_check_layers(num_layers));
        l.sort_unstable();
        l.dedup();
        match l.iter().find(|&&x| x >= layers) {
            Some(x) => Err(SimError::Config(format!("check layer {x} is past the {layers} layers"))),
            None => Ok(l),
        }
    }
}

/// Runs `model` on `selection`'s backend (`gpu` for a GPU backend), logging to `log`.
pub fn run_sim(
    model: &SimModel,
    cfg: &SimConfig,
    selection: &Selection,
    gpu: Option<GpuHandles>,
    log: &mut dyn Write,
) -> Result<SimReport, SimError> {
    match model.config.q_dtype {
        DType::BF16 => Sim::<bf16>::new(model, cfg, selection, gpu)?.run(log),
        DType::F16 => Sim::<f16>::new(model, cfg, selection, gpu)?.run(log),
        DType::F32 => Sim::<f32>::new(model, cfg, selection, gpu)?.run(log),
        other => Err(SimError::Config(format!("activations of dtype {other:?}"))),
    }
}

/// Where the layers' caches and outputs live.
enum Buffers<T> {
    Host {
        caches: Vec<Vec<T>>,
        out: Vec<T>,
        /// One output per checked layer, kept until the step's check.
        check_outs: Vec<Vec<T>>,
    },
    /// Shared, so that graphs can hold them.
    Device {
        stream: Arc<CudaStream>,
        pool: CudaSlice<T>,
        caches: Vec<SharedBuf<T>>,
        out: SharedBuf<T>,
        check_outs: Vec<SharedBuf<T>>,
        /// Graph steps' activation rows: the step's pool rows are copied here before a replay
        /// (an engine's QKV projection would write them).
        graph_input: Option<SharedBuf<T>>,
    },
}

/// Decoder steps replayed from CUDA graphs: a graph step per bucket, and its graph, captured
/// the first time a step takes the bucket.
struct Graphs {
    /// Whether the backend captures mixed steps (`tensor-core`; `mla` captures decodes only,
    /// and its other steps run eagerly).
    mixed: bool,
    max_running: usize,
    token_budget: usize,
    buckets: Vec<GraphEntry>,
}

struct GraphEntry {
    bucket: GraphBucket,
    step: StepMetadata,
    /// An encoder-decoder model's cross-attention step of the same bucket, which the graph's
    /// cross-attention layers run.
    cross: Option<StepMetadata>,
    graph: Option<StepGraph>,
}

impl Graphs {
    /// The bucket `batch` replays in: one-token decodes in the uniform bucket of the next power
    /// of two requests; any other batch, where the backend takes mixed steps, in the mixed
    /// bucket of every running request and the next power of two tokens (at least 64, at most
    /// the budget). `None`: eager.
    fn bucket_for(&self, batch: &Batch) -> Option<GraphBucket> {
        let (n, nt) = (batch.reqs.len(), batch.num_tokens());
        if n == 0 {
            return None;
        }
        if batch.num_decode_tokens == nt && nt == n {
            return Some(GraphBucket::decode(n.next_power_of_two().min(self.max_running)));
        }
        let tokens = nt.next_power_of_two().max(64).min(self.token_budget).max(nt);
        self.mixed.then(|| GraphBucket::mixed(self.max_running, tokens))
    }
}

/// Which of a step's metadata a layer runs with.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Phase {
    /// The decoder step (every layer of a decoder-only model).
    Decoder,
    /// An encoder-decoder model's encoder step: the encoder layers, and the cross-attention
    /// layers' `write_kv`.
    Encoder,
    /// The decoder step's cross-attention step: the cross-attention layers.
    Cross,
}

/// An encoder-decoder model's other two metadata, of the same `Attention` as the decoder step.
struct EncoderSteps {
    encoder: StepMetadata,
    cross: StepMetadata,
}

struct Sim<T> {
    model: SimModel,
    cfg: SimConfig,
    /// Attention layers run.
    layers: usize,
    /// Each layer's kind (decoder, or an encoder-decoder model's encoder, decoder and
    /// cross-attention layers).
    kinds: Vec<AttentionType>,
    /// The layer whose cache each layer reads (itself, or the target it shares).
    kv_source: Vec<usize>,
    /// Which of the caches (one per layer that keeps one) each layer reads.
    cache_of: Vec<usize>,
    attn: Attention,
    step: StepMetadata,
    encoder_steps: Option<EncoderSteps>,
    graphs: Option<Graphs>,
    sched: Scheduler,
    checker: Checker,
    /// Random activation rows, `pool_rows x width` (also on the device for a GPU backend).
    pool: Vec<T>,
    pool_rows: usize,
    bufs: Buffers<T>,
    rng: SplitMix,
    report: SimReport,
}

impl<T: HostElement> Sim<T> {
    fn new(model: &SimModel, cfg: &SimConfig, selection: &Selection, gpu: Option<GpuHandles>) -> Result<Self, SimError> {
        let model = &cfg.run_model(model);
        let num_layers = cfg.layers(model);
        if num_layers == 0 {
            return Err(SimError::Config("no layers".into()));
        }
        if model.encoder_len == Some(0) {
            return Err(SimError::Config("an encoder input of no tokens".into()));
        }
        let layers = model.attention_layers(num_layers);
        let c = &model.config;
        // Two block pools: the decoder's (self-attention caches) and, with an encoder, the
        // encoder's (encoder and cross-attention caches). Every cache of the one `Attention`
        // has the larger pool's block count.
        let decoder_blocks = cfg.blocks(c.block_size);
        let encoder_blocks = cfg.encoder_blocks(model, c.block_size);
        let num_blocks = decoder_blocks.max(encoder_blocks.unwrap_or(0));
        let max_tokens = cfg.token_budget.max(cfg.max_encoder_step(model));
        let max_model_len = cfg.workload.max_model_len().max(model.encoder_len.unwrap_or(0));
        let limits = ForwardLimits { max_num_tokens: max_tokens, max_num_reqs: cfg.max_running, max_model_len };
        let mut fc = ForwardConfig::new(*c, num_blocks, limits).with_layers(model.layer_specs(num_layers));
        fc.decode_threshold = cfg.decode_threshold;
        let attn = Attention::new(selection, fc, gpu)?;
        let step = attn.new_step_metadata()?;
        let encoder_steps = match model.is_encoder_decoder() {
            true => Some(EncoderSteps { encoder: attn.new_step_metadata()?, cross: attn.new_step_metadata()? }),
            false => None,
        };
        let mut rng = SplitMix::new(cfg.seed);
        let requests = cfg.workload.generate(&mut rng);
        let alloc = BlockAllocator::shuffled(decoder_blocks, c.block_size, &mut rng);
        let sc = SchedulerConfig { max_running: cfg.max_running, token_budget: cfg.token_budget, decode_threshold: cfg.decode_threshold };
        if sc.max_running == 0 || sc.token_budget < sc.max_running {
            return Err(SimError::Config(format!("token budget {} below max running {}", sc.token_budget, sc.max_running)));
        }
        let mut sched = Scheduler::new(sc, alloc, requests)?;
        if let (Some(len), Some(blocks)) = (model.encoder_len, encoder_blocks) {
            let alloc = BlockAllocator::shuffled(blocks, c.block_size, &mut rng);
            sched = sched.with_encoder(alloc, len, cfg.encoder_budget)?;
        }
        let checker =
            Checker::new(model, num_layers, cfg.checked_layers(model, num_layers)?, cfg.check_every, cfg.check_reqs, cfg.check_tokens);
        let kinds: Vec<AttentionType> = (0..layers).map(|l| model.layer_kind(l, num_layers)).collect();
        let kv_source: Vec<usize> = (0..layers).map(|l| model.kv_source(l, num_layers)).collect();
        let owners: Vec<usize> = (0..layers).filter(|&l| kv_source[l] == l).collect();
        let cache_of = kv_source.iter().map(|s| owners.binary_search(s).expect("a source keeps its cache")).collect();

        let width = model.row_layout().width;
        let pool_rows = max_tokens + max_tokens.max(256);
        let pool: Vec<T> = (0..pool_rows * width).map(|_| T::from_f32(rng.signed_unit())).collect();
        let cache_len = attn.cache_spec().num_elements();
        let out_len = max_tokens * c.num_q_heads * attn.cache_spec().v_head_size();
        let checked = checker.layers.len();
        let bufs = match attn.stream() {
            None => Buffers::Host {
                caches: owners.iter().map(|_| vec![T::default(); cache_len]).collect(),
                out: vec![T::default(); out_len],
                check_outs: vec![vec![T::default(); out_len]; checked],
            },
            Some(stream) => {
                let zeros = |len| stream.alloc_zeros(len).map(SharedBuf::new);
                Buffers::Device {
                    stream: stream.clone(),
                    pool: stream.clone_htod(&pool)?,
                    caches: owners.iter().map(|_| zeros(cache_len)).collect::<Result<_, _>>()?,
                    out: zeros(out_len)?,
                    check_outs: (0..checked).map(|_| zeros(out_len)).collect::<Result<_, _>>()?,
                    graph_input: if cfg.graphs { Some(zeros(max_tokens * width)?) } else { None },
                }
            }
        };
        let graphs = match (cfg.graphs, &bufs) {
            (false, _) => None,
            (true, Buffers::Host { .. }) => return Err(SimError::Config("CUDA graphs need a GPU backend".into())),
            (true, _) => Some(Graphs {
                mixed: attn.backend().graph_support == GraphSupport::Always,
                max_running: cfg.max_running,
                token_budget: cfg.token_budget,
                buckets: Vec::new(),
            }),
        };
        let mut report =
            SimReport::new(model, &attn, (num_layers, layers, owners.len()), num_blocks, cfg.workload.num_requests, checker.tolerance());
        report.pools = encoder_blocks.map(|e| (e, decoder_blocks));
        report.check_layers = checker.layers.clone();
        Ok(Sim {
            model: *model,
            cfg: cfg.clone(),
            layers,
            kinds,
            kv_source,
            cache_of,
            attn,
            step,
            encoder_steps,
            graphs,
            sched,
            checker,
            pool,
            pool_rows,
            bufs,
            rng,
            report,
        })
    }

    fn run(mut self, log: &mut dyn Write) -> Result<SimReport, SimError> {
        writeln!(log, "{}", self.report.header())?;
        self.attn.set_timing(true);
        let mut step = 0;
        let mut window = SimReport::window_start(&self.report);
        let (nb, bs) = (self.attn.cache_spec().num_blocks(), self.attn.cache_spec().block_size());
        while self.report.steps < self.cfg.max_steps && !self.sched.is_done() {
            let started = Instant::now();
            let batch = self.sched.schedule(&mut step)?;
            if batch.is_empty() {
                return Err(SimError::Config(format!("step {step}: nothing could be scheduled (too few blocks?)")));
            }
            let built = Instant::now();
            let bucket = self.graphs.as_ref().and_then(|g| g.bucket_for(&batch));
            if bucket.is_none() {
                self.step.build(&batch.arrays.input(nb, bs))?;
            }
            let (nt, ne) = (batch.num_tokens(), batch.num_encoder_tokens());
            if let Some(e) = &mut self.encoder_steps {
                if ne > 0 {
                    e.encoder.build(&batch.encoder.input(nb, bs))?;
                }
                // A graph step builds its own cross-attention step.
                if bucket.is_none() {
                    e.cross.build(&batch.cross.input(nb, bs))?;
                }
            }
            let metadata = built.elapsed();
            // The encoder step first: the encoder layers, and the cross-attention layers' caches.
            let enc_offsets: Vec<usize> = match ne {
                0 => Vec::new(),
                _ => (0..self.layers).map(|l| self.layer_offset(step, l, ne, Phase::Encoder)).collect(),
            };
            for (layer, &offset) in enc_offsets.iter().enumerate() {
                match self.kinds[layer] {
                    AttentionType::Encoder => self.forward_layer(layer, offset, ne, Phase::Encoder)?,
                    AttentionType::EncoderDecoder => self.write_kv(layer, offset, ne)?,
                    _ => {}
                }
            }
            // With graphs every layer of a step reads the same rows (one copy into the graphs'
            // input a step).
            let offset_of = |l: usize| if self.graphs.is_some() { 0 } else { l };
            let offsets: Vec<usize> = (0..self.layers).map(|l| self.layer_offset(step, offset_of(l), nt, Phase::Decoder)).collect();
            if let Some(bucket) = bucket {
                let cross = self.encoder_steps.is_some().then(|| batch.cross.input(nb, bs));
                self.replay(bucket, (&batch.arrays.input(nb, bs), cross.as_ref()), offsets[0], nt)?;
            } else {
                for (layer, &offset) in offsets.iter().enumerate() {
                    match self.kinds[layer] {
                        AttentionType::Encoder => {}
                        AttentionType::EncoderDecoder => self.forward_layer(layer, offset, nt, Phase::Cross)?,
                        _ => self.forward_layer(layer, offset, nt, Phase::Decoder)?,
                    }
                }
            }
            let times = self.attn.take_times()?;
            self.attn.check_status()?;
            let elapsed = started.elapsed();
            let eager_cross = |e: &EncoderSteps| if bucket.is_some() { 0 } else { e.cross.upload_bytes() };
            let upload = if bucket.is_some() { 0 } else { self.step.upload_bytes() }
                + self.encoder_steps.as_ref().map_or(0, |e| eager_cross(e) + if ne > 0 { e.encoder.upload_bytes() } else { 0 });
            self.report.book_step(&batch, elapsed, metadata, times, upload);
            self.report.graph_steps += usize::from(bucket.is_some());

            let checked: Vec<usize> = self.checker.layers.iter().map(|&l| offsets[l]).collect();
            let checked_kv: Vec<usize> = self.checker.layers.iter().map(|&l| offsets[self.kv_source[l]]).collect();
            self.checker.record_encoder(&batch, &enc_offsets);
            self.checker.record(&batch, &checked_kv);
            if ne > 0 && self.checker.is_encoder_check() {
                self.check_encoder(&batch, &enc_offsets)?;
            }
            if self.checker.is_check_step(self.report.steps - 1) {
                self.check(&batch, &checked)?;
            }
            let done = self.sched.complete(&batch)?;
            self.checker.forget(&done);
            if self.cfg.progress_every > 0 && self.report.steps.is_multiple_of(self.cfg.progress_every) {
                writeln!(log, "{}", progress_line(&self.report, &window, step, &batch, &self.sched, &self.checker.stats))?;
                window = SimReport::window_start(&self.report);
            }
            step += 1;
        }
        self.report.finished = self.sched.num_finished();
        self.report.graphs = self.graphs.as_ref().map(|g| g.buckets.iter().map(|e| e.bucket).collect());
        self.report.checks = self.checker.stats.clone();
        for line in self.report.summary() {
            writeln!(log, "{line}")?;
        }
        Ok(self.report)
    }

    /// A decoder step replayed from `bucket`'s graph: builds the bucket's graph step (and an
    /// encoder-decoder model's cross-attention step, from `cross`), copies the step's `nt` pool
    /// rows from `offset` into the graphs' input, captures the graph if this is the bucket's
    /// first step (every decoder and cross-attention layer, as `forward_layer` runs them, on
    /// the shared buffers), and replays it.
    fn replay(
        &mut self,
        bucket: GraphBucket,
        (input, cross): (&StepInput<'_>, Option<&StepInput<'_>>),
        offset: usize,
        nt: usize,
    ) -> Result<(), SimError> {
        let Sim { graphs, attn, bufs, model, kv_source, cache_of, checker, layers, kinds, .. } = self;
        let g = graphs.as_mut().expect("graph steps need graphs");
        let i = match g.buckets.iter().position(|e| e.bucket == bucket) {
            Some(i) => i,
            None => {
                let cross = cross.map(|_| attn.new_graph_step(bucket)).transpose()?;
                g.buckets.push(GraphEntry { bucket, step: attn.new_graph_step(bucket)?, cross, graph: None });
                g.buckets.len() - 1
            }
        };
        let e = &mut g.buckets[i];
        e.step.build(input)?;
        if let (Some(step), Some(input)) = (&mut e.cross, cross) {
            step.build(input)?;
        }
        let Buffers::Device { stream, pool, caches, out, check_outs, graph_input: Some(rows) } = &*bufs else {
            return Err(SimError::Config("CUDA graphs need a GPU backend".into()));
        };
        let lay = model.row_layout();
        rows.write_from_device_at(stream, 0, &pool.slice(offset * lay.width..(offset + nt) * lay.width))?;
        if e.graph.is_none() {
            let (step, cross) = (&e.step, e.cross.as_ref());
            let graph = attn.capture(step, |a| {
                for layer in 0..*layers {
                    // Encoder layers run in the encoder step (eagerly); cross-attention layers
                    // in the cross-attention step, reading their caches.
                    let (step, reads_only) = match (kinds[layer], cross) {
                        (AttentionType::Encoder, _) => continue,
                        (AttentionType::EncoderDecoder, Some(c)) => (c, true),
                        _ => (step, kv_source[layer] != layer),
                    };
                    let qkv = |col| DevIn::shared_range(rows, col.., stream);
                    let l = layer_of(model, bucket.num_tokens(), reads_only, qkv(lay.q)?, qkv(lay.k)?, qkv(lay.v)?);
                    let out = match checker.layers.iter().position(|&c| c == layer) {
                        Some(j) => &check_outs[j],
                        None => out,
                    };
                    let l = l.finish(DevOut::shared(&caches[cache_of[layer]], stream), DevOut::shared(out, stream));
                    a.forward_layer(step, layer, LayerIo::Gpu(l))?;
                }
                Ok(())
            })?;
            e.graph = Some(graph);
        }
        e.graph.as_ref().expect("captured above").replay(&e.step)?;
        Ok(())
    }

    /// The pool row layer `layer` of step `step` starts at in `phase` (deterministic; the
    /// encoder step's apart from the decoder step's).
    fn layer_offset(&self, step: usize, layer: usize, num_tokens: usize, phase: Phase) -> usize {
        let salt = if phase == Phase::Encoder { 0x5bd1_e995_u64 << 32 } else { 0 };
        let mut r =
            SplitMix::new(self.cfg.seed ^ (step as u64).wrapping_mul(0x9e37_79b9) ^ (layer as u64).wrapping_mul(0x85eb_ca6b) << 20 ^ salt);
        r.range(0, self.pool_rows - num_tokens)
    }

    fn forward_layer(&mut self, layer: usize, offset: usize, nt: usize, phase: Phase) -> Result<(), SimError> {
        let lay = self.model.row_layout();
        let width = lay.width;
        let check = self.checker.layers.iter().position(|&l| l == layer);
        let base = offset * width;
        // A KV-sharing layer and a cross-attention layer read a cache written before.
        let reads_only = self.kv_source[layer] != layer || phase == Phase::Cross;
        let cache = self.cache_of[layer];
        let step = match (phase, &self.encoder_steps) {
            (Phase::Decoder, _) => &self.step,
            (Phase::Encoder, Some(e)) => &e.encoder,
            (Phase::Cross, Some(e)) => &e.cross,
            (_, None) => unreachable!("a decoder-only model runs decoder steps"),
        };
        let io = match &mut self.bufs {
            Buffers::Host { caches, out, check_outs } => {
                let out = match check {
                    Some(j) => &mut check_outs[j],
                    None => out,
                };
                let rows = &self.pool[base..];
                let l = layer_of(
                    &self.model,
                    nt,
                    reads_only,
                    T::host_in(&rows[lay.q..]),
                    T::host_in(&rows[lay.k..]),
                    T::host_in(&rows[lay.v..]),
                );
                let l = l.finish(T::host_out(&mut caches[cache]), T::host_out(out));
                self.attn.forward_layer(step, layer, LayerIo::Cpu(l))?;
                return Ok(());
            }
            Buffers::Device { stream, pool, caches, out, check_outs, .. } => (stream, pool, caches, out, check_outs),
        };
        let (stream, pool, caches, out, check_outs) = io;
        let out = match check {
            Some(j) => &mut check_outs[j],
            None => out,
        };
        let (qv, kv, vv) = (pool.slice(base + lay.q..), pool.slice(base + lay.k..), pool.slice(base + lay.v..));
        let l = layer_of(&self.model, nt, reads_only, DevIn::new(&qv, stream), DevIn::new(&kv, stream), DevIn::new(&vv, stream));
        let l = l.finish(DevOut::shared(&caches[cache], stream), DevOut::shared(out, stream));
        self.attn.forward_layer(step, layer, LayerIo::Gpu(l))?;
        Ok(())
    }

    /// Fills cross-attention layer `layer`'s own cache in the encoder step: its keys and values
    /// of the `nt` encoder tokens are the pool rows from `offset` on (its projection of the
    /// encoder's output), written at the encoder step's slots, nothing attended.
    fn write_kv(&mut self, layer: usize, offset: usize, nt: usize) -> Result<(), SimError> {
        let lay = self.model.row_layout();
        let c = &self.model.config;
        let rows = RowsDesc {
            num_tokens: nt,
            num_heads: c.num_kv_heads,
            head_size: c.head_size,
            token_stride: lay.width,
            head_stride: c.head_size,
        };
        let base = offset * lay.width;
        let cache = self.cache_of[layer];
        let step = &self.encoder_steps.as_ref().expect("an encoder-decoder model").encoder;
        match &mut self.bufs {
            Buffers::Host { caches, .. } => {
                let r = &self.pool[base..];
                let new_kv = NewKv::Standard { k: T::host_in(&r[lay.k..]), k_rows: rows, v: T::host_in(&r[lay.v..]), v_rows: rows };
                let w = KvCacheWrite { new_kv, cache: T::host_out(&mut caches[cache]), kv_scales: None };
                self.attn.write_kv(step, layer, KvWriteIo::Cpu(w))?;
            }
            Buffers::Device { stream, pool, caches, .. } => {
                let (kv, vv) = (pool.slice(base + lay.k..), pool.slice(base + lay.v..));
                let new_kv = NewKv::Standard { k: DevIn::new(&kv, stream), k_rows: rows, v: DevIn::new(&vv, stream), v_rows: rows };
                let w = KvCacheWrite { new_kv, cache: DevOut::shared(&caches[cache], stream), kv_scales: None };
                self.attn.write_kv(step, layer, KvWriteIo::Gpu(w))?;
            }
        }
        Ok(())
    }

    /// Checked layer `j`'s output rows for `nt` tokens, as the host sees them.
    fn checked_out(&self, j: usize, out_rows: &RowsDesc) -> Result<Vec<T>, SimError> {
        Ok(match &self.bufs {
            Buffers::Host { check_outs, .. } => check_outs[j][..out_rows.required_len()].to_vec(),
            Buffers::Device { stream, check_outs, .. } => {
                stream.clone_dtoh(&check_outs[j].as_cuda_slice().slice(..out_rows.required_len()))?
            }
        })
    }

    /// Compares the checked decoder-step layers' outputs (decoder self-attention and
    /// cross-attention) for a few requests with the reference.
    fn check(&mut self, batch: &Batch, offsets: &[usize]) -> Result<(), SimError> {
        let started = Instant::now();
        let picked = self.checker.pick(batch, &mut self.rng);
        let c = &self.model.config;
        let out_rows = RowsDesc::contiguous(batch.num_tokens(), c.num_q_heads, self.attn.cache_spec().v_head_size());
        for (j, &offset) in offsets.iter().enumerate() {
            if self.checker.kind(j) == AttentionType::Encoder {
                continue;
            }
            let out = self.checked_out(j, &out_rows)?;
            self.checker.compare(&self.model, &self.pool, batch, &picked, j, offset, &out, &out_rows);
        }
        self.report.check_time += started.elapsed();
        Ok(())
    }

    /// Compares the checked encoder layers' outputs in the step's encoder step for a few
    /// requests with the reference (`offsets`: every layer's pool offset in the encoder step).
    fn check_encoder(&mut self, batch: &Batch, offsets: &[usize]) -> Result<(), SimError> {
        let started = Instant::now();
        let picked = self.checker.pick_encoder(batch, &mut self.rng);
        let c = &self.model.config;
        let out_rows = RowsDesc::contiguous(batch.num_encoder_tokens(), c.num_q_heads, self.attn.cache_spec().v_head_size());
        for j in 0..self.checker.layers.len() {
            if self.checker.kind(j) != AttentionType::Encoder {
                continue;
            }
            let out = self.checked_out(j, &out_rows)?;
            let offset = offsets[self.checker.layers[j]];
            self.checker.compare_encoder(&self.model, &self.pool, batch, &picked, j, offset, &out, &out_rows);
        }
        self.report.check_time += started.elapsed();
        Ok(())
    }
}

/// A layer's inputs from one token-row view per tensor (q, k, v; MLA: q, kv_c, k_pe), rows of the
/// pool's width (a layer that `reads_only` a cache written before, another layer's or by
/// `write_kv`, takes only q); the cache and output come with [`Pending::finish`].
fn layer_of<I>(model: &SimModel, nt: usize, reads_only: bool, q: I, k: I, v: I) -> Pending<I> {
    let c = &model.config;
    let width = model.row_layout().width;
    let d = c.head_size;
    let q_rows = RowsDesc { num_tokens: nt, num_heads: c.num_q_heads, head_size: d, token_stride: width, head_stride: d };
    let new_kv = if reads_only {
        NewKv::None
    } else if model.is_mla() {
        NewKv::Mla { kv_c: k, kv_c_token_stride: width, k_pe: v, k_pe_token_stride: width }
    } else {
        let rows = RowsDesc { num_tokens: nt, num_heads: c.num_kv_heads, head_size: d, token_stride: width, head_stride: d };
        NewKv::Standard { k, k_rows: rows, v, v_rows: rows }
    };
    let dv = if model.is_mla() { d - attn_rs::MlaCacheSpec::DEEPSEEK_ROPE } else { d };
    Pending { q, q_rows, new_kv, out_rows: RowsDesc::contiguous(nt, c.num_q_heads, dv) }
}

/// A layer's inputs, waiting for its cache and output.
struct Pending<I> {
    q: I,
    q_rows: RowsDesc,
    new_kv: NewKv<I>,
    out_rows: RowsDesc,
}

impl<I> Pending<I> {
    fn finish<O>(self, cache: O, out: O) -> Layer<I, O> {
        Layer {
            q: self.q,
            q_rows: self.q_rows,
            new_kv: self.new_kv,
            cache,
            out,
            out_rows: self.out_rows,
            alibi_slopes: None,
            sinks: None,
            kv_scales: None,
        }
    }
}
