//! What a backend is, as plain data: the devices, dtypes, shapes, attention kinds, features and
//! cache layouts it takes, and how far CUDA graphs can capture it. Validation
//! ([`super::validate`]) reads these fields; nothing here runs code.

use crate::dtype::DType;
use crate::layout::KvLayout;
use std::fmt;

/// An NVIDIA compute capability (`sm_80` is 8.0). Ordered by (major, minor).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct ComputeCapability {
    pub major: u32,
    pub minor: u32,
}

impl ComputeCapability {
    pub const SM_70: ComputeCapability = ComputeCapability::new(7, 0);
    pub const SM_80: ComputeCapability = ComputeCapability::new(8, 0);
    pub const SM_90: ComputeCapability = ComputeCapability::new(9, 0);

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

    pub const fn between(min: ComputeCapability, max: ComputeCapability) -> Self {
        CcRange { min, max: Some(max) }
    }

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
    Any,
    List(&'static [usize]),
}

impl HeadSizes {
    pub fn contains(&self, head_size: usize) -> bool {
        match self {
            HeadSizes::Any => true,
            HeadSizes::List(sizes) => sizes.contains(&head_size),
        }
    }
}

impl fmt::Display for HeadSizes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HeadSizes::Any => f.write_str("any"),
            HeadSizes::List(sizes) => write_list(f, sizes.iter()),
        }
    }
}

/// The KV-cache block sizes (tokens per block) a backend takes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BlockSizes {
    List(&'static [usize]),
    /// Any positive multiple of `n`.
    MultipleOf(usize),
}

impl BlockSizes {
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
    Standard,
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
    Sinks,
    SlidingWindow,
    SoftCap,
    Alibi,
}

impl Feature {
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
    pub sinks: bool,
    pub sliding_window: bool,
    pub softcap: bool,
    pub alibi: bool,
}

impl Features {
    pub const NONE: Features = Features { sinks: false, sliding_window: false, softcap: false, alibi: false };
    pub const ALL: Features = Features { sinks: true, sliding_window: true, softcap: true, alibi: true };

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
    pub q_dtypes: &'static [DType],
    pub cache_dtypes: &'static [DType],
    pub cache_dtype_rule: CacheDTypeRule,
    pub head_sizes: HeadSizes,
    pub block_sizes: BlockSizes,
    pub kinds: &'static [AttentionKind],
    pub features: Features,
    /// The K/V-cache layouts it reads for standard attention (empty for an MLA-only backend,
    /// whose cache is [`crate::layout::MlaCacheSpec`]).
    pub layouts: &'static [KvLayout],
    pub graph_support: GraphSupport,
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
