//! What a backend is, as plain data: the devices, dtypes, shapes, attention kinds, features and
//! cache layouts it takes, and how far CUDA graphs can capture it. Validation
//! ([`super::validate`]) reads these fields; nothing here runs code.

use crate::dtype::DType;
use crate::layout::KvLayout;
use std::fmt;

/// An NVIDIA compute capability (`sm_80` is 8.0). Ordered by (major, minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    /// The major version (8 for Ampere's sm_80/sm_86, 9 for Hopper).
    pub major: u32,
    /// The minor version.
    pub minor: u32,
}

impl ComputeCapability {
    /// Volta (V100).
    pub const SM_70: ComputeCapability = ComputeCapability::new(7, 0);
    /// Ampere (A100), the oldest GPU the kernels run on.
    pub const SM_80: ComputeCapability = ComputeCapability::new(8, 0);
    /// Hopper (H100, H200).
    pub const SM_90: ComputeCapability = ComputeCapability::new(9, 0);

    /// `major.minor`.
    pub const fn new(major: u32, minor: u32) -> Self {
        ComputeCapability { major, minor }
    }
}

impl fmt::Display for ComputeCapability {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "sm_{}{}", self.major, self.minor)
    }
}

/// The compute capabilities a GPU backend runs on, both ends inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CcRange {
    /// The oldest supported.
    pub min: ComputeCapability,
    /// `None`: no upper bound.
    pub max: Option<ComputeCapability>,
}

impl CcRange {
    /// Every GPU.
    pub const ANY: CcRange = CcRange { min: ComputeCapability::new(0, 0), max: None };

    /// `min` and newer.
    pub const fn from(min: ComputeCapability) -> Self {
        CcRange { min, max: None }
    }

    /// `min` to `max`, both included.
    pub const fn between(min: ComputeCapability, max: ComputeCapability) -> Self {
        CcRange { min, max: Some(max) }
    }

    /// Whether `cc` is in the range.
    pub fn contains(&self, cc: ComputeCapability) -> bool {
        cc >= self.min && self.max.is_none_or(|max| cc <= max)
    }
}

impl fmt::Display for CcRange {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.max {
            None => write!(f, "{} and newer", self.min),
            Some(max) if max == self.min => write!(f, "{max} only"),
            Some(max) => write!(f, "{} to {max}", self.min),
        }
    }
}

/// The head sizes a backend has kernels for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HeadSizes {
    /// Every head size (the CPU implementation).
    Any,
    /// Exactly these.
    List(&'static [usize]),
    /// The multiples of `step` from `min` to `max`; with an FP8 cache, of `fp8_step`.
    Multiples {
        /// The step with a 16-bit cache.
        step: usize,
        /// The step with an FP8 cache.
        fp8_step: usize,
        /// The smallest and largest head size.
        min: usize,
        /// See `min`.
        max: usize,
    },
}

impl HeadSizes {
    /// Whether the backend takes `head_size` (with an FP8 cache when `fp8`).
    pub fn contains(&self, head_size: usize, fp8: bool) -> bool {
        match *self {
            HeadSizes::Any => true,
            HeadSizes::List(sizes) => sizes.contains(&head_size),
            HeadSizes::Multiples { step, fp8_step, min, max } => {
                (min..=max).contains(&head_size) && head_size.is_multiple_of(if fp8 { fp8_step } else { step })
            }
        }
    }
}

impl fmt::Display for HeadSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match *self {
            HeadSizes::Any => f.write_str("any"),
            HeadSizes::List(sizes) => write_list(f, sizes.iter()),
            HeadSizes::Multiples { step, fp8_step, min, max } if fp8_step == step => write!(f, "multiples of {step} from {min} to {max}"),
            HeadSizes::Multiples { step, fp8_step, min, max } => {
                write!(f, "multiples of {step} from {min} to {max} (of {fp8_step} with an fp8 cache)")
            }
        }
    }
}

/// The KV-cache block sizes (tokens per block) a backend takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSizes {
    /// Exactly these.
    List(&'static [usize]),
    /// Any positive multiple of `n`.
    MultipleOf(usize),
}

impl BlockSizes {
    /// Whether the backend takes `block_size` tokens per block.
    pub fn contains(&self, block_size: usize) -> bool {
        match *self {
            BlockSizes::List(sizes) => sizes.contains(&block_size),
            BlockSizes::MultipleOf(n) => block_size > 0 && n > 0 && block_size.is_multiple_of(n),
        }
    }
}

impl fmt::Display for BlockSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BlockSizes::List(sizes) => write_list(f, sizes.iter()),
            BlockSizes::MultipleOf(1) => f.write_str("any"),
            BlockSizes::MultipleOf(n) => write!(f, "multiples of {n}"),
        }
    }
}

/// Standard (MHA/GQA/MQA over a K/V cache) or multi-head latent attention (DeepSeek's MLA over a
/// latent cache, [`crate::layout::MlaCacheSpec`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum AttentionKind {
    /// Multi-head, grouped-query or multi-query attention over a K/V cache.
    Standard,
    /// Multi-head latent attention over a latent cache.
    Mla,
}

impl fmt::Display for AttentionKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionKind::Standard => "standard",
            AttentionKind::Mla => "MLA",
        })
    }
}

/// One optional attention feature.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Feature {
    /// Per-head sink logits that join the softmax denominator (gpt-oss).
    Sinks,
    /// Each query sees only its last `window` keys.
    SlidingWindow,
    /// Logits capped as `cap * tanh(logit / cap)` (Gemma 2).
    SoftCap,
    /// Per-head linear position biases (ALiBi).
    Alibi,
}

impl Feature {
    /// Every feature.
    pub const ALL: [Feature; 4] = [Feature::Sinks, Feature::SlidingWindow, Feature::SoftCap, Feature::Alibi];
}

impl fmt::Display for Feature {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Feature::Sinks => "attention sinks",
            Feature::SlidingWindow => "sliding window",
            Feature::SoftCap => "logit soft-cap",
            Feature::Alibi => "ALiBi",
        })
    }
}

/// A set of [`Feature`]s: what a backend supports, or what a model uses.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct Features {
    /// [`Feature::Sinks`].
    pub sinks: bool,
    /// [`Feature::SlidingWindow`].
    pub sliding_window: bool,
    /// [`Feature::SoftCap`].
    pub softcap: bool,
    /// [`Feature::Alibi`].
    pub alibi: bool,
}

impl Features {
    /// No feature.
    pub const NONE: Features = Features { sinks: false, sliding_window: false, softcap: false, alibi: false };
    /// Every feature.
    pub const ALL: Features = Features { sinks: true, sliding_window: true, softcap: true, alibi: true };

    /// Whether `feature` is in the set.
    pub fn has(&self, feature: Feature) -> bool {
        match feature {
            Feature::Sinks => self.sinks,
            Feature::SlidingWindow => self.sliding_window,
            Feature::SoftCap => self.softcap,
            Feature::Alibi => self.alibi,
        }
    }

    /// The features in `self` that `supported` lacks, in [`Feature::ALL`] order.
    pub fn missing_from(self, supported: Features) -> impl Iterator<Item = Feature> {
        Feature::ALL.into_iter().filter(move |&f| self.has(f) && !supported.has(f))
    }
}

/// Which KV-cache dtype goes with which query dtype (each must be in its list as well).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CacheDTypeRule {
    /// Any listed cache dtype with any listed query dtype.
    Any,
    /// The query's own dtype, or FP8 E4M3 (dequantised with per-tensor scales).
    SameAsQueryOrFp8,
}

/// How much of a backend's work a CUDA graph can capture (vLLM's `AttentionCGSupport`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum GraphSupport {
    /// Any batch, mixed prefill and decode included.
    Always,
    /// Batches whose requests all have the same query length.
    UniformBatch,
    /// Batches of one-token decodes only.
    SingleTokenDecode,
    /// No capture: run eagerly.
    Never,
}

impl fmt::Display for GraphSupport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            GraphSupport::Always => "always (any batch)",
            GraphSupport::UniformBatch => "uniform batches (every request the same query length)",
            GraphSupport::SingleTokenDecode => "single-token decode batches only",
            GraphSupport::Never => "never (runs eagerly)",
        })
    }
}

/// One attention backend, as data. Registered in [`super::registry::REGISTRY`]; ranked per
/// model and device by [`super::priority::priorities`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct BackendSpec {
    /// The name overrides use (`ATTN_BACKEND=tensor-core`), lower case with dashes.
    pub name: &'static str,
    /// One line for reports.
    pub summary: &'static str,
    /// Whether it runs on a GPU (and so needs one, within `compute_capability`).
    pub needs_gpu: bool,
    /// The GPUs it runs on; only read when `needs_gpu`.
    pub compute_capability: CcRange,
    /// Query (and output) dtypes it has kernels for.
    pub q_dtypes: &'static [DType],
    /// Cache dtypes it has kernels for.
    pub cache_dtypes: &'static [DType],
    /// Which cache dtype goes with which query dtype.
    pub cache_dtype_rule: CacheDTypeRule,
    /// Head sizes (query/key width) it has kernels for.
    pub head_sizes: HeadSizes,
    /// Block sizes (tokens per cache block) it takes.
    pub block_sizes: BlockSizes,
    /// The kinds of attention it does.
    pub kinds: &'static [AttentionKind],
    /// The optional features it supports.
    pub features: Features,
    /// The K/V-cache layouts it reads for standard attention (empty for an MLA-only backend,
    /// whose cache is [`crate::layout::MlaCacheSpec`]).
    pub layouts: &'static [KvLayout],
    /// How far CUDA graphs capture its work.
    pub graph_support: GraphSupport,
    /// Whether it runs sparse MLA (DeepSeek-V3.2: each query token attends only the top-k
    /// positions its index list names, [`crate::mla::mla_sparse_attention`]).
    pub sparse_mla: bool,
}

/// `a, b, c` (or `none`).
pub(crate) fn write_list<T: fmt::Display>(f: &mut fmt::Formatter<'_>, items: impl Iterator<Item = T>) -> fmt::Result {
    let mut any = false;
    for (i, item) in items.enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{item}")?;
        any = true;
    }
    if !any {
        f.write_str("none")?;
    }
    Ok(())
}
