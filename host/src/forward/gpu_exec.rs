//! The GPU backends' forward, every array of the step's metadata read from its one upload
//! ([`StepMetadata`]): `tensor-core` runs `reshape_and_cache`, then `paged_decode` for the
//! decode part and the tensor-core `prefill` for the prefill part; `mla` runs
//! `concat_and_cache_mla`, then `mla_attention` (latent form) for both parts.

use super::cascade_exec::CascadeScratch;
use super::config::ForwardConfig;
use super::cp_exec::CpRank;
use super::graph_plan::{GraphBucket, GraphPlanner, GraphPrefillKernel};
use super::held::Held;
use super::io::CacheSpec;
use super::io::{GpuLayer, KvCacheWrite, Layer, NewKv};
use super::layers::{AttentionType, LayerSpec};
use super::step::{DeviceStep, StepMetadata};
use super::step_plan::{PlanKind, StepPlanner};
use super::timing::Timer;
use super::validate::Parts;
use crate::batch::{DecodeBatch, DeviceBatch, PrefillBatch};
use crate::buffer::{DevIn, DevOut, KeepAlive};
use crate::cache_write::{concat_and_cache_mla_from, reshape_and_cache_from, KvScales, KvWrite, MlaWrite};
use crate::context_parallel::CpExchange;
use crate::decode::{decode_tc_kernel, merge_attn_states_from, paged_decode_from, DecodeArgs, DecodeWorkspace, MergeArgs, PlanSource};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};
use crate::metadata::{CascadeMode, LocalBatch, PlanConfig, StagingLayout, StagingSizes};
use crate::mla::{mla_attention_from, mla_tc_kernel, MlaArgs};
use crate::options::{PlanOptions, SplitMode};
use crate::prefill::{
    prefill_from, prefill_kernel_for, DevicePrefillPlan, PrefillArgs, PrefillKernel, PrefillKv, PrefillOptions, PrefillSource,
    PrefillWorkspace,
};
use crate::status::DeviceStatus;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

/// Query rows (tokens x query heads per kv head) a prefill launch surely takes for one request:
/// 65536 row tiles of at least 16 rows (one MMA tile).
pub(crate) const MAX_PREFILL_ROWS: usize = 16 * 65536;

/// The device, stream, workspaces and status word of a GPU [`Attention`](super::Attention).
///
/// What a captured graph's kernels use is [`Held`]: a graph takes a handle to each
/// ([`keep_alive`](Self::keep_alive)), so that dropping the `Attention` frees none of it while
/// the graph lives. The cascade scratch is not: it grows (reallocates), and graph steps never
/// cascade.
pub(crate) struct GpuExec {
    pub(crate) dev: Arc<AttnDevice>,
    pub(crate) stream: Arc<CudaStream>,
    decode_ws: Held<DecodeWorkspace>,
    prefill_ws: Held<PrefillWorkspace>,
    cascade_scratch: CascadeScratch,
    /// Cascade's shared prefix runs here, beside the suffixes on the main stream.
    side: Held<Option<SideStream>>,
    status: Held<DeviceStatus>,
    /// A context-parallel rank's parts and exchange (groups of two or more).
    cp: Option<CpRank>,
}

/// A second stream with its own split-K workspace and status word (so that nothing the two
/// streams touch makes one wait for the other), forked from and joined to the main stream
/// with events.
struct SideStream {
    stream: Arc<CudaStream>,
    ws: DecodeWorkspace,
    status: DeviceStatus,
    fork: CudaEvent,
    join: CudaEvent,
}

impl SideStream {
    fn new(main: &Arc<CudaStream>, partial_rows: usize, v_width: usize, max_reqs: usize, max_tokens: usize) -> Result<Self> {
        let ctx = main.context();
        let stream = ctx.new_stream()?;
        Ok(SideStream {
            ws: DecodeWorkspace::new(&stream, partial_rows, v_width, max_reqs, max_tokens)?,
            status: DeviceStatus::new(&stream)?,
            fork: ctx.new_event(None)?,
            join: ctx.new_event(None)?,
            stream,
        })
    }
}

impl GpuExec {
    /// Waits for both streams and reports what the kernels refused (see `DeviceStatus`).
    pub(crate) fn check_status(&mut self) -> Result<()> {
        if let Some(side) = &mut *self.side {
            side.status.check(&side.stream)?;
        }
        self.status.check(&self.stream)
    }
}

impl GpuExec {
    /// Workspaces for the largest step of `config` (split-K partials for
    /// `4 * sm_count * 8 * group` rows, as `DecodeWorkspace` suggests).
    pub(crate) fn new(dev: Arc<AttnDevice>, stream: Arc<CudaStream>, config: &ForwardConfig) -> Result<Self> {
        let m = &config.model;
        let group = m.num_q_heads / m.num_kv_heads;
        let l = &config.kernel_limits();
        // A request's prefill rows must fit one launch; the limits bound them.
        ensure(l.max_num_tokens.saturating_mul(group) <= MAX_PREFILL_ROWS, "limits", || {
            format!(
                "max_num_tokens {} x {group} query heads per kv head exceeds the {MAX_PREFILL_ROWS} rows of a prefill launch",
                l.max_num_tokens
            )
        })?;
        // Split-K partials are rows of V: MLA's are the 512 latent columns of its 576-wide rows.
        // Standard models get twice decode's need, so that a cascade prefix (every token of the
        // step as one request) can take 16 splits of 64 tokens x 32 heads (17 MB at d128).
        let (v_width, waves) = match config.cache_spec()? {
            super::io::CacheSpec::Mla(s) => (s.latent_dim, 4),
            super::io::CacheSpec::Paged(_) => (m.head_size, 8),
        };
        let partial_rows = waves * dev.sm_count() as usize * 8 * group;
        let decode_ws = DecodeWorkspace::new(&stream, partial_rows, v_width, l.max_num_reqs, l.max_num_tokens)?;
        let prefill_ws = PrefillWorkspace::new(&stream, l.max_num_tokens, l.max_num_reqs, group)?;
        let status = DeviceStatus::new(&stream)?;
        let standard = matches!(m.kind, crate::backend::AttentionKind::Standard);
        let side = match config.cascade {
            CascadeMode::Off => None,
            _ if !standard => None,
            _ => Some(SideStream::new(&stream, partial_rows, v_width, l.max_num_reqs, l.max_num_tokens)?),
        };
        Ok(GpuExec {
            dev,
            stream,
            decode_ws: Held::new(decode_ws),
            prefill_ws: Held::new(prefill_ws),
            cascade_scratch: CascadeScratch::default(),
            side: Held::new(side),
            status: Held::new(status),
            cp: CpRank::new(config.context_parallel),
        })
    }

    /// A context-parallel rank's exchange (a group of one has none to use).
    pub(crate) fn set_cp_exchange(&mut self, exchange: Box<dyn CpExchange>) {
        if let Some(cp) = &mut self.cp {
            cp.set_exchange(exchange);
        }
    }

    /// Handles to everything of this executor a captured graph uses (the device, whose modules
    /// hold the kernels; the workspaces, merge counters and status words): the graph keeps them.
    pub(crate) fn keep_alive(&self) -> Vec<KeepAlive> {
        vec![self.dev.clone(), self.decode_ws.keep_alive(), self.prefill_ws.keep_alive(), self.side.keep_alive(), self.status.keep_alive()]
    }

    /// The metadata builder's config (its checks and split).
    pub(crate) fn plan_config(&self, config: &ForwardConfig) -> PlanConfig {
        let m = &config.model;
        // The config must name a head size the decode kernels have (the builder validates it):
        // an MLA model's 576-wide rows take 128.
        let head_size = if matches!(m.kind, crate::backend::AttentionKind::Mla) { 128 } else { m.head_size };
        PlanConfig { decode_threshold: config.decode_threshold, num_q_heads: m.num_q_heads, num_kv_heads: m.num_kv_heads, head_size }
    }

    /// The step's device buffers, sized for the largest step.
    pub(crate) fn device_step(&self, config: &ForwardConfig) -> Result<DeviceStep> {
        let l = &config.kernel_limits();
        let (n, nt) = (l.max_num_reqs, l.max_num_tokens);
        let words = StagingLayout::new(&StagingSizes {
            num_reqs: n,
            block_table_stride: config.max_blocks_per_req(),
            num_actual_tokens: nt,
            num_decodes: n,
            num_prefills: n,
            num_work_items: n + self.decode_ws.partial_rows(),
            num_decode_tokens: nt,
        })
        .total_words;
        DeviceStep::new(self.stream.clone(), words)
    }

    /// A graph step's planner for `bucket`: the kernel its decodes run on, planned as eager
    /// decodes of that shape are, and for a mixed bucket the prefill kernel its tiles are cut
    /// for (the one eager prefills of the model run).
    pub(crate) fn graph_planner(&self, config: &ForwardConfig, spec: &CacheSpec, bucket: GraphBucket) -> Result<GraphPlanner> {
        let m = &config.model;
        let q = match bucket {
            GraphBucket::Uniform { query_len, .. } => query_len as u32,
            GraphBucket::Mixed { .. } => config.decode_threshold as u32,
        };
        let t = &config.tuning;
        let tc = match spec {
            // A graph runs whatever lengths its steps have: the kernels of long requests (16-bit
            // at width 128: two CTAs an SM, `keys_rows::HALF_LONG_KEYS`; FP8: the deep pipeline
            // where the device's DRAM is slow for its SMs, `AttnDevice::fp8_deep_pipeline`).
            CacheSpec::Paged(s) => {
                decode_tc_kernel(&self.dev, m.q_dtype, m.cache_dtype, s.layout, m.head_size, m.num_q_heads, m.num_kv_heads, q, u32::MAX, t)?
            }
            CacheSpec::Mla(_) => mla_tc_kernel(&self.dev, m.q_dtype, m.cache_dtype.fp8_format(), m.num_q_heads, q, t)?,
        };
        let prefill = match (bucket, spec) {
            (GraphBucket::Uniform { .. }, _) => None,
            (GraphBucket::Mixed { .. }, CacheSpec::Paged(_)) => {
                let k = prefill_kernel_for(self.dev.ptx_target(), m.q_dtype, m.cache_dtype, m.head_size, m.head_size, false)?;
                Some(GraphPrefillKernel { kernel: k.id, block_m: k.block_m, group: m.num_q_heads / m.num_kv_heads })
            }
            (GraphBucket::Mixed { .. }, CacheSpec::Mla(_)) => {
                return Err(AttnError::invalid("bucket", "MLA graph steps take uniform decode buckets"));
            }
        };
        // One tile list for each kernel that runs some layer of the model over the whole step.
        let mut whole_step: Vec<GraphPrefillKernel> = Vec::new();
        if let CacheSpec::Paged(_) = spec {
            let specs = match config.layers.is_empty() {
                true => vec![LayerSpec::uniform(m, config.opts)],
                false => config.layers.clone(),
            };
            for ls in &specs {
                if let Some(k) = self.whole_step_kernel(config, ls, bucket)? {
                    if !whole_step.iter().any(|w| w.kernel == k.id) {
                        whole_step.push(GraphPrefillKernel { kernel: k.id, block_m: k.block_m, group: m.num_q_heads / m.num_kv_heads });
                    }
                }
            }
        }
        let (mode, width, partial) = (config.split_mode, config.max_blocks_per_req(), self.decode_ws.partial_rows());
        GraphPlanner::new(bucket, config.decode_threshold, tc, mode, m.num_q_heads, width, partial, prefill, &whole_step)
    }

    /// The prefill kernel that runs layer `ls` of a graph step for `bucket` as one launch over
    /// the whole step, decodes included, if it runs so: chunked local attention (the decode
    /// kernels have no chunk mask) unless the step runs it as a local batch (chunks of whole
    /// blocks, [`local_batch_bucket`]), encoder and encoder-only layers (each request's own new K/V, packed, in the queries'
    /// type), and cross-attention when a decode may have several query tokens, which the decode
    /// kernels would mask among their last keys.
    fn whole_step_kernel(&self, config: &ForwardConfig, ls: &LayerSpec, bucket: GraphBucket) -> Result<Option<PrefillKernel>> {
        let m = &config.model;
        let decode_len = match bucket {
            GraphBucket::Uniform { query_len, .. } => query_len,
            GraphBucket::Mixed { .. } => config.decode_threshold,
        };
        if let Some(chunk) = ls.opts.chunk_size.filter(|_| ls.attn_type == AttentionType::Decoder) {
            let chunk = chunk as usize;
            if config.chunk_of_whole_blocks(chunk) {
                return Ok(None);
            }
        }
        let local = ls.opts.chunk_size.is_some() || ls.opts.symmetric_window.is_some();
        // The K/V's type: the step's own K/V (the queries' type), or the cache's.
        let kv = match ls.attn_type {
            AttentionType::EncoderOnly | AttentionType::Encoder => m.q_dtype,
            AttentionType::EncoderDecoder if decode_len > 1 => m.cache_dtype,
            // Chunks that are not whole blocks (16-bit caches only: `Attention::new` refuses FP8).
            AttentionType::Decoder if ls.opts.chunk_size.is_some() => m.cache_dtype,
            AttentionType::EncoderDecoder | AttentionType::Decoder => return Ok(None),
        };
        prefill_kernel_for(self.dev.ptx_target(), m.q_dtype, kv, m.head_size, m.head_size, local).map(Some)
    }

    /// A graph step's tiles of the whole step for layer `ls`, if it runs so (see
    /// [`whole_step_kernel`](Self::whole_step_kernel)); `None` for other steps.
    fn graph_whole_step_plan(&self, config: &ForwardConfig, ls: &LayerSpec, step: &StepMetadata) -> Result<Option<DevicePrefillPlan>> {
        let Some(bucket) = step.graph_bucket() else { return Ok(None) };
        let Some(k) = self.whole_step_kernel(config, ls, bucket)? else { return Ok(None) };
        step.device_whole_step_plan(k.id)
            .map(Some)
            .ok_or_else(|| AttnError::invalid("step", format!("is a graph step without tiles for kernel {} (a planner bug)", k.id)))
    }

    /// The per-step planner of the decode kernels (and cascade's arrays).
    pub(crate) fn step_planner(&self, config: &ForwardConfig, spec: &CacheSpec) -> Result<StepPlanner> {
        let m = &config.model;
        let kind = match spec {
            CacheSpec::Paged(s) => PlanKind::Standard { head_size: m.head_size, num_kv_heads: m.num_kv_heads, layout: s.layout },
            CacheSpec::Mla(_) => PlanKind::Mla,
        };
        let l = &config.limits;
        let words = 4096 + 8 * l.max_num_reqs + 2 * l.max_num_tokens;
        let partial = self.decode_ws.partial_rows();
        let plan = config.plan_options();
        StepPlanner::new(self.dev.clone(), self.stream.clone(), kind, m.q_dtype, m.cache_dtype, m.num_q_heads, plan, partial, words)
    }

    /// A graph step's device buffer.
    pub(crate) fn graph_device_step(&self, words: usize) -> Result<DeviceStep> {
        DeviceStep::new(self.stream.clone(), words)
    }

    /// Runs a validated layer: the GPU-only checks (alignment), then the cache write, the decode
    /// part and the prefill part, enqueued on the stream.
    pub(crate) fn forward(
        &mut self,
        config: &ForwardConfig,
        ls: &LayerSpec,
        spec: &KvCacheSpec,
        step: &StepMetadata,
        layer: GpuLayer<'_>,
        timer: &mut Timer,
    ) -> Result<()> {
        // A graph step runs some layers as one prefill over the whole step from its own tiles;
        // the others, in a mixed bucket, as its decode plan and prefill tiles.
        let graph_whole = self.graph_whole_step_plan(config, ls, step)?;
        let mixed_graph = step.device_prefill_plan().filter(|_| graph_whole.is_none());
        if ls.attn_type.attends_new_kv() {
            return self.forward_encoder(ls, spec, step, layer, graph_whole.as_ref(), timer);
        }
        let views = StepViews::of(step, &self.stream)?;
        // The decode plan is already on the device: a graph step's (nothing is uploaded:
        // capturable), or the one `build` made for every layer of the step.
        let plans = step.step_plans();
        let graph_plan = step.device_plan().or_else(|| plans.and_then(|p| p.decode.clone()));
        let Layer { q, q_rows, new_kv, mut cache, mut out, out_rows, alibi_slopes, sinks, kv_scales } = layer;
        // An FP8 cache's scales, as each op takes them.
        let scales = || kv_scales.as_ref().map(|(k, v)| KvScales { k: k.tail(0), v: v.tail(0) });
        // A KV-sharing layer has no new K/V: it reads its target's cache as it is.
        let new_kv = match new_kv {
            NewKv::Standard { k, k_rows, v, v_rows } => Some((k, k_rows, v, v_rows)),
            NewKv::None => None,
            NewKv::Mla { .. } => return Err(AttnError::invalid("new_kv", "MLA latents given for a standard-attention model")),
        };
        check_aligned("q", q.ptr, q.dtype, &q_rows)?;
        if let Some((k, k_rows, v, v_rows)) = &new_kv {
            check_aligned("k", k.ptr, k.dtype, k_rows)?;
            check_aligned("v", v.ptr, v.dtype, v_rows)?;
        }
        check_aligned("out", out.ptr, out.dtype, &out_rows)?;
        ensure(cache.ptr.is_multiple_of(16), "cache", || format!("address {:#x} is not 16-byte aligned", cache.ptr))?;
        let split = step.split();
        let (nd, ndt, np, npt) = (split.num_decodes, split.num_decode_tokens, split.num_prefills, split.num_prefill_tokens);
        let parts = Parts::of(step);
        let (stream, nt, stride) = (&self.stream, views.num_tokens, views.stride());

        let start = timer.mark(Some(stream))?;
        if let Some((k, k_rows, v, v_rows)) = new_kv {
            let write = kv_write(spec, &views, (k, k_rows, v, v_rows), &mut cache, scales());
            reshape_and_cache_from(&self.dev, stream, write, &mut self.status)?;
        }
        let written = timer.mark(Some(stream))?;

        let cache = cache.as_input();
        let mixed = mixed_graph.as_ref().zip(graph_plan.as_ref());
        if let Some((_, dp)) = mixed {
            // A mixed graph step: both kernels take the whole padded batch and find their own
            // requests through their plans (the decodes', then the prefills' tiles below).
            let host = DecodeBatch { seq_lens: step.seq_lens(), query_start_loc: step.query_start_loc() };
            let all = views.decodes(step.num_reqs());
            let args = DecodeArgs {
                q: q.tail(0),
                q_rows: RowsDesc { num_tokens: nt, ..q_rows },
                cache: cache.tail(0),
                spec: *spec,
                block_table: all.block_table,
                block_table_stride: stride,
                out: out.tail_mut(0),
                out_rows: RowsDesc { num_tokens: nt, ..out_rows },
                lse: None,
                alibi_slopes: alibi_slopes.as_ref().map(|b| b.tail(0)),
                sinks: sinks.as_ref().map(|b| b.tail(0)),
                scales: scales(),
            };
            let meta = DeviceBatch { seq_lens: all.seq_lens, query_start_loc: all.query_start_loc, key_start_loc: None };
            let (source, opts) = (PlanSource::Device(dp), &ls.opts);
            paged_decode_from(&self.dev, stream, args, &host, meta, opts, source, true, &mut self.decode_ws, &mut self.status)?;
        }
        // One prefill over the whole step (every request's arrays, the first `nt` rows of the
        // queries and outputs): a mixed graph step's prefill part, or a chunked local layer.
        let mut whole_step_prefill = |source: PrefillSource<'_>| -> Result<()> {
            let part = views.decodes(step.num_reqs());
            let batch = PrefillBatch { query_start_loc: step.query_start_loc(), seq_lens: step.seq_lens(), key_start_loc: None };
            let args = PrefillArgs {
                q: q.tail(0),
                q_rows: RowsDesc { num_tokens: nt, ..q_rows },
                kv: PrefillKv::Paged { cache: cache.tail(0), spec: *spec, block_table: part.block_table, block_table_stride: stride },
                out: out.tail_mut(0),
                out_rows: RowsDesc { num_tokens: nt, ..out_rows },
                lse: None,
                alibi_slopes: alibi_slopes.as_ref().map(|b| b.tail(0)),
                sinks: sinks.as_ref().map(|b| b.tail(0)),
                scales: scales(),
            };
            let meta = DeviceBatch { seq_lens: part.seq_lens, query_start_loc: part.query_start_loc, key_start_loc: None };
            let opts = PrefillOptions { attn: ls.opts, causal: ls.attn_type.is_causal() };
            prefill_from(&self.dev, stream, args, &batch, meta, &opts, source, &mut self.prefill_ws, &mut self.status).map(|_| ())
        };
        // Cross-attention's one-token decodes see every encoder key, as the decode kernels
        // do; a decode of several tokens would be masked among its last keys.
        let cross = ls.attn_type == AttentionType::EncoderDecoder;
        let whole_step = match step.graph_bucket() {
            Some(_) => graph_whole.is_some(),
            None => ls.opts.chunk_size.is_some() || (cross && ndt != nd),
        };
        if let Some(wp) = &graph_whole {
            whole_step_prefill(PrefillSource::Device(wp))?;
        } else if let Some((pp, _)) = mixed {
            whole_step_prefill(PrefillSource::Device(pp))?;
        } else if whole_step && step.num_reqs() > 0 && nt > 0 {
            // The decode kernels have no chunk mask: the whole step, decodes included, is one
            // prefill over the paged cache (a decode is a request of one query token), causal
            // for chunks, not across to the encoder.
            whole_step_prefill(PrefillSource::Host)?;
        }
        if mixed.is_some() || whole_step {
            let end = timer.mark(Some(stream))?;
            timer.layer([start, written, end]);
            return Ok(());
        }
        // Cascade (the step's shared prefix once for all tokens) unless the layer has ALiBi or
        // sinks, whose terms depend on the whole context.
        let cascade = step.cascade_prefix().filter(|_| alibi_slopes.is_none() && sinks.is_none());
        let hq = q_rows.num_heads;
        let all_out_rows = RowsDesc { num_tokens: nt, ..out_rows };
        let targets = match cascade {
            Some(_) => Some(self.cascade_scratch.targets(stream, out.dtype, all_out_rows.required_len(), nt * hq)?),
            None => None,
        };
        let cascade_plans = plans.filter(|_| cascade.is_some());
        if cascade.is_some() {
            // The prefix reads the cache the write above filled: fork the side stream here.
            let side = self.side.as_mut().expect("cascade configs have a side stream");
            side.fork.record(stream)?;
            side.stream.wait(&side.fork)?;
        }
        let suffix_lens = |from: usize, len: usize| {
            let base = cascade_plans.map_or(0, |p| p.suffix_seq_lens);
            DevIn::owned(base + from as u64 * 4, len, DType::I32)
        };
        let skip = cascade.map_or(0, |p| p.blocks);
        let host_suffix = step.cascade_suffix_lens();
        {
            // The parts write the layer's output, or (cascade) the suffix scratch and its LSEs.
            let (mut target, mut target_lse) = match &targets {
                Some(t) => {
                    let (o, l) = t.suffix();
                    (o, Some(l))
                }
                None => (out.tail_mut(0), None),
            };
            if nd > 0 {
                let part = views.decodes(nd);
                let batch = match cascade {
                    Some(_) => DecodeBatch { seq_lens: &host_suffix[..nd], ..parts.decode },
                    None => parts.decode,
                };
                let args = DecodeArgs {
                    q: q.tail(0),
                    q_rows: RowsDesc { num_tokens: ndt, ..q_rows },
                    cache: cache.tail(0),
                    spec: *spec,
                    block_table: part.block_table.tail(skip),
                    block_table_stride: stride,
                    out: target.tail_mut(0),
                    out_rows: RowsDesc { num_tokens: ndt, ..out_rows },
                    lse: target_lse.as_mut().map(|l| l.tail_mut(0)),
                    alibi_slopes: alibi_slopes.as_ref().map(|b| b.tail(0)),
                    sinks: sinks.as_ref().map(|b| b.tail(0)),
                    scales: scales(),
                };
                let meta = DeviceBatch {
                    seq_lens: if cascade.is_some() { suffix_lens(0, nd) } else { part.seq_lens },
                    query_start_loc: part.query_start_loc,
                    key_start_loc: None,
                };
                let source = graph_plan.as_ref().map_or(PlanSource::Host(config.plan_options()), PlanSource::Device);
                let (opts, ws, status) = (&ls.opts, &mut self.decode_ws, &mut self.status);
                match &mut self.cp {
                    None => paged_decode_from(&self.dev, stream, args, &batch, meta, opts, source, true, ws, status).map(|_| ())?,
                    Some(cp) => {
                        let (out, out_rows, sinks) = (args.out, args.out_rows, args.sinks.filter(|_| cp.takes_sinks()));
                        cp.decode(&self.dev, stream, (out, out_rows), |part, lse| {
                            let mine = DecodeArgs { out: part, lse: Some(lse), sinks, ..args };
                            paged_decode_from(&self.dev, stream, mine, &batch, meta, opts, source, true, ws, status).map(|_| ())
                        })?
                    }
                }
            }
            if np > 0 {
                let part = views.prefills(np);
                let batch = match cascade {
                    Some(_) => PrefillBatch { seq_lens: &host_suffix[nd..], ..parts.prefill },
                    None => parts.prefill,
                };
                let args = PrefillArgs {
                    q: q.tail(ndt * q_rows.token_stride),
                    q_rows: RowsDesc { num_tokens: npt, ..q_rows },
                    kv: PrefillKv::Paged {
                        cache: cache.tail(0),
                        spec: *spec,
                        block_table: part.block_table.tail(skip),
                        block_table_stride: stride,
                    },
                    out: target.tail_mut(ndt * out_rows.token_stride),
                    out_rows: RowsDesc { num_tokens: npt, ..out_rows },
                    lse: target_lse.as_mut().map(|l| l.tail_mut(ndt * hq)),
                    alibi_slopes: alibi_slopes.as_ref().map(|b| b.tail(0)),
                    sinks: sinks.as_ref().map(|b| b.tail(0)),
                    scales: scales(),
                };
                let meta = DeviceBatch {
                    seq_lens: if cascade.is_some() { suffix_lens(nd, np) } else { part.seq_lens },
                    query_start_loc: part.query_start_loc,
                    key_start_loc: None,
                };
                // Cross-attention's prompts see every encoder key.
                let opts = PrefillOptions { attn: ls.opts, causal: ls.attn_type.is_causal() };
                prefill_from(&self.dev, stream, args, &batch, meta, &opts, PrefillSource::Host, &mut self.prefill_ws, &mut self.status)?;
            }
        }
        if let (Some(prefix), Some(t), Some(cp)) = (cascade, &targets, cascade_plans) {
            // The shared prefix: every token of the step as one request over the prefix's keys
            // (request 0's first blocks), no causal mask, split-K as decode plans it.
            let (prefix_out, prefix_lse) = t.prefix();
            let args = DecodeArgs {
                q: q.tail(0),
                q_rows: RowsDesc { num_tokens: nt, ..q_rows },
                cache: cache.tail(0),
                spec: *spec,
                block_table: views.first_row(),
                block_table_stride: stride,
                out: prefix_out,
                out_rows: all_out_rows,
                lse: Some(prefix_lse),
                alibi_slopes: None,
                sinks: None,
                scales: scales(),
            };
            let (lens, qsl) = ([prefix.tokens as i32], [0, nt as i32]);
            let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
            let auto = PlanOptions { split: SplitMode::Auto, tuning: config.tuning };
            let source = cp.prefix.as_ref().map_or(PlanSource::Host(auto), PlanSource::Device);
            let meta = DeviceBatch {
                seq_lens: DevIn::owned(cp.prefix_seq_len, 1, DType::I32),
                query_start_loc: DevIn::owned(cp.prefix_query_start_loc, 2, DType::I32),
                key_start_loc: None,
            };
            let side = self.side.as_mut().expect("cascade configs have a side stream");
            let (opts, ws) = (&ls.opts, &mut side.ws);
            paged_decode_from(&self.dev, &side.stream, args, &batch, meta, opts, source, false, ws, &mut side.status)?;
            side.join.record(&side.stream)?;
            stream.wait(&side.join)?;
            let [prefix_out, prefix_lse, suffix_out, suffix_lse] = t.partials();
            let merge = MergeArgs {
                prefix_out,
                prefix_lse,
                suffix_out,
                suffix_lse,
                out: out.tail_mut(0),
                out_lse: None,
                rows: all_out_rows,
                lse_strides: (hq, 1),
            };
            merge_attn_states_from(&self.dev, stream, merge)?;
        }
        let end = timer.mark(Some(stream))?;
        timer.layer([start, written, end]);
        Ok(())
    }
}

impl GpuExec {
    /// A validated [`Attention::write_kv`](super::Attention::write_kv): the step's new K/V
    /// into the cache at the step's slots.
    pub(crate) fn write_kv(&mut self, spec: &KvCacheSpec, step: &StepMetadata, w: KvCacheWrite<DevIn<'_>, DevOut<'_>>) -> Result<()> {
        let views = StepViews::of(step, &self.stream)?;
        let KvCacheWrite { new_kv, mut cache, kv_scales } = w;
        let NewKv::Standard { k, k_rows, v, v_rows } = new_kv else {
            return Err(AttnError::invalid("new_kv", "write_kv takes standard K/V (NewKv::Standard) for a paged cache"));
        };
        check_aligned("k", k.ptr, k.dtype, &k_rows)?;
        check_aligned("v", v.ptr, v.dtype, &v_rows)?;
        ensure(cache.ptr.is_multiple_of(16), "cache", || format!("address {:#x} is not 16-byte aligned", cache.ptr))?;
        let scales = kv_scales.as_ref().map(|(k, v)| KvScales { k: k.tail(0), v: v.tail(0) });
        let write = kv_write(spec, &views, (k, k_rows, v, v_rows), &mut cache, scales);
        reshape_and_cache_from(&self.dev, &self.stream, write, &mut self.status)
    }

    /// An encoder-only or encoder layer: every request's queries against its own new K/V
    /// (packed rows, `key_start_loc` = the step's `query_start_loc`), bidirectional, one prefill
    /// launch over the whole step. An encoder layer first writes the new K/V into its cache
    /// (for the cross-attention layers); an encoder-only layer touches no cache.
    /// `graph`: a graph step's tiles for the layer's kernel.
    fn forward_encoder(
        &mut self,
        ls: &LayerSpec,
        spec: &KvCacheSpec,
        step: &StepMetadata,
        layer: GpuLayer<'_>,
        graph: Option<&DevicePrefillPlan>,
        timer: &mut Timer,
    ) -> Result<()> {
        let views = StepViews::of(step, &self.stream)?;
        let Layer { q, q_rows, new_kv, mut cache, mut out, out_rows, alibi_slopes, sinks, kv_scales } = layer;
        let NewKv::Standard { k, k_rows, v, v_rows } = new_kv else {
            return Err(AttnError::invalid("new_kv", format!("an {} layer attends its new K/V (NewKv::Standard)", ls.attn_type)));
        };
        for (arg, b, rows) in [("q", &q, &q_rows), ("k", &k, &k_rows), ("v", &v, &v_rows)] {
            check_aligned(arg, b.ptr, b.dtype, rows)?;
        }
        check_aligned("out", out.ptr, out.dtype, &out_rows)?;
        let start = timer.mark(Some(&self.stream))?;
        if ls.attn_type.writes_cache() {
            ensure(cache.ptr.is_multiple_of(16), "cache", || format!("address {:#x} is not 16-byte aligned", cache.ptr))?;
            let scales = kv_scales.as_ref().map(|(k, v)| KvScales { k: k.tail(0), v: v.tail(0) });
            let write = kv_write(spec, &views, (k.tail(0), k_rows, v.tail(0), v_rows), &mut cache, scales);
            reshape_and_cache_from(&self.dev, &self.stream, write, &mut self.status)?;
        }
        let written = timer.mark(Some(&self.stream))?;
        let (stream, nt, n) = (&self.stream, views.num_tokens, step.num_reqs());
        if n > 0 && nt > 0 {
            let qsl = step.query_start_loc();
            // A graph step's padding requests have length 0 on the device, where no tile names
            // them; their packed keys are their query tokens, as the host's checks count them.
            let own_lens: Vec<i32> = (0..n).map(|r| qsl[r + 1] - qsl[r]).collect();
            let lens = if graph.is_some() { &own_lens[..] } else { step.seq_lens() };
            let batch = PrefillBatch { query_start_loc: qsl, seq_lens: lens, key_start_loc: Some(qsl) };
            // The whole step's arrays; its start locations are also its packed keys' starts.
            let (all, keys) = (views.decodes(n), views.decodes(n));
            let meta =
                DeviceBatch { seq_lens: all.seq_lens, query_start_loc: all.query_start_loc, key_start_loc: Some(keys.query_start_loc) };
            let rows = |r: RowsDesc| RowsDesc { num_tokens: nt, ..r };
            let args = PrefillArgs {
                q: q.tail(0),
                q_rows: rows(q_rows),
                kv: PrefillKv::Packed { k: k.tail(0), k_rows: rows(k_rows), v: v.tail(0), v_rows: rows(v_rows) },
                out: out.tail_mut(0),
                out_rows: rows(out_rows),
                lse: None,
                alibi_slopes: alibi_slopes.as_ref().map(|b| b.tail(0)),
                sinks: sinks.as_ref().map(|b| b.tail(0)),
                scales: None,
            };
            let opts = PrefillOptions { attn: ls.opts, causal: false };
            let source = graph.map_or(PrefillSource::Host, PrefillSource::Device);
            prefill_from(&self.dev, stream, args, &batch, meta, &opts, source, &mut self.prefill_ws, &mut self.status)?;
        }
        let end = timer.mark(Some(stream))?;
        timer.layer([start, written, end]);
        Ok(())
    }

    /// An MLA layer: the latent cache write, then latent attention for the decode part and the
    /// prefill part (the same kernel: any query length, causal among a request's new tokens).
    pub(crate) fn forward_mla(
        &mut self,
        config: &ForwardConfig,
        ls: &LayerSpec,
        spec: &MlaCacheSpec,
        step: &StepMetadata,
        layer: GpuLayer<'_>,
        timer: &mut Timer,
    ) -> Result<()> {
        let views = StepViews::of(step, &self.stream)?;
        // The decode plan is already on the device: a graph step's (nothing is uploaded:
        // capturable), or the one `build` made for every layer of the step.
        let plans = step.step_plans();
        let graph_plan = step.device_plan().or_else(|| plans.and_then(|p| p.decode.clone()));
        let Layer { q, q_rows, new_kv, mut cache, mut out, out_rows, alibi_slopes, sinks, kv_scales } = layer;
        // An FP8 cache's scales, as each op takes them.
        let scales = || kv_scales.as_ref().map(|(k, v)| KvScales { k: k.tail(0), v: v.tail(0) });
        let NewKv::Mla { kv_c, kv_c_token_stride, k_pe, k_pe_token_stride } = new_kv else {
            return Err(AttnError::invalid("new_kv", "standard K/V given for an MLA model"));
        };
        ensure(alibi_slopes.is_none(), "alibi_slopes", || "MLA attention takes no ALiBi slopes".into())?;
        ensure(sinks.is_none(), "sinks", || "MLA attention takes no sinks".into())?;
        check_aligned("q", q.ptr, q.dtype, &q_rows)?;
        check_aligned("out", out.ptr, out.dtype, &out_rows)?;
        ensure(cache.ptr.is_multiple_of(16), "cache", || format!("address {:#x} is not 16-byte aligned", cache.ptr))?;
        let split = step.split();
        let (nd, ndt, np, npt) = (split.num_decodes, split.num_decode_tokens, split.num_prefills, split.num_prefill_tokens);
        let parts = Parts::of(step);
        let (stream, nt, stride) = (&self.stream, views.num_tokens, views.stride());

        let start = timer.mark(Some(stream))?;
        let write = MlaWrite {
            kv_c,
            kv_c_token_stride,
            k_pe,
            k_pe_token_stride,
            num_tokens: nt,
            slot_mapping: views.slot_mapping(),
            cache: cache.tail_mut(0),
            spec: *spec,
            scale: kv_scales.as_ref().map(|(k, _)| k.tail(0)),
        };
        concat_and_cache_mla_from(&self.dev, stream, write, &mut self.status)?;
        let written = timer.mark(Some(stream))?;

        let cache = cache.as_input();
        let scale = ls.opts.softmax_scale;
        if nd > 0 {
            let part = views.decodes(nd);
            let args = MlaArgs {
                q: q.tail(0),
                q_rows: RowsDesc { num_tokens: ndt, ..q_rows },
                cache: cache.tail(0),
                spec: *spec,
                block_table: part.block_table,
                block_table_stride: stride,
                out: out.tail_mut(0),
                out_rows: RowsDesc { num_tokens: ndt, ..out_rows },
                lse: None,
                scales: scales(),
            };
            let meta = DeviceBatch { seq_lens: part.seq_lens, query_start_loc: part.query_start_loc, key_start_loc: None };
            let source = graph_plan.as_ref().map_or(PlanSource::Host(config.plan_options()), PlanSource::Device);
            let (ws, status) = (&mut self.decode_ws, &mut self.status);
            match &mut self.cp {
                None => mla_attention_from(&self.dev, stream, args, &parts.decode, meta, scale, source, ws, status).map(|_| ())?,
                Some(cp) => cp.decode(&self.dev, stream, (args.out, args.out_rows), |part, lse| {
                    let mine = MlaArgs { out: part, lse: Some(lse), ..args };
                    mla_attention_from(&self.dev, stream, mine, &parts.decode, meta, scale, source, ws, status).map(|_| ())
                })?,
            }
        }
        if np > 0 {
            let part = views.prefills(np);
            let args = MlaArgs {
                q: q.tail(ndt * q_rows.token_stride),
                q_rows: RowsDesc { num_tokens: npt, ..q_rows },
                cache: cache.tail(0),
                spec: *spec,
                block_table: part.block_table,
                block_table_stride: stride,
                out: out.tail_mut(ndt * out_rows.token_stride),
                out_rows: RowsDesc { num_tokens: npt, ..out_rows },
                lse: None,
                scales: scales(),
            };
            let batch = DecodeBatch { seq_lens: parts.prefill.seq_lens, query_start_loc: parts.prefill.query_start_loc };
            let meta = DeviceBatch { seq_lens: part.seq_lens, query_start_loc: part.query_start_loc, key_start_loc: None };
            let (source, ws) = (PlanSource::Host(config.plan_options()), &mut self.decode_ws);
            mla_attention_from(&self.dev, stream, args, &batch, meta, scale, source, ws, &mut self.status)?;
        }
        let end = timer.mark(Some(stream))?;
        timer.layer([start, written, end]);
        Ok(())
    }
}

/// The bucket of the graph step that holds the local batch of a graph step for `bucket`, whose
/// chunked local layers run on it: a one-token decode bucket's is the same bucket (a decode lies
/// in one chunk: one piece a request); a speculative decode bucket's and a mixed bucket's, a
/// mixed bucket of the same tokens with room for the pieces ([`LocalBatch::max_reqs`]): a
/// decode whose tokens cross a chunk start falls into two decodes of fewer tokens, which a
/// uniform bucket would not take.
pub(crate) fn local_batch_bucket(bucket: GraphBucket, chunk: usize) -> GraphBucket {
    match bucket {
        GraphBucket::Uniform { query_len: 1, .. } => bucket,
        GraphBucket::Uniform { .. } | GraphBucket::Mixed { .. } => {
            let (n, nt) = (bucket.num_reqs(), bucket.num_tokens());
            GraphBucket::mixed(LocalBatch::max_reqs(n, nt, chunk), nt)
        }
    }
}

/// A step's uploaded metadata as device views: the slot mapping, and each part's block table,
/// sequence lengths and start locations.
struct StepViews<'s> {
    words: DevIn<'s>,
    lay: &'s crate::metadata::StagingLayout,
    num_tokens: usize,
}

/// One part's (decodes' or prefills') device arrays.
struct PartViews<'a> {
    block_table: DevIn<'a>,
    seq_lens: DevIn<'a>,
    query_start_loc: DevIn<'a>,
}

impl<'s> StepViews<'s> {
    /// The step's views, after checking it was built for the GPU on `stream`.
    fn of(step: &'s StepMetadata, stream: &'s Arc<CudaStream>) -> Result<Self> {
        let dstep = step.device_step().ok_or_else(|| AttnError::invalid("step", "was not built for the GPU"))?;
        ensure(Arc::ptr_eq(&dstep.stream, stream), "step", || "was built on another stream".into())?;
        Ok(StepViews { words: DevIn::new(&dstep.words, stream), lay: &dstep.layout, num_tokens: step.num_actual_tokens() })
    }

    fn i32s(&self, offset: usize, len: usize) -> DevIn<'_> {
        self.words.view(offset * 4, len, DType::I32)
    }

    fn slot_mapping(&self) -> DevIn<'_> {
        self.words.view(self.lay.slot_mapping.byte_offset(), self.num_tokens, DType::I64)
    }

    fn stride(&self) -> usize {
        self.lay.block_table_stride
    }

    /// Request 0's block-table row.
    fn first_row(&self) -> DevIn<'_> {
        self.i32s(self.lay.block_table.offset, self.stride())
    }

    /// The decode part's arrays (requests `0..nd`).
    fn decodes(&self, nd: usize) -> PartViews<'_> {
        let l = self.lay;
        PartViews {
            block_table: self.i32s(l.block_table.offset, nd * self.stride()),
            seq_lens: self.i32s(l.seq_lens.offset, nd),
            query_start_loc: self.i32s(l.query_start_loc.offset, nd + 1),
        }
    }

    /// The prefill part's arrays (its `np` requests, start locations rebased to 0).
    fn prefills(&self, np: usize) -> PartViews<'_> {
        let l = self.lay;
        PartViews {
            block_table: self.i32s(l.prefill_block_table().offset, np * self.stride()),
            seq_lens: self.i32s(l.prefill_seq_lens().offset, np),
            query_start_loc: self.i32s(l.prefill_query_start_loc.offset, np + 1),
        }
    }
}

/// The kernels' vector loads: a 16-byte aligned address and 16-byte-multiple strides.
fn check_aligned(arg: &'static str, ptr: u64, dtype: DType, rows: &RowsDesc) -> Result<()> {
    let bytes = dtype.size_bytes();
    let ok = ptr.is_multiple_of(16) && (rows.token_stride * bytes).is_multiple_of(16) && (rows.head_stride * bytes).is_multiple_of(16);
    ensure(ok, arg, || {
        format!(
            "address {ptr:#x} with strides ({}, {}) elements: must be 16-byte aligned with 16-byte-multiple strides",
            rows.token_stride, rows.head_stride
        )
    })
}

/// The step's new K/V into `cache` at the step's slots, as `reshape_and_cache` takes them.
fn kv_write<'a>(
    spec: &KvCacheSpec,
    views: &'a StepViews<'_>,
    (k, k_rows, v, v_rows): (DevIn<'a>, RowsDesc, DevIn<'a>, RowsDesc),
    cache: &'a mut DevOut<'_>,
    scales: Option<KvScales<'a>>,
) -> KvWrite<'a> {
    let nt = views.num_tokens;
    KvWrite {
        key: k,
        key_rows: RowsDesc { num_tokens: nt, ..k_rows },
        value: v,
        value_rows: RowsDesc { num_tokens: nt, ..v_rows },
        slot_mapping: views.slot_mapping(),
        cache: cache.tail_mut(0),
        spec: *spec,
        scales,
    }
}
