//! [`Attention`]: a model's attention layers on the chosen backend; [`forward`](Attention::forward)
//! is the one call per layer.

use super::config::ForwardConfig;
use super::cpu_exec::forward_cpu;
use super::gpu_exec::{local_batch_bucket, GpuExec};
use super::graph::{capture_stream, Capture, StepGraph};
use super::graph_plan::GraphBucket;
use super::io::{CacheSpec, KvWriteIo, LayerIo};
use super::kv_sharing::CacheOwners;
use super::layers::{AttentionType, LayerSpec};
use super::step::{LocalStep, StepMetadata};
use super::timing::{PhaseTimes, Timer};
use super::validate::{validate_layer, validate_write, Buf};
use crate::backend::{refusal_reasons, BackendSpec, DeviceInfo, GraphSupport, Selection, CPU, MLA, TENSOR_CORE};
use crate::context_parallel::CpExchange;
use crate::device::AttnDevice;
use crate::error::{ensure, AttnError, Result};
use crate::metadata::{CascadeMode, LocalBatch, MetadataBuilder};
use crate::stream_check::{refuse_foreign_capture, CaptureInProgress};
use cudarc::driver::CudaStream;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

/// The GPU a GPU backend runs on: the device and the stream every launch is enqueued on.
#[derive(Clone)]
pub struct GpuHandles {
    /// The device the kernels load on.
    pub dev: Arc<AttnDevice>,
    /// The stream every call of the [`Attention`] runs on (step metadata, cache writes and
    /// attention; a cascade step's prefix runs on a second stream of its own, joined back).
    pub stream: Arc<CudaStream>,
}

enum Exec {
    Cpu,
    Gpu(Box<GpuExec>),
}

/// The attention of every layer of one model, on the backend selection chose.
pub struct Attention {
    id: u64,
    config: ForwardConfig,
    spec: CacheSpec,
    backend: &'static BackendSpec,
    exec: Exec,
    timer: Timer,
    /// Set while [`capture`](Attention::capture) records: what the graph will hold.
    capturing: Option<Capture>,
    /// The cache buffer each layer was last given (KV sharing's check).
    cache_owners: CacheOwners,
}

/// A KV-sharing layer must be given its target's cache buffer; a layer with a cache of its own
/// records it for the layers that share it.
fn track_cache(owners: &mut CacheOwners, index: usize, ls: &LayerSpec, addr: u64) -> Result<()> {
    match ls.kv_sharing_target {
        Some(target) => owners.check(index, target, addr),
        None if ls.attn_type == AttentionType::EncoderDecoder => owners.check_own(index, addr),
        None if ls.attn_type.writes_cache() => {
            owners.record(index, addr);
            Ok(())
        }
        None => Ok(()),
    }
}

impl Attention {
    /// The layers of `config.model` on `selection`'s backend (from
    /// [`select_backend`](crate::backend::select_backend) for that model): `gpu` is needed by a GPU
    /// backend (and ignored by `cpu`). Checks the configuration, re-checks that the backend takes
    /// the model on this device, and allocates the GPU workspaces for `config.limits`.
    ///
    /// Errors: `InvalidArgument` naming the field.
    pub fn new(selection: &Selection, config: ForwardConfig, gpu: Option<GpuHandles>) -> Result<Self> {
        config.validate()?;
        let backend = selection.backend;
        let device = gpu.as_ref().map_or(DeviceInfo::no_gpu(), |g| DeviceInfo::from_device(&g.dev));
        let reasons = refusal_reasons(backend, &config.model, &device);
        if !reasons.is_empty() {
            let reasons: Vec<String> = reasons.iter().map(ToString::to_string).collect();
            return Err(AttnError::invalid(
                "backend",
                format!("\"{}\" cannot run {} on {device}: {}", backend.name, config.model, reasons.join("; ")),
            ));
        }
        let spec = config.cache_spec()?;
        ensure(config.context_parallel.is_none() || [TENSOR_CORE.name, MLA.name].contains(&backend.name), "context_parallel", || {
            format!("on backend \"{}\": context parallelism runs on \"tensor-core\" and \"mla\"", backend.name)
        })?;
        let exec = match backend.name {
            name if name == CPU.name => Exec::Cpu,
            name if name == TENSOR_CORE.name => {
                let gpu =
                    gpu.ok_or_else(|| AttnError::invalid("gpu", "backend \"tensor-core\" runs on a GPU: pass its device and stream"))?;
                let fp8 = config.model.cache_dtype.is_fp8();
                crate::kernels::head_width("model", config.model.head_size)?;
                let bs = config.model.block_size;
                for i in 0..config.layers.len().max(1) {
                    let o = config.layer(i)?.opts;
                    ensure(o.chunk_size.is_none_or(|c| config.chunk_of_whole_blocks(c as usize)) || !fp8, "layers", || {
                        format!(
                            "layer {i}: chunk_size {:?} with an FP8 cache: a chunk of a whole number of blocks ({bs} tokens) runs \
                             as a local batch; others need the local-mask kernels, which read 16-bit caches",
                            o.chunk_size
                        )
                    })?;
                }
                Exec::Gpu(Box::new(GpuExec::new(gpu.dev, gpu.stream, &config)?))
            }
            name if name == MLA.name => {
                let gpu = gpu.ok_or_else(|| AttnError::invalid("gpu", "backend \"mla\" runs on a GPU: pass its device and stream"))?;
                Exec::Gpu(Box::new(GpuExec::new(gpu.dev, gpu.stream, &config)?))
            }
            _ => return Err(AttnError::MissingKernel { what: "forward on this backend", missing: "its executor in attn_rs::forward" }),
        };
        static NEXT_ID: AtomicU64 = AtomicU64::new(1);
        let id = NEXT_ID.fetch_add(1, Ordering::Relaxed);
        Ok(Attention { id, config, spec, backend, exec, timer: Timer::default(), capturing: None, cache_owners: CacheOwners::default() })
    }

    /// The exchange of a context-parallel rank ([`ForwardConfig::context_parallel`]): how its
    /// decode results reach the other ranks ([`NcclExchange`](crate::context_parallel) across
    /// GPUs, [`LocalGroup`](crate::context_parallel::LocalGroup) for ranks on one device).
    /// Needed before the first `forward` of a group of two or more.
    ///
    /// Errors: a config without context parallelism, or an exchange of another rank or size.
    pub fn set_cp_exchange(&mut self, exchange: Box<dyn CpExchange>) -> Result<()> {
        let Some(shard) = self.config.context_parallel else {
            return Err(AttnError::invalid("exchange", "the config has no context_parallel group"));
        };
        ensure(exchange.rank() == shard.rank && exchange.world_size() == shard.world_size, "exchange", || {
            format!("is rank {} of {}, the config's is rank {} of {}", exchange.rank(), exchange.world_size(), shard.rank, shard.world_size)
        })?;
        match &mut self.exec {
            Exec::Gpu(g) => {
                g.set_cp_exchange(exchange);
                Ok(())
            }
            Exec::Cpu => Err(AttnError::invalid("backend", "context parallelism runs on the GPU backends")),
        }
    }

    /// The backend the [`Selection`] chose.
    pub fn backend(&self) -> &'static BackendSpec {
        self.backend
    }

    /// The configuration it was made with.
    pub fn config(&self) -> &ForwardConfig {
        &self.config
    }

    /// The layout of each layer's cache (allocate `cache_spec().num_elements()` elements of the
    /// model's cache dtype per layer).
    pub fn cache_spec(&self) -> CacheSpec {
        self.spec
    }

    /// Whether layers take [`LayerIo::Gpu`] (else [`LayerIo::Cpu`]).
    pub fn runs_on_gpu(&self) -> bool {
        matches!(self.exec, Exec::Gpu(_))
    }

    /// The stream a GPU backend enqueues on.
    pub fn stream(&self) -> Option<&Arc<CudaStream>> {
        match &self.exec {
            Exec::Gpu(g) => Some(&g.stream),
            Exec::Cpu => None,
        }
    }

    /// Per-step metadata for this model (allocated once, rebuilt every step with
    /// [`StepMetadata::build`]); on the GPU its upload buffers are sized for `config.limits`.
    pub fn new_step_metadata(&self) -> Result<StepMetadata> {
        self.refuse_while_capturing()?;
        match &self.exec {
            Exec::Cpu => Ok(StepMetadata::new(self.id, self.config.clone(), None, None, None)),
            Exec::Gpu(g) => {
                // The builder checks, splits and packs; decode is planned for the tensor cores
                // by the step's own planner.
                let mut builder = MetadataBuilder::new(g.plan_config(&self.config))?;
                if self.config.context_parallel.is_some() {
                    builder.take_empty_contexts();
                }
                let plans = g.step_planner(&self.config, &self.spec)?;
                let step = StepMetadata::new(self.id, self.config.clone(), Some(builder), Some(g.device_step(&self.config)?), Some(plans));
                Ok(step.with_local_steps(self.local_steps(g)?))
            }
        }
    }

    /// The local batches a tensor-core step cuts for its chunked local layers, each with
    /// metadata of its own: planned as any step (no cascade), as large as the largest local
    /// batch (`kernel_limits`).
    fn local_steps(&self, g: &GpuExec) -> Result<Vec<LocalStep>> {
        if !matches!(self.spec, CacheSpec::Paged(_)) {
            return Ok(Vec::new());
        }
        let config = self.local_batch_config();
        self.config
            .local_batch_chunks()
            .into_iter()
            .map(|chunk| {
                let batch = LocalBatch::new(chunk, self.config.model.block_size)?;
                let builder = MetadataBuilder::new(g.plan_config(&config))?;
                let plans = g.step_planner(&config, &self.spec)?;
                let step = StepMetadata::new(self.id, config.clone(), Some(builder), Some(g.device_step(&config)?), Some(plans));
                Ok(LocalStep::new(batch, step))
            })
            .collect()
    }

    /// The config of a local batch's step: as large as the largest local batch
    /// (`kernel_limits`), no cascade.
    fn local_batch_config(&self) -> ForwardConfig {
        ForwardConfig { cascade: CascadeMode::Off, limits: self.config.kernel_limits(), ..self.config.clone() }
    }

    /// A CUDA-graph step for `bucket` (padded to it: see [`GraphBucket`]): build it every step
    /// like any step, run the layers eagerly or [`capture`](Self::capture) them once and
    /// [`replay`](StepGraph::replay). Layer tensors must hold `bucket.num_tokens()` rows.
    ///
    /// Errors: a backend that declares no graph support (`cpu`), or not the bucket's (mixed
    /// buckets need [`GraphSupport::Always`]), a bucket past the limits, a uniform bucket's
    /// query length past `decode_threshold`.
    pub fn new_graph_step(&self, bucket: GraphBucket) -> Result<StepMetadata> {
        let support = self.backend.graph_support;
        let Exec::Gpu(g) = &self.exec else {
            return Err(AttnError::invalid("backend", format!("\"{}\" has no CUDA graphs (graph support: {support})", self.backend.name)));
        };
        self.refuse_while_capturing()?;
        ensure(self.config.context_parallel.is_none(), "context_parallel", || {
            "graph steps are not sharded: run context-parallel steps eagerly".into()
        })?;
        ensure(support != GraphSupport::Never, "backend", || format!("\"{}\" declares no CUDA-graph support", self.backend.name))?;
        let l = &self.config.limits;
        ensure(bucket.num_reqs() <= l.max_num_reqs && bucket.num_tokens() <= l.max_num_tokens, "bucket", || {
            format!("{bucket:?} exceeds the limits ({} requests, {} tokens)", l.max_num_reqs, l.max_num_tokens)
        })?;
        let t = self.config.decode_threshold;
        match bucket {
            GraphBucket::Uniform { query_len, .. } => {
                ensure((1..=t).contains(&query_len), "bucket", || {
                    format!("query_len {query_len} (uniform graph steps are decodes: 1..={t}, the decode threshold)")
                })?;
                ensure(query_len == 1 || support <= GraphSupport::UniformBatch, "bucket", || {
                    format!("query_len {query_len}: \"{}\" captures one-token decodes only", self.backend.name)
                })?;
            }
            GraphBucket::Mixed { .. } => {
                ensure(support == GraphSupport::Always, "bucket", || format!("{bucket:?}: \"{}\" captures {support}", self.backend.name))?
            }
        }
        let graph_step = |g: &GpuExec, config: &ForwardConfig, bucket: GraphBucket| -> Result<StepMetadata> {
            let planner = g.graph_planner(config, &self.spec, bucket)?;
            let device = g.graph_device_step(planner.total_words())?;
            Ok(StepMetadata::new_graph(self.id, config.clone(), planner, device))
        };
        // Chunked local layers run on local batches held by graph steps of their own.
        let mut local = Vec::new();
        if matches!(self.spec, CacheSpec::Paged(_)) {
            let config = self.local_batch_config();
            for chunk in self.config.local_batch_chunks() {
                let b = local_batch_bucket(bucket, chunk);
                local.push(LocalStep::new(LocalBatch::new(chunk, self.config.model.block_size)?, graph_step(g, &config, b)?));
            }
        }
        Ok(graph_step(g, &self.config, bucket)?.with_local_steps(local))
    }

    /// Captures what `record` enqueues on this Attention's stream (typically every layer's
    /// [`forward`](Self::forward) with `step`, and the engine's own kernels between them) into a
    /// CUDA graph for `step`'s bucket. `step` must be a built graph step of this Attention; the
    /// capture runs nothing. Timing is off during the capture. Layers may also run other built
    /// graph steps of this Attention (an encoder-decoder model's cross-attention step, built
    /// for the same batch); the graph holds them too, and each replay reads their last builds.
    ///
    /// The graph replays on the memory the recorded calls used, so it holds all of it (see
    /// [`StepGraph`]): the step's device buffer, this Attention's workspaces and status words,
    /// and every buffer a recorded `forward` takes, which must therefore be a
    /// [`SharedBuf`](crate::buffer::SharedBuf) ([`DevIn::shared`](crate::DevIn::shared),
    /// [`DevOut::shared`](crate::DevOut::shared), or their `shared_range`s for parts of one
    /// buffer): a borrowed one is refused, naming the argument, before anything is enqueued.
    /// Also refused while recording: a `forward` with a step that is not a graph step, making
    /// steps, and another Attention's `forward` or a step's `build` on the stream being captured
    /// (the graph would not hold their memory). The engine's own kernels are its own to keep
    /// alive.
    pub fn capture(&mut self, step: &StepMetadata, record: impl FnOnce(&mut Attention) -> Result<()>) -> Result<StepGraph> {
        ensure(step.owner == self.id, "step", || "was made by another Attention".into())?;
        let bucket = step.graph_bucket().ok_or_else(|| AttnError::invalid("step", "is not a graph step (use new_graph_step)"))?;
        ensure(step.is_built(), "step", || "must be built before the capture".into())?;
        let Exec::Gpu(g) = &self.exec else { return Err(AttnError::invalid("backend", "captures need a GPU backend")) };
        self.refuse_while_capturing()?;
        let stream = g.stream.clone();
        let capture = Capture::new(step, g.keep_alive(), self.timer.enabled)?;
        // Timing events recorded into the graph would be this Attention's (freed with it).
        self.timer.enabled = false;
        self.capturing = Some(capture);
        let in_progress = CaptureInProgress::begin();
        let graph = capture_stream(&stream, || record(self));
        drop(in_progress);
        let capture = self.capturing.take().expect("set above");
        self.timer.enabled = capture.timing_after;
        Ok(capture.into_graph(graph?, stream, self.id, bucket))
    }

    fn refuse_while_capturing(&self) -> Result<()> {
        ensure(self.capturing.is_none(), "capture", || "is recording: this call cannot be made inside it".into())
    }

    /// One layer of one step, for a config whose layers all share one setting (no
    /// [`layers`](ForwardConfig::layers) list): writes the step's new K/V into `layer.cache` at
    /// the step's slots, then computes attention for every request into `layer.out`, the decode
    /// part (requests `0..num_decodes`, at most `decode_threshold` query tokens each) with paged
    /// decode and the prefill part with prefill attention over the paged cache (causal, aligned
    /// to the end of each sequence: chunked prefill).
    ///
    /// Everything is checked before anything is written or launched; a refusal names the
    /// argument. On the GPU the work is enqueued on the stream and nothing synchronises (see
    /// [`check_status`](Self::check_status)).
    ///
    /// Errors: also a config that lists its layers (`layer`): their settings differ, so the call
    /// must say which it runs ([`forward_layer`](Self::forward_layer)).
    pub fn forward(&mut self, step: &StepMetadata, layer: LayerIo<'_>) -> Result<()> {
        let n = self.config.layers.len();
        ensure(n == 0, "layer", || {
            format!("not given: the config lists {n} layers, each with its own setting (call forward_layer with the layer's index)")
        })?;
        let spec = LayerSpec::uniform(&self.config.model, self.config.opts);
        self.run_layer(step, (0, spec), layer)
    }

    /// Layer `layer` (an index into [`ForwardConfig::layers`], or any index when the config
    /// lists none) of one step, with that layer's [`LayerSpec`]:
    /// - a decoder writes the step's new K/V into its cache and attends as
    ///   [`forward`](Self::forward) does (its window, soft-cap, chunks, ALiBi, sinks, scale);
    /// - a KV-sharing decoder writes nothing ([`NewKv::None`](super::NewKv::None)) and reads the
    ///   cache buffer its target layer was given in its last call, which must come first;
    /// - an encoder-only layer attends each request's own new K/V, bidirectionally (within its
    ///   symmetric window), and writes no cache: every request of the step must be whole
    ///   (`seq_len` = its query tokens);
    /// - an encoder layer does the same and also writes its new K/V into its cache at the
    ///   step's slots;
    /// - a cross-attention layer (encoder-decoder) writes nothing and attends, non-causally,
    ///   every key of each request's encoder sequence in the cache its encoder layer was given:
    ///   its `step` is built over that cache (`seq_lens` the encoder lengths, the encoder's block
    ///   tables, query tokens the decoder's).
    ///
    /// Errors: as `forward`, and `layer` past the config's list, naming both.
    pub fn forward_layer(&mut self, step: &StepMetadata, layer: usize, io: LayerIo<'_>) -> Result<()> {
        let spec = self.config.layer(layer)?;
        self.run_layer(step, (layer, spec), io)
    }

    fn run_layer(&mut self, step: &StepMetadata, (index, ls): (usize, LayerSpec), layer: LayerIo<'_>) -> Result<()> {
        ensure(step.owner == self.id, "step", || "was made by another Attention (use its new_step_metadata)".into())?;
        let stride = step.kernel_block_table_stride();
        let owners = &mut self.cache_owners;
        match (&mut self.exec, layer) {
            (Exec::Cpu, LayerIo::Cpu(l)) => {
                validate_layer(&self.config, (index, &ls), &self.spec, step, stride, &l)?;
                track_cache(owners, index, &ls, l.cache.buf_addr())?;
                forward_cpu(&self.config, &ls, &self.spec, step, l, &mut self.timer)
            }
            (Exec::Gpu(g), LayerIo::Gpu(l)) => {
                // A chunked local layer runs on the step's local batch, its chunks cut there:
                // the kernels see requests that start at a chunk, and no chunk mask.
                let (run_ls, run_step) = match step.local_step(&ls) {
                    Some(local) => (ls.without_chunks(), local),
                    None => (ls, step),
                };
                match &mut self.capturing {
                    // The graph holds the local batch's step too, and replays its last build.
                    Some(capture) => capture.take(run_step, &l)?,
                    None => refuse_foreign_capture(&g.stream, "stream", "another Attention's forward")?,
                }
                validate_layer(&self.config, (index, &ls), &self.spec, step, stride, &l)?;
                track_cache(owners, index, &ls, l.cache.buf_addr())?;
                match &self.spec {
                    CacheSpec::Paged(spec) => g.forward(&self.config, &run_ls, spec, run_step, l, &mut self.timer),
                    CacheSpec::Mla(spec) => g.forward_mla(&self.config, &ls, spec, step, l, &mut self.timer),
                }
            }
            (_, layer) => Err(AttnError::invalid(
                "layer",
                format!(
                    "tensors in {} memory, but backend \"{}\" takes {} tensors",
                    layer.location(),
                    self.backend.name,
                    if self.runs_on_gpu() { "GPU" } else { "host" }
                ),
            )),
        }
    }

    /// Writes `step`'s new keys and values into the cache of layer `layer`, a cross-attention
    /// layer with a cache of its own ([`LayerSpec::cross_attention_own`]), at the step's slots,
    /// and attends nothing: the encoder-decoder models whose every decoder layer projects the
    /// encoder's output into keys and values of its own (Whisper, BART) fill each such cache
    /// once per request, in the encoder's step (built over the encoder tokens, the encoder
    /// blocks' slots). The layer's `forward_layer` then reads that cache.
    ///
    /// Errors: another kind of layer (`layer`), `NewKv::None` (`new_kv`), and what
    /// `forward_layer` refuses of `new_kv`, `cache` and `kv_scales`. Not inside a
    /// [`capture`](Self::capture).
    pub fn write_kv(&mut self, step: &StepMetadata, layer: usize, io: KvWriteIo<'_>) -> Result<()> {
        ensure(step.owner == self.id, "step", || "was made by another Attention (use its new_step_metadata)".into())?;
        self.refuse_while_capturing()?;
        let ls = self.config.layer(layer)?;
        match (&mut self.exec, io) {
            (Exec::Cpu, KvWriteIo::Cpu(w)) => {
                validate_write(&self.config, (layer, &ls), &self.spec, step, &w)?;
                self.cache_owners.record(layer, w.cache.buf_addr());
                super::cpu_exec::write_cpu(&self.config, &self.spec, step, w)
            }
            (Exec::Gpu(g), KvWriteIo::Gpu(w)) => {
                refuse_foreign_capture(&g.stream, "stream", "another Attention's write_kv")?;
                validate_write(&self.config, (layer, &ls), &self.spec, step, &w)?;
                self.cache_owners.record(layer, w.cache.buf_addr());
                match &self.spec {
                    CacheSpec::Paged(spec) => g.write_kv(spec, step, w),
                    CacheSpec::Mla(_) => Err(AttnError::invalid("layer", "MLA layers write their cache in forward_layer")),
                }
            }
            (_, _) => Err(AttnError::invalid(
                "io",
                format!(
                    "tensors in the wrong memory for backend \"{}\" (it takes {} tensors)",
                    self.backend.name,
                    if self.runs_on_gpu() { "GPU" } else { "host" }
                ),
            )),
        }
    }

    /// Measure each layer's cache write and attention from now on (events on the GPU). Inside a
    /// [`capture`](Self::capture), from its end.
    pub fn set_timing(&mut self, on: bool) {
        match &mut self.capturing {
            Some(capture) => capture.timing_after = on,
            None => self.timer.enabled = on,
        }
    }

    /// The times measured since the last call (on the GPU this waits for the layers enqueued).
    pub fn take_times(&mut self) -> Result<PhaseTimes> {
        self.timer.take()
    }

    /// On the GPU: waits for the stream and reports any slot or block id the kernels refused
    /// (`SlotOutOfRange`, `BlockOutOfRange`); the CPU backend reports them from `forward`.
    pub fn check_status(&mut self) -> Result<()> {
        match &mut self.exec {
            Exec::Gpu(g) => g.check_status(),
            Exec::Cpu => Ok(()),
        }
    }
}
