//! Checking the chosen backend against the reference ([`super::reference`], plain f64
//! attention written apart from the library) on a sample: for a few layers, the simulator
//! remembers which rows of its activation pool each request's cached tokens came from (for a
//! KV-sharing layer, its target layer's rows); on check steps it recomputes a few query tokens of
//! a few requests from those rows (packed K/V, no paging, no block tables) with the layer's
//! scale, sliding window, chunks and soft-cap, and compares.
//!
//! An encoder-decoder model's layers are checked by kind: an encoder layer in the encoder steps
//! (every `every`-th, counted apart from the steps, the first included), bidirectional over the
//! request's encoder tokens (its own rows of that step); a decoder self-attention layer causal
//! over the request's decoder history, as any decoder layer; a cross-attention layer without a
//! mask over the encoder rows its `write_kv` wrote in the request's encoder step.
//!
//! For a layer with a window, chunks or a soft-cap the check also measures whether it would notice a
//! backend that ignored it: how often the reference without it differs from the reference by
//! more than the tolerance ([`Sensitivity`]); for encoder and cross-attention layers, a backend
//! that applied a causal mask, and for cross-attention layers one that read another layer's
//! encoder keys and values.

use super::model::SimModel;
use super::reference::{reference_attention, reference_attention_bidirectional, RefShape};
use super::rng::SplitMix;
use super::scheduler::{Batch, Scheduled};
use attn_rs::forward::{AttentionType, LayerSpec};
use attn_rs::AttnOptions;
use attn_rs::RowsDesc;
use attn_rs::{DType, Element};
use std::collections::HashMap;
use std::sync::Arc;

/// `sqrt(sum (got - want)^2 / sum want^2)` (the absolute norm when `want` is all zeros).
pub fn rel_error(got: &[f64], want: &[f64]) -> f64 {
    let num: f64 = got.iter().zip(want).map(|(g, w)| (g - w) * (g - w)).sum();
    let den: f64 = want.iter().map(|w| w * w).sum();
    if den == 0.0 {
        num.sqrt()
    } else {
        (num / den).sqrt()
    }
}

/// The relative error a result of `dtype` may have against the f64 reference.
pub fn tolerance(dtype: DType) -> f64 {
    match dtype {
        DType::BF16 => 1e-2,
        DType::F16 => 3e-3,
        _ => 1e-4,
    }
}

/// What the checks found.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct CheckStats {
    /// Request x layer comparisons.
    pub comparisons: usize,
    /// Query tokens compared.
    pub tokens: usize,
    pub worst_rel_error: f64,
    pub failures: usize,
    pub first_failure: Option<String>,
    /// Whether the comparisons of windowed layers would catch a backend ignoring the window ...
    pub window: Sensitivity,
    /// ... those of chunked local layers one ignoring the chunks ...
    pub chunk: Sensitivity,
    /// ... and those of soft-capped layers one ignoring the soft-cap.
    pub softcap: Sensitivity,
    /// Comparisons of encoder layers (in encoder steps) and of cross-attention layers, among
    /// the `comparisons`.
    pub encoder_comparisons: usize,
    pub cross_comparisons: usize,
    /// Whether the comparisons of encoder and cross-attention layers would catch a backend
    /// applying a causal mask there ...
    pub bidirectional: Sensitivity,
    /// ... and those of cross-attention layers one reading another layer's encoder keys and
    /// values ([`Checker::other_source`]).
    pub cross_source: Sensitivity,
}

/// Comparisons of layers with a setting (a sliding window, chunks, a soft-cap), and those among them in
/// which the reference without it differs from the reference by more than the tolerance: a
/// backend that ignored it would have failed those.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Sensitivity {
    pub comparisons: usize,
    pub caught: usize,
}

/// Which layers, steps and requests are checked, and each request's cached rows there.
pub struct Checker {
    /// Checked layer ids.
    pub layers: Vec<usize>,
    /// Each checked layer's attention: kind, scale, window, chunks and soft-cap.
    specs: Vec<LayerSpec>,
    /// Each checked cross-attention layer's other source (see [`Checker::other_source`]).
    others: Vec<Option<usize>>,
    every: usize,
    reqs: usize,
    tokens: usize,
    tolerance: f64,
    /// Request id -> for each checked decoder layer, the pool row of each cached token.
    history: HashMap<usize, Vec<Vec<u32>>>,
    /// Request id -> its encoder input's rows: its first token in its encoder step, and each
    /// layer's pool offset in that step (token `t`'s row in layer `l` is `offsets[l] + first + t`).
    encoder: HashMap<usize, (usize, Arc<Vec<usize>>)>,
    encoder_len: usize,
    /// Encoder steps seen.
    encoder_steps: usize,
    pub stats: CheckStats,
}

impl Checker {
    /// Checks `layers` of `model`'s attention layers in a run of `num_layers` model layers every
    /// `every` steps (0: never): `reqs` requests, `tokens` query tokens each (the first and the
    /// last of the step's tokens).
    pub fn new(model: &SimModel, num_layers: usize, layers: Vec<usize>, every: usize, reqs: usize, tokens: usize) -> Self {
        Checker {
            specs: layers.iter().map(|&l| model.layer_spec(l, num_layers)).collect(),
            others: layers
                .iter()
                .map(|&l| (model.layer_kind(l, num_layers) == AttentionType::EncoderDecoder).then(|| Self::other_source(l, num_layers)))
                .collect(),
            layers,
            every,
            reqs,
            tokens: tokens.max(1),
            tolerance: tolerance(model.config.q_dtype),
            history: HashMap::new(),
            encoder: HashMap::new(),
            encoder_len: model.encoder_len.unwrap_or(0),
            encoder_steps: 0,
            stats: CheckStats::default(),
        }
    }

    /// The layer whose encoder keys and values a backend mixing up cross-attention layer
    /// `layer`'s (of an encoder-decoder run of `num_layers` model layers) would read: the next
    /// cross-attention layer's own, the previous one's for the last, and with one decoder block
    /// the last encoder layer's cache.
    pub fn other_source(layer: usize, num_layers: usize) -> usize {
        let n = 3 * num_layers;
        if layer + 2 < n {
            layer + 2
        } else if layer >= num_layers + 3 {
            layer - 2
        } else {
            num_layers - 1
        }
    }

    pub fn tolerance(&self) -> f64 {
        self.tolerance
    }

    /// The kind of checked layer `j`.
    pub fn kind(&self, j: usize) -> AttentionType {
        self.specs[j].attn_type
    }

    pub fn is_check_step(&self, step: usize) -> bool {
        self.every > 0 && !self.layers.is_empty() && (step + 1).is_multiple_of(self.every)
    }

    /// Counts an encoder step; whether to check it (the first, then every `every`-th, when an
    /// encoder layer is checked).
    pub fn is_encoder_check(&mut self) -> bool {
        let k = self.encoder_steps;
        self.encoder_steps += 1;
        self.every > 0 && self.specs.iter().any(|s| s.attn_type == AttentionType::Encoder) && k.is_multiple_of(self.every)
    }

    /// Remembers the pool rows of this step's tokens: the keys and values of token `i` of the
    /// batch that checked layer `j` reads came from row `offsets[j] + i` (decoder layers; the
    /// others keep no decoder history).
    pub fn record(&mut self, batch: &Batch, offsets: &[usize]) {
        let n = self.layers.len();
        for (b, s) in batch.reqs.iter().enumerate() {
            let rows = self.history.entry(s.id).or_insert_with(|| vec![Vec::new(); n]);
            let first = batch.arrays.query_start_loc[b] as usize;
            for (j, &off) in offsets.iter().enumerate().filter(|&(j, _)| self.specs[j].attn_type == AttentionType::Decoder) {
                debug_assert_eq!(rows[j].len(), s.context, "request {} history", s.id);
                rows[j].extend((first..first + s.q_len).map(|t| (off + t) as u32));
            }
        }
    }

    /// Remembers where the encoder inputs of the batch's encoder step are: layer `l` of that
    /// step (an encoder layer, or a cross-attention layer's `write_kv`) took its rows from
    /// `offsets[l]` on.
    pub fn record_encoder(&mut self, batch: &Batch, offsets: &[usize]) {
        let offsets = Arc::new(offsets.to_vec());
        for (b, s) in batch.encoder_reqs.iter().enumerate() {
            self.encoder.insert(s.id, (batch.encoder.query_start_loc[b] as usize, offsets.clone()));
        }
    }

    /// The pool rows of request `id`'s encoder input in layer `layer`.
    fn encoder_rows(&self, id: usize, layer: usize) -> Vec<u32> {
        let (first, offsets) = &self.encoder[&id];
        (0..self.encoder_len).map(|t| (offsets[layer] + first + t) as u32).collect()
    }

    /// Forgets finished requests.
    pub fn forget(&mut self, ids: &[usize]) {
        for id in ids {
            self.history.remove(id);
            self.encoder.remove(id);
        }
    }

    /// The batch positions to check this step: decodes and prefills alike.
    pub fn pick(&self, batch: &Batch, rng: &mut SplitMix) -> Vec<usize> {
        let (nd, n) = (batch.num_decodes, batch.reqs.len());
        let mut picked = Vec::new();
        let half = self.reqs.div_ceil(2);
        for (lo, hi, want) in [(0, nd, half), (nd, n, self.reqs - half)] {
            let mut idx: Vec<usize> = (lo..hi).collect();
            rng.shuffle(&mut idx);
            picked.extend(idx.into_iter().take(want));
        }
        // Fill from either part when one is short.
        for b in 0..n {
            if picked.len() >= self.reqs.min(n) {
                break;
            }
            if !picked.contains(&b) {
                picked.push(b);
            }
        }
        picked
    }

    /// The positions in the batch's encoder step to check.
    pub fn pick_encoder(&self, batch: &Batch, rng: &mut SplitMix) -> Vec<usize> {
        let mut idx: Vec<usize> = (0..batch.encoder_reqs.len()).collect();
        rng.shuffle(&mut idx);
        idx.truncate(self.reqs);
        idx
    }

    /// Compares checked layer `j`'s output for the batch positions `picked` (from `out`, rows
    /// `out_rows`) with the reference; the layer's queries are the pool rows from `q_offset`.
    /// A decoder layer's keys are the request's history, a cross-attention layer's its encoder
    /// rows; an encoder layer is checked in [`compare_encoder`](Self::compare_encoder).
    #[allow(clippy::too_many_arguments)]
    pub fn compare<T: Element>(
        &mut self,
        model: &SimModel,
        pool: &[T],
        batch: &Batch,
        picked: &[usize],
        j: usize,
        q_offset: usize,
        out: &[T],
        out_rows: &RowsDesc,
    ) {
        let kind = self.specs[j].attn_type;
        assert_ne!(kind, AttentionType::Encoder, "encoder layers are checked in the encoder steps");
        for &b in picked {
            let s = batch.reqs[b];
            let first = batch.arrays.query_start_loc[b] as usize;
            let keys = match kind {
                AttentionType::EncoderDecoder => Keys::Cross {
                    own: self.encoder_rows(s.id, self.layers[j]),
                    other: self.encoder_rows(s.id, self.others[j].expect("a cross-attention layer's other source")),
                },
                _ => Keys::Causal(self.history[&s.id][j][..s.seq_len()].to_vec()),
            };
            self.compare_request(model, pool, (j, s, "query tokens"), q_offset + first, &keys, (out, out_rows, first));
        }
    }

    /// Compares checked encoder layer `j`'s output in the batch's encoder step for its positions
    /// `picked` with the reference: the layer's queries, keys and values are the pool rows from
    /// `offset` (the step's tokens in order), every key seen.
    #[allow(clippy::too_many_arguments)]
    pub fn compare_encoder<T: Element>(
        &mut self,
        model: &SimModel,
        pool: &[T],
        batch: &Batch,
        picked: &[usize],
        j: usize,
        offset: usize,
        out: &[T],
        out_rows: &RowsDesc,
    ) {
        assert_eq!(self.specs[j].attn_type, AttentionType::Encoder, "layer {} is no encoder layer", self.layers[j]);
        for &b in picked {
            let s = batch.encoder_reqs[b];
            let first = batch.encoder.query_start_loc[b] as usize;
            let keys = Keys::Bidirectional(self.encoder_rows(s.id, self.layers[j]));
            self.compare_request(model, pool, (j, s, "encoder tokens"), offset + first, &keys, (out, out_rows, first));
        }
    }

    /// One request's comparison: its first and last query tokens (of `s.q_len`, the first's
    /// pool row `q_row`) against `keys`; the output's rows from `first`.
    fn compare_request<T: Element>(
        &mut self,
        model: &SimModel,
        pool: &[T],
        (j, s, what): (usize, Scheduled, &str),
        q_row: usize,
        keys: &Keys,
        (out, out_rows, first): (&[T], &RowsDesc, usize),
    ) {
        let opts = self.specs[j].opts;
        let n = self.tokens.min(s.q_len);
        // The first token and the last n - 1 (all of them when q_len <= n).
        let head = if n == s.q_len { n } else { 1 };
        let groups = [(0, head), (s.q_len - (n - head), s.q_len)];
        let mut caught = [false; 5]; // window, soft-cap, causal, other source, chunks
        for (i0, i1) in groups.into_iter().filter(|(a, b)| b > a) {
            let q_rows = || (i0..i1).map(|i| q_row + i);
            // Under a causal mask the group's last query sits `s.q_len - i1` tokens before the
            // end of the keys, and sees none past it.
            let causal_keys = |keys: &[u32]| -> Vec<u32> { keys[..keys.len() - (s.q_len - i1)].to_vec() };
            let (want, rows) = match keys {
                Keys::Causal(history) => {
                    let rows = Rows::gather(model, pool, q_rows(), &causal_keys(history));
                    (rows.attend(&opts), rows)
                }
                Keys::Bidirectional(all) | Keys::Cross { own: all, .. } => {
                    let rows = Rows::gather(model, pool, q_rows(), all);
                    (rows.attend_all(&opts), rows)
                }
            };
            let dv = out_rows.head_size;
            let hq = out_rows.num_heads;
            let mut got = Vec::with_capacity(want.len());
            for t in first + i0..first + i1 {
                for h in 0..hq {
                    let at = out_rows.offset(t, h, 0);
                    got.extend(out[at..at + dv].iter().map(|x| x.to_f32() as f64));
                }
            }
            let err = rel_error(&got, &want);
            self.stats.tokens += i1 - i0;
            // A NaN is kept as the worst (`f64::max` would drop it) and fails.
            if err.is_nan() || err > self.stats.worst_rel_error {
                self.stats.worst_rel_error = err;
            }
            if err.is_nan() || err > self.tolerance {
                self.stats.failures += 1;
                self.stats.first_failure.get_or_insert_with(|| {
                    format!(
                        "layer {} ({}) request {} ({what} {i0}..{i1} of {}, context {}): rel error {err:.3e} > {:.0e}",
                        self.layers[j], self.specs[j].attn_type, s.id, s.q_len, s.context, self.tolerance
                    )
                });
            }
            let differs = |other: Vec<f64>| rel_error(&other, &want) > self.tolerance;
            // Without the window the keys differ only where the context passes it.
            if opts.window.is_some_and(|w| s.context + i1 > w as usize) {
                caught[0] |= differs(rows.attend(&AttnOptions { window: None, ..opts }));
            }
            // Without the chunks only where the group's last query is past the first chunk.
            if opts.chunk_size.is_some_and(|c| s.context + i1 > c as usize) {
                caught[4] |= differs(rows.attend(&AttnOptions { chunk_size: None, ..opts }));
            }
            if opts.softcap.is_some() {
                caught[1] |= differs(match keys {
                    Keys::Causal(_) => rows.attend(&AttnOptions { softcap: None, ..opts }),
                    _ => rows.attend_all(&AttnOptions { softcap: None, ..opts }),
                });
            }
            if let Keys::Bidirectional(all) | Keys::Cross { own: all, .. } = keys {
                caught[2] |= differs(Rows::gather(model, pool, q_rows(), &causal_keys(all)).attend(&opts));
            }
            if let Keys::Cross { other, .. } = keys {
                caught[3] |= differs(Rows::gather(model, pool, q_rows(), other).attend_all(&opts));
            }
        }
        let st = &mut self.stats;
        st.comparisons += 1;
        let bidirectional = !matches!(keys, Keys::Causal(_));
        let cross = matches!(keys, Keys::Cross { .. });
        st.encoder_comparisons += usize::from(matches!(keys, Keys::Bidirectional(_)));
        st.cross_comparisons += usize::from(cross);
        for (sens, has, caught) in [
            (&mut st.window, opts.window.is_some(), caught[0]),
            (&mut st.chunk, opts.chunk_size.is_some(), caught[4]),
            (&mut st.softcap, opts.softcap.is_some(), caught[1]),
            (&mut st.bidirectional, bidirectional, caught[2]),
            (&mut st.cross_source, cross, caught[3]),
        ] {
            sens.comparisons += usize::from(has);
            sens.caught += usize::from(caught);
        }
    }
}

/// The keys of a layer's comparison, as pool rows.
enum Keys {
    /// A decoder layer's: the request's history up to the end of the step's tokens.
    Causal(Vec<u32>),
    /// An encoder layer's: the request's encoder rows of that layer, every one seen.
    Bidirectional(Vec<u32>),
    /// A cross-attention layer's: the encoder rows its `write_kv` wrote, every one seen, and
    /// those of its other source ([`Checker::other_source`]).
    Cross { own: Vec<u32>, other: Vec<u32> },
}

/// One reference computation's inputs in f64: query rows (the last query tokens of a sequence)
/// and the sequence's keys and values, gathered from the pool.
struct Rows {
    shape: RefShape,
    q: Vec<f64>,
    k: Vec<f64>,
    v: Vec<f64>,
}

impl Rows {
    /// The pool rows `q_rows` as queries, `keys` as keys and values (MLA: one latent row per
    /// key, all of it the key and its first latent columns the value).
    fn gather<T: Element>(model: &SimModel, pool: &[T], mut q_rows: impl Iterator<Item = usize>, keys: &[u32]) -> Self {
        let c = &model.config;
        let lay = model.row_layout();
        let gather = |rows: &mut dyn Iterator<Item = usize>, col: usize, len: usize| -> Vec<f64> {
            let mut v = Vec::new();
            for r in rows {
                v.extend(pool[r * lay.width + col..][..len].iter().map(|x| x.to_f32() as f64));
            }
            v
        };
        let key_rows = || keys.iter().map(|&r| r as usize);
        let dk = c.head_size;
        let q = gather(&mut q_rows, lay.q, c.num_q_heads * dk);
        let (shape, k, v) = if model.is_mla() {
            let dv = lay.v - lay.k;
            let shape = RefShape { q_heads: c.num_q_heads, kv_heads: 1, dk, dv };
            (shape, gather(&mut key_rows(), lay.k, dk), gather(&mut key_rows(), lay.k, dv))
        } else {
            let shape = RefShape { q_heads: c.num_q_heads, kv_heads: c.num_kv_heads, dk, dv: dk };
            let width = c.num_kv_heads * dk;
            (shape, gather(&mut key_rows(), lay.k, width), gather(&mut key_rows(), lay.v, width))
        };
        Rows { shape, q, k, v }
    }

    /// `[q rows, q heads, dv]` with `opts`' scale, window, chunks and soft-cap, the queries the last
    /// of the keys' tokens (causal).
    fn attend(&self, opts: &AttnOptions) -> Vec<f64> {
        reference_attention(self.shape, opts, &self.q, &self.k, &self.v)
    }

    /// `[q rows, q heads, dv]` with `opts`' scale and soft-cap, every key seen.
    fn attend_all(&self, opts: &AttnOptions) -> Vec<f64> {
        reference_attention_bidirectional(self.shape, opts, &self.q, &self.k, &self.v)
    }
}
