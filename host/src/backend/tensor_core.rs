//! `tensor-core`: the paged decode kernels of [`crate::decode`] (tensor-core tiles, split-K),
//! for standard attention on Ampere and newer.

use super::spec::{AttentionKind, BackendSpec, BlockSizes, CacheDTypeRule, CcRange, ComputeCapability, Features, GraphSupport, HeadSizes};
use crate::dtype::DType;
use crate::layout::KvLayout;

/// The `tensor-core` backend: standard attention on the GPU (decode, prefill and cache-write
/// kernels; sm_80 and newer).
pub static TENSOR_CORE: BackendSpec = BackendSpec {
    name: "tensor-core",
    summary: "paged split-K decode kernels on tensor cores (Ampere and newer)",
    needs_gpu: true,
    compute_capability: CcRange::from(ComputeCapability::SM_80),
    q_dtypes: &[DType::F16, DType::BF16],
    cache_dtypes: &[DType::F16, DType::BF16, DType::Fp8E4m3, DType::Fp8E5m2],
    cache_dtype_rule: CacheDTypeRule::SameAsQueryOrFp8,
    // Run at the kernel widths 64, 96, 128 and 256 (`attn_math::decode::width`).
    head_sizes: HeadSizes::Multiples {
        step: 8,
        fp8_step: 8,
        min: attn_math::decode::MIN_HEAD_SIZE as usize,
        max: attn_math::decode::MAX_HEAD_SIZE as usize,
    },
    block_sizes: BlockSizes::MultipleOf(16),
    kinds: &[AttentionKind::Standard],
    features: Features::ALL,
    layouts: &KvLayout::ALL,
    // One plan per batch shape: a graph captured for one query length replays only that one.
    graph_support: GraphSupport::Always,
    sparse_mla: false,
};
