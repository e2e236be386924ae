//! CPU tests of `attn_rs::forward` on the `cpu` backend: multi-step mixed batches (decodes first,
//! then chunked prefills, scattered blocks, strided fused-QKV rows, padding rows) against a
//! straightforward per-request reference written here (each request's keys and values kept in
//! order, attention token by token in f64), for standard attention (GQA, layouts, dtypes,
//! sliding window, soft-cap, ALiBi, sinks, multi-token decodes) and MLA; and every refusal
//! naming its argument, before anything is written.
//!
//! Here: the reference, the small engine and the mixed-batch tests; [`refusals`]: the refusals.

#[allow(dead_code)]
#[path = "../common/compare.rs"]
mod compare;
use attn_rs::backend::{select_backend_no_env, DeviceInfo, Features, ModelConfig};
use attn_rs::forward::{Attention, CpuLayer, ForwardConfig, ForwardLimits, HostElement, LayerIo, NewKv};
use attn_rs::metadata::{is_decode, StepInput};
use attn_rs::{DType, KvLayout, RowsDesc};
use compare::{rel_error, tolerance};
use half::{bf16, f16};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

#[allow(dead_code)]
#[path = "../common/layer_steps.rs"]
mod layer_steps;
mod layers;
mod refusals;

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
