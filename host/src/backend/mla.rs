//! `mla`: multi-head latent attention (DeepSeek-V2/V3) over the latent cache
//! ([`crate::layout::MlaCacheSpec`], 512 latent + 64 rope columns), on Ampere and newer.

use super::spec::{AttentionKind, BackendSpec, BlockSizes, CacheDTypeRule, CcRange, ComputeCapability, Features, GraphSupport, HeadSizes};
use crate::dtype::DType;
use crate::layout::MlaCacheSpec;

/// The query/key width MLA decode works in: latent plus rope (DeepSeek: 512 + 64).
pub const MLA_HEAD_SIZE: usize = MlaCacheSpec::DEEPSEEK_LATENT + MlaCacheSpec::DEEPSEEK_ROPE;

/// The `mla` backend: MLA on the GPU (`concat_and_cache_mla`, then `mla_attention` for
/// decodes and prefills, `mla_sparse_attention` for DeepSeek-V3.2's top-k lists; sm_80 and
/// newer).
pub static MLA: BackendSpec = BackendSpec {
    name: "mla",
    summary: "multi-head latent attention over the 512 + 64 latent cache (Ampere and newer)",
    needs_gpu: true,
    compute_capability: CcRange::from(ComputeCapability::SM_80),
    q_dtypes: &[DType::F16, DType::BF16],
    cache_dtypes: &[DType::F16, DType::BF16, DType::Fp8E4m3, DType::Fp8E5m2],
    cache_dtype_rule: CacheDTypeRule::SameAsQueryOrFp8,
    head_sizes: HeadSizes::List(&[MLA_HEAD_SIZE]),
    block_sizes: BlockSizes::MultipleOf(16),
    kinds: &[AttentionKind::Mla],
    features: Features::NONE,
    layouts: &[],
    graph_support: GraphSupport::UniformBatch,
    sparse_mla: true,
};
