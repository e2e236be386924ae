//! The caches as candle tensors.
//!
//! [`KvCache`] is one layer's paged K/V cache: one tensor holding both planes, shaped as its
//! [`KvCacheSpec`] says (`spec.shape()`), e.g. `[2, num_blocks, block_size, num_kv_heads,
//! head_size]` for [`KvLayout::FlashNhd`] (K is `tensor.get(0)`, V `tensor.get(1)`) or
//! `[num_blocks, 2, block_size, num_kv_heads, head_size]` for [`KvLayout::FlashInferNhd`].
//! [`MlaCache`] is one layer's MLA latent cache, `[num_blocks, block_size, latent_dim +
//! rope_dim]`. The tensor must be contiguous; it may start anywhere in its storage, so that
//! every layer's cache can be one tensor `[num_layers, ...]` and each layer's `.get(layer)`.
//!
//! The dtype is the tensor's: f16, bf16, f32, or FP8 E4M3 (`DType::F8E4M3`), which also needs
//! its scales (vLLM's `k_scale`/`v_scale`: a stored element is `value / scale`) as one-element
//! f32 tensors on the cache's device ([`KvCache::with_scales`], [`MlaCache::with_scale`]).

use crate::error::{ensure, invalid};
use attn_rs::{KvCacheSpec, KvLayout, MlaCacheSpec};
use candle_core::{DType, Device, Result, Tensor};

fn check_dtype(arg: &str, dtype: DType) -> Result<()> {
    ensure(matches!(dtype, DType::F16 | DType::BF16 | DType::F32 | DType::F8E4M3), arg, || {
        format!("dtype {dtype:?}: caches are f16, bf16, f32 or f8e4m3")
    })
}

fn check_cache_tensor(arg: &str, t: &Tensor, shape: &[usize]) -> Result<()> {
    check_dtype(arg, t.dtype())?;
    ensure(t.dims() == shape, arg, || format!("shape {:?}, its spec's is {shape:?}", t.dims()))?;
    ensure(t.is_contiguous(), arg, || {
        format!("strides {:?} are not contiguous (a cache is one dense tensor): call `.contiguous()` on it", t.stride())
    })
}

/// One f32 value on `device`.
fn check_scale(arg: &str, s: &Tensor, device: &Device) -> Result<()> {
    ensure(s.dtype() == DType::F32 && s.elem_count() == 1, arg, || format!("must be one f32 value, got {:?} {:?}", s.dtype(), s.dims()))?;
    ensure(s.device().same_device(device), arg, || format!("is on {:?}, the cache on {device:?}", s.device().location()))
}

/// The one f32 of a scale tensor, on the host.
pub(crate) fn host_scale(s: &Tensor) -> Result<f32> {
    s.flatten_all()?.to_vec1::<f32>()?.first().copied().ok_or_else(|| invalid("scale", "is empty"))
}

/// One layer's paged K/V cache: the tensor holding its K and V planes and their layout.
#[derive(Clone, Debug)]
pub struct KvCache {
    tensor: Tensor,
    spec: KvCacheSpec,
    scales: Option<(Tensor, Tensor)>,
}

impl KvCache {
    /// A zeroed cache of `spec` in `dtype` on `device` (an FP8 one then needs
    /// [`with_scales`](Self::with_scales)).
    ///
    /// ```
    /// use attn_candle::{KvCache, KvCacheSpec, KvLayout};
    /// use candle_core::{DType, Device};
    ///
    /// let spec = KvCacheSpec::new(KvLayout::FlashNhd, 8, 16, 2, 64)?;
    /// let cache = KvCache::zeros(spec, DType::F32, &Device::Cpu)?;
    /// assert_eq!(cache.tensor().dims(), &[2, 8, 16, 2, 64]);
    /// assert_eq!(cache.key_cache()?.dims(), &[8, 16, 2, 64]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn zeros(spec: KvCacheSpec, dtype: DType, device: &Device) -> Result<Self> {
        spec.validate("spec").map_err(crate::error::attn)?;
        check_dtype("dtype", dtype)?;
        Ok(KvCache { tensor: Tensor::zeros(spec.shape().to_vec(), dtype, device)?, spec, scales: None })
    }

    /// An existing tensor as a cache of `layout`: its shape must be one of that layout
    /// (`[2, num_blocks, block_size, num_kv_heads, head_size]` for `FlashNhd`, ... see
    /// [`KvCacheSpec::shape`]), and it must be contiguous (from any start offset).
    ///
    /// ```
    /// use attn_candle::{KvCache, KvLayout};
    /// use candle_core::{DType, Device, Tensor};
    ///
    /// // Every layer's cache in one tensor; layer 3's is a view of it.
    /// let all = Tensor::zeros((4, 2, 8, 16, 2, 64), DType::BF16, &Device::Cpu)?;
    /// let layer3 = KvCache::from_tensor(all.get(3)?, KvLayout::FlashNhd)?;
    /// assert_eq!((layer3.spec().num_blocks, layer3.spec().num_kv_heads), (8, 2));
    /// # Ok::<(), candle_core::Error>(())
    /// ```
    pub fn from_tensor(tensor: Tensor, layout: KvLayout) -> Result<Self> {
        let dims = tensor.dims();
        let [a, b, c, d, e] = *dims else {
            return Err(invalid("tensor", format!("shape {dims:?}: a K/V cache has 5 dimensions ({layout:?})")));
        };
        let (n, bs, h) = match layout {
            KvLayout::FlashNhd => (b, c, d),
            KvLayout::FlashHnd => (b, d, c),
            KvLayout::FlashInferNhd => (a, c, d),
            KvLayout::FlashInferHnd => (a, d, c),
        };
        let spec = KvCacheSpec::new(layout, n, bs, h, e).map_err(crate::error::attn)?;
        check_cache_tensor("tensor", &tensor, &spec.shape())?;
        Ok(KvCache { tensor, spec, scales: None })
    }

    /// The cache with its FP8 scales: `k_scale` and `v_scale`, one f32 each on the cache's device
    /// (read by the kernels from there, so that changing them needs no new cache).
    pub fn with_scales(self, k_scale: Tensor, v_scale: Tensor) -> Result<Self> {
        ensure(self.tensor.dtype() == DType::F8E4M3, "scales", || {
            format!("given for a {:?} cache (only FP8 caches are scaled)", self.tensor.dtype())
        })?;
        check_scale("k_scale", &k_scale, self.tensor.device())?;
        check_scale("v_scale", &v_scale, self.tensor.device())?;
        Ok(KvCache { scales: Some((k_scale, v_scale)), ..self })
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    pub fn spec(&self) -> KvCacheSpec {
        self.spec
    }

    pub fn dtype(&self) -> DType {
        self.tensor.dtype()
    }

    pub fn device(&self) -> &Device {
        self.tensor.device()
    }

    /// `(k_scale, v_scale)` of an FP8 cache.
    pub fn scales(&self) -> Option<(&Tensor, &Tensor)> {
        self.scales.as_ref().map(|(k, v)| (k, v))
    }

    /// The K plane: `[num_blocks, block_size, num_kv_heads, head_size]` (NHD) or `[num_blocks,
    /// num_kv_heads, block_size, head_size]` (HND), a view of the cache.
    pub fn key_cache(&self) -> Result<Tensor> {
        self.plane(0)
    }

    /// The V plane, as [`key_cache`](Self::key_cache).
    pub fn value_cache(&self) -> Result<Tensor> {
        self.plane(1)
    }

    fn plane(&self, p: usize) -> Result<Tensor> {
        match self.spec.layout {
            KvLayout::FlashNhd | KvLayout::FlashHnd => self.tensor.get(p),
            KvLayout::FlashInferNhd | KvLayout::FlashInferHnd => self.tensor.narrow(1, p, 1)?.squeeze(1),
        }
    }

    /// The scales an FP8 cache needs, refused (naming the cache) when missing.
    pub(crate) fn needed_scales(&self) -> Result<Option<(&Tensor, &Tensor)>> {
        if self.tensor.dtype() != DType::F8E4M3 {
            return Ok(None);
        }
        let s = self.scales().ok_or_else(|| invalid("cache", "an FP8 cache needs its k and v scales (KvCache::with_scales)"))?;
        Ok(Some(s))
    }
}

/// One layer's MLA latent cache: `[num_blocks, block_size, latent_dim + rope_dim]`, each row a
/// token's compressed KV (`latent_dim`) then its rope key.
#[derive(Clone, Debug)]
pub struct MlaCache {
    tensor: Tensor,
    spec: MlaCacheSpec,
    scale: Option<Tensor>,
}

impl MlaCache {
    /// A zeroed cache of `spec` in `dtype` on `device` (an FP8 one then needs
    /// [`with_scale`](Self::with_scale)).
    ///
    /// ```
    /// use attn_candle::{MlaCache, MlaCacheSpec};
    /// use candle_core::{DType, Device};
    ///
    /// let cache = MlaCache::zeros(MlaCacheSpec::deepseek(4, 16)?, DType::BF16, &Device::Cpu)?;
    /// assert_eq!(cache.tensor().dims(), &[4, 16, 576]);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn zeros(spec: MlaCacheSpec, dtype: DType, device: &Device) -> Result<Self> {
        spec.validate("spec").map_err(crate::error::attn)?;
        check_dtype("dtype", dtype)?;
        Ok(MlaCache { tensor: Tensor::zeros(spec.shape().to_vec(), dtype, device)?, spec, scale: None })
    }

    /// An existing contiguous tensor `[num_blocks, block_size, latent_dim + rope_dim]` as a
    /// cache whose rows start with `latent_dim` latent columns.
    pub fn from_tensor(tensor: Tensor, latent_dim: usize) -> Result<Self> {
        let dims = tensor.dims();
        let [n, b, w] = *dims else {
            return Err(invalid("tensor", format!("shape {dims:?}: an MLA cache is [num_blocks, block_size, latent_dim + rope_dim]")));
        };
        ensure(w >= latent_dim, "latent_dim", || format!("{latent_dim} is wider than the rows of {w}"))?;
        let spec = MlaCacheSpec::new(n, b, latent_dim, w - latent_dim).map_err(crate::error::attn)?;
        check_cache_tensor("tensor", &tensor, &spec.shape())?;
        Ok(MlaCache { tensor, spec, scale: None })
    }

    /// The cache with its FP8 scale (one f32 on the cache's device, for K and V alike).
    pub fn with_scale(self, scale: Tensor) -> Result<Self> {
        ensure(self.tensor.dtype() == DType::F8E4M3, "scale", || {
            format!("given for a {:?} cache (only FP8 caches are scaled)", self.tensor.dtype())
        })?;
        check_scale("scale", &scale, self.tensor.device())?;
        Ok(MlaCache { scale: Some(scale), ..self })
    }

    pub fn tensor(&self) -> &Tensor {
        &self.tensor
    }

    pub fn spec(&self) -> MlaCacheSpec {
        self.spec
    }

    pub fn dtype(&self) -> DType {
        self.tensor.dtype()
    }

    pub fn device(&self) -> &Device {
        self.tensor.device()
    }

    pub fn scale(&self) -> Option<&Tensor> {
        self.scale.as_ref()
    }

    pub(crate) fn needed_scale(&self) -> Result<Option<&Tensor>> {
        if self.tensor.dtype() != DType::F8E4M3 {
            return Ok(None);
        }
        self.scale.as_ref().map(Some).ok_or_else(|| invalid("cache", "an FP8 cache needs its scale (MlaCache::with_scale)"))
    }
}
