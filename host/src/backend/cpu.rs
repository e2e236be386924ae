//! `cpu`: the CPU implementation ([`crate::cpu`]): every dtype, shape, kind, feature and layout,
//! no GPU needed; the only candidate without a GPU, and with one only when an override names it.

use super::spec::{AttentionKind, BackendSpec, BlockSizes, CacheDTypeRule, CcRange, Features, GraphSupport, HeadSizes};
use crate::dtype::DType;
use crate::layout::KvLayout;

/// The `cpu` backend: [`crate::cpu`]'s implementation, any model, no GPU; `forward` takes
/// host slices ([`LayerIo::Cpu`](crate::forward::LayerIo::Cpu)).
pub static CPU: BackendSpec = BackendSpec {
    name: "cpu",
    summary: "CPU implementation (reference; machines without a GPU, or when named)",
    needs_gpu: false,
    compute_capability: CcRange::ANY,
    q_dtypes: &[DType::F16, DType::BF16, DType::F32],
    cache_dtypes: &[DType::F16, DType::BF16, DType::F32, DType::Fp8E4m3, DType::Fp8E5m2],
    cache_dtype_rule: CacheDTypeRule::Any,
    head_sizes: HeadSizes::Any,
    block_sizes: BlockSizes::MultipleOf(1),
    kinds: &[AttentionKind::Standard, AttentionKind::Mla],
    features: Features::ALL,
    layouts: &KvLayout::ALL,
    graph_support: GraphSupport::Never,
    sparse_mla: false,
};
