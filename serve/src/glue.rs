//! The attention glue: candle tensors in, attn-rs's [`Attention::forward`] over the paged
//! caches, a candle tensor out. The one place that knows both libraries' memory.
//!
//! - CPU tensors (f32) are read in place as host slices ([`LayerIo::Cpu`]): a `[tokens, heads,
//!   head_dim]` view with unit head-dim stride becomes a slice from its offset and a
//!   [`RowsDesc`] with its token and head strides, so strided views (slices of a wider
//!   projection) need no copy. The output is a fresh `Vec` that becomes the tensor's storage.
//! - CUDA tensors are cast to f16 (the kernels take f16/bf16; the cache is f16) and passed as
//!   views of candle's own `CudaSlice` ([`DevIn::new`], [`LayerIo::Gpu`]) on candle's stream,
//!   with the [`AttnDevice`] made from candle's context, so attention is ordered with candle's
//!   kernels and nothing synchronises. The f16 output buffer becomes a candle tensor, cast back
//!   to f32.

use crate::error::{Result, ServeError};
use crate::gguf::LlamaConfig;
use attn_rs::backend::{select_backend, DeviceInfo, ModelConfig};
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv, PhaseTimes, StepMetadata};
use attn_rs::metadata::{BatchSplit, StepInput};
use attn_rs::{DType, KvLayout, RowsDesc};
use candle_core::{CpuStorage, Device, Layout, Storage, Tensor};
use std::time::{Duration, Instant};

/// Where the layers' caches live.
enum Caches {
    Host(Vec<Vec<f32>>),
    #[cfg(feature = "cuda")]
    Device(gpu::DeviceCaches),
}

/// Every layer's paged attention for one model on one device.
pub struct PagedAttention {
    attn: Attention,
    step: StepMetadata,
    caches: Caches,
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    /// Wall time of the `forward` calls (CPU: the attention itself; GPU: enqueueing).
    call_time: Duration,
}

impl PagedAttention {
    /// The attention of `cfg`'s layers on `device` (CPU: f32 queries and cache, the `cpu`
    /// backend; CUDA: f16, the backend selection picks for the GPU), `num_blocks` blocks of
    /// `block_size` tokens per layer. `ATTN_BACKEND` overrides the choice.
    pub fn new(cfg: &LlamaConfig, device: &Device, num_blocks: usize, block_size: usize, limits: ForwardLimits) -> Result<Self> {
        let model = |dtype| ModelConfig::standard(cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, dtype, block_size, KvLayout::FlashNhd);
        let (attn, caches) = match device {
            Device::Cpu => {
                let mc = model(DType::F32);
                let selection = select_backend(&mc, &DeviceInfo::no_gpu(), None)?;
                let attn = Attention::new(&selection, ForwardConfig::new(mc, num_blocks, limits), None)?;
                let len = attn.cache_spec().num_elements();
                (attn, Caches::Host((0..cfg.num_layers).map(|_| vec![0f32; len]).collect()))
            }
            #[cfg(feature = "cuda")]
            Device::Cuda(dev) => {
                let (attn, caches) = gpu::DeviceCaches::new(dev, model(DType::F16), num_blocks, limits, cfg.num_layers)?;
                (attn, Caches::Device(caches))
            }
            other => return Err(ServeError::Config(format!("attention on {other:?}: CPU or CUDA (the `cuda` feature) only"))),
        };
        let step = attn.new_step_metadata()?;
        Ok(PagedAttention {
            attn,
            step,
            caches,
            num_heads: cfg.num_heads,
            num_kv_heads: cfg.num_kv_heads,
            head_dim: cfg.head_dim,
            call_time: Duration::ZERO,
        })
    }

    /// The backend's name (`cpu`, `tensor-core`).
    pub fn backend(&self) -> &'static str {
        self.attn.backend().name
    }

    pub fn num_blocks(&self) -> usize {
        self.attn.cache_spec().num_blocks()
    }

    pub fn block_size(&self) -> usize {
        self.attn.cache_spec().block_size()
    }

    /// Bytes of KV cache over all layers.
    pub fn cache_bytes(&self) -> usize {
        let elem = if self.attn.runs_on_gpu() { 2 } else { 4 };
        self.attn.cache_spec().num_elements() * elem * self.num_layers()
    }

    fn num_layers(&self) -> usize {
        match &self.caches {
            Caches::Host(c) => c.len(),
            #[cfg(feature = "cuda")]
            Caches::Device(c) => c.caches.len(),
        }
    }

    /// Measure the cache write and attention of every layer (CUDA events on the GPU).
    pub fn set_timing(&mut self, on: bool) {
        self.attn.set_timing(on);
    }

    /// The phase times since the last call (on the GPU this waits for the layers), and the
    /// wall time of the `forward` calls.
    pub fn take_times(&mut self) -> Result<(PhaseTimes, Duration)> {
        Ok((self.attn.take_times()?, std::mem::take(&mut self.call_time)))
    }

    /// This step's metadata, once per step, before the layers (the batch ordered decodes first).
    pub fn build(&mut self, input: &StepInput<'_>) -> Result<BatchSplit> {
        Ok(self.step.build(input)?)
    }

    /// Layer `layer` of the built step: writes `k`, `v` (`[tokens, kv_heads, head_dim]`) into the
    /// layer's cache and returns the attention of `q` (`[tokens, heads, head_dim]`) as
    /// `[tokens, heads * head_dim]`, f32.
    pub fn forward(&mut self, layer: usize, q: &Tensor, k: &Tensor, v: &Tensor) -> Result<Tensor> {
        let nt = self.step.num_actual_tokens();
        let (h, hk, d) = (self.num_heads, self.num_kv_heads, self.head_dim);
        let started = Instant::now();
        let out = match &mut self.caches {
            Caches::Host(caches) => {
                let cache = caches.get_mut(layer).ok_or_else(|| ServeError::Config(format!("layer {layer} has no cache")))?;
                let (qs, ql) = q.storage_and_layout();
                let (ks, kl) = k.storage_and_layout();
                let (vs, vl) = v.storage_and_layout();
                let (q, q_rows) = host_rows(&qs, ql, (nt, h, d), "q")?;
                let (k, k_rows) = host_rows(&ks, kl, (nt, hk, d), "k")?;
                let (v, v_rows) = host_rows(&vs, vl, (nt, hk, d), "v")?;
                let mut out = vec![0f32; nt * h * d];
                let io = CpuLayer {
                    q: q.into(),
                    q_rows,
                    new_kv: NewKv::Standard { k: k.into(), k_rows, v: v.into(), v_rows },
                    cache: cache.as_mut_slice().into(),
                    out: out.as_mut_slice().into(),
                    out_rows: RowsDesc::contiguous(nt, h, d),
                    alibi_slopes: None,
                    sinks: None,
                    kv_scales: None,
                };
                self.attn.forward(&self.step, LayerIo::Cpu(io))?;
                Tensor::from_vec(out, (nt, h * d), &Device::Cpu)?
            }
            #[cfg(feature = "cuda")]
            Caches::Device(caches) => caches.forward(&mut self.attn, &self.step, layer, q, k, v, (nt, h, hk, d))?,
        };
        self.call_time += started.elapsed();
        Ok(out)
    }
}

/// `[tokens, heads, head_dim]` rows of a view with unit head-dim stride: its f32 slice from its
/// offset and the strides between tokens and heads.
fn host_rows<'a>(storage: &'a Storage, layout: &Layout, want: (usize, usize, usize), arg: &str) -> Result<(&'a [f32], RowsDesc)> {
    let Storage::Cpu(CpuStorage::F32(data)) = storage else {
        return Err(ServeError::Config(format!("{arg}: the CPU path takes f32 host tensors")));
    };
    let rows = rows_desc(layout, want, arg)?;
    Ok((&data[layout.start_offset()..], rows))
}

/// The [`RowsDesc`] of a `[tokens, heads, head_dim]` view (more tokens than `want.0` is fine).
pub(crate) fn rows_desc(layout: &Layout, want: (usize, usize, usize), arg: &str) -> Result<RowsDesc> {
    let (nt, h, d) = want;
    let (dims, stride) = (layout.dims(), layout.stride());
    if dims.len() != 3 || dims[0] < nt || dims[1] != h || dims[2] != d || (d > 1 && stride[2] != 1) {
        return Err(ServeError::Config(format!("{arg}: {dims:?} with strides {stride:?}, want [{nt}, {h}, {d}] with unit last stride")));
    }
    Ok(RowsDesc { num_tokens: nt, num_heads: h, head_size: d, token_stride: stride[0], head_stride: stride[1] })
}

#[cfg(feature = "cuda")]
mod gpu {
    //! The CUDA side of the glue (candle-core's CUDA backend, cudarc 0.19 as attn-rs).
    use super::rows_desc;
    use crate::error::{Result, ServeError};
    use attn_rs::backend::{select_backend, DeviceInfo, ModelConfig};
    use attn_rs::forward::{Attention, ForwardConfig, ForwardLimits, GpuHandles, GpuLayer, LayerIo, NewKv, StepMetadata};
    use attn_rs::{AttnDevice, DevIn, DevOut, RowsDesc};
    use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream};
    use candle_core::op::BackpropOp;
    use candle_core::{CudaDevice, CudaStorage, DType, Storage, Tensor};
    use half::f16;
    use std::sync::Arc;

    pub(super) struct DeviceCaches {
        pub(super) caches: Vec<CudaSlice<f16>>,
        stream: Arc<CudaStream>,
        device: CudaDevice,
    }

    impl DeviceCaches {
        pub(super) fn new(
            device: &CudaDevice,
            model: ModelConfig,
            num_blocks: usize,
            limits: ForwardLimits,
            layers: usize,
        ) -> Result<(Attention, Self)> {
            // candle's stream and context: attention is enqueued between candle's kernels.
            let stream = device.cuda_stream();
            let dev = Arc::new(AttnDevice::from_context(stream.context().clone())?);
            let selection = select_backend(&model, &DeviceInfo::from_device(&dev), None)?;
            let handles = GpuHandles { dev, stream: stream.clone() };
            let attn = Attention::new(&selection, ForwardConfig::new(model, num_blocks, limits), Some(handles))?;
            let len = attn.cache_spec().num_elements();
            let caches =
                (0..layers).map(|_| stream.alloc_zeros::<f16>(len)).collect::<Result<Vec<_>, _>>().map_err(attn_rs::AttnError::from)?;
            Ok((attn, DeviceCaches { caches, stream, device: device.clone() }))
        }

        #[allow(clippy::too_many_arguments)]
        pub(super) fn forward(
            &mut self,
            attn: &mut Attention,
            step: &StepMetadata,
            layer: usize,
            q: &Tensor,
            k: &Tensor,
            v: &Tensor,
            (nt, h, hk, d): (usize, usize, usize, usize),
        ) -> Result<Tensor> {
            let stream = self.stream.clone();
            let (q, k, v) = (q.to_dtype(DType::F16)?, k.to_dtype(DType::F16)?, v.to_dtype(DType::F16)?);
            let (qs, ql) = q.storage_and_layout();
            let (ks, kl) = k.storage_and_layout();
            let (vs, vl) = v.storage_and_layout();
            let (qv, q_rows) = (device_slice(&qs, "q")?.slice(ql.start_offset()..), rows_desc(ql, (nt, h, d), "q")?);
            let (kv, k_rows) = (device_slice(&ks, "k")?.slice(kl.start_offset()..), rows_desc(kl, (nt, hk, d), "k")?);
            let (vv, v_rows) = (device_slice(&vs, "v")?.slice(vl.start_offset()..), rows_desc(vl, (nt, hk, d), "v")?);
            let mut out = stream.alloc_zeros::<f16>(nt * h * d).map_err(attn_rs::AttnError::from)?;
            let cache = self.caches.get_mut(layer).ok_or_else(|| ServeError::Config(format!("layer {layer} has no cache")))?;
            let io = GpuLayer {
                q: DevIn::new(&qv, &stream),
                q_rows,
                new_kv: NewKv::Standard { k: DevIn::new(&kv, &stream), k_rows, v: DevIn::new(&vv, &stream), v_rows },
                cache: DevOut::new(cache, &stream),
                out: DevOut::new(&mut out, &stream),
                out_rows: RowsDesc::contiguous(nt, h, d),
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            };
            attn.forward(step, LayerIo::Gpu(io))?;
            let storage = Storage::Cuda(CudaStorage::wrap_cuda_slice(out, self.device.clone()));
            Ok(Tensor::from_storage(storage, (nt, h * d), BackpropOp::none(), false).to_dtype(DType::F32)?)
        }
    }

    fn device_slice<'a>(storage: &'a Storage, arg: &str) -> Result<&'a CudaSlice<f16>> {
        match storage {
            Storage::Cuda(s) => Ok(s.as_cuda_slice::<f16>()?),
            _ => Err(ServeError::Config(format!("{arg}: the GPU path takes CUDA tensors"))),
        }
    }
}
