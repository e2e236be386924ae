//! Checks a model and device against a backend's [`BackendSpec`], collecting every reason it
//! refuses (not just the first).

use super::config::{DeviceInfo, ModelConfig};
use super::reason::Reason;
use super::spec::{AttentionKind, BackendSpec, CacheDTypeRule};

/// Every reason `spec` cannot run `config` on `device`; empty when it can. The model's own
/// configuration errors ([`config_reasons`]) come first, for every backend.
pub fn refusal_reasons(spec: &BackendSpec, config: &ModelConfig, device: &DeviceInfo) -> Vec<Reason> {
    let mut reasons = config_reasons(config);
    if spec.needs_gpu {
        match device.compute_capability {
            None => reasons.push(Reason::NoGpu),
            Some(cc) if !spec.compute_capability.contains(cc) => {
                reasons.push(Reason::ComputeCapability { device: cc, supported: spec.compute_capability })
            }
            Some(_) => {}
        }
    }
    let kind_ok = spec.kinds.contains(&config.kind);
    if !kind_ok {
        reasons.push(Reason::Kind { kind: config.kind, supported: spec.kinds });
    }
    let q_ok = spec.q_dtypes.contains(&config.q_dtype);
    if !q_ok {
        reasons.push(Reason::QDType { dtype: config.q_dtype, supported: spec.q_dtypes });
    }
    let cache_ok = spec.cache_dtypes.contains(&config.cache_dtype);
    if !cache_ok {
        reasons.push(Reason::CacheDType { dtype: config.cache_dtype, supported: spec.cache_dtypes });
    }
    let pair_ok = match spec.cache_dtype_rule {
        CacheDTypeRule::Any => true,
        CacheDTypeRule::SameAsQueryOrFp8 => config.cache_dtype == config.q_dtype || config.cache_dtype.is_fp8(),
    };
    // Only when each dtype is fine on its own: otherwise that is the reason.
    if q_ok && cache_ok && !pair_ok {
        reasons.push(Reason::CacheDTypeWithQuery { cache: config.cache_dtype, q: config.q_dtype });
    }
    // Sizes of zero are config errors already.
    if config.head_size > 0 && !spec.head_sizes.contains(config.head_size, config.cache_dtype.is_fp8()) {
        reasons.push(Reason::HeadSize { head_size: config.head_size, supported: spec.head_sizes });
    }
    if config.block_size > 0 && !spec.block_sizes.contains(config.block_size) {
        reasons.push(Reason::BlockSize { block_size: config.block_size, supported: spec.block_sizes });
    }
    reasons.extend(config.features.missing_from(spec.features).map(Reason::Feature));
    // Sparse attention on a valid (MLA) model: the backend must have the sparse kernels.
    if config.sparse_topk.is_some() && config.kind == AttentionKind::Mla && !spec.sparse_mla {
        reasons.push(Reason::SparseMla);
    }
    // The layout matters only to a backend that takes standard attention at all.
    if let (AttentionKind::Standard, true, Some(layout)) = (config.kind, kind_ok, config.kv_layout) {
        if !spec.layouts.contains(&layout) {
            reasons.push(Reason::Layout { layout, supported: spec.layouts });
        }
    }
    reasons
}

/// Problems of the model's configuration itself, whatever the backend.
pub fn config_reasons(config: &ModelConfig) -> Vec<Reason> {
    let mut reasons = Vec::new();
    for (what, value) in [
        ("num_q_heads", config.num_q_heads),
        ("num_kv_heads", config.num_kv_heads),
        ("head_size", config.head_size),
        ("block_size", config.block_size),
    ] {
        if value == 0 {
            reasons.push(Reason::Zero { what });
        }
    }
    if config.num_q_heads > 0 && config.num_kv_heads > 0 && !config.num_q_heads.is_multiple_of(config.num_kv_heads) {
        reasons.push(Reason::HeadsNotDivisible { num_q_heads: config.num_q_heads, num_kv_heads: config.num_kv_heads });
    }
    match (config.kind, config.kv_layout) {
        (AttentionKind::Standard, None) => reasons.push(Reason::MissingLayout),
        (AttentionKind::Mla, Some(layout)) => reasons.push(Reason::LayoutWithMla { layout }),
        _ => {}
    }
    if config.kind == AttentionKind::Mla && config.num_kv_heads > 1 {
        reasons.push(Reason::MlaKvHeads { num_kv_heads: config.num_kv_heads });
    }
    match config.sparse_topk {
        Some(0) => reasons.push(Reason::Zero { what: "sparse_topk" }),
        Some(_) if config.kind != AttentionKind::Mla => reasons.push(Reason::SparseWithoutMla),
        _ => {}
    }
    reasons
}
