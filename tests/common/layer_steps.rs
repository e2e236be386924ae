//! A small multi-layer engine for the per-layer tests (CPU and GPU): requests with scattered
//! block tables, steps ordered decodes first, random per-layer Q/K/V rows with padding past the
//! step's tokens, and a reference written here (each request's keys and values per cache-owning
//! layer, attention token by token in f64) for every [`LayerSpec`] setting: decoder or
//! encoder-only, window, chunks, symmetric window, soft-cap, ALiBi, sinks, scale, KV sharing;
//! and encoder-decoder models: encoder steps of whole requests, then decoder steps whose
//! cross-attention layers read the encoder's keys through a step of their own
//! ([`Engine::cross_step`]).

use attn_rs::forward::{AttentionType, LayerSpec};
use attn_rs::metadata::StepInput;
use attn_rs::AttnOptions;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;

/// Padding rows past a step's tokens in every tensor (never read, never written).
pub const PADDING: usize = 3;

/// The model the engine serves.
#[derive(Clone, Debug)]
pub struct Shape {
    pub hq: usize,
    pub hkv: usize,
    pub d: usize,
    pub block_size: usize,
    pub num_blocks: usize,
}

/// One request: its blocks, length, and the keys/values (f64, `[hkv * d]` a token) of each
/// layer that owns a cache.
struct Req {
    blocks: Vec<i32>,
    len: usize,
    k: HashMap<usize, Vec<Vec<f64>>>,
    v: HashMap<usize, Vec<Vec<f64>>>,
}

/// A step as built: (request id, query tokens) decodes first, and its arrays.
pub struct Step {
    pub order: Vec<(usize, usize)>,
    pub qsl: Vec<i32>,
    pub seq_lens: Vec<i32>,
    pub block_table: Vec<i32>,
    pub stride: usize,
    pub slots: Vec<i64>,
    pub nt: usize,
}

impl Step {
    pub fn input(&self, shape: &Shape) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: self.nt,
            num_blocks: shape.num_blocks,
            block_size: shape.block_size,
        }
    }

    /// Rows of every tensor: the tokens and the padding.
    pub fn rows(&self) -> usize {
        self.nt + PADDING
    }
}

/// One layer's inputs for a step: `[rows, hq, d]` q, `[rows, hkv, d]` k and v (already rounded
/// to the tested dtype).
pub struct LayerData {
    pub q: Vec<f32>,
    pub k: Vec<f32>,
    pub v: Vec<f32>,
}

pub struct Engine {
    pub shape: Shape,
    pub layers: Vec<LayerSpec>,
    pub slopes: Vec<f32>,
    pub sinks: Vec<f32>,
    rng: SmallRng,
    free: Vec<i32>,
    reqs: HashMap<usize, Req>,
    round: fn(f32) -> f32,
    /// Each decoder request's encoder request (encoder-decoder models).
    pub encoder_of: HashMap<usize, usize>,
}

impl Engine {
    /// `round`: what the tested dtype makes of an f32.
    pub fn new(shape: Shape, layers: Vec<LayerSpec>, seed: u64, round: fn(f32) -> f32) -> Self {
        let mut rng = SmallRng::seed_from_u64(seed);
        // Block 0 is never given out: it is the null block of a KV-cache group's tables
        // ([`Engine::group_step`]), never written.
        let mut free: Vec<i32> = (1..shape.num_blocks as i32).collect();
        free.shuffle(&mut rng);
        let slopes = (0..shape.hq).map(|h| 0.5f32.powi(h as i32 % 4 + 1)).collect();
        let sinks = (0..shape.hq).map(|_| rng.random_range(-1.0..2.0)).collect();
        Engine { shape, layers, slopes, sinks, rng, free, reqs: HashMap::new(), round, encoder_of: HashMap::new() }
    }

    /// The step of `(request id, query tokens)` pairs: decodes (one token) first, blocks taken
    /// at random from the free list, unused block-table entries garbage.
    pub fn step(&mut self, pairs: &[(usize, usize)]) -> Step {
        let mut order = pairs.to_vec();
        order.sort_by_key(|&(_, q)| q > 1);
        let bs = self.shape.block_size;
        let (mut qsl, mut seq_lens, mut slots) = (vec![0i32], Vec::new(), Vec::new());
        for &(id, q) in &order {
            let r = self.reqs.entry(id).or_insert_with(|| Req { blocks: Vec::new(), len: 0, k: HashMap::new(), v: HashMap::new() });
            while r.blocks.len() * bs < r.len + q {
                r.blocks.push(self.free.pop().expect("enough blocks"));
            }
            slots.extend((r.len..r.len + q).map(|pos| r.blocks[pos / bs] as i64 * bs as i64 + (pos % bs) as i64));
            qsl.push(qsl.last().unwrap() + q as i32);
            seq_lens.push((r.len + q) as i32);
        }
        let stride = order.iter().map(|&(id, _)| self.reqs[&id].blocks.len()).max().unwrap_or(0) + 1;
        let mut block_table = vec![-7; order.len() * stride];
        for (i, &(id, _)) in order.iter().enumerate() {
            block_table[i * stride..][..self.reqs[&id].blocks.len()].copy_from_slice(&self.reqs[&id].blocks);
        }
        let nt = *qsl.last().unwrap() as usize;
        Step { order, qsl, seq_lens, block_table, stride, slots, nt }
    }

    /// The cross-attention step of decoder step `step`: the same query tokens, each request's
    /// encoder length and encoder blocks, no slots (cross-attention writes nothing).
    pub fn cross_step(&self, step: &Step) -> Step {
        let enc = |id: &usize| &self.reqs[&self.encoder_of[id]];
        let seq_lens = step.order.iter().map(|(id, _)| enc(id).len as i32).collect();
        let stride = step.order.iter().map(|(id, _)| enc(id).blocks.len()).max().unwrap_or(0) + 1;
        let mut block_table = vec![-7; step.order.len() * stride];
        for (i, (id, _)) in step.order.iter().enumerate() {
            block_table[i * stride..][..enc(id).blocks.len()].copy_from_slice(&enc(id).blocks);
        }
        let slots = vec![-1; step.nt];
        Step { order: step.order.clone(), qsl: step.qsl.clone(), seq_lens, block_table, stride, slots, nt: step.nt }
    }

    /// `step` in a second KV-cache group (vLLM's hybrid models: the sliding-window layers' own
    /// block tables and slots): every block id `b` is `num_blocks - b` there, and with `window`
    /// each request's blocks wholly before the window of its first query token are the null
    /// block 0 (freed in vLLM; the kernels must not need them).
    pub fn group_step(&self, step: &Step, window: Option<usize>) -> Step {
        let (bs, nb) = (self.shape.block_size, self.shape.num_blocks as i32);
        let map = |b: i32| if b > 0 && b < nb { nb - b } else { b };
        let mut block_table: Vec<i32> = step.block_table.iter().map(|&b| map(b)).collect();
        if let Some(w) = window {
            for (i, &(_, q)) in step.order.iter().enumerate() {
                let first_pos = step.seq_lens[i] as usize - q;
                // Keys before `first_pos + 1 - w` are outside every query's window.
                let first_key = (first_pos + 1).saturating_sub(w);
                for entry in &mut block_table[i * step.stride..][..first_key / bs] {
                    *entry = 0;
                }
            }
        }
        let slot = |s: i64| if s < 0 { s } else { map((s / bs as i64) as i32) as i64 * bs as i64 + s % bs as i64 };
        let slots = step.slots.iter().map(|&s| slot(s)).collect();
        Step { block_table, slots, order: step.order.clone(), qsl: step.qsl.clone(), seq_lens: step.seq_lens.clone(), ..*step }
    }

    /// Random inputs of one layer for `step`.
    pub fn data(&mut self, step: &Step) -> LayerData {
        let (rows, s) = (step.rows(), &self.shape);
        let round = self.round;
        let mut gen = |n: usize| (0..n).map(|_| round(self.rng.random_range(-1.0f32..1.0))).collect::<Vec<f32>>();
        LayerData { q: gen(rows * s.hq * s.d), k: gen(rows * s.hkv * s.d), v: gen(rows * s.hkv * s.d) }
    }

    /// Layer `layer`'s expected output for `step` (`[nt, hq, d]`, f64), after taking its new
    /// keys and values into the history of the layer whose cache it uses.
    pub fn reference(&mut self, step: &Step, layer: usize, data: &LayerData) -> Vec<f64> {
        let spec = self.layers[layer];
        let (hq, hkv, d) = (self.shape.hq, self.shape.hkv, self.shape.d);
        let owner = spec.kv_sharing_target.unwrap_or(layer);
        let row = |buf: &[f32], t: usize, w: usize| buf[t * w..(t + 1) * w].iter().map(|&x| x as f64).collect::<Vec<f64>>();
        let mut out = vec![0.0; step.nt * hq * d];
        for (b, &(id, q)) in step.order.iter().enumerate() {
            let t0 = step.qsl[b] as usize;
            let cross = spec.attn_type == AttentionType::EncoderDecoder;
            if cross {
                let e = &self.reqs[&self.encoder_of[&id]];
                let (keys, values) = (&e.k[&owner], &e.v[&owner]);
                for i in 0..q {
                    // No position relates a decoder query to the encoder's keys: all are seen.
                    let qv = row(&data.q, t0 + i, hq * d);
                    let o = token(&spec, &qv, keys, values, 0, (hq, hkv, d), &self.slopes, &self.sinks);
                    out[(t0 + i) * hq * d..(t0 + i + 1) * hq * d].copy_from_slice(&o);
                }
                continue;
            }
            let r = self.reqs.get_mut(&id).unwrap();
            let (keys, values): (Vec<Vec<f64>>, Vec<Vec<f64>>) = if spec.attn_type == AttentionType::EncoderOnly {
                ((t0..t0 + q).map(|t| row(&data.k, t, hkv * d)).collect(), (t0..t0 + q).map(|t| row(&data.v, t, hkv * d)).collect())
            } else {
                if spec.kv_sharing_target.is_none() {
                    let (ks, vs) = (r.k.entry(owner).or_default(), r.v.entry(owner).or_default());
                    ks.truncate(r.len);
                    vs.truncate(r.len);
                    ks.extend((t0..t0 + q).map(|t| row(&data.k, t, hkv * d)));
                    vs.extend((t0..t0 + q).map(|t| row(&data.v, t, hkv * d)));
                }
                (r.k[&owner].clone(), r.v[&owner].clone())
            };
            let len = keys.len();
            for i in 0..q {
                let pos = len - q + i;
                let qv = row(&data.q, t0 + i, hq * d);
                let o = token(&spec, &qv, &keys, &values, pos, (hq, hkv, d), &self.slopes, &self.sinks);
                out[(t0 + i) * hq * d..(t0 + i + 1) * hq * d].copy_from_slice(&o);
            }
        }
        out
    }

    /// Layer `layer`'s cache takes `data`'s keys and values at `step`'s tokens without
    /// attending (`Attention::write_kv`).
    pub fn write(&mut self, step: &Step, layer: usize, data: &LayerData) {
        let w = self.shape.hkv * self.shape.d;
        let row = |buf: &[f32], t: usize| buf[t * w..(t + 1) * w].iter().map(|&x| x as f64).collect::<Vec<f64>>();
        for (b, &(id, q)) in step.order.iter().enumerate() {
            let t0 = step.qsl[b] as usize;
            let r = self.reqs.get_mut(&id).unwrap();
            let (ks, vs) = (r.k.entry(layer).or_default(), r.v.entry(layer).or_default());
            ks.truncate(r.len);
            vs.truncate(r.len);
            ks.extend((t0..t0 + q).map(|t| row(&data.k, t)));
            vs.extend((t0..t0 + q).map(|t| row(&data.v, t)));
        }
    }

    /// After every layer of `step` ran: the requests' lengths advance (encoder-only steps hold
    /// whole requests, which end with the step).
    pub fn finish(&mut self, step: &Step) {
        for &(id, q) in &step.order {
            self.reqs.get_mut(&id).unwrap().len += q;
        }
    }

    /// Drops request `id` and gives its blocks back.
    pub fn retire(&mut self, id: usize) {
        if let Some(r) = self.reqs.remove(&id) {
            self.free.extend(r.blocks);
        }
    }
}

/// Whether a query at `pos` sees key `t` of `len` under `spec`.
fn visible(spec: &LayerSpec, t: usize, pos: usize) -> bool {
    let o = &spec.opts;
    let causal = spec.attn_type == AttentionType::Decoder;
    // Cross-attention has no window of either kind (the layer check refuses them).
    (!causal || t <= pos)
        && o.window.is_none_or(|w| t + w as usize > pos)
        && o.chunk_size.is_none_or(|c| t / c as usize == pos / c as usize)
        && o.symmetric_window.is_none_or(|w| t.abs_diff(pos) <= w as usize)
}

/// One query token (`[hq * d]`) against `keys`/`values`: `[hq * d]`.
#[allow(clippy::too_many_arguments)]
fn token(
    spec: &LayerSpec,
    q: &[f64],
    keys: &[Vec<f64>],
    values: &[Vec<f64>],
    pos: usize,
    (hq, hkv, d): (usize, usize, usize),
    slopes: &[f32],
    sinks: &[f32],
) -> Vec<f64> {
    let group = hq / hkv;
    let mut out = vec![0.0; hq * d];
    for h in 0..hq {
        let kvh = h / group;
        let mut logits = Vec::new();
        for (t, k) in keys.iter().enumerate().filter(|&(t, _)| visible(spec, t, pos)) {
            let dot: f64 = (0..d).map(|i| q[h * d + i] * k[kvh * d + i]).sum();
            let mut l = dot * spec.opts.softmax_scale as f64;
            if let Some(cap) = spec.opts.softcap {
                l = cap as f64 * (l / cap as f64).tanh();
            }
            if spec.alibi {
                l += slopes[h] as f64 * (t as f64 - pos as f64);
            }
            logits.push((t, l));
        }
        let sink = if spec.sinks { sinks[h] as f64 } else { f64::NEG_INFINITY };
        let max = logits.iter().map(|p| p.1).fold(sink, f64::max);
        if max == f64::NEG_INFINITY {
            continue;
        }
        let denom: f64 = logits.iter().map(|p| (p.1 - max).exp()).sum::<f64>() + (sink - max).exp();
        for &(t, l) in &logits {
            let w = (l - max).exp() / denom;
            for i in 0..d {
                out[h * d + i] += w * values[t][kvh * d + i];
            }
        }
    }
    out
}

/// A step of an encoder-decoder schedule.
pub enum EncDecStep {
    /// Whole requests through the encoder layers: `(request id, its encoder tokens)`.
    Encoder(Vec<(usize, usize)>),
    /// Decoder requests `(request id, query tokens)` through the decoder and cross-attention
    /// layers; `encoder_of` pairs each new decoder request with its encoder request.
    Decoder { pairs: Vec<(usize, usize)>, encoder_of: Vec<(usize, usize)> },
}

impl EncDecStep {
    /// A step of `pairs` through `layers` of one kind: an encoder step when they are all
    /// encoder(-only) layers, else a decoder step.
    pub fn for_layers(layers: &[LayerSpec], pairs: &[(usize, usize)]) -> Self {
        let encoder = |l: &LayerSpec| matches!(l.attn_type, AttentionType::Encoder | AttentionType::EncoderOnly);
        match layers.iter().all(encoder) {
            true => EncDecStep::Encoder(pairs.to_vec()),
            false => EncDecStep::Decoder { pairs: pairs.to_vec(), encoder_of: Vec::new() },
        }
    }

    pub fn pairs(&self) -> &[(usize, usize)] {
        match self {
            EncDecStep::Encoder(p) | EncDecStep::Decoder { pairs: p, .. } => p,
        }
    }

    /// The cross-attention layers whose own caches this step fills (`Attention::write_kv`):
    /// those of an encoder step.
    pub fn writes(&self, layers: &[LayerSpec]) -> Vec<usize> {
        let own = |l: &LayerSpec| l.attn_type == AttentionType::EncoderDecoder && l.kv_sharing_target.is_none();
        match self {
            EncDecStep::Encoder(_) => (0..layers.len()).filter(|&i| own(&layers[i])).collect(),
            EncDecStep::Decoder { .. } => Vec::new(),
        }
    }

    /// The layers this step runs: the encoders', or the decoders' and cross-attention's.
    pub fn layers(&self, layers: &[LayerSpec]) -> Vec<usize> {
        let encoder = matches!(self, EncDecStep::Encoder(_));
        let runs = |t: AttentionType| matches!(t, AttentionType::Encoder | AttentionType::EncoderOnly) == encoder;
        (0..layers.len()).filter(|&i| runs(layers[i].attn_type)).collect()
    }
}

/// A Whisper-like stack at head size `d`: two encoder layers (one with a symmetric window and
/// a soft-cap), then decoder self-attention, cross-attention to each encoder layer's cache (one
/// with a soft-cap and sinks), and a cross-attention layer with a cache of its own (filled in
/// the encoder steps: Whisper's decoder layers each project the encoder's output).
pub fn enc_dec_layers(d: usize) -> Vec<LayerSpec> {
    let o = AttnOptions::new(d);
    vec![
        LayerSpec::encoder(o),
        LayerSpec::encoder(AttnOptions { symmetric_window: Some(9), softcap: Some(20.0), ..o }),
        LayerSpec::decoder(o),
        LayerSpec::cross_attention(o, 0),
        LayerSpec::decoder(AttnOptions { window: Some(6), ..o }),
        LayerSpec { sinks: true, ..LayerSpec::cross_attention(AttnOptions { softcap: Some(30.0), ..o }, 1) },
        LayerSpec::decoder(o),
        LayerSpec::cross_attention_own(AttnOptions { softmax_scale: 0.3 / (d as f32).sqrt(), ..o }),
    ]
}

/// Encoder passes of odd lengths, one token and a long one, decoder prompts (at most their
/// encoder's length), decodes beside them, a late request whose encoder runs while others
/// decode, and runs of 2 and 3 tokens.
pub fn enc_dec_schedule() -> Vec<EncDecStep> {
    use EncDecStep::{Decoder, Encoder};
    vec![
        Encoder(vec![(100, 37), (101, 1), (102, 150)]),
        Decoder { pairs: vec![(0, 5), (1, 1), (2, 17)], encoder_of: vec![(0, 100), (1, 101), (2, 102)] },
        Decoder { pairs: vec![(0, 1), (1, 1), (2, 1)], encoder_of: vec![] },
        Encoder(vec![(103, 64)]),
        Decoder { pairs: vec![(0, 1), (2, 1), (3, 9)], encoder_of: vec![(3, 103)] },
        Decoder { pairs: vec![(3, 1), (1, 1), (0, 1), (2, 1)], encoder_of: vec![] },
        // Short runs of several tokens: prefills, or decodes under a decode threshold of 4.
        Decoder { pairs: vec![(0, 3), (1, 1), (3, 2)], encoder_of: vec![] },
    ]
}
