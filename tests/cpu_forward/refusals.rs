//! Refusals: every refusal of a layer, a step or a configuration names its argument, before
//! anything is written; empty requests, block ids outside the cache, GPU backends without a
//! GPU and FP8 caches' scales.

use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig, Selection, CPU, MLA, TENSOR_CORE};
use attn_rs::context_parallel::CpShard;
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv, StepMetadata};
use attn_rs::metadata::StepInput;
use attn_rs::{AttnError, DType, KvLayout, RowsDesc};
use half::bf16;

/// The argument an error names.
fn arg_of<T>(r: attn_rs::Result<T>) -> String {
    match r {
        Err(AttnError::InvalidArgument { arg, .. }) | Err(AttnError::UnsupportedDType { arg, .. }) => arg.to_string(),
        Err(e) => format!("other error: {e}"),
        Ok(_) => "accepted".to_string(),
    }
}

const HQ: usize = 4;
const HKV: usize = 2;
const D: usize = 8;
const BS: usize = 4;
const NB: usize = 8;

fn small_model() -> ModelConfig {
    ModelConfig::standard(HQ, HKV, D, DType::F32, BS, KvLayout::FlashNhd)
}

fn limits() -> ForwardLimits {
    ForwardLimits { max_num_tokens: 16, max_num_reqs: 4, max_model_len: 32 }
}

fn cpu_selection(model: &ModelConfig) -> Selection {
    select_backend_no_env(model, &DeviceInfo::no_gpu(), None).unwrap()
}

/// A decode (1 token, length 4, block 2) then a prefill of 5 (blocks 0, 1).
struct Small {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    slots: Vec<i64>,
}

impl Small {
    fn new() -> Self {
        Small { qsl: vec![0, 1, 6], seq_lens: vec![4, 5], block_table: vec![2, 0, 0, 1], slots: vec![11, 0, 1, 2, 3, 4] }
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: 2,
            slot_mapping: &self.slots,
            num_actual_tokens: *self.qsl.last().unwrap() as usize,
            num_blocks: NB,
            block_size: BS,
        }
    }
}

/// Buffers of a valid layer for [`Small`].
struct Bufs {
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    cache: Vec<f32>,
    out: Vec<f32>,
    slopes: Vec<f32>,
}

impl Bufs {
    fn new(cache_len: usize) -> Self {
        let nt = 6;
        Bufs {
            q: vec![0.5; nt * HQ * D],
            k: vec![0.25; nt * HKV * D],
            v: vec![1.0; nt * HKV * D],
            cache: vec![0.0; cache_len],
            out: vec![-3.0; nt * HQ * D],
            slopes: vec![0.5; HQ],
        }
    }

    fn layer(&mut self) -> CpuLayer<'_> {
        CpuLayer {
            q: self.q.as_slice().into(),
            q_rows: RowsDesc::contiguous(6, HQ, D),
            new_kv: NewKv::Standard {
                k: self.k.as_slice().into(),
                k_rows: RowsDesc::contiguous(6, HKV, D),
                v: self.v.as_slice().into(),
                v_rows: RowsDesc::contiguous(6, HKV, D),
            },
            cache: self.cache.as_mut_slice().into(),
            out: self.out.as_mut_slice().into(),
            out_rows: RowsDesc::contiguous(6, HQ, D),
            alibi_slopes: None,
            sinks: None,
            kv_scales: None,
        }
    }

    fn untouched(&self) -> bool {
        self.cache.iter().all(|&x| x == 0.0) && self.out.iter().all(|&x| x == -3.0)
    }
}

fn small_attention() -> (Attention, StepMetadata, Bufs) {
    let model = small_model();
    let attn = Attention::new(&cpu_selection(&model), ForwardConfig::new(model, NB, limits()), None).unwrap();
    let mut meta = attn.new_step_metadata().unwrap();
    meta.build(&Small::new().input()).unwrap();
    let bufs = Bufs::new(attn.cache_spec().num_elements());
    (attn, meta, bufs)
}

#[test]
fn a_valid_small_layer_runs() {
    let (mut attn, meta, mut b) = small_attention();
    attn.forward(&meta, LayerIo::Cpu(b.layer())).unwrap();
    assert!(b.out.iter().all(|&x| x != -3.0));
    assert!(b.out[HQ * D..].iter().all(|&x| (x - 1.0).abs() < 1e-6), "the prefill sees only V = 1");
}

/// A change that makes a valid layer invalid.
type LayerEdit = Box<dyn Fn(&mut CpuLayer<'_>)>;
/// A change that makes a valid step invalid.
type StepEdit = Box<dyn Fn(&mut Small)>;

#[test]
fn layer_refusals_name_the_argument_and_write_nothing() {
    let bf: &'static [bf16] = Box::leak(vec![bf16::ZERO; 6 * HQ * D].into_boxed_slice());
    let small: &'static [f32] = Box::leak(vec![0.0f32; 10].into_boxed_slice());
    let cases: Vec<(&str, &str, LayerEdit)> = vec![
        ("q dtype", "q", Box::new(move |l| l.q = bf.into())),
        ("q heads", "q", Box::new(|l| l.q_rows.num_heads = HQ + 1)),
        ("q head size", "q", Box::new(|l| l.q_rows.head_size = D * 2)),
        ("q tokens", "q", Box::new(|l| l.q_rows.num_tokens = 5)),
        ("q buffer", "q", Box::new(move |l| l.q = small.into())),
        ("q overlapping heads", "q", Box::new(|l| l.q_rows.head_stride = D / 2)),
        (
            "k heads",
            "k",
            Box::new(|l| {
                if let NewKv::Standard { k_rows, .. } = &mut l.new_kv {
                    k_rows.num_heads = HQ
                }
            }),
        ),
        (
            "v tokens",
            "v",
            Box::new(|l| {
                if let NewKv::Standard { v_rows, .. } = &mut l.new_kv {
                    v_rows.num_tokens = 2
                }
            }),
        ),
        (
            "k dtype",
            "k",
            Box::new(move |l| {
                if let NewKv::Standard { k, .. } = &mut l.new_kv {
                    *k = bf.into()
                }
            }),
        ),
        (
            "MLA latents for a standard model",
            "new_kv",
            Box::new(move |l| {
                l.new_kv = NewKv::Mla { kv_c: small.into(), kv_c_token_stride: 512, k_pe: small.into(), k_pe_token_stride: 64 }
            }),
        ),
        ("out head size", "out", Box::new(|l| l.out_rows.head_size = D / 2)),
        ("out heads", "out", Box::new(|l| l.out_rows.num_heads = 1)),
        ("alibi not declared", "alibi_slopes", Box::new(move |l| l.alibi_slopes = Some(small.into()))),
        ("sinks not declared", "sinks", Box::new(move |l| l.sinks = Some(small.into()))),
    ];
    for (what, arg, mutate) in cases {
        let (mut attn, meta, mut b) = small_attention();
        let mut layer = b.layer();
        mutate(&mut layer);
        let got = arg_of(attn.forward(&meta, LayerIo::Cpu(layer)));
        assert_eq!(got, arg, "{what}");
        assert!(b.untouched(), "{what}: something was written before the refusal");
    }
}

#[test]
fn cache_and_out_buffers_are_checked() {
    let (mut attn, meta, mut b) = small_attention();
    let mut short_cache = vec![0.0f32; b.cache.len() - 1];
    let mut layer = b.layer();
    layer.cache = short_cache.as_mut_slice().into();
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(layer))), "cache");
    let mut bf_cache = vec![bf16::ZERO; b.cache.len()];
    let mut layer = b.layer();
    layer.cache = bf_cache.as_mut_slice().into();
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(layer))), "cache");
    let mut short_out = vec![0.0f32; 6 * HQ * D - 1];
    let mut layer = b.layer();
    layer.out = short_out.as_mut_slice().into();
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(layer))), "out");
    assert!(b.untouched() && short_cache.iter().all(|&x| x == 0.0));
}

#[test]
fn declared_features_need_their_inputs() {
    let model = small_model().with_features(Features { alibi: true, sinks: true, ..Features::NONE });
    let mut attn = Attention::new(&cpu_selection(&model), ForwardConfig::new(model, NB, limits()), None).unwrap();
    let mut meta = attn.new_step_metadata().unwrap();
    meta.build(&Small::new().input()).unwrap();
    let mut b = Bufs::new(attn.cache_spec().num_elements());
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(b.layer()))), "alibi_slopes");
    let slopes = b.slopes.clone();
    let mut layer = b.layer();
    layer.alibi_slopes = Some(slopes.as_slice().into());
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(layer))), "sinks");
    let mut layer = b.layer();
    layer.alibi_slopes = Some(slopes.as_slice().into());
    layer.sinks = Some(slopes[..HQ - 1].into());
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(layer))), "sinks", "too few sink values");
    let mut layer = b.layer();
    layer.alibi_slopes = Some(slopes.as_slice().into());
    layer.sinks = Some(slopes.as_slice().into());
    attn.forward(&meta, LayerIo::Cpu(layer)).unwrap();
}

#[test]
fn step_refusals_name_the_argument() {
    let (mut attn, mut meta, mut b) = small_attention();
    // Another Attention's metadata.
    let (_, other_meta, _) = small_attention();
    assert_eq!(arg_of(attn.forward(&other_meta, LayerIo::Cpu(b.layer()))), "step");
    // A failed build leaves no step.
    let mut bad = Small::new();
    bad.block_table[2] = NB as i32; // the prefill's first block is outside the cache
    assert_eq!(arg_of(meta.build(&bad.input())), "block_table");
    assert!(!meta.is_built());
    assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(b.layer()))), "step");
    assert!(b.untouched());

    let cases: Vec<(&str, &str, StepEdit)> = vec![
        ("slot outside the cache", "slot_mapping", Box::new(|s| s.slots[2] = (NB * BS) as i64)),
        (
            "decode after prefill",
            "query_start_loc",
            Box::new(|s| {
                s.qsl = vec![0, 5, 6];
                s.seq_lens = vec![5, 4];
                s.block_table = vec![0, 1, 2, 0];
                s.slots = vec![0, 1, 2, 3, 4, 11];
            }),
        ),
        ("length below its queries", "seq_lens", Box::new(|s| s.seq_lens[1] = 4)),
        (
            "too many tokens",
            "num_actual_tokens",
            Box::new(|s| {
                s.qsl = vec![0, 1, 17];
                s.seq_lens = vec![4, 16];
                s.block_table = vec![2, 0, 0, 0, 0, 1, 3, 4];
                s.slots = (0..17).collect();
            }),
        ),
        ("longer than max_model_len", "seq_lens", Box::new(|s| s.seq_lens[0] = 33)),
    ];
    for (what, arg, mutate) in cases {
        let mut s = Small::new();
        mutate(&mut s);
        assert_eq!(arg_of(meta.build(&s.input())), arg, "{what}");
    }
    let s = Small::new();
    let mut wrong_cache = s.input();
    wrong_cache.num_blocks = NB * 2;
    assert_eq!(arg_of(meta.build(&wrong_cache)), "num_blocks");
}

/// A request with no query tokens this step is an empty decode: `build` takes it and so does
/// `forward`, which attends nothing for it and gives the other requests what they get without it.
#[test]
fn empty_requests_are_decodes_for_build_and_forward() {
    let run = |s: &Small| {
        let (mut attn, mut meta, mut b) = small_attention();
        let split = meta.build(&StepInput { block_table_stride: 2, ..s.input() }).unwrap();
        attn.forward(&meta, LayerIo::Cpu(b.layer())).unwrap();
        (split, b.out)
    };
    let (_, want) = run(&Small::new());
    // The empty request first, between the decode and the prefill, and alone in the decode part.
    let cases = [
        Small { qsl: vec![0, 0, 1, 6], seq_lens: vec![3, 4, 5], block_table: vec![3, 0, 2, 0, 0, 1], slots: vec![11, 0, 1, 2, 3, 4] },
        Small { qsl: vec![0, 1, 1, 6], seq_lens: vec![4, 3, 5], block_table: vec![2, 0, 3, 0, 0, 1], slots: vec![11, 0, 1, 2, 3, 4] },
    ];
    for (i, s) in cases.iter().enumerate() {
        let (split, got) = run(s);
        assert_eq!((split.num_decodes, split.num_prefills), (2, 1), "case {i}");
        assert_eq!(got, want, "case {i}: the empty request changes nothing else");
    }
    let alone = Small { qsl: vec![0, 0, 5], seq_lens: vec![3, 5], block_table: vec![3, 0, 0, 1], slots: vec![0, 1, 2, 3, 4, -1] };
    let (mut attn, mut meta, mut b) = small_attention();
    assert_eq!(meta.build(&StepInput { num_actual_tokens: 5, ..alone.input() }).unwrap().num_decodes, 1);
    attn.forward(&meta, LayerIo::Cpu(b.layer())).unwrap();
    assert!(b.out[..5 * HQ * D].iter().all(|&x| (x - 1.0).abs() < 1e-6), "the prefill sees only its own keys, V = 1");
    assert!(b.out[5 * HQ * D..].iter().all(|&x| x == -3.0), "the padding row is left as it is");
}

/// A used block-table entry outside the cache is refused by `build`, before any layer runs,
/// naming the request, the entry and the value; entries past a request's used blocks are
/// padding and may hold anything.
#[test]
fn block_ids_outside_the_cache_are_refused_at_build() {
    let (mut attn, mut meta, mut b) = small_attention();
    for (entry, value) in [(2, 9001), (3, -1), (3, NB as i32), (0, i32::MIN)] {
        let mut s = Small::new();
        s.block_table[entry] = value;
        match meta.build(&s.input()) {
            Err(AttnError::InvalidArgument { arg: "block_table", reason }) => {
                let (r, e) = (entry / 2, entry % 2);
                let want = format!("request {r} entry {e} is block {value}, the cache has {NB} blocks");
                assert!(reason.contains(&want), "entry {entry} = {value}: {reason}");
            }
            other => panic!("entry {entry} = {value}: expected a block_table refusal, got {other:?}"),
        }
        assert_eq!(arg_of(attn.forward(&meta, LayerIo::Cpu(b.layer()))), "step");
        assert!(b.untouched());
    }
    // The decode (length 4, block size 4) uses one block: its second entry is padding.
    let mut s = Small::new();
    s.block_table[1] = 9001;
    meta.build(&s.input()).unwrap();
    attn.forward(&meta, LayerIo::Cpu(b.layer())).unwrap();
}

#[test]
fn config_refusals_name_the_argument() {
    let model = small_model();
    let sel = cpu_selection(&model);
    let new = |c: ForwardConfig| arg_of(Attention::new(&sel, c, None));
    let base = ForwardConfig::new(model, NB, limits());
    assert_eq!(new(ForwardConfig { decode_threshold: 0, ..base.clone() }), "decode_threshold");
    assert_eq!(new(ForwardConfig { decode_threshold: 9, ..base.clone() }), "decode_threshold");
    let mut c = base.clone();
    c.opts.window = Some(8);
    assert_eq!(new(c), "opts", "a window the model does not declare");
    let mut c = base.clone();
    c.opts.softcap = Some(30.0);
    assert_eq!(new(c), "opts", "a soft-cap the model does not declare");
    assert_eq!(new(ForwardConfig { limits: ForwardLimits { max_num_tokens: 0, ..limits() }, ..base.clone() }), "limits");
    assert_eq!(new(ForwardConfig { num_blocks: 0, ..base.clone() }), "num_blocks");
    let fp8 = model.with_cache_dtype(DType::Fp8E4m3);
    assert_eq!(arg_of(Attention::new(&cpu_selection(&fp8), ForwardConfig::new(fp8, NB, limits()), None)), "model", "fp8 cache");
    let odd = ModelConfig::standard(6, 4, D, DType::F32, BS, KvLayout::FlashNhd);
    assert_eq!(arg_of(Attention::new(&sel, ForwardConfig::new(odd, NB, limits()), None)), "model", "6 q heads over 4 kv heads");
    // Sparse (top-k) attention runs through `mla::mla_sparse_attention`, not `forward`.
    let sparse = ModelConfig { sparse_topk: Some(64), ..model };
    assert_eq!(new(ForwardConfig::new(sparse, NB, limits())), "model", "sparse top-k");
    // Context parallelism: no position-dependent masks, the GPU backends only.
    let cp = |c: ForwardConfig| ForwardConfig { context_parallel: Some(CpShard::new(2, 0, 1).unwrap()), ..c };
    let mut windowed = ForwardConfig::new(model.with_features(Features { sliding_window: true, ..Features::NONE }), NB, limits());
    windowed.opts.window = Some(8);
    assert_eq!(new(cp(windowed)), "context_parallel", "a window");
    assert_eq!(new(cp(base.clone())), "context_parallel", "the cpu backend");
    let bad = ForwardConfig { context_parallel: Some(CpShard { world_size: 2, rank: 2, interleave: 1 }), ..base.clone() };
    assert_eq!(new(bad), "rank");
}

#[test]
fn gpu_backends_are_refused_without_a_gpu() {
    let model = ModelConfig::standard(32, 8, 128, DType::BF16, 16, KvLayout::FlashNhd);
    let tc = Selection { backend: &TENSOR_CORE, overridden_by: None, refused: Vec::new() };
    match Attention::new(&tc, ForwardConfig::new(model, NB, limits()), None) {
        Err(AttnError::InvalidArgument { arg: "backend", reason }) => assert!(reason.contains("needs a GPU"), "{reason}"),
        other => panic!("expected a backend refusal, got {:?}", other.err()),
    }
    let mla = ModelConfig::mla(16, DType::BF16, 64);
    let sel = Selection { backend: &MLA, overridden_by: None, refused: Vec::new() };
    match Attention::new(&sel, ForwardConfig::new(mla, NB, limits()), None) {
        Err(AttnError::InvalidArgument { arg: "backend", reason }) => assert!(reason.contains("needs a GPU"), "{reason}"),
        other => panic!("expected a backend refusal, got {:?}", other.err()),
    }
    // The CPU backend runs MLA.
    let sel = Selection { backend: &CPU, overridden_by: None, refused: Vec::new() };
    let attn = Attention::new(&sel, ForwardConfig::new(mla, NB, limits()), None).unwrap();
    assert!(!attn.runs_on_gpu());
    assert_eq!(attn.cache_spec().v_head_size(), 512);
    assert_eq!(attn.cache_spec().num_elements(), NB * 64 * 576);
}

/// An FP8 cache through `forward` on the CPU: bf16 queries, the cache written as value / scale
/// and read back through the scales. The prefill sees only V = 1 (stored as 1 / v_scale = 32,
/// exact in e4m3); refusals name `kv_scales` when they are missing, or given for a bf16 cache.
#[test]
fn fp8_caches_take_their_scales() {
    let nt = 6;
    let q = vec![bf16::from_f32(0.5); nt * HQ * D];
    let (k, v) = (vec![bf16::from_f32(0.25); nt * HKV * D], vec![bf16::ONE; nt * HKV * D]);
    let mut out = vec![bf16::from_f32(-3.0); nt * HQ * D];
    let scales = ([1.0f32 / 64.0], [1.0f32 / 32.0]);
    // One layer of the small step on a bf16-query model whose cache is `C`.
    let run = |cache_dtype: DType, cache: attn_rs::forward::HostOut<'_>, out: &mut [bf16], scales: Option<(&[f32], &[f32])>| {
        let model = ModelConfig { cache_dtype, ..ModelConfig::standard(HQ, HKV, D, DType::BF16, BS, KvLayout::FlashNhd) };
        let mut attn = Attention::new(&cpu_selection(&model), ForwardConfig::new(model, NB, limits()), None).unwrap();
        let mut meta = attn.new_step_metadata().unwrap();
        meta.build(&Small::new().input()).unwrap();
        attn.forward(
            &meta,
            LayerIo::Cpu(CpuLayer {
                q: q.as_slice().into(),
                q_rows: RowsDesc::contiguous(nt, HQ, D),
                new_kv: NewKv::Standard {
                    k: k.as_slice().into(),
                    k_rows: RowsDesc::contiguous(nt, HKV, D),
                    v: v.as_slice().into(),
                    v_rows: RowsDesc::contiguous(nt, HKV, D),
                },
                cache,
                out: out.into(),
                out_rows: RowsDesc::contiguous(nt, HQ, D),
                alibi_slopes: None,
                sinks: None,
                kv_scales: scales.map(|(k, v)| (k.into(), v.into())),
            }),
        )
    };
    let len = attn_rs::KvCacheSpec::new(KvLayout::FlashNhd, NB, BS, HKV, D).unwrap().num_elements();
    let mut cache = vec![attn_rs::Fp8E4m3::default(); len];
    assert_eq!(arg_of(run(DType::Fp8E4m3, cache.as_mut_slice().into(), &mut out, None)), "kv_scales");
    run(DType::Fp8E4m3, cache.as_mut_slice().into(), &mut out, Some((&scales.0, &scales.1))).unwrap();
    assert!(out[HQ * D..].iter().all(|x| (x.to_f32() - 1.0).abs() < 1e-6), "the prefill sees only V = 1");
    // The decode's cached keys were never written (code 0 = 0.0): its output mixes V = 0 and 1.
    assert!(out[..HQ * D].iter().all(|x| x.to_f32() > 0.0 && x.to_f32() < 1.0));

    let mut cache = vec![bf16::ZERO; len];
    assert_eq!(arg_of(run(DType::BF16, cache.as_mut_slice().into(), &mut out, Some((&scales.0, &scales.1)))), "kv_scales");
}
