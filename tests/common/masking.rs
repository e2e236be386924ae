//! Inputs that make a one-key masking error visible in every output row, at any context length.
//!
//! With random queries and keys, each of a row's n visible keys carries about 1/n of its
//! softmax weight, so one key too many or too few at the window's edge or at the causal
//! diagonal moves a row of a 20000-key context by well under the tolerance. Here every query
//! row instead has exactly two keys far above the rest: the first key of its window and its
//! diagonal key (its own position). The key just outside the window and the key just past the
//! diagonal (the next token's) are as strongly aligned with it, so a kernel that admits one of
//! them gives the row a third dominant key and one that drops an edge key leaves it one: either
//! moves the row by a large fraction of its norm.
//!
//! Token t of the request gets the query `a * r_t` (every head of a kv head's group the same),
//! with `r_t` random unit vectors, each orthogonal to the two before it. Key e of the band at
//! the window's first keys (`first_0 - 1 + e`, e in 0..=q_len) is `b * (r_{e-1} + r_e)`: the
//! first visible key of token e - 1 and the key just outside the window of token e. Key c of
//! the band at the diagonal (`pos_0 + c`) is `b * (r_c + r_{c-1})`: token c's own key and the
//! key just past token c - 1's diagonal. The logit of a matched pair is `scale * a * b` = 12;
//! the other keys of the bands are near 0 for neighbours (orthogonal) and spread about
//! `12 * sqrt(2 / d)` for the rest; random keys elsewhere keep logits of a few tenths.

use attn_rs::{Element, RowsDesc};
use rand::rngs::SmallRng;
use rand::Rng;

/// The logit of a query with each of its two dominant keys.
const MATCH_LOGIT: f64 = 12.0;

/// One request's query tokens and where its keys live.
pub struct MarkedRequest {
    /// The request's first query token (a row of `q_rows`).
    pub q0: usize,
    /// Its query tokens: the last `q_len` positions of `seq_len` keys.
    pub q_len: usize,
    pub seq_len: usize,
    /// The sliding window; the band of first keys must lie after key 0 and before the
    /// diagonal band (`q_len + 1 < window < seq_len - q_len`).
    pub window: usize,
    pub num_kv_heads: usize,
    pub softmax_scale: f32,
}

/// Rewrites the request's queries in `q` and its band keys in `keys` (`key_at(pos, kv_head,
/// dim)`: the element index of key `pos`'s column `dim`), as the module describes. `keys` holds
/// values as stored (no FP8 scale).
pub fn plant_edge_markers<Q: Element, C: Element>(
    rng: &mut SmallRng,
    m: &MarkedRequest,
    q: &mut [Q],
    q_rows: RowsDesc,
    keys: &mut [C],
    key_at: impl Fn(usize, usize, usize) -> usize,
) {
    let (d, hq, hkv) = (q_rows.head_size, q_rows.num_heads, m.num_kv_heads);
    assert!(hkv > 0 && hq % hkv == 0);
    assert!(m.q_len > 0 && m.window > m.q_len + 1 && m.seq_len > m.window + m.q_len, "bands overlap: {}", m.window);
    let group = hq / hkv;
    let a = 0.5 * (d as f64).sqrt();
    let b = MATCH_LOGIT / (m.softmax_scale as f64 * a);
    let pos0 = m.seq_len - m.q_len;
    let first0 = pos0 + 1 - m.window;
    for kvh in 0..hkv {
        let r = chained_unit_vectors(rng, m.q_len, d);
        for (t, rt) in r.iter().enumerate() {
            for h in kvh * group..(kvh + 1) * group {
                for (x, &v) in rt.iter().enumerate() {
                    q[q_rows.offset(m.q0 + t, h, x)] = Q::from_f32((a * v) as f32);
                }
            }
        }
        // r_i + r_j of the tokens that exist (-1 and q_len do not).
        let pair = |i: isize, j: isize| -> Vec<f64> {
            let get = |t: isize| if t >= 0 && (t as usize) < m.q_len { Some(&r[t as usize]) } else { None };
            (0..d).map(|x| b * (get(i).map_or(0.0, |v| v[x]) + get(j).map_or(0.0, |v| v[x]))).collect()
        };
        let mut put = |pos: usize, k: Vec<f64>| {
            for (x, v) in k.into_iter().enumerate() {
                keys[key_at(pos, kvh, x)] = C::from_f32(v as f32);
            }
        };
        for e in 0..=m.q_len {
            put(first0 - 1 + e, pair(e as isize - 1, e as isize));
        }
        for c in 0..m.q_len {
            put(pos0 + c, pair(c as isize, c as isize - 1));
        }
    }
}

/// `n` random unit vectors of `d` columns, each orthogonal to the two before it.
fn chained_unit_vectors(rng: &mut SmallRng, n: usize, d: usize) -> Vec<Vec<f64>> {
    let mut out: Vec<Vec<f64>> = Vec::with_capacity(n);
    for t in 0..n {
        let mut v: Vec<f64> = (0..d).map(|_| rng.random_range(-1.0..1.0)).collect();
        for prev in out[t.saturating_sub(2)..t].iter() {
            let dot: f64 = v.iter().zip(prev).map(|(a, b)| a * b).sum();
            v.iter_mut().zip(prev).for_each(|(a, b)| *a -= dot * b);
        }
        let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
        v.iter_mut().for_each(|x| *x /= norm);
        out.push(v);
    }
    out
}
