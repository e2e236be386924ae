//! Checking the chosen backend against the reference ([`super::reference`], plain f64
//! attention written apart from the library) on a sample: for a few layers, the simulator
//! remembers which rows of its activation pool each request's cached tokens came from (for a
//! KV-sharing layer, its target layer's rows); on check steps it recomputes a few query tokens of
//! a few requests from those rows (packed K/V, no paging, no block tables) with the layer's
//! scale, sliding window and soft-cap, and compares.
//!
//! For a layer with a window or a soft-cap the check also measures whether it would notice a
//! backend that ignored it: how often the reference without it differs from the reference by
//! more than the tolerance ([`Sensitivity`]).

use super::model::SimModel;
use super::reference::{reference_attention, RefShape};
use super::rng::SplitMix;
use super::scheduler::Batch;
use attn_rs::AttnOptions;
use attn_rs::RowsDesc;
use attn_rs::{DType, Element};
use std::collections::HashMap;

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
    /// ... and those of soft-capped layers one ignoring the soft-cap.
    pub softcap: Sensitivity,
}

/// Comparisons of layers with a setting (a sliding window, a soft-cap), and those among them in
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
    /// Each checked layer's scale, window and soft-cap.
    opts: Vec<AttnOptions>,
    every: usize,
    reqs: usize,
    tokens: usize,
    tolerance: f64,
    /// Request id -> for each checked layer, the pool row of each cached token.
    history: HashMap<usize, Vec<Vec<u32>>>,
    pub stats: CheckStats,
}

impl Checker {
    /// Checks `layers` of `model`'s first `num_layers` every `every` steps (0: never): `reqs`
    /// requests, `tokens` query tokens each (the first and the last of the step's tokens).
    pub fn new(model: &SimModel, num_layers: usize, layers: Vec<usize>, every: usize, reqs: usize, tokens: usize) -> Self {
        Checker {
            opts: layers.iter().map(|&l| model.layer_spec(l, num_layers).opts).collect(),
            layers,
            every,
            reqs,
            tokens: tokens.max(1),
            tolerance: tolerance(model.config.q_dtype),
            history: HashMap::new(),
            stats: CheckStats::default(),
        }
    }

    pub fn tolerance(&self) -> f64 {
        self.tolerance
    }

    pub fn is_check_step(&self, step: usize) -> bool {
        self.every > 0 && !self.layers.is_empty() && (step + 1).is_multiple_of(self.every)
    }

    /// Remembers the pool rows of this step's tokens: the keys and values of token `i` of the
    /// batch that checked layer `j` reads came from row `offsets[j] + i`.
    pub fn record(&mut self, batch: &Batch, offsets: &[usize]) {
        let n = self.layers.len();
        for (b, s) in batch.reqs.iter().enumerate() {
            let rows = self.history.entry(s.id).or_insert_with(|| vec![Vec::new(); n]);
            let first = batch.arrays.query_start_loc[b] as usize;
            for (j, &off) in offsets.iter().enumerate() {
                debug_assert_eq!(rows[j].len(), s.context, "request {} history", s.id);
                rows[j].extend((first..first + s.q_len).map(|t| (off + t) as u32));
            }
        }
    }

    /// Forgets finished requests.
    pub fn forget(&mut self, ids: &[usize]) {
        for id in ids {
            self.history.remove(id);
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

    /// Compares checked layer `j`'s output for the batch positions `picked` (from `out`, rows
    /// `out_rows`) with the reference; the layer's queries are the pool rows from `q_offset`.
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
        let opts = self.opts[j];
        for &b in picked {
            let s = batch.reqs[b];
            let first = batch.arrays.query_start_loc[b] as usize;
            let n = self.tokens.min(s.q_len);
            // The first token and the last n - 1 (all of them when q_len <= n).
            let head = if n == s.q_len { n } else { 1 };
            let groups = [(0, head), (s.q_len - (n - head), s.q_len)];
            let mut caught = (false, false);
            for (i0, i1) in groups.into_iter().filter(|(a, b)| b > a) {
                let rows = Rows::gather(model, pool, (i0..i1).map(|i| q_offset + first + i), &self.history[&s.id][j][..s.context + i1]);
                let want = rows.attend(&opts);
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
                            "layer {} request {} (query tokens {i0}..{i1} of {}, context {}): rel error {err:.3e} > {:.0e}",
                            self.layers[j], s.id, s.q_len, s.context, self.tolerance
                        )
                    });
                }
                // Without the window the keys differ only where the context passes it.
                if opts.window.is_some_and(|w| s.context + i1 > w as usize) {
                    caught.0 |= rel_error(&rows.attend(&AttnOptions { window: None, ..opts }), &want) > self.tolerance;
                }
                if opts.softcap.is_some() {
                    caught.1 |= rel_error(&rows.attend(&AttnOptions { softcap: None, ..opts }), &want) > self.tolerance;
                }
            }
            self.stats.comparisons += 1;
            for (sens, has, caught) in
                [(&mut self.stats.window, opts.window.is_some(), caught.0), (&mut self.stats.softcap, opts.softcap.is_some(), caught.1)]
            {
                sens.comparisons += usize::from(has);
                sens.caught += usize::from(caught);
            }
        }
    }
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

    /// `[q rows, q heads, dv]` with `opts`' scale, window and soft-cap.
    fn attend(&self, opts: &AttnOptions) -> Vec<f64> {
        reference_attention(self.shape, opts, &self.q, &self.k, &self.v)
    }
}
