//! Checking the chosen backend against the CPU reference ([`attn_rs::cpu::prefill`]) on a sample:
//! for a few layers, the simulator remembers which rows of its activation pool each request's
//! cached tokens came from; on check steps it recomputes a few query tokens of a few requests
//! from those rows (packed K/V, no paging, no block tables) and compares.
//!
//! On the CPU backend both sides run [`attn_rs::cpu`]'s attention: the check then covers what
//! comes before it (the cache writes, block tables, positions, the batch's layout), not the
//! attention arithmetic, which the GPU tests check against the same reference.

use super::model::SimModel;
use super::rng::SplitMix;
use super::scheduler::Batch;
use attn_rs::cpu::{self, KvRef, PrefillRef};
use attn_rs::AttnOptions;
use attn_rs::Result;
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
}

/// Which layers, steps and requests are checked, and each request's cached rows there.
pub struct Checker {
    /// Checked layer ids.
    pub layers: Vec<usize>,
    every: usize,
    reqs: usize,
    tokens: usize,
    tolerance: f64,
    /// Request id -> for each checked layer, the pool row of each cached token.
    history: HashMap<usize, Vec<Vec<u32>>>,
    pub stats: CheckStats,
}

impl Checker {
    /// Checks `layers` every `every` steps (0: never): `reqs` requests, `tokens` query tokens
    /// each (the first and the last of the step's tokens).
    pub fn new(layers: Vec<usize>, every: usize, reqs: usize, tokens: usize, dtype: DType) -> Self {
        Checker {
            layers,
            every,
            reqs,
            tokens: tokens.max(1),
            tolerance: tolerance(dtype),
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

    /// Remembers the pool rows of this step's tokens: token `i` of the batch came from row
    /// `offsets[j] + i` in checked layer `j`.
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
    /// `out_rows`) with the CPU reference over the pool rows `pool` (row width `width`).
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
    ) -> Result<()> {
        for &b in picked {
            let s = batch.reqs[b];
            let first = batch.arrays.query_start_loc[b] as usize;
            let n = self.tokens.min(s.q_len);
            // The first token and the last n - 1 (all of them when q_len <= n).
            let head = if n == s.q_len { n } else { 1 };
            let groups = [(0, head), (s.q_len - (n - head), s.q_len)];
            for (i0, i1) in groups.into_iter().filter(|(a, b)| b > a) {
                let keys = &self.history[&s.id][j][..s.context + i1];
                let q_rows: Vec<usize> = (i0..i1).map(|i| q_offset + first + i).collect();
                let want = reference(model, pool, &q_rows, keys)?;
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
            }
            self.stats.comparisons += 1;
        }
        Ok(())
    }
}

/// The CPU reference for query rows `q_rows` (the last query tokens of a sequence whose keys
/// and values are the pool rows `keys`): `[q_rows, hq, dv]` in f64.
fn reference<T: Element>(model: &SimModel, pool: &[T], q_rows: &[usize], keys: &[u32]) -> Result<Vec<f64>> {
    let c = &model.config;
    let lay = model.row_layout();
    let (hq, dqk) = (c.num_q_heads, c.head_size);
    let gather = |rows: &mut dyn Iterator<Item = usize>, col: usize, len: usize| -> Vec<T> {
        let mut v = Vec::new();
        for r in rows {
            v.extend_from_slice(&pool[r * lay.width + col..][..len]);
        }
        v
    };
    let q = gather(&mut q_rows.iter().copied(), lay.q, hq * dqk);
    let nk = keys.len();
    let mut key_rows = keys.iter().map(|&r| r as usize);
    let (k, v, k_rows, v_rows, dv);
    if model.is_mla() {
        // One latent row per key: K is all of it, V its first latent_dim columns.
        dv = lay.v - lay.k;
        k = gather(&mut key_rows, lay.k, dqk);
        v = Vec::new();
        k_rows = RowsDesc::contiguous(nk, 1, dqk);
        v_rows = RowsDesc { head_size: dv, ..k_rows };
    } else {
        dv = dqk;
        let kv_width = c.num_kv_heads * dqk;
        k = gather(&mut key_rows, lay.k, kv_width);
        v = gather(&mut keys.iter().map(|&r| r as usize), lay.v, kv_width);
        k_rows = RowsDesc::contiguous(nk, c.num_kv_heads, dqk);
        v_rows = k_rows;
    }
    let mut opts = AttnOptions::new(dqk);
    opts.softmax_scale = model.softmax_scale;
    let nq = q_rows.len();
    let res = cpu::prefill(&PrefillRef {
        q: &q,
        q_rows: RowsDesc::contiguous(nq, hq, dqk),
        kv: KvRef::Packed { k: &k, k_rows, v: if model.is_mla() { &k } else { &v }, v_rows, key_start_loc: &[0, nk as i32] },
        head_size_v: dv,
        query_start_loc: &[0, nq as i32],
        seq_lens: &[nk as i32],
        causal: true,
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })?;
    Ok(res.out)
}
