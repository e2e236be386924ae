//! CPU tests of `host::forward` on the `cpu` backend: multi-step mixed batches (decodes first,
//! then chunked prefills, scattered blocks, strided fused-QKV rows, padding rows) against a
//! straightforward per-request reference written here (each request's keys and values kept in
//! order, attention token by token in f64), for standard attention (GQA, layouts, dtypes,
//! sliding window, soft-cap, ALiBi, sinks, multi-token decodes) and MLA; and every refusal
//! naming its argument, before anything is written.

#[allow(dead_code)]
#[path = "common/compare.rs"]
mod compare;
use compare::{rel_error, tolerance};
use half::{bf16, f16};
use host::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig, Selection, CPU, MLA, TENSOR_CORE};
use host::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, HostElement, LayerIo, NewKv, StepMetadata};
use host::metadata::{is_decode, StepInput};
use host::{AttnError, DType, KvLayout, RowsDesc};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

// ---------------------------------------------------------------------------------------------
// The per-request reference
// ---------------------------------------------------------------------------------------------

/// What the reference applies (the model's features and options).
#[derive(Clone, Copy, Debug, Default)]
struct Extras {
    window: Option<u32>,
    softcap: Option<f32>,
    alibi: bool,
    sinks: bool,
}

/// One request's cached keys and values (f64), token by token: `[kv_heads * dk]` / `[kv_heads * dv]`.
#[derive(Default)]
struct History {
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

/// Attention of one query token at position `pos` over `h.k[..=pos]`: `[hq * dv]`.
#[allow(clippy::too_many_arguments)]
fn reference_token(
    q: &[f64],
    h: &History,
    pos: usize,
    hq: usize,
    hkv: usize,
    dk: usize,
    dv: usize,
    scale: f64,
    x: &Extras,
    slopes: &[f32],
    sinks: &[f32],
) -> Vec<f64> {
    let group = hq / hkv;
    let first = x.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
    let mut out = vec![0.0; hq * dv];
    for head in 0..hq {
        let kvh = head / group;
        let mut logits = Vec::new();
        for t in first..=pos {
            let dot: f64 = (0..dk).map(|i| q[head * dk + i] * h.k[t][kvh * dk + i]).sum();
            let mut l = dot * scale;
            if let Some(cap) = x.softcap {
                l = cap as f64 * (l / cap as f64).tanh();
            }
            if x.alibi {
                l += slopes[head] as f64 * (t as f64 - pos as f64);
            }
            logits.push((t, l));
        }
        let sink = if x.sinks { sinks[head] as f64 } else { f64::NEG_INFINITY };
        let max = logits.iter().map(|p| p.1).fold(sink, f64::max);
        let denom: f64 = logits.iter().map(|p| (p.1 - max).exp()).sum::<f64>() + (sink - max).exp();
        for &(t, l) in &logits {
            let w = (l - max).exp() / denom;
            for i in 0..dv {
                out[head * dv + i] += w * h.v[t][kvh * dv + i];
            }
        }
    }
    out
}

// ---------------------------------------------------------------------------------------------
// A small engine for the tests: requests with block tables, steps as (request, q_len) lists
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug)]
struct Case {
    mla: bool,
    hq: usize,
    hkv: usize,
    d: usize,
    layout: KvLayout,
    block_size: usize,
    num_blocks: usize,
    threshold: usize,
    extras: Extras,
    /// Extra (padding) rows in q/k/v/out past the step's tokens.
    padding: usize,
}

impl Case {
    fn standard(hq: usize, hkv: usize, d: usize) -> Self {
        Case {
            mla: false,
            hq,
            hkv,
            d,
            layout: KvLayout::FlashNhd,
            block_size: 16,
            num_blocks: 64,
            threshold: 1,
            extras: Extras::default(),
            padding: 0,
        }
    }

    fn mla(hq: usize) -> Self {
        Case { mla: true, hkv: 1, d: 576, ..Case::standard(hq, 1, 576) }
    }

    fn model(&self, dtype: DType) -> ModelConfig {
        let m = if self.mla {
            ModelConfig::mla(self.hq, dtype, self.block_size)
        } else {
            ModelConfig::standard(self.hq, self.hkv, self.d, dtype, self.block_size, self.layout)
        };
        let x = &self.extras;
        m.with_features(Features { sinks: x.sinks, sliding_window: x.window.is_some(), softcap: x.softcap.is_some(), alibi: x.alibi })
    }

    /// (q width, k width, v width) of a token's row; MLA: q, kv_c, k_pe.
    fn widths(&self) -> (usize, usize, usize) {
        if self.mla {
            (self.hq * 576, 512, 64)
        } else {
            (self.hq * self.d, self.hkv * self.d, self.hkv * self.d)
        }
    }

    fn dv(&self) -> usize {
        if self.mla {
            512
        } else {
            self.d
        }
    }
}

struct Request {
    blocks: Vec<i32>,
    len: usize,
    history: History,
}

/// Runs `steps` (each a list of (request id, query tokens), in any order: they are put decodes
/// first) through `forward` on one layer, checking every request's output against the
/// reference after every step.
fn run_case<T: HostElement>(case: &Case, steps: &[Vec<(usize, usize)>], seed: u64) {
    let dtype = T::DTYPE;
    let mut rng = SmallRng::seed_from_u64(seed);
    let model = case.model(dtype);
    let selection = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).expect("cpu takes every model");
    assert_eq!(selection.name(), "cpu");
    let max_len = 512;
    let limits = ForwardLimits { max_num_tokens: 512, max_num_reqs: 16, max_model_len: max_len };
    let mut config = ForwardConfig::new(model, case.num_blocks, limits);
    config.decode_threshold = case.threshold;
    config.opts.window = case.extras.window;
    config.opts.softcap = case.extras.softcap;
    config.opts.softmax_scale = 0.5 / (case.d as f32).sqrt();
    let mut attn = Attention::new(&selection, config, None).expect("attention");
    let mut meta = attn.new_step_metadata().unwrap();
    let mut cache = vec![T::default(); attn.cache_spec().num_elements()];
    let mut free: Vec<i32> = (0..case.num_blocks as i32).collect();
    free.shuffle(&mut rng);
    let mut reqs: HashMap<usize, Request> = HashMap::new();
    let slopes: Vec<f32> = (0..case.hq).map(|h| 0.5f32.powi(h as i32 % 4 + 1)).collect();
    let sinks: Vec<f32> = (0..case.hq).map(|_| rng.random_range(-1.0..2.0)).collect();
    let (wq, wk, wv) = case.widths();
    let width = wq + wk + wv + 8; // a fused projection row, with a gap
    let bs = case.block_size;

    for (s, step) in steps.iter().enumerate() {
        let mut order = step.clone();
        order.sort_by_key(|&(_, q)| !is_decode(q as i64, case.threshold));
        let nt: usize = order.iter().map(|p| p.1).sum();
        let rows = nt + case.padding;
        let data: Vec<T> = (0..rows * width).map(|_| T::from_f32(rng.random_range(-1.0..1.0))).collect();
        let (mut qsl, mut seq_lens, mut slots) = (vec![0i32], Vec::new(), Vec::new());
        for &(id, q) in &order {
            let r = reqs.entry(id).or_insert_with(|| Request { blocks: Vec::new(), len: 0, history: History::default() });
            while r.blocks.len() * bs < r.len + q {
                r.blocks.push(free.pop().expect("enough blocks"));
            }
            for pos in r.len..r.len + q {
                slots.push(r.blocks[pos / bs] as i64 * bs as i64 + (pos % bs) as i64);
            }
            qsl.push(qsl.last().unwrap() + q as i32);
            seq_lens.push((r.len + q) as i32);
        }
        let stride = order.iter().map(|&(id, _)| reqs[&id].blocks.len()).max().unwrap() + 1;
        let mut block_table = vec![-7; order.len() * stride]; // unused entries are garbage
        for (i, &(id, _)) in order.iter().enumerate() {
            block_table[i * stride..][..reqs[&id].blocks.len()].copy_from_slice(&reqs[&id].blocks);
        }
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &block_table,
            block_table_stride: stride,
            slot_mapping: &slots,
            num_actual_tokens: nt,
            num_blocks: case.num_blocks,
            block_size: bs,
        };
        let split = meta.build(&input).unwrap();
        assert_eq!(split.num_decodes, order.iter().filter(|p| is_decode(p.1 as i64, case.threshold)).count(), "step {s}");

        let sentinel = T::from_f32(7.0);
        let out_rows = RowsDesc::contiguous(rows, case.hq, case.dv());
        let mut out = vec![sentinel; out_rows.required_len()];
        let q_rows = RowsDesc { num_tokens: rows, num_heads: case.hq, head_size: case.d, token_stride: width, head_stride: case.d };
        let new_kv = if case.mla {
            NewKv::Mla {
                kv_c: T::host_in(&data[wq..]),
                kv_c_token_stride: width,
                k_pe: T::host_in(&data[wq + wk..]),
                k_pe_token_stride: width,
            }
        } else {
            let kv_rows = RowsDesc { num_tokens: rows, num_heads: case.hkv, head_size: case.d, token_stride: width, head_stride: case.d };
            NewKv::Standard { k: T::host_in(&data[wq..]), k_rows: kv_rows, v: T::host_in(&data[wq + wk..]), v_rows: kv_rows }
        };
        attn.forward(
            &meta,
            LayerIo::Cpu(CpuLayer {
                q: T::host_in(&data),
                q_rows,
                new_kv,
                cache: T::host_out(&mut cache),
                out: T::host_out(&mut out),
                out_rows,
                alibi_slopes: case.extras.alibi.then(|| f32::host_in(&slopes)),
                sinks: case.extras.sinks.then(|| f32::host_in(&sinks)),
                kv_scales: None,
            }),
        )
        .unwrap_or_else(|e| panic!("step {s}: {e}"));

        // The reference: append this step's keys and values, then attend token by token.
        let val = |i: usize| data[i].to_f32() as f64;
        for (b, &(id, q)) in order.iter().enumerate() {
            let r = reqs.get_mut(&id).unwrap();
            for t in qsl[b] as usize..qsl[b] as usize + q {
                let row = t * width;
                if case.mla {
                    let latent: Vec<f64> = (0..512).map(|i| val(row + wq + i)).collect();
                    let mut key = latent.clone();
                    key.extend((0..64).map(|i| val(row + wq + wk + i)));
                    r.history.k.push(key);
                    r.history.v.push(latent);
                } else {
                    r.history.k.push((0..wk).map(|i| val(row + wq + i)).collect());
                    r.history.v.push((0..wv).map(|i| val(row + wq + wk + i)).collect());
                }
            }
            let mut got = Vec::new();
            let mut want = Vec::new();
            for i in 0..q {
                let t = qsl[b] as usize + i;
                let qv: Vec<f64> = (0..case.hq * case.d).map(|j| val(t * width + j)).collect();
                let x = &case.extras;
                want.extend(reference_token(
                    &qv,
                    &r.history,
                    r.len + i,
                    case.hq,
                    case.hkv,
                    case.d,
                    case.dv(),
                    0.5 / (case.d as f64).sqrt(),
                    x,
                    &slopes,
                    &sinks,
                ));
                got.extend(out[t * case.hq * case.dv()..(t + 1) * case.hq * case.dv()].iter().map(|x| x.to_f32() as f64));
            }
            r.len += q;
            let err = rel_error(&got, &want);
            assert!(err <= tolerance(dtype), "{case:?} {dtype:?} step {s} request {id} (q {q}, len {}): rel error {err:.3e}", r.len);
        }
        // Padding rows: not written.
        assert!(out[nt * case.hq * case.dv()..].iter().all(|x| x.to_f32() == 7.0), "step {s}: padding rows were written");
    }
}

/// Steps that prefill in chunks and decode side by side: request 0 arrives first and is
/// decoding while 1 prefills in chunks and 2 arrives; ids are in arbitrary order per step.
fn mixed_steps() -> Vec<Vec<(usize, usize)>> {
    vec![
        vec![(0, 37)],
        vec![(1, 20), (0, 1)],
        vec![(0, 1), (1, 33), (2, 5)],
        vec![(2, 1), (1, 1), (0, 1), (3, 17)],
        vec![(3, 40), (0, 1), (2, 1), (1, 1)],
    ]
}

#[test]
fn mixed_batches_match_the_per_request_reference() {
    for (i, layout) in KvLayout::ALL.into_iter().enumerate() {
        let case = Case { layout, block_size: [16, 8, 32, 16][i], ..Case::standard(8, 2, 64) };
        run_case::<f32>(&case, &mixed_steps(), 1 + i as u64);
    }
    run_case::<bf16>(&Case::standard(32, 8, 128), &mixed_steps(), 11);
    run_case::<f16>(&Case { padding: 3, ..Case::standard(4, 4, 32) }, &mixed_steps(), 12);
    run_case::<f32>(&Case { padding: 5, ..Case::standard(6, 1, 16) }, &mixed_steps(), 13);
}

#[test]
fn features_window_softcap_alibi_sinks() {
    let extras = Extras { window: Some(9), softcap: Some(5.0), alibi: true, sinks: true };
    run_case::<f32>(&Case { extras, ..Case::standard(4, 2, 32) }, &mixed_steps(), 21);
    let extras = Extras { sinks: true, ..Extras::default() };
    run_case::<bf16>(&Case { extras, ..Case::standard(8, 2, 64) }, &mixed_steps(), 22);
}

#[test]
fn multi_token_decodes_go_to_decode() {
    // Threshold 4: 2-4 token requests (speculative decoding) are decodes, 5+ prefills.
    let steps = vec![vec![(0, 30), (1, 12)], vec![(0, 3), (1, 4), (2, 9)], vec![(2, 2), (0, 1), (1, 5), (3, 4)]];
    run_case::<f32>(&Case { threshold: 4, ..Case::standard(4, 2, 32) }, &steps, 31);
}

#[test]
fn mla_mixed_batches_match_the_reference() {
    run_case::<f32>(&Case::mla(4), &mixed_steps(), 41);
    run_case::<bf16>(&Case { block_size: 64, padding: 2, ..Case::mla(16) }, &mixed_steps(), 42);
}

#[test]
fn random_batches_match_the_reference() {
    let mut rng = SmallRng::seed_from_u64(51);
    for iter in 0..6 {
        let mut steps = Vec::new();
        let mut lens: HashMap<usize, usize> = HashMap::new();
        for _ in 0..4 {
            let mut step = Vec::new();
            for id in 0..rng.random_range(1..6usize) {
                let q = if lens.contains_key(&id) && rng.random_bool(0.6) { rng.random_range(1..3) } else { rng.random_range(1..40) };
                if lens.get(&id).copied().unwrap_or(0) + q <= 160 {
                    *lens.entry(id).or_default() += q;
                    step.push((id, q));
                }
            }
            steps.push(step);
        }
        let case = Case { threshold: rng.random_range(1..3), block_size: [8, 16][iter % 2], ..Case::standard(4, 2, 32) };
        run_case::<f32>(&case, &steps, 100 + iter as u64);
    }
}

// ---------------------------------------------------------------------------------------------
// Refusals
// ---------------------------------------------------------------------------------------------

/// The argument an error names.
fn arg_of<T>(r: host::Result<T>) -> String {
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
    assert_eq!(new(ForwardConfig { decode_threshold: 0, ..base }), "decode_threshold");
    assert_eq!(new(ForwardConfig { decode_threshold: 9, ..base }), "decode_threshold");
    let mut c = base;
    c.opts.window = Some(8);
    assert_eq!(new(c), "opts", "a window the model does not declare");
    let mut c = base;
    c.opts.softcap = Some(30.0);
    assert_eq!(new(c), "opts", "a soft-cap the model does not declare");
    assert_eq!(new(ForwardConfig { limits: ForwardLimits { max_num_tokens: 0, ..limits() }, ..base }), "limits");
    assert_eq!(new(ForwardConfig { num_blocks: 0, ..base }), "num_blocks");
    let fp8 = model.with_cache_dtype(DType::Fp8E4m3);
    assert_eq!(arg_of(Attention::new(&cpu_selection(&fp8), ForwardConfig::new(fp8, NB, limits()), None)), "model", "fp8 cache");
    let odd = ModelConfig::standard(6, 4, D, DType::F32, BS, KvLayout::FlashNhd);
    assert_eq!(arg_of(Attention::new(&sel, ForwardConfig::new(odd, NB, limits()), None)), "model", "6 q heads over 4 kv heads");
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
    let run = |cache_dtype: DType, cache: host::forward::HostOut<'_>, out: &mut [bf16], scales: Option<(&[f32], &[f32])>| {
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
    let len = host::KvCacheSpec::new(KvLayout::FlashNhd, NB, BS, HKV, D).unwrap().num_elements();
    let mut cache = vec![host::Fp8E4m3::default(); len];
    assert_eq!(arg_of(run(DType::Fp8E4m3, cache.as_mut_slice().into(), &mut out, None)), "kv_scales");
    run(DType::Fp8E4m3, cache.as_mut_slice().into(), &mut out, Some((&scales.0, &scales.1))).unwrap();
    assert!(out[HQ * D..].iter().all(|x| (x.to_f32() - 1.0).abs() < 1e-6), "the prefill sees only V = 1");
    // The decode's cached keys were never written (code 0 = 0.0): its output mixes V = 0 and 1.
    assert!(out[..HQ * D].iter().all(|x| x.to_f32() > 0.0 && x.to_f32() < 1.0));

    let mut cache = vec![bf16::ZERO; len];
    assert_eq!(arg_of(run(DType::BF16, cache.as_mut_slice().into(), &mut out, Some((&scales.0, &scales.1)))), "kv_scales");
}
