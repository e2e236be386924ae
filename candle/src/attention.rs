//! [`PagedAttention`]: attn-rs's [`forward`](attn_rs::forward::Attention::forward) on candle
//! tensors. One per model (every layer shares it): each step, [`begin_step`](PagedAttention::begin_step)
//! once with the engine's batch, then each layer's [`forward`](PagedAttention::forward) (or
//! [`forward_mla`](PagedAttention::forward_mla)) writes the layer's new keys and values into its
//! cache and returns its attention output, decodes and prefills mixed in one call.

use crate::cache::{host_scale, KvCache, MlaCache};
use crate::cache_write::same_device;
use crate::error::{ensure, invalid, AttnResult};
use crate::host::{cpu, host_in, host_out};
use crate::layout::{latent_rows, rows};
use crate::reorder::Reorder;
use attn_rs::backend::{select_backend, DeviceInfo};
use attn_rs::forward::{Attention, CacheSpec, CpuLayer, ForwardConfig, GpuHandles, HostIn, LayerIo, NewKv};
use attn_rs::metadata::{decode_first_order, BatchSplit, StepInput};
use attn_rs::RowsDesc;
use candle_core::backend::BackendDevice;
use candle_core::op::BackpropOp;
use candle_core::{CpuStorage, DType, Device, InplaceOp3, Layout, Result, Shape, Storage, Tensor};
use std::cell::RefCell;

/// One step's batch as the engine's scheduler left it, in host memory (what an engine uploads
/// for its own kernels anyway). Requests may come in any order: a batch whose decodes do not
/// come first is reordered here (see [`PagedAttention::begin_step`]).
#[derive(Clone, Copy, Debug)]
pub struct StepBatch<'a> {
    /// `[num_reqs + 1]`: request `r`'s new tokens are rows `query_start_loc[r]..query_start_loc[r + 1]`
    /// of the layer's `q`/`k`/`v`; the last entry is the step's token count (rows past it are
    /// padding: not written, not attended, output zero).
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]`: each request's context length, this step's new tokens included.
    pub seq_lens: &'a [i32],
    /// `[num_reqs, block_table_stride]`: each request's physical block ids.
    pub block_table: &'a [i32],
    pub block_table_stride: usize,
    /// `[>= num_tokens]`: each new token's cache slot, `block * block_size + offset` (negative:
    /// padding).
    pub slot_mapping: &'a [i64],
}

/// A layer's optional inputs, given exactly when the model config declares them.
#[derive(Clone, Copy, Debug, Default)]
pub struct LayerExtras<'a> {
    /// `[num_q_heads]` f32 ALiBi slopes (`features.alibi`).
    pub alibi_slopes: Option<&'a Tensor>,
    /// `[num_q_heads]` f32 attention-sink logits (`features.sinks`).
    pub sinks: Option<&'a Tensor>,
}

/// attn-rs's attention for every layer of one model, on candle tensors of one device.
///
/// ```
/// use attn_candle::attn_rs::backend::ModelConfig;
/// use attn_candle::attn_rs::forward::{ForwardConfig, ForwardLimits};
/// use attn_candle::{KvLayout, PagedAttention, StepBatch};
/// use candle_core::{DType, Device, Tensor};
///
/// let dev = Device::Cpu;
/// // 4 query heads over 2 kv heads of 16, blocks of 4 tokens, 8 blocks per layer.
/// let model = ModelConfig::standard(4, 2, 16, attn_candle::attn_rs::DType::F32, 4, KvLayout::FlashNhd);
/// let limits = ForwardLimits { max_num_tokens: 32, max_num_reqs: 4, max_model_len: 32 };
/// let mut attn = PagedAttention::new(ForwardConfig::new(model, 8, limits), &dev)?;
/// let cache = attn.new_kv_cache()?; // one per layer
///
/// // A prefill of 5 tokens (blocks 3, 1) and a decode with 2 cached tokens (block 0): any order.
/// attn.begin_step(&StepBatch {
///     query_start_loc: &[0, 5, 6],
///     seq_lens: &[5, 3],
///     block_table: &[3, 1, 0, 0],
///     block_table_stride: 2,
///     slot_mapping: &[12, 13, 14, 15, 4, 2],
/// })?;
/// let (q, k, v) = (
///     Tensor::randn(0f32, 1., (6, 4, 16), &dev)?,
///     Tensor::randn(0f32, 1., (6, 2, 16), &dev)?,
///     Tensor::randn(0f32, 1., (6, 2, 16), &dev)?,
/// );
/// let out = attn.forward(&q, &k, &v, &cache)?; // each layer, with its own cache
/// assert_eq!(out.dims(), &[6, 4, 16]);
/// # Ok::<(), candle_core::Error>(())
/// ```
pub struct PagedAttention {
    attn: Attention,
    step: attn_rs::forward::StepMetadata,
    device: Device,
    reorder: Option<Reorder>,
}

impl PagedAttention {
    /// The layers of `config.model` on `device` (CPU or CUDA), on the backend attn-rs selects
    /// for it there (`ATTN_BACKEND` may name another). On a CUDA device the kernels run on
    /// candle's stream for it; a model no GPU backend takes is refused with every reason.
    pub fn new(config: ForwardConfig, device: &Device) -> Result<Self> {
        Self::with_backend(config, device, None)
    }

    /// [`new`](Self::new) on the backend `backend` names (`"cpu"`, `"tensor-core"`, `"mla"`).
    pub fn with_backend(config: ForwardConfig, device: &Device, backend: Option<&str>) -> Result<Self> {
        let gpu = gpu_handles(device)?;
        let info = gpu.as_ref().map_or(DeviceInfo::no_gpu(), |g| DeviceInfo::from_device(&g.dev));
        let selection = select_backend(&config.model, &info, backend).c()?;
        if gpu.is_some() && !selection.backend.needs_gpu {
            let why: Vec<String> = selection
                .refused
                .iter()
                .map(|r| format!("{}: {}", r.backend.name, r.reasons.iter().map(|x| x.to_string()).collect::<Vec<_>>().join("; ")))
                .collect();
            return Err(invalid(
                "device",
                format!(
                    "{:?} is a GPU, but no GPU backend takes {} ({}); use the CPU device",
                    device.location(),
                    config.model,
                    why.join(". ")
                ),
            ));
        }
        let attn = Attention::new(&selection, config, gpu).c()?;
        let step = attn.new_step_metadata().c()?;
        Ok(PagedAttention { attn, step, device: device.clone(), reorder: None })
    }

    /// The attn-rs `Attention` inside (its backend, config, timing).
    pub fn attention(&self) -> &Attention {
        &self.attn
    }

    pub fn config(&self) -> &ForwardConfig {
        self.attn.config()
    }

    pub fn device(&self) -> &Device {
        &self.device
    }

    /// The name of the backend running the layers.
    pub fn backend(&self) -> &'static str {
        self.attn.backend().name
    }

    /// Each layer's cache layout.
    pub fn cache_spec(&self) -> CacheSpec {
        self.attn.cache_spec()
    }

    /// A zeroed cache for one layer of this (standard-attention) model, in the model's cache
    /// dtype on this device. An FP8 one then needs [`KvCache::with_scales`].
    pub fn new_kv_cache(&self) -> Result<KvCache> {
        match self.cache_spec() {
            CacheSpec::Paged(spec) => KvCache::zeros(spec, candle_dtype(self.config().model.cache_dtype)?, &self.device),
            CacheSpec::Mla(_) => Err(invalid("model", "is MLA: its caches are MlaCache (new_mla_cache)")),
        }
    }

    /// A zeroed cache for one layer of this MLA model (an FP8 one then needs
    /// [`MlaCache::with_scale`]).
    pub fn new_mla_cache(&self) -> Result<MlaCache> {
        match self.cache_spec() {
            CacheSpec::Mla(spec) => MlaCache::zeros(spec, candle_dtype(self.config().model.cache_dtype)?, &self.device),
            CacheSpec::Paged(_) => Err(invalid("model", "is standard attention: its caches are KvCache (new_kv_cache)")),
        }
    }

    /// Builds this step once for every layer: checks the batch (naming the field it refuses),
    /// splits it into decodes (at most `decode_threshold` new tokens) and prefills, plans it and,
    /// on the GPU, uploads it in one copy.
    ///
    /// attn-rs runs the decodes first. A batch in another order is reordered here, and each
    /// layer's `forward` then gathers its rows into that order and its output back (one
    /// `index_select` each way per tensor): engines that put decodes first avoid those copies.
    pub fn begin_step(&mut self, batch: &StepBatch<'_>) -> Result<BatchSplit> {
        self.reorder = None;
        let cfg = self.attn.config();
        let (num_blocks, block_size, threshold) = (cfg.num_blocks, cfg.model.block_size, cfg.decode_threshold);
        let nt = batch.query_start_loc.last().copied().unwrap_or(0);
        ensure(nt >= 0, "query_start_loc", || format!("ends at {nt}"))?;
        let input = StepInput {
            query_start_loc: batch.query_start_loc,
            seq_lens: batch.seq_lens,
            block_table: batch.block_table,
            block_table_stride: batch.block_table_stride,
            slot_mapping: batch.slot_mapping,
            num_actual_tokens: nt as usize,
            num_blocks,
            block_size,
        };
        attn_rs::metadata::validate(&input).c()?;
        let order = decode_first_order(&input, threshold);
        if order.iter().enumerate().all(|(i, &r)| i == r) {
            return self.step.build(&input).c();
        }
        let reorder = Reorder::new(&input, &order);
        let split = self.step.build(&reorder.input(&input)).c()?;
        self.reorder = Some(reorder);
        Ok(split)
    }

    /// [`begin_step`](Self::begin_step) from tensors (any integer dtype, any device; copied to
    /// the host, which waits for a GPU's stream): `query_start_loc` `[num_reqs + 1]`, `seq_lens`
    /// `[num_reqs]`, `block_tables` `[num_reqs, max_blocks]`, `slot_mapping` `[num_tokens]`.
    pub fn begin_step_from_tensors(
        &mut self,
        query_start_loc: &Tensor,
        seq_lens: &Tensor,
        block_tables: &Tensor,
        slot_mapping: &Tensor,
    ) -> Result<BatchSplit> {
        let qsl = host_i32("query_start_loc", query_start_loc, 1)?;
        let seq = host_i32("seq_lens", seq_lens, 1)?;
        let bt = host_block_table("block_tables", block_tables)?;
        let stride = block_tables.dims()[1];
        let slots = host_ints("slot_mapping", slot_mapping, 1)?;
        self.begin_step(&StepBatch {
            query_start_loc: &qsl,
            seq_lens: &seq,
            block_table: &bt,
            block_table_stride: stride,
            slot_mapping: &slots,
        })
    }

    /// The decodes and prefills of the step being run.
    pub fn split(&self) -> BatchSplit {
        self.step.split()
    }

    /// One layer of the step: writes `k` and `v` into `cache` at the step's slots, then returns
    /// the attention of every new token over its request's context.
    ///
    /// - `q`: `[num_tokens, num_q_heads, head_size]` or `[num_tokens, num_q_heads * head_size]`,
    ///   the model's query dtype; `k`, `v`: the same with `num_kv_heads`. Any token and head
    ///   strides with a contiguous head dimension (e.g. `narrow`s of a fused QKV projection) are
    ///   passed without a copy.
    /// - `cache`: this layer's, of [`cache_spec`](Self::cache_spec) in the model's cache dtype.
    /// - Returns `[num_tokens, num_q_heads, head_size]` (or `[num_tokens, num_q_heads *
    ///   head_size]` for a 2-D `q`), contiguous, in the query dtype.
    pub fn forward(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &KvCache) -> Result<Tensor> {
        self.forward_with(q, k, v, cache, &LayerExtras::default())
    }

    /// [`forward`](Self::forward) with ALiBi slopes or attention sinks.
    pub fn forward_with(&mut self, q: &Tensor, k: &Tensor, v: &Tensor, cache: &KvCache, extras: &LayerExtras<'_>) -> Result<Tensor> {
        let CacheSpec::Paged(spec) = self.attn.cache_spec() else {
            return Err(invalid("cache", "this model is MLA: use forward_mla"));
        };
        ensure(cache.spec() == spec, "cache", || format!("layout {:?}, the model's is {spec:?}", cache.spec()))?;
        let scales = cache.needed_scales()?;
        let [q, k, v] = self.gather([q, k, v], cache)?;
        let q_rows = rows("q", q.layout(), spec.head_size)?;
        let k_rows = rows("k", k.layout(), spec.head_size)?;
        let v_rows = rows("v", v.layout(), spec.head_size)?;
        let new = NewRows::Standard { k: k_rows, v: v_rows };
        let out = self.run(&q, q_rows, spec.head_size, &k, &v, new, cache.tensor(), scales, extras)?;
        self.scatter(out)
    }

    /// One MLA layer of the step: writes the latents into `cache` at the step's slots, then
    /// returns the attention of every new token over its request's latent rows.
    ///
    /// - `q`: the absorbed query, `[num_tokens, num_heads, latent_dim + rope_dim]` (or 2-D).
    /// - `kv_c`: `[num_tokens, latent_dim]`, `k_pe`: `[num_tokens, rope_dim]` or `[num_tokens,
    ///   1, rope_dim]`, any token stride.
    /// - Returns `[num_tokens, num_heads, latent_dim]` (in the latent space: the caller applies
    ///   the V up-projection).
    pub fn forward_mla(&mut self, q: &Tensor, kv_c: &Tensor, k_pe: &Tensor, cache: &MlaCache) -> Result<Tensor> {
        let CacheSpec::Mla(spec) = self.attn.cache_spec() else {
            return Err(invalid("cache", "this model is standard attention: use forward"));
        };
        ensure(cache.spec() == spec, "cache", || format!("layout {:?}, the model's is {spec:?}", cache.spec()))?;
        let scale = cache.needed_scale()?;
        let [q, kv_c, k_pe] = self.gather([q, kv_c, k_pe], cache)?;
        let q_rows = rows("q", q.layout(), spec.row_width())?;
        let (_, kv_c_stride) = latent_rows("kv_c", kv_c.layout(), spec.latent_dim)?;
        let (_, k_pe_stride) = latent_rows("k_pe", k_pe.layout(), spec.rope_dim)?;
        let new = NewRows::Mla { kv_c_stride, k_pe_stride };
        let out =
            self.run(&q, q_rows, spec.latent_dim, &kv_c, &k_pe, new, cache.tensor(), scale.map(|s| (s, s)), &LayerExtras::default())?;
        self.scatter(out)
    }

    /// On the GPU: waits for candle's stream and reports any slot or block id the kernels
    /// refused since the last check (the CPU reports them from `forward`).
    pub fn check_status(&mut self) -> Result<()> {
        self.attn.check_status().c()
    }

    /// The layer's tensors in the step's order (a gather when the batch was reordered).
    fn gather<C>(&mut self, ts: [&Tensor; 3], cache: &C) -> Result<[Tensor; 3]>
    where
        C: CacheTensor,
    {
        for (arg, t) in ["q", "new keys", "new values"].into_iter().zip(ts) {
            same_device(arg, t, &self.device)?;
        }
        same_device("cache", cache.cache_tensor(), &self.device)?;
        let Some(reorder) = &mut self.reorder else { return Ok(ts.map(Tensor::clone)) };
        let rows = crate::layout::leading("q", ts[0].layout())?;
        let runs = reorder.runs(rows)?;
        let mut out = Vec::with_capacity(3);
        for t in ts {
            // One copy, of any layout (`index_select` takes contiguous tensors only).
            let parts = runs.iter().map(|&(start, len)| t.narrow(0, start, len)).collect::<Result<Vec<_>>>()?;
            out.push(Tensor::cat(&parts, 0)?);
        }
        Ok(out.try_into().expect("three tensors"))
    }

    /// The output in the engine's row order.
    fn scatter(&mut self, out: Tensor) -> Result<Tensor> {
        let Some(reorder) = &mut self.reorder else { return Ok(out) };
        let rows = crate::layout::leading("q", out.layout())?;
        let scatter = reorder.scatter(rows, &self.device)?;
        out.index_select(&scatter, 0)
    }

    /// Runs a layer through the in-place op on the cache.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &mut self,
        q: &Tensor,
        q_rows: RowsDesc,
        v_head_size: usize,
        a: &Tensor,
        b: &Tensor,
        new: NewRows,
        cache: &Tensor,
        scales: Option<(&Tensor, &Tensor)>,
        extras: &LayerExtras<'_>,
    ) -> Result<Tensor> {
        ensure(!shares_storage(q, cache), "q", || "shares its storage with the cache".into())?;
        for (arg, t) in [("alibi_slopes", extras.alibi_slopes), ("sinks", extras.sinks)] {
            if let Some(t) = t {
                same_device(arg, t, &self.device)?;
                ensure(t.dtype() == DType::F32 && t.rank() == 1 && t.is_contiguous(), arg, || {
                    format!("{:?} {:?}: expected [num_q_heads] f32, contiguous", t.dtype(), t.dims())
                })?;
            }
        }
        let (t, hq) = (q_rows.num_tokens, q_rows.num_heads);
        let out_rows = RowsDesc::contiguous(t, hq, v_head_size);
        let out_shape: Shape = if q.rank() == 3 { (t, hq, v_head_size).into() } else { (t, hq * v_head_size).into() };
        let cpu = self.device.is_cpu();
        let host_f32 = |x: Option<&Tensor>| x.filter(|_| cpu).map(|t| t.to_vec1::<f32>()).transpose();
        // q's storage is locked for reading before the op locks the others: k and v are often
        // views of the same fused projection, and candle takes their (shared) lock recursively.
        let (q_guard, q_layout) = q.storage_and_layout();
        let op = ForwardOp {
            attn: RefCell::new(&mut self.attn),
            step: &self.step,
            q: &q_guard,
            q_offset: q_layout.start_offset(),
            q_rows,
            new,
            out_rows,
            out_shape: out_shape.clone(),
            out_dtype: q.dtype(),
            host_scales: match scales {
                Some((k, v)) if cpu => Some([host_scale(k)?, host_scale(v)?]),
                _ => None,
            },
            host_alibi: host_f32(extras.alibi_slopes)?,
            host_sinks: host_f32(extras.sinks)?,
            scales,
            alibi: extras.alibi_slopes,
            sinks: extras.sinks,
            out: RefCell::new(None),
        };
        cache.inplace_op3(a, b, &op)?;
        let storage = op.out.into_inner().ok_or_else(|| invalid("layer", "produced no output"))?;
        Ok(Tensor::from_storage(storage, out_shape, BackpropOp::none(), false))
    }
}

/// What a cache type holds (for device checks).
trait CacheTensor {
    fn cache_tensor(&self) -> &Tensor;
}

impl CacheTensor for KvCache {
    fn cache_tensor(&self) -> &Tensor {
        self.tensor()
    }
}

impl CacheTensor for MlaCache {
    fn cache_tensor(&self) -> &Tensor {
        self.tensor()
    }
}

/// The layer's new keys: rows of K and V, or MLA's latent strides.
#[derive(Clone, Copy)]
enum NewRows {
    Standard { k: RowsDesc, v: RowsDesc },
    Mla { kv_c_stride: usize, k_pe_stride: usize },
}

impl NewRows {
    fn with<I>(self, a: I, b: I) -> NewKv<I> {
        match self {
            NewRows::Standard { k, v } => NewKv::Standard { k: a, k_rows: k, v: b, v_rows: v },
            NewRows::Mla { kv_c_stride, k_pe_stride } => {
                NewKv::Mla { kv_c: a, kv_c_token_stride: kv_c_stride, k_pe: b, k_pe_token_stride: k_pe_stride }
            }
        }
    }
}

/// One layer's `forward` as an in-place op on its cache (the write needs the cache's storage
/// mutably); the two other tensors the op locks are the new keys' and values' (or latents').
struct ForwardOp<'a> {
    attn: RefCell<&'a mut Attention>,
    step: &'a attn_rs::forward::StepMetadata,
    /// q's storage (locked by the caller) and the element its rows start at.
    q: &'a Storage,
    q_offset: usize,
    q_rows: RowsDesc,
    new: NewRows,
    out_rows: RowsDesc,
    out_shape: Shape,
    out_dtype: DType,
    /// CPU: host copies of the scales and per-head inputs.
    host_scales: Option<[f32; 2]>,
    host_alibi: Option<Vec<f32>>,
    host_sinks: Option<Vec<f32>>,
    /// CUDA: read on the device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scales: Option<(&'a Tensor, &'a Tensor)>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    alibi: Option<&'a Tensor>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    sinks: Option<&'a Tensor>,
    out: RefCell<Option<Storage>>,
}

impl InplaceOp3 for ForwardOp<'_> {
    fn name(&self) -> &'static str {
        "attn-forward"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cl: &Layout, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> Result<()> {
        let q = host_in("q", cpu("q", self.q)?, self.q_offset)?;
        let (a_arg, b_arg) = match self.new {
            NewRows::Standard { .. } => ("k", "v"),
            NewRows::Mla { .. } => ("kv_c", "k_pe"),
        };
        let new_kv = self.new.with(host_in(a_arg, a, al.start_offset())?, host_in(b_arg, b, bl.start_offset())?);
        let mut out = candle_core::cpu_backend::CpuDevice.zeros_impl(&self.out_shape, self.out_dtype)?;
        let layer = CpuLayer {
            q,
            q_rows: self.q_rows,
            new_kv,
            cache: host_out("cache", cache, cl.start_offset())?,
            out: host_out("out", &mut out, 0)?,
            out_rows: self.out_rows,
            alibi_slopes: self.host_alibi.as_deref().map(HostIn::F32),
            sinks: self.host_sinks.as_deref().map(HostIn::F32),
            kv_scales: self.host_scales.as_ref().map(|s| (HostIn::F32(&s[..1]), HostIn::F32(&s[1..]))),
        };
        self.attn.borrow_mut().forward(self.step, LayerIo::Cpu(layer)).c()?;
        *self.out.borrow_mut() = Some(Storage::Cpu(out));
        Ok(())
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        use crate::cuda::{cuda, guarded, CudaIn, CudaOut};
        use attn_rs::forward::GpuLayer;
        let stream =
            self.attn.borrow().stream().cloned().ok_or_else(|| invalid("layer", "CUDA tensors, but the backend runs on the CPU"))?;
        let device = cache.device.clone();
        let q = CudaIn::new("q", cuda("q", self.q)?, self.q_offset)?;
        let (a_arg, b_arg) = match self.new {
            NewRows::Standard { .. } => ("k", "v"),
            NewRows::Mla { .. } => ("kv_c", "k_pe"),
        };
        let a = CudaIn::new(a_arg, a, al.start_offset())?;
        let b = CudaIn::new(b_arg, b, bl.start_offset())?;
        let alibi_g = self.alibi.map(Tensor::storage_and_layout);
        let sinks_g = self.sinks.map(Tensor::storage_and_layout);
        let scale_g = self.scales.map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()));
        let alibi = alibi_g.as_ref().map(|g| guarded("alibi_slopes", g)).transpose()?;
        let sinks = sinks_g.as_ref().map(|g| guarded("sinks", g)).transpose()?;
        let scales = match &scale_g {
            Some((k, v)) => Some((guarded("k_scale", k)?, guarded("v_scale", v)?)),
            None => None,
        };
        let mut out = device.zeros_impl(&self.out_shape, self.out_dtype)?;
        {
            let mut cache = CudaOut::new("cache", cache, cl.start_offset())?;
            let mut out_view = CudaOut::new("out", &mut out, 0)?;
            let layer = GpuLayer {
                q: q.dev_in(&stream),
                q_rows: self.q_rows,
                new_kv: self.new.with(a.dev_in(&stream), b.dev_in(&stream)),
                cache: cache.dev_out(&stream),
                out: out_view.dev_out(&stream),
                out_rows: self.out_rows,
                alibi_slopes: alibi.as_ref().map(|x| x.dev_in(&stream)),
                sinks: sinks.as_ref().map(|x| x.dev_in(&stream)),
                kv_scales: scales.as_ref().map(|(k, v)| (k.dev_in(&stream), v.dev_in(&stream))),
            };
            self.attn.borrow_mut().forward(self.step, LayerIo::Gpu(layer)).c()?;
        }
        *self.out.borrow_mut() = Some(Storage::Cuda(out));
        Ok(())
    }
}

/// Whether two tensors are views of one storage.
pub(crate) fn shares_storage(a: &Tensor, b: &Tensor) -> bool {
    let addr = |t: &Tensor| {
        let (s, _) = t.storage_and_layout();
        std::ptr::from_ref::<Storage>(&s).addr()
    };
    addr(a) == addr(b)
}

/// The GPU handles for `device`: candle's stream and the device's attn-rs kernels.
fn gpu_handles(device: &Device) -> Result<Option<GpuHandles>> {
    match device {
        Device::Cpu => Ok(None),
        #[cfg(feature = "cuda")]
        Device::Cuda(d) => {
            let s = crate::cuda::device_state(d)?;
            Ok(Some(GpuHandles { dev: s.dev.clone(), stream: s.stream.clone() }))
        }
        other => Err(invalid(
            "device",
            format!(
                "{:?}: the ops run on CPU tensors{}",
                other.location(),
                if cfg!(feature = "cuda") { " and CUDA tensors" } else { " (CUDA tensors need the `cuda` feature)" }
            ),
        )),
    }
}

/// The candle dtype of an attn-rs float dtype.
pub(crate) fn candle_dtype(d: attn_rs::DType) -> Result<DType> {
    Ok(match d {
        attn_rs::DType::F16 => DType::F16,
        attn_rs::DType::BF16 => DType::BF16,
        attn_rs::DType::F32 => DType::F32,
        attn_rs::DType::Fp8E4m3 => DType::F8E4M3,
        attn_rs::DType::Fp8E5m2 => {
            return Err(invalid("dtype", "Fp8E5m2: candle has no E5M2 dtype (attn-rs takes E5M2 caches through its own API)"))
        }
        other => return Err(invalid("dtype", format!("{other:?} is no cache dtype"))),
    })
}

/// An integer tensor of rank `rank`, flattened, on the host.
pub(crate) fn host_ints(arg: &str, t: &Tensor, rank: usize) -> Result<Vec<i64>> {
    ensure(t.rank() == rank && t.dtype().is_int(), arg, || format!("{:?} {:?}: expected {rank}-D integers", t.dtype(), t.dims()))?;
    t.flatten_all()?.to_dtype(DType::I64)?.to_vec1::<i64>()
}

/// A `[rows, width]` block table on the host as i32: u32 ids are read as i32 bits (as on the
/// GPU, where a u32 table is read in place: padding like `u32::MAX` reads as -1), other
/// dtypes refuse values past i32.
pub(crate) fn host_block_table(arg: &str, t: &Tensor) -> Result<Vec<i32>> {
    if t.dtype() == DType::U32 && t.rank() == 2 {
        return Ok(t.flatten_all()?.to_vec1::<u32>()?.into_iter().map(|x| x as i32).collect());
    }
    host_i32(arg, t, 2)
}

/// [`host_ints`] as i32 (refusing values past them).
pub(crate) fn host_i32(arg: &str, t: &Tensor, rank: usize) -> Result<Vec<i32>> {
    host_ints(arg, t, rank)?.into_iter().map(|x| i32::try_from(x).map_err(|_| invalid(arg, format!("value {x} is past i32")))).collect()
}
