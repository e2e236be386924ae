//! Why a backend cannot run a model: one [`Reason`] per problem, each naming the value and what
//! is supported.

use super::spec::{write_list, AttentionKind, BlockSizes, CcRange, ComputeCapability, Feature, HeadSizes};
use crate::dtype::DType;
use crate::layout::KvLayout;
use std::fmt;

/// One reason a backend refuses a model on a device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    // The model's own configuration is inconsistent: reported for every backend.
    /// A head count, head size or block size of zero.
    Zero {
        /// Which size (`num_q_heads`, `head_size`, ...).
        what: &'static str,
    },
    /// Grouped-query attention needs whole groups.
    HeadsNotDivisible {
        /// The model's query heads.
        num_q_heads: usize,
        /// The model's kv heads, which do not divide them.
        num_kv_heads: usize,
    },
    /// MLA has one latent shared by every query head.
    MlaKvHeads {
        /// The kv heads given (MLA takes 1).
        num_kv_heads: usize,
    },
    /// Standard attention without a K/V-cache layout.
    MissingLayout,
    /// A K/V-cache layout given for MLA, whose cache is the latent one.
    LayoutWithMla {
        /// The layout given.
        layout: KvLayout,
    },
    /// Sparse (top-k) attention asked of standard attention: it is an MLA model's.
    SparseWithoutMla,

    // The backend cannot take this (valid) model on this device.
    /// The backend runs on a GPU and the device has none.
    NoGpu,
    /// The GPU is outside the backend's compute capabilities.
    ComputeCapability {
        /// The device's.
        device: ComputeCapability,
        /// The backend's.
        supported: CcRange,
    },
    /// The backend does not do this kind of attention.
    Kind {
        /// The model's.
        kind: AttentionKind,
        /// The backend's.
        supported: &'static [AttentionKind],
    },
    /// The backend has no kernels for this query dtype.
    QDType {
        /// The model's.
        dtype: DType,
        /// The backend's.
        supported: &'static [DType],
    },
    /// The backend has no kernels for this cache dtype.
    CacheDType {
        /// The model's.
        dtype: DType,
        /// The backend's.
        supported: &'static [DType],
    },
    /// Both dtypes are supported, but not together (the cache must be the query dtype or FP8).
    CacheDTypeWithQuery {
        /// The cache dtype.
        cache: DType,
        /// The query dtype.
        q: DType,
    },
    /// The backend has no kernels for this head size.
    HeadSize {
        /// The model's.
        head_size: usize,
        /// The backend's.
        supported: HeadSizes,
    },
    /// The backend does not take this block size.
    BlockSize {
        /// The model's.
        block_size: usize,
        /// The backend's.
        supported: BlockSizes,
    },
    /// The model uses a feature the backend lacks.
    Feature(Feature),
    /// The model's MLA is sparse (top-k index lists) and the backend has no sparse kernels.
    SparseMla,
    /// The `cpu` backend on a machine with a GPU: automatic selection does not take it (an engine
    /// that set up GPU buffers would get a backend that takes host ones); an override names it.
    GpuPresent,
    /// The backend does not read this K/V-cache layout.
    Layout {
        /// The model's.
        layout: KvLayout,
        /// The backend's.
        supported: &'static [KvLayout],
    },
}

impl Reason {
    /// Whether this is a problem of the model's configuration rather than of the backend.
    pub fn is_config_error(&self) -> bool {
        matches!(
            self,
            Reason::Zero { .. }
                | Reason::HeadsNotDivisible { .. }
                | Reason::MlaKvHeads { .. }
                | Reason::MissingLayout
                | Reason::LayoutWithMla { .. }
                | Reason::SparseWithoutMla
        )
    }
}

impl fmt::Display for Reason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            Reason::Zero { what } => write!(f, "model config error: {what} is 0"),
            Reason::HeadsNotDivisible { num_q_heads, num_kv_heads } => {
                write!(f, "model config error: num_q_heads {num_q_heads} is not a multiple of num_kv_heads {num_kv_heads}")
            }
            Reason::MlaKvHeads { num_kv_heads } => {
                write!(f, "model config error: MLA has 1 kv head (the shared latent), not {num_kv_heads}")
            }
            Reason::MissingLayout => f.write_str("model config error: standard attention needs a kv layout"),
            Reason::LayoutWithMla { layout } => {
                write!(f, "model config error: kv layout {layout:?} given for MLA, which uses the latent cache")
            }
            Reason::SparseWithoutMla => f.write_str("model config error: sparse top-k attention is MLA's, not standard attention's"),
            Reason::SparseMla => f.write_str("sparse MLA (top-k index lists) not supported"),
            Reason::NoGpu => f.write_str("needs a GPU, and there is none"),
            Reason::ComputeCapability { device, supported } => {
                write!(f, "compute capability {device} not supported (supports {supported})")
            }
            Reason::Kind { kind, supported } => {
                write!(f, "{kind} attention not supported (supports ")?;
                write_list(f, supported.iter())?;
                f.write_str(")")
            }
            Reason::QDType { dtype, supported } => {
                write!(f, "query dtype {} not supported (supports ", dtype_name(dtype))?;
                write_list(f, supported.iter().map(|&d| dtype_name(d)))?;
                f.write_str(")")
            }
            Reason::CacheDType { dtype, supported } => {
                write!(f, "kv-cache dtype {} not supported (supports ", dtype_name(dtype))?;
                write_list(f, supported.iter().map(|&d| dtype_name(d)))?;
                f.write_str(")")
            }
            Reason::CacheDTypeWithQuery { cache, q } => write!(
                f,
                "kv-cache dtype {} not supported with {} queries (supports the query dtype, fp8_e4m3 or fp8_e5m2)",
                dtype_name(cache),
                dtype_name(q)
            ),
            Reason::HeadSize { head_size, supported } => write!(f, "head size {head_size} not supported (supports {supported})"),
            Reason::BlockSize { block_size, supported } => write!(f, "block size {block_size} not supported (supports {supported})"),
            Reason::Feature(feature) => write!(f, "{feature} not supported"),
            Reason::GpuPresent => {
                f.write_str("not chosen automatically on a machine with a GPU (it takes host tensors): name it as an override to use it")
            }
            Reason::Layout { layout, supported } => {
                write!(f, "kv layout {layout:?} not supported (supports ")?;
                write_list(f, supported.iter().map(|l| format!("{l:?}")))?;
                f.write_str(")")
            }
        }
    }
}

/// Lower-case dtype names for reports (`bf16`, `fp8_e4m3`, `fp8_e5m2`).
pub fn dtype_name(dtype: DType) -> &'static str {
    match dtype {
        DType::Fp8E4m3 => "fp8_e4m3",
        DType::Fp8E5m2 => "fp8_e5m2",
        other => other.kernel_name(),
    }
}
