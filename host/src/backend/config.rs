//! What selection validates: the model's attention ([`ModelConfig`]) and the device
//! ([`DeviceInfo`], real or simulated).

use super::mla::MLA_HEAD_SIZE;
use super::reason::dtype_name;
use super::spec::{AttentionKind, ComputeCapability, Feature, Features};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::layout::KvLayout;
use std::fmt;

/// The attention of one model (all its layers share it), as selection sees it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ModelConfig {
    /// Standard (K/V cache) or MLA (latent cache) attention.
    pub kind: AttentionKind,
    /// Query heads per layer.
    pub num_q_heads: usize,
    /// 1 for MLA (one latent shared by every head).
    pub num_kv_heads: usize,
    /// Query/key width: 576 for MLA (latent 512 + rope 64).
    pub head_size: usize,
    /// Dtype of the queries, new keys/values and outputs (f16, bf16, or f32 on the CPU).
    pub q_dtype: DType,
    /// Dtype of the cache: the query dtype, or FP8 E4M3 (with per-layer scales).
    pub cache_dtype: DType,
    /// Tokens per KV-cache block.
    pub block_size: usize,
    /// The K/V-cache layout of standard attention; `None` for MLA (its cache is
    /// [`crate::layout::MlaCacheSpec`]).
    pub kv_layout: Option<KvLayout>,
    /// The features its layers use.
    pub features: Features,
    /// DeepSeek-V3.2's sparse attention (MLA only): each query token attends the `k` positions
    /// of its context an index list names; `None`: dense.
    pub sparse_topk: Option<usize>,
}

impl ModelConfig {
    /// Standard attention with a cache of the query dtype and no optional features.
    pub fn standard(num_q_heads: usize, num_kv_heads: usize, head_size: usize, dtype: DType, block_size: usize, layout: KvLayout) -> Self {
        ModelConfig {
            kind: AttentionKind::Standard,
            num_q_heads,
            num_kv_heads,
            head_size,
            q_dtype: dtype,
            cache_dtype: dtype,
            block_size,
            kv_layout: Some(layout),
            features: Features::NONE,
            sparse_topk: None,
        }
    }

    /// MLA (DeepSeek): `num_heads` query heads over one latent of 512 + 64, a cache of the query
    /// dtype, no optional features.
    pub fn mla(num_heads: usize, dtype: DType, block_size: usize) -> Self {
        ModelConfig {
            kind: AttentionKind::Mla,
            num_q_heads: num_heads,
            num_kv_heads: 1,
            head_size: MLA_HEAD_SIZE,
            q_dtype: dtype,
            cache_dtype: dtype,
            block_size,
            kv_layout: None,
            features: Features::NONE,
            sparse_topk: None,
        }
    }

    /// The same model with a cache of `cache_dtype` (FP8 E4M3 for an FP8 cache).
    pub fn with_cache_dtype(self, cache_dtype: DType) -> Self {
        ModelConfig { cache_dtype, ..self }
    }

    /// The same model using `features` (sinks, sliding window, soft-cap, ALiBi).
    pub fn with_features(self, features: Features) -> Self {
        ModelConfig { features, ..self }
    }

    /// The same model with sparse attention over the top `k` positions of each query token
    /// (DeepSeek-V3.2; MLA only).
    pub fn with_sparse_topk(self, k: usize) -> Self {
        ModelConfig { sparse_topk: Some(k), ..self }
    }
}

impl fmt::Display for ModelConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} attention, q heads {}, kv heads {}, head size {}, q {}, kv cache {}, block size {}",
            self.kind,
            self.num_q_heads,
            self.num_kv_heads,
            self.head_size,
            dtype_name(self.q_dtype),
            dtype_name(self.cache_dtype),
            self.block_size
        )?;
        if let Some(layout) = self.kv_layout {
            write!(f, ", layout {layout:?}")?;
        }
        let used: Vec<String> = Feature::ALL.iter().filter(|&&x| self.features.has(x)).map(|x| x.to_string()).collect();
        if !used.is_empty() {
            write!(f, ", with {}", used.join(", "))?;
        }
        if let Some(k) = self.sparse_topk {
            write!(f, ", sparse top-{k}")?;
        }
        Ok(())
    }
}

/// The device a model runs on: a GPU's compute capability, or none.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct DeviceInfo {
    /// The GPU's compute capability; `None`: no GPU.
    pub compute_capability: Option<ComputeCapability>,
}

impl DeviceInfo {
    /// A GPU of compute capability `major.minor` (real or simulated).
    pub const fn gpu(major: u32, minor: u32) -> Self {
        DeviceInfo { compute_capability: Some(ComputeCapability::new(major, minor)) }
    }

    /// No GPU: only backends that run on the CPU fit.
    pub const fn no_gpu() -> Self {
        DeviceInfo { compute_capability: None }
    }

    /// The GPU `dev` runs on.
    pub fn from_device(dev: &AttnDevice) -> Self {
        let (major, minor) = dev.compute_capability();
        DeviceInfo::gpu(u32::try_from(major).unwrap_or(0), u32::try_from(minor).unwrap_or(0))
    }

    /// Whether there is a GPU.
    pub fn has_gpu(&self) -> bool {
        self.compute_capability.is_some()
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.compute_capability {
            Some(cc) => write!(f, "GPU {cc}"),
            None => f.write_str("no GPU"),
        }
    }
}
