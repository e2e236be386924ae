//! CPU tests of backend registry and selection (`attn_rs::backend`), on simulated devices: the
//! automatic choice per model and GPU generation, overrides, every refusal reason, and the
//! `describe` report. The environment is never read or written here (the `_no_env` variants
//! take the override explicitly), except to compare `select_backend` with them.

use attn_rs::backend::{
    backend_names, config_reasons, describe_no_env, find_backend, priorities, refusal_reasons, select_backend, select_backend_no_env,
    AttentionKind, BackendSpec, BlockSizes, CacheDTypeRule, CcRange, ComputeCapability, DeviceInfo, Feature, Features, GraphSupport,
    HeadSizes, ModelConfig, OverrideSource, Reason, CPU, MLA, OVERRIDE_ENV, REGISTRY, TENSOR_CORE,
};
use attn_rs::{AttnError, DType, KvLayout};

const SM70: DeviceInfo = DeviceInfo::gpu(7, 0);
const SM80: DeviceInfo = DeviceInfo::gpu(8, 0);
const SM90: DeviceInfo = DeviceInfo::gpu(9, 0);
const NO_GPU: DeviceInfo = DeviceInfo::no_gpu();

/// Llama-3-8B: 32 q heads, 8 kv heads, d128, bf16, block 16, FlashAttention NHD cache.
fn llama() -> ModelConfig {
    ModelConfig::standard(32, 8, 128, DType::BF16, 16, KvLayout::FlashNhd)
}

/// DeepSeek-V3: 128 heads over one 512 + 64 latent, bf16, block 64.
fn deepseek() -> ModelConfig {
    ModelConfig::mla(128, DType::BF16, 64)
}

fn auto(config: &ModelConfig, device: &DeviceInfo) -> attn_rs::Result<attn_rs::backend::Selection> {
    select_backend_no_env(config, device, None)
}

/// The `reason` text of a `backend` `InvalidArgument` error.
fn backend_error(result: attn_rs::Result<attn_rs::backend::Selection>) -> String {
    match result {
        Err(AttnError::InvalidArgument { arg: "backend", reason }) => reason,
        other => panic!("expected a `backend` InvalidArgument error, got {other:?}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Registry and specs
// ---------------------------------------------------------------------------------------------

#[test]
fn registry_holds_the_three_backends_with_unique_names() {
    assert_eq!(backend_names(), ["tensor-core", "mla", "cpu"]);
    for (i, a) in REGISTRY.iter().enumerate() {
        assert!(REGISTRY[i + 1..].iter().all(|b| b.name != a.name), "duplicate name {}", a.name);
        assert_eq!(find_backend(a.name).map(|b| b.name), Some(a.name));
    }
    assert_eq!(find_backend("TENSOR_CORE").map(|b| b.name), Some("tensor-core"));
    assert_eq!(find_backend(" Cpu ").map(|b| b.name), Some("cpu"));
    assert!(find_backend("flash-attn").is_none());
}

#[test]
fn specs_are_what_the_kernels_take() {
    assert!(TENSOR_CORE.needs_gpu && MLA.needs_gpu && !CPU.needs_gpu);
    assert_eq!(TENSOR_CORE.compute_capability, CcRange::from(ComputeCapability::SM_80));
    assert_eq!(TENSOR_CORE.head_sizes, HeadSizes::Multiples { step: 8, fp8_step: 8, min: 32, max: 256 });
    // The kernels take every multiple of 8 from 32 to 256, at the widths built.
    for d in (32..=256).step_by(8) {
        assert!(TENSOR_CORE.head_sizes.contains(d, false) && TENSOR_CORE.head_sizes.contains(d, true), "{d}");
        assert!(attn_math::decode::width(d as u32).is_some_and(|w| attn_math::decode::HEAD_SIZES.contains(&w)));
    }
    assert!(!TENSOR_CORE.head_sizes.contains(24, false) && !TENSOR_CORE.head_sizes.contains(84, false));
    assert!(!TENSOR_CORE.head_sizes.contains(264, false));
    assert_eq!(TENSOR_CORE.head_sizes.to_string(), "multiples of 8 from 32 to 256");
    assert_eq!(TENSOR_CORE.layouts, KvLayout::ALL);
    assert_eq!(TENSOR_CORE.features, Features::ALL);
    assert_eq!(TENSOR_CORE.graph_support, GraphSupport::Always);
    assert_eq!(MLA.head_sizes, HeadSizes::List(&[576]));
    assert!(MLA.layouts.is_empty());
    assert_eq!(MLA.features, Features::NONE);
    assert_eq!(MLA.kinds, [AttentionKind::Mla]);
    assert_eq!(CPU.kinds, [AttentionKind::Standard, AttentionKind::Mla]);
    assert_eq!(CPU.graph_support, GraphSupport::Never);
    assert!(CPU.head_sizes.contains(80, false) && CPU.block_sizes.contains(1) && CPU.block_sizes.contains(7));
    assert!(BlockSizes::MultipleOf(16).contains(32) && !BlockSizes::MultipleOf(16).contains(8) && !BlockSizes::MultipleOf(16).contains(0));
    assert!(BlockSizes::List(&[16, 32]).contains(32) && !BlockSizes::List(&[16, 32]).contains(48));
    assert!(CcRange::between(ComputeCapability::SM_80, ComputeCapability::new(8, 9)).contains(ComputeCapability::new(8, 6)));
    assert!(!CcRange::between(ComputeCapability::SM_80, ComputeCapability::new(8, 9)).contains(ComputeCapability::SM_90));
}

#[test]
fn priorities_depend_on_kind_and_device() {
    let names = |s: &[&BackendSpec]| s.iter().map(|b| b.name).collect::<Vec<_>>();
    for gpu in [SM70, SM80, SM90] {
        assert_eq!(names(priorities(AttentionKind::Standard, &gpu)), ["tensor-core"]);
        assert_eq!(names(priorities(AttentionKind::Mla, &gpu)), ["mla"]);
    }
    assert_eq!(names(priorities(AttentionKind::Standard, &NO_GPU)), ["cpu"]);
    assert_eq!(names(priorities(AttentionKind::Mla, &NO_GPU)), ["cpu"]);
}

// ---------------------------------------------------------------------------------------------
// Automatic selection
// ---------------------------------------------------------------------------------------------

#[test]
fn mha_selection_per_device() {
    for gpu in [SM80, SM90] {
        let s = auto(&llama(), &gpu).unwrap();
        assert_eq!(s.name(), "tensor-core");
        assert_eq!(s.overridden_by, None);
        assert!(s.refused.is_empty());
        assert_eq!(s.graph_support(), GraphSupport::Always);
    }
    // No GPU: the CPU is the only candidate, so nothing ranked better was refused.
    let s = auto(&llama(), &NO_GPU).unwrap();
    assert_eq!(s.name(), "cpu");
    assert!(s.refused.is_empty());
    assert_eq!(s.graph_support(), GraphSupport::Never);
    // Too old a GPU: tensor-core refuses, and the CPU is not automatic where there is a GPU.
    let e = auto(&llama(), &SM70).unwrap_err().to_string();
    assert!(e.contains("tensor-core: compute capability sm_70 not supported (supports sm_80 and newer)"), "{e}");
    assert!(e.contains("cpu: not chosen automatically on a machine with a GPU"), "{e}");
    // Named, it runs there.
    assert_eq!(select_backend_no_env(&llama(), &SM70, Some("cpu")).unwrap().name(), "cpu");
}

#[test]
fn mla_selection_per_device() {
    for gpu in [SM80, SM90] {
        let s = auto(&deepseek(), &gpu).unwrap();
        assert_eq!(s.name(), "mla");
        assert!(s.refused.is_empty());
        assert_eq!(s.graph_support(), GraphSupport::UniformBatch);
    }
    assert_eq!(auto(&deepseek(), &NO_GPU).unwrap().name(), "cpu");
    // An FP8 latent cache is fine on mla.
    assert_eq!(auto(&deepseek().with_cache_dtype(DType::Fp8E4m3), &SM90).unwrap().name(), "mla");
}

/// A head size the GPU kernels lack (84: not a multiple of 8) on a GPU machine: refused with every backend's reasons,
/// never handed to the CPU (which would then fail on the engine's device buffers).
#[test]
fn a_model_no_gpu_backend_takes_is_refused_on_a_gpu_with_every_reason() {
    let config = ModelConfig { head_size: 84, ..llama() };
    for gpu in [SM80, SM90] {
        let e = auto(&config, &gpu).unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, AttnError::InvalidArgument { arg: "backend", .. }), "{text}");
        assert!(text.contains("tensor-core: head size 84 not supported (supports multiples of 8 from 32 to 256)"), "{text}");
        assert!(text.contains("cpu: not chosen automatically on a machine with a GPU"), "{text}");
        assert_eq!(select_backend_no_env(&config, &gpu, Some("cpu")).unwrap().name(), "cpu");
    }
    // Without a GPU the CPU takes it.
    assert_eq!(auto(&config, &NO_GPU).unwrap().name(), "cpu");
    assert_eq!(
        Reason::GpuPresent.to_string(),
        "not chosen automatically on a machine with a GPU (it takes host tensors): name it as an override to use it"
    );
}

#[test]
fn select_backend_reads_no_override_when_the_environment_has_none() {
    if std::env::var_os(OVERRIDE_ENV).is_some() {
        return; // Not this test's to judge: the environment chooses.
    }
    assert_eq!(attn_rs::backend::override_from_env(), None);
    for device in [SM70, SM80, SM90, NO_GPU] {
        for config in [llama(), deepseek()] {
            assert_eq!(select_backend(&config, &device, None).ok(), auto(&config, &device).ok());
        }
    }
    // An explicit argument wins over the environment either way.
    let s = select_backend(&llama(), &SM80, Some("cpu")).unwrap();
    assert_eq!((s.name(), s.overridden_by), ("cpu", Some(OverrideSource::Argument)));
}

// ---------------------------------------------------------------------------------------------
// Overrides
// ---------------------------------------------------------------------------------------------

#[test]
fn override_to_cpu_on_a_gpu() {
    for (config, gpu) in [(llama(), SM80), (deepseek(), SM90)] {
        let s = select_backend_no_env(&config, &gpu, Some("cpu")).unwrap();
        assert_eq!(s.name(), "cpu");
        assert_eq!(s.overridden_by, Some(OverrideSource::Argument));
        assert!(s.refused.is_empty());
    }
    // Naming the automatic choice is fine too.
    assert_eq!(select_backend_no_env(&llama(), &SM90, Some("tensor-core")).unwrap().name(), "tensor-core");
}

#[test]
fn override_naming_an_unknown_backend_lists_the_known_ones() {
    let e = backend_error(select_backend_no_env(&llama(), &SM80, Some("flash-attn")));
    assert!(e.contains("unknown backend \"flash-attn\""), "{e}");
    for name in backend_names() {
        assert!(e.contains(name), "{e} does not name {name}");
    }
}

#[test]
fn override_whose_backend_refuses_is_an_error_with_its_reasons() {
    // tensor-core without a GPU: no silent fallback to the CPU.
    let e = backend_error(select_backend_no_env(&llama(), &NO_GPU, Some("tensor-core")));
    assert!(e.contains("\"tensor-core\"") && e.contains("needs a GPU"), "{e}");

    // mla for an MHA model: the kind and the head size.
    let e = backend_error(select_backend_no_env(&llama(), &SM90, Some("mla")));
    assert!(e.contains("\"mla\""), "{e}");
    assert!(e.contains("standard attention not supported (supports MLA)"), "{e}");
    assert!(e.contains("head size 128 not supported (supports 576)"), "{e}");
    assert_eq!(
        refusal_reasons(&MLA, &llama(), &SM90),
        [
            Reason::Kind { kind: AttentionKind::Standard, supported: MLA.kinds },
            Reason::HeadSize { head_size: 128, supported: MLA.head_sizes }
        ]
    );

    // tensor-core for an MLA model, and on too old a GPU.
    let e = backend_error(select_backend_no_env(&deepseek(), &SM70, Some("tensor-core")));
    assert!(e.contains("compute capability sm_70 not supported (supports sm_80 and newer)"), "{e}");
    assert!(e.contains("MLA attention not supported (supports standard)"), "{e}");
    assert!(e.contains("head size 576 not supported"), "{e}");
}

// ---------------------------------------------------------------------------------------------
// Every refusal reason
// ---------------------------------------------------------------------------------------------

fn reason_texts(spec: &BackendSpec, config: &ModelConfig, device: &DeviceInfo) -> Vec<String> {
    refusal_reasons(spec, config, device).iter().map(|r| r.to_string()).collect()
}

#[test]
fn reason_device() {
    assert_eq!(refusal_reasons(&TENSOR_CORE, &llama(), &NO_GPU), [Reason::NoGpu]);
    assert_eq!(refusal_reasons(&MLA, &deepseek(), &NO_GPU), [Reason::NoGpu]);
    assert_eq!(reason_texts(&TENSOR_CORE, &llama(), &SM70), ["compute capability sm_70 not supported (supports sm_80 and newer)"]);
    // An upper bound, for a backend of one generation.
    let hopper_only =
        BackendSpec { compute_capability: CcRange::between(ComputeCapability::SM_90, ComputeCapability::SM_90), ..TENSOR_CORE };
    assert_eq!(reason_texts(&hopper_only, &llama(), &SM80), ["compute capability sm_80 not supported (supports sm_90 only)"]);
    assert!(refusal_reasons(&hopper_only, &llama(), &SM90).is_empty());
    let band = BackendSpec { compute_capability: CcRange::between(ComputeCapability::SM_80, ComputeCapability::new(8, 9)), ..TENSOR_CORE };
    assert_eq!(reason_texts(&band, &llama(), &SM90), ["compute capability sm_90 not supported (supports sm_80 to sm_89)"]);
    // The CPU backend never needs a GPU, and runs beside any.
    for device in [SM70, SM80, SM90, NO_GPU] {
        assert!(refusal_reasons(&CPU, &llama(), &device).is_empty());
        assert!(refusal_reasons(&CPU, &deepseek(), &device).is_empty());
    }
}

#[test]
fn reason_q_dtype() {
    let config = ModelConfig::standard(32, 8, 128, DType::F32, 16, KvLayout::FlashNhd).with_cache_dtype(DType::BF16);
    assert_eq!(reason_texts(&TENSOR_CORE, &config, &SM80), ["query dtype f32 not supported (supports f16, bf16)"]);
    // The CPU takes f32 queries, when named (or without a GPU).
    assert!(auto(&config, &SM80).is_err());
    assert_eq!(auto(&config, &NO_GPU).unwrap().name(), "cpu");
}

#[test]
fn reason_cache_dtype() {
    let f32_cache = llama().with_cache_dtype(DType::F32);
    assert_eq!(
        reason_texts(&TENSOR_CORE, &f32_cache, &SM80),
        ["kv-cache dtype f32 not supported (supports f16, bf16, fp8_e4m3, fp8_e5m2)"]
    );
    assert!(refusal_reasons(&TENSOR_CORE, &llama().with_cache_dtype(DType::Fp8E4m3), &SM80).is_empty());
    assert!(refusal_reasons(&TENSOR_CORE, &llama().with_cache_dtype(DType::Fp8E5m2), &SM80).is_empty());
    // f16 and bf16 are each supported, but a bf16 query reads a bf16 or fp8 cache only.
    let mixed = llama().with_cache_dtype(DType::F16);
    assert_eq!(refusal_reasons(&TENSOR_CORE, &mixed, &SM80), [Reason::CacheDTypeWithQuery { cache: DType::F16, q: DType::BF16 }]);
    assert_eq!(
        reason_texts(&TENSOR_CORE, &mixed, &SM80),
        ["kv-cache dtype f16 not supported with bf16 queries (supports the query dtype, fp8_e4m3 or fp8_e5m2)"]
    );
    assert!(refusal_reasons(&CPU, &mixed, &SM80).is_empty());
    assert_eq!(CPU.cache_dtype_rule, CacheDTypeRule::Any);
}

#[test]
fn reason_head_size() {
    let config = ModelConfig { head_size: 84, ..llama() };
    assert_eq!(reason_texts(&TENSOR_CORE, &config, &SM80), ["head size 84 not supported (supports multiples of 8 from 32 to 256)"]);
    // An FP8 cache takes the multiples of 8 too (the odd ones on the `_fp8_a8` kernels).
    let fp8 = ModelConfig { head_size: 72, ..llama() }.with_cache_dtype(DType::Fp8E4m3);
    assert!(refusal_reasons(&TENSOR_CORE, &fp8, &SM80).is_empty());
    for d in [32, 40, 64, 72, 80, 96, 112, 128, 136, 192, 200, 256] {
        assert!(refusal_reasons(&TENSOR_CORE, &ModelConfig { head_size: d, ..llama() }, &SM80).is_empty());
    }
    let config = ModelConfig { head_size: 512, ..deepseek() };
    assert_eq!(reason_texts(&MLA, &config, &SM80), ["head size 512 not supported (supports 576)"]);
}

#[test]
fn reason_block_size() {
    let config = ModelConfig { block_size: 8, ..llama() };
    assert_eq!(reason_texts(&TENSOR_CORE, &config, &SM80), ["block size 8 not supported (supports multiples of 16)"]);
    assert_eq!(
        reason_texts(&MLA, &ModelConfig { block_size: 8, ..deepseek() }, &SM80),
        ["block size 8 not supported (supports multiples of 16)"]
    );
    let listed = BackendSpec { block_sizes: BlockSizes::List(&[16, 32, 64]), ..TENSOR_CORE };
    assert_eq!(
        reason_texts(&listed, &ModelConfig { block_size: 48, ..llama() }, &SM80),
        ["block size 48 not supported (supports 16, 32, 64)"]
    );
    assert!(auto(&config, &SM80).is_err());
}

#[test]
fn reason_attention_kind() {
    assert_eq!(
        refusal_reasons(&TENSOR_CORE, &deepseek(), &SM80)[0],
        Reason::Kind { kind: AttentionKind::Mla, supported: TENSOR_CORE.kinds }
    );
    // Same head size, so only the kind is left.
    let mha_576 = ModelConfig::standard(16, 16, 576, DType::BF16, 16, KvLayout::FlashNhd);
    assert_eq!(reason_texts(&MLA, &mha_576, &SM80), ["standard attention not supported (supports MLA)"]);
}

#[test]
fn reason_features_unsupported_by_mla() {
    let config = deepseek().with_features(Features::ALL);
    assert_eq!(refusal_reasons(&MLA, &config, &SM90), Feature::ALL.map(Reason::Feature));
    assert_eq!(
        reason_texts(&MLA, &config, &SM90),
        ["attention sinks not supported", "sliding window not supported", "logit soft-cap not supported", "ALiBi not supported"]
    );
    // One feature at a time.
    let window = Features { sliding_window: true, ..Features::NONE };
    assert_eq!(refusal_reasons(&MLA, &deepseek().with_features(window), &SM90), [Reason::Feature(Feature::SlidingWindow)]);
    // Refused on the GPU with mla's four reasons and the CPU's.
    let e = auto(&config, &SM90).unwrap_err().to_string();
    assert!(e.contains("mla: attention sinks not supported; sliding window not supported"), "{e}");
    assert!(e.contains("cpu: not chosen automatically"), "{e}");
    // tensor-core supports them all.
    assert!(refusal_reasons(&TENSOR_CORE, &llama().with_features(Features::ALL), &SM80).is_empty());
}

#[test]
fn sparse_mla_is_the_mla_backends_capability() {
    // DeepSeek-V3.2: sparse MLA over the top 2048 positions of each query token.
    let v32 = deepseek().with_sparse_topk(2048);
    assert!(MLA.sparse_mla && !CPU.sparse_mla && !TENSOR_CORE.sparse_mla);
    assert!(refusal_reasons(&MLA, &v32, &SM90).is_empty());
    assert_eq!(refusal_reasons(&CPU, &v32, &NO_GPU), [Reason::SparseMla]);
    assert_eq!(reason_texts(&CPU, &v32, &NO_GPU), ["sparse MLA (top-k index lists) not supported"]);
    assert_eq!(auto(&v32, &SM90).unwrap().name(), "mla");
    assert!(auto(&v32, &NO_GPU).is_err());
    assert!(v32.to_string().ends_with(", sparse top-2048"), "{v32}");
    // Top-k lists belong to MLA models, and k is at least 1: model errors for every backend.
    assert_eq!(config_reasons(&llama().with_sparse_topk(64)), [Reason::SparseWithoutMla]);
    assert!(Reason::SparseWithoutMla.is_config_error());
    assert_eq!(config_reasons(&deepseek().with_sparse_topk(0)), [Reason::Zero { what: "sparse_topk" }]);
}

#[test]
fn reason_layout() {
    // Every registered standard backend takes every layout.
    for spec in REGISTRY.iter().filter(|b| b.kinds.contains(&AttentionKind::Standard)) {
        for layout in KvLayout::ALL {
            let config = ModelConfig { kv_layout: Some(layout), ..llama() };
            assert!(refusal_reasons(spec, &config, &SM80).is_empty(), "{} refuses {layout:?}", spec.name);
        }
    }
    let nhd_only = BackendSpec { name: "nhd-only", layouts: &[KvLayout::FlashNhd, KvLayout::FlashInferNhd], ..TENSOR_CORE };
    assert!(refusal_reasons(&nhd_only, &llama(), &SM80).is_empty());
    let hnd = ModelConfig { kv_layout: Some(KvLayout::FlashHnd), ..llama() };
    assert_eq!(
        refusal_reasons(&nhd_only, &hnd, &SM80),
        [Reason::Layout { layout: KvLayout::FlashHnd, supported: &[KvLayout::FlashNhd, KvLayout::FlashInferNhd] }]
    );
    assert_eq!(reason_texts(&nhd_only, &hnd, &SM80), ["kv layout FlashHnd not supported (supports FlashNhd, FlashInferNhd)"]);
}

#[test]
fn reason_heads_not_dividing_is_a_config_error_for_every_backend() {
    let config = ModelConfig { num_q_heads: 30, ..llama() };
    let expected = Reason::HeadsNotDivisible { num_q_heads: 30, num_kv_heads: 8 };
    assert_eq!(config_reasons(&config), [expected]);
    assert!(expected.is_config_error());
    for spec in REGISTRY {
        assert!(refusal_reasons(spec, &config, &SM80).contains(&expected), "{}", spec.name);
    }
    assert_eq!(expected.to_string(), "model config error: num_q_heads 30 is not a multiple of num_kv_heads 8");
    // No backend fits; the error names each candidate with its reasons.
    let e = backend_error(auto(&config, &SM80));
    assert!(e.starts_with("no backend fits"), "{e}");
    assert!(e.contains("tensor-core: model config error: num_q_heads 30"), "{e}");
    assert!(e.contains("cpu: model config error: num_q_heads 30"), "{e}");
}

#[test]
fn other_config_errors() {
    let zero = ModelConfig { num_kv_heads: 0, block_size: 0, ..llama() };
    assert_eq!(config_reasons(&zero), [Reason::Zero { what: "num_kv_heads" }, Reason::Zero { what: "block_size" }]);
    // A zero block size is not also reported as an unsupported one.
    assert_eq!(refusal_reasons(&TENSOR_CORE, &zero, &SM80).len(), 2);
    assert_eq!(config_reasons(&ModelConfig { num_kv_heads: 8, ..deepseek() }), [Reason::MlaKvHeads { num_kv_heads: 8 }]);
    assert_eq!(config_reasons(&ModelConfig { kv_layout: None, ..llama() }), [Reason::MissingLayout]);
    assert_eq!(
        config_reasons(&ModelConfig { kv_layout: Some(KvLayout::FlashNhd), ..deepseek() }),
        [Reason::LayoutWithMla { layout: KvLayout::FlashNhd }]
    );
    assert!(config_reasons(&llama()).is_empty() && config_reasons(&deepseek()).is_empty());
    assert!(!Reason::NoGpu.is_config_error());
}

#[test]
fn every_reason_is_collected_not_just_the_first() {
    // Three problems for tensor-core: f32 queries, head size 84 (not a multiple of 8), block size 8.
    let config = ModelConfig { head_size: 84, block_size: 8, q_dtype: DType::F32, ..llama() };
    let reasons = refusal_reasons(&TENSOR_CORE, &config, &SM80);
    assert_eq!(
        reasons,
        [
            Reason::QDType { dtype: DType::F32, supported: TENSOR_CORE.q_dtypes },
            Reason::HeadSize { head_size: 84, supported: TENSOR_CORE.head_sizes },
            Reason::BlockSize { block_size: 8, supported: TENSOR_CORE.block_sizes },
        ]
    );
    // And the device on top: four.
    assert_eq!(refusal_reasons(&TENSOR_CORE, &config, &SM70).len(), 4);
    // All of them reach an override's error.
    let e = backend_error(select_backend_no_env(&config, &SM80, Some("tensor-core")));
    for r in &reasons {
        assert!(e.contains(&r.to_string()), "{e} lacks {r}");
    }
    // Many at once for mla: device, kind, q dtype, cache dtype, head size, block size, features.
    let everything =
        ModelConfig { q_dtype: DType::F32, cache_dtype: DType::F32, head_size: 80, block_size: 8, ..llama() }.with_features(Features::ALL);
    assert_eq!(refusal_reasons(&MLA, &everything, &NO_GPU).len(), 1 + 1 + 1 + 1 + 1 + 1 + 4);
}

// ---------------------------------------------------------------------------------------------
// describe
// ---------------------------------------------------------------------------------------------

#[test]
fn describe_a_plain_choice() {
    let text = describe_no_env(&llama(), &SM80, None);
    assert!(text.contains("on GPU sm_80"), "{text}");
    assert!(text.contains("1. tensor-core: chosen"), "{text}");
    assert!(text.contains("2. cpu [named only: a GPU is present]: fits, not chosen automatically"), "{text}");
    assert!(text.contains("CUDA graphs: always (any batch)"), "{text}");
}

#[test]
fn describe_a_refusal_on_a_gpu_with_reasons() {
    let config = ModelConfig { head_size: 84, ..llama() };
    let text = describe_no_env(&config, &SM90, None);
    assert!(text.contains("1. tensor-core: refused"), "{text}");
    assert!(text.contains("- head size 84 not supported (supports multiples of 8 from 32 to 256)"), "{text}");
    assert!(text.contains("2. cpu [named only: a GPU is present]: fits, not chosen automatically"), "{text}");
    assert!(text.contains("no backend chosen") && text.contains("cpu: not chosen automatically"), "{text}");

    let text = describe_no_env(&deepseek().with_features(Features::ALL), &SM90, None);
    assert!(text.contains("1. mla: refused") && text.contains("- attention sinks not supported"), "{text}");
    assert!(text.contains("2. cpu [named only: a GPU is present]: fits"), "{text}");
}

#[test]
fn describe_mentions_each_candidate_and_the_chosen_one() {
    for (config, device) in [(llama(), SM80), (llama(), SM90), (llama(), NO_GPU), (deepseek(), SM80), (deepseek(), NO_GPU)] {
        let text = describe_no_env(&config, &device, None);
        let chosen = auto(&config, &device).unwrap();
        for b in priorities(config.kind, &device) {
            assert!(text.contains(&format!(". {}:", b.name)), "{text} lacks {}", b.name);
        }
        assert!(text.contains(&format!("chosen: {}", chosen.name())), "{text}");
        assert!(text.contains(&format!("CUDA graphs: {}", chosen.graph_support())), "{text}");
    }
}

#[test]
fn describe_overrides_and_failures() {
    let text = describe_no_env(&llama(), &SM80, Some("cpu"));
    assert!(text.contains("override: \"cpu\" from the override argument"), "{text}");
    assert!(text.contains("1. tensor-core: fits, not used (override)"), "{text}");
    assert!(text.contains("2. cpu [named only: a GPU is present]: chosen (override)"), "{text}");

    // An override outside the priority list is still shown, with its reasons.
    let text = describe_no_env(&llama(), &SM80, Some("mla"));
    assert!(text.contains("3. mla [not a candidate for this model and device]: refused"), "{text}");
    assert!(text.contains("no backend chosen: invalid argument `backend`"), "{text}");

    let text = describe_no_env(&llama(), &SM80, Some("nope"));
    assert!(text.contains("unknown backend \"nope\""), "{text}");

    let text = describe_no_env(&ModelConfig { num_q_heads: 30, ..llama() }, &SM80, None);
    assert!(text.contains("no backend chosen") && text.contains("no backend fits"), "{text}");
}
