//! The engine loop: every step the scheduler's batch, its metadata built once, then
//! `forward_layer` on every layer with that layer's settings and random activations (there is
//! no model: each layer takes its q/k/v rows from a pool of random rows at a pseudo-random
//! offset; a KV-sharing layer takes only q and reads its target's cache), timed, sampled against
//! the f64 reference, and logged.

use super::allocator::{AllocError, BlockAllocator, BlockTable};
use super::check::Checker;
use super::model::SimModel;
use super::report::{progress_line, SimReport};
use super::requests::Workload;
use super::rng::SplitMix;
use super::scheduler::{Batch, Scheduler, SchedulerConfig};
use attn_rs::backend::Selection;
use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, HostElement, Layer, LayerIo, NewKv, StepMetadata};
use attn_rs::AttnError;
use attn_rs::DType;
use attn_rs::RowsDesc;
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
    /// length would take (so admission waits for blocks at times).
    pub num_blocks: Option<usize>,
    /// Layers run; `None`: the model's.
    pub num_layers: Option<usize>,
    /// The sliding window of a model's windowed layers; `None`: the model's.
    pub window: Option<u32>,
    /// The soft-cap of a model's soft-capped layers; `None`: the model's.
    pub softcap: Option<f32>,
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
}

impl SimConfig {
    /// Sizes for the CPU backend (the f64 reference is slow): a few short requests, two layers,
    /// and a window (64) and soft-cap (0.5) that change the outputs at these contexts and with
    /// the random activations (see [`SimModel::gemma2_2b`]).
    pub fn cpu_default() -> Self {
        SimConfig {
            workload: Workload { num_requests: 16, prompt_len: (16, 96), gen_len: (4, 24), initial: 4, max_arrivals_per_step: 2 },
            max_running: 8,
            token_budget: 48,
            num_blocks: None,
            num_layers: Some(2),
            window: Some(64),
            softcap: Some(0.5),
            max_steps: 10_000,
            check_every: 4,
            check_layers: None,
            check_reqs: 2,
            check_tokens: 2,
            progress_every: 5,
            decode_threshold: 1,
            seed: 1,
        }
    }

    /// Sizes for a GPU: a busy server's mix of long prompts and generations.
    pub fn gpu_default() -> Self {
        SimConfig {
            workload: Workload { num_requests: 256, prompt_len: (128, 2048), gen_len: (16, 256), initial: 32, max_arrivals_per_step: 4 },
            max_running: 64,
            token_budget: 2048,
            num_blocks: None,
            num_layers: None,
            window: None,
            softcap: None,
            max_steps: 100_000,
            check_every: 25,
            check_layers: None,
            check_reqs: 3,
            check_tokens: 2,
            progress_every: 25,
            decode_threshold: 1,
            seed: 1,
        }
    }

    pub fn layers(&self, model: &SimModel) -> usize {
        self.num_layers.unwrap_or(model.num_layers)
    }

    /// `model` as this run plays it: with this config's window and soft-cap, if it has them.
    pub fn run_model(&self, model: &SimModel) -> SimModel {
        model.with_window_and_softcap(self.window, self.softcap)
    }

    /// The same sizes, with prompts of up to one and a half windows where no context would pass
    /// the sliding window of `model` (as this config plays it): otherwise the window would never
    /// hide a key, and the check would not see whether it is applied.
    pub fn with_contexts_past_window(mut self, model: &SimModel) -> Self {
        if let Some(w) = self.run_model(model).window.map(|w| w as usize) {
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

    fn checked_layers(&self, layers: usize) -> Result<Vec<usize>, SimError> {
        let mut l = self.check_layers.clone().unwrap_or_else(|| vec![0, layers - 1]);
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
    Device {
        stream: Arc<CudaStream>,
        pool: CudaSlice<T>,
        caches: Vec<CudaSlice<T>>,
        out: CudaSlice<T>,
        check_outs: Vec<CudaSlice<T>>,
    },
}

struct Sim<T> {
    model: SimModel,
    cfg: SimConfig,
    layers: usize,
    /// The layer whose cache each layer reads (itself, or the target it shares).
    kv_source: Vec<usize>,
    /// Which of the caches (one per layer that keeps one) each layer reads.
    cache_of: Vec<usize>,
    attn: Attention,
    step: StepMetadata,
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
        let layers = cfg.layers(model);
        if layers == 0 {
            return Err(SimError::Config("no layers".into()));
        }
        let c = &model.config;
        let num_blocks = cfg.blocks(c.block_size);
        let limits =
            ForwardLimits { max_num_tokens: cfg.token_budget, max_num_reqs: cfg.max_running, max_model_len: cfg.workload.max_model_len() };
        let mut fc = ForwardConfig::new(*c, num_blocks, limits).with_layers(model.layer_specs(layers));
        fc.decode_threshold = cfg.decode_threshold;
        let attn = Attention::new(selection, fc, gpu)?;
        let step = attn.new_step_metadata()?;
        let mut rng = SplitMix::new(cfg.seed);
        let requests = cfg.workload.generate(&mut rng);
        let alloc = BlockAllocator::shuffled(num_blocks, c.block_size, &mut rng);
        let sc = SchedulerConfig { max_running: cfg.max_running, token_budget: cfg.token_budget, decode_threshold: cfg.decode_threshold };
        if sc.max_running == 0 || sc.token_budget < sc.max_running {
            return Err(SimError::Config(format!("token budget {} below max running {}", sc.token_budget, sc.max_running)));
        }
        let sched = Scheduler::new(sc, alloc, requests)?;
        let checker = Checker::new(model, layers, cfg.checked_layers(layers)?, cfg.check_every, cfg.check_reqs, cfg.check_tokens);
        let kv_source: Vec<usize> = (0..layers).map(|l| model.kv_source(l, layers)).collect();
        let owners: Vec<usize> = (0..layers).filter(|&l| kv_source[l] == l).collect();
        let cache_of = kv_source.iter().map(|s| owners.binary_search(s).expect("a source keeps its cache")).collect();

        let width = model.row_layout().width;
        let pool_rows = cfg.token_budget + cfg.token_budget.max(256);
        let pool: Vec<T> = (0..pool_rows * width).map(|_| T::from_f32(rng.signed_unit())).collect();
        let cache_len = attn.cache_spec().num_elements();
        let out_len = cfg.token_budget * c.num_q_heads * attn.cache_spec().v_head_size();
        let checked = checker.layers.len();
        let bufs = match attn.stream() {
            None => Buffers::Host {
                caches: owners.iter().map(|_| vec![T::default(); cache_len]).collect(),
                out: vec![T::default(); out_len],
                check_outs: vec![vec![T::default(); out_len]; checked],
            },
            Some(stream) => Buffers::Device {
                stream: stream.clone(),
                pool: stream.clone_htod(&pool)?,
                caches: owners.iter().map(|_| stream.alloc_zeros(cache_len)).collect::<Result<_, _>>()?,
                out: stream.alloc_zeros(out_len)?,
                check_outs: (0..checked).map(|_| stream.alloc_zeros(out_len)).collect::<Result<_, _>>()?,
            },
        };
        let mut report = SimReport::new(model, &attn, (layers, owners.len()), num_blocks, cfg.workload.num_requests, checker.tolerance());
        report.check_layers = checker.layers.clone();
        Ok(Sim {
            model: *model,
            cfg: cfg.clone(),
            layers,
            kv_source,
            cache_of,
            attn,
            step,
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
        while self.report.steps < self.cfg.max_steps && !self.sched.is_done() {
            let started = Instant::now();
            let batch = self.sched.schedule(&mut step)?;
            if batch.is_empty() {
                return Err(SimError::Config(format!("step {step}: nothing could be scheduled (too few blocks?)")));
            }
            let built = Instant::now();
            let input = batch.arrays.input(self.attn.cache_spec().num_blocks(), self.attn.cache_spec().block_size());
            self.step.build(&input)?;
            let metadata = built.elapsed();
            let offsets: Vec<usize> = (0..self.layers).map(|l| self.layer_offset(step, l, batch.num_tokens())).collect();
            for (layer, &offset) in offsets.iter().enumerate() {
                self.forward_layer(layer, offset, batch.num_tokens())?;
            }
            let times = self.attn.take_times()?;
            self.attn.check_status()?;
            let elapsed = started.elapsed();
            self.report.book_step(&batch, elapsed, metadata, times, self.step.upload_bytes());

            let checked: Vec<usize> = self.checker.layers.iter().map(|&l| offsets[l]).collect();
            let checked_kv: Vec<usize> = self.checker.layers.iter().map(|&l| offsets[self.kv_source[l]]).collect();
            self.checker.record(&batch, &checked_kv);
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
        self.report.checks = self.checker.stats.clone();
        for line in self.report.summary() {
            writeln!(log, "{line}")?;
        }
        Ok(self.report)
    }

    /// The pool row layer `layer` of step `step` starts at (deterministic).
    fn layer_offset(&self, step: usize, layer: usize, num_tokens: usize) -> usize {
        let mut r = SplitMix::new(self.cfg.seed ^ (step as u64).wrapping_mul(0x9e37_79b9) ^ (layer as u64).wrapping_mul(0x85eb_ca6b) << 20);
        r.range(0, self.pool_rows - num_tokens)
    }

    fn forward_layer(&mut self, layer: usize, offset: usize, nt: usize) -> Result<(), SimError> {
        let lay = self.model.row_layout();
        let width = lay.width;
        let check = self.checker.layers.iter().position(|&l| l == layer);
        let base = offset * width;
        let (shares, cache) = (self.kv_source[layer] != layer, self.cache_of[layer]);
        let io = match &mut self.bufs {
            Buffers::Host { caches, out, check_outs } => {
                let out = match check {
                    Some(j) => &mut check_outs[j],
                    None => out,
                };
                let rows = &self.pool[base..];
                let l =
                    layer_of(&self.model, nt, shares, T::host_in(&rows[lay.q..]), T::host_in(&rows[lay.k..]), T::host_in(&rows[lay.v..]));
                let l = l.finish(T::host_out(&mut caches[cache]), T::host_out(out));
                self.attn.forward_layer(&self.step, layer, LayerIo::Cpu(l))?;
                return Ok(());
            }
            Buffers::Device { stream, pool, caches, out, check_outs } => (stream, pool, caches, out, check_outs),
        };
        let (stream, pool, caches, out, check_outs) = io;
        let out = match check {
            Some(j) => &mut check_outs[j],
            None => out,
        };
        let (qv, kv, vv) = (pool.slice(base + lay.q..), pool.slice(base + lay.k..), pool.slice(base + lay.v..));
        let l = layer_of(&self.model, nt, shares, DevIn::new(&qv, stream), DevIn::new(&kv, stream), DevIn::new(&vv, stream));
        let l = l.finish(DevOut::new(&mut caches[cache], stream), DevOut::new(out, stream));
        self.attn.forward_layer(&self.step, layer, LayerIo::Gpu(l))?;
        Ok(())
    }

    /// Compares the checked layers' outputs for a few requests with the reference.
    fn check(&mut self, batch: &Batch, offsets: &[usize]) -> Result<(), SimError> {
        let started = Instant::now();
        let picked = self.checker.pick(batch, &mut self.rng);
        let c = &self.model.config;
        let out_rows = RowsDesc::contiguous(batch.num_tokens(), c.num_q_heads, self.attn.cache_spec().v_head_size());
        for (j, &offset) in offsets.iter().enumerate() {
            let out: Vec<T> = match &self.bufs {
                Buffers::Host { check_outs, .. } => check_outs[j][..out_rows.required_len()].to_vec(),
                Buffers::Device { stream, check_outs, .. } => stream.clone_dtoh(&check_outs[j].slice(..out_rows.required_len()))?,
            };
            self.checker.compare(&self.model, &self.pool, batch, &picked, j, offset, &out, &out_rows);
        }
        self.report.check_time += started.elapsed();
        Ok(())
    }
}

/// A layer's inputs from one token-row view per tensor (q, k, v; MLA: q, kv_c, k_pe), rows of the
/// pool's width (a layer that `shares` another's cache takes only q); the cache and output come
/// with [`Pending::finish`].
fn layer_of<I>(model: &SimModel, nt: usize, shares: bool, q: I, k: I, v: I) -> Pending<I> {
    let c = &model.config;
    let width = model.row_layout().width;
    let d = c.head_size;
    let q_rows = RowsDesc { num_tokens: nt, num_heads: c.num_q_heads, head_size: d, token_stride: width, head_stride: d };
    let new_kv = if shares {
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
