//! The attention the checks compare with: plain f64 loops, written apart from
//! [`attn_rs::cpu`] (which the CPU backend runs) so that a check on the CPU backend compares two
//! implementations, and a layer's window and soft-cap are read from the one definition here.
//!
//! Query `i` of `nq` over a sequence of `nk` keys sits at position `pos = nk - nq + i` (the
//! queries are the sequence's last tokens) and sees key `j` when `j <= pos` and, with a sliding
//! window of `w`, `pos - j < w`: the keys `pos - w + 1 ..= pos`, itself included
//! ([`AttnOptions::window`]), and with chunks of `c` (chunked local attention), `j / c == pos / c`:
//! the keys from its chunk's start ([`AttnOptions::chunk_size`]). Its logit for key `j` is
//! `scale * q . k_j`, then `cap * tanh(logit / cap)` with a soft-cap.
//!
//! Bidirectional attention ([`reference_attention_bidirectional`]: an encoder layer over its
//! request's encoder tokens, a cross-attention layer over its encoder keys) has no mask: every
//! query sees every key, wherever it is.

use attn_rs::AttnOptions;

/// The heads and widths of a reference computation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RefShape {
    pub q_heads: usize,
    /// Query head `h` reads kv head `h / (q_heads / kv_heads)`.
    pub kv_heads: usize,
    /// Query/key width.
    pub dk: usize,
    /// Value width.
    pub dv: usize,
}

/// Whether the query at `pos` sees the key at `key`: causal, within `opts`' window and in the
/// query's chunk.
pub fn key_visible(pos: usize, key: usize, opts: &AttnOptions) -> bool {
    key <= pos && opts.window.is_none_or(|w| pos - key < w as usize) && opts.chunk_size.is_none_or(|c| key / c as usize == pos / c as usize)
}

/// The attention of `q` (`[nq, q_heads, dk]`, the last `nq` tokens of the sequence) over `k`
/// (`[nk, kv_heads, dk]`) and `v` (`[nk, kv_heads, dv]`), with `opts`' scale, window, chunks
/// and soft-cap: `[nq, q_heads, dv]`. `opts` may hold nothing else (a symmetric window).
pub fn reference_attention(shape: RefShape, opts: &AttnOptions, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
    attention(shape, opts, true, q, k, v)
}

/// The attention of `q` (`[nq, q_heads, dk]`, any tokens) over every key of `k`
/// (`[nk, kv_heads, dk]`) and `v` (`[nk, kv_heads, dv]`), with `opts`' scale and soft-cap, no
/// mask: `[nq, q_heads, dv]`. `opts` may hold no window, chunks or symmetric window.
pub fn reference_attention_bidirectional(shape: RefShape, opts: &AttnOptions, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
    assert!(opts.window.is_none() && opts.chunk_size.is_none(), "bidirectional attention has no causal window or chunks");
    attention(shape, opts, false, q, k, v)
}

fn attention(shape: RefShape, opts: &AttnOptions, causal: bool, q: &[f64], k: &[f64], v: &[f64]) -> Vec<f64> {
    let RefShape { q_heads, kv_heads, dk, dv } = shape;
    assert!(opts.symmetric_window.is_none(), "the reference has no symmetric windows");
    assert!(kv_heads > 0 && q_heads.is_multiple_of(kv_heads), "{q_heads} query heads over {kv_heads} kv heads");
    let (nq, nk) = (q.len() / (q_heads * dk), k.len() / (kv_heads * dk));
    assert!(v.len() == nk * kv_heads * dv, "{nk} keys, {} values", v.len() / (kv_heads * dv).max(1));
    assert!(!causal || nq <= nk, "{nq} causal queries over {nk} keys");
    let group = q_heads / kv_heads;
    let scale = opts.softmax_scale as f64;
    let mut out = vec![0.0; nq * q_heads * dv];
    for i in 0..nq {
        for h in 0..q_heads {
            let kvh = h / group;
            let qv = &q[(i * q_heads + h) * dk..][..dk];
            let keys: Vec<usize> = match causal {
                true => (0..nk).filter(|&j| key_visible(nk - nq + i, j, opts)).collect(),
                false => (0..nk).collect(),
            };
            let logits: Vec<f64> = keys
                .iter()
                .map(|&j| {
                    let kv = &k[(j * kv_heads + kvh) * dk..][..dk];
                    let s = scale * qv.iter().zip(kv).map(|(a, b)| a * b).sum::<f64>();
                    opts.softcap.map_or(s, |cap| cap as f64 * (s / cap as f64).tanh())
                })
                .collect();
            let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
            let denom: f64 = weights.iter().sum();
            let o = &mut out[(i * q_heads + h) * dv..][..dv];
            for (&j, w) in keys.iter().zip(&weights) {
                let vv = &v[(j * kv_heads + kvh) * dv..][..dv];
                for (x, y) in o.iter_mut().zip(vv) {
                    *x += w / denom * y;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One head, keys of width 1 and one-hot values: with a zero query every visible key weighs
    /// the same, so the output names the keys seen.
    fn seen(nk: usize, nq: usize, window: Option<u32>) -> Vec<Vec<usize>> {
        seen_with(nk, nq, AttnOptions { window, ..AttnOptions::new(1) })
    }

    fn seen_with(nk: usize, nq: usize, opts: AttnOptions) -> Vec<Vec<usize>> {
        let shape = RefShape { q_heads: 1, kv_heads: 1, dk: 1, dv: nk };
        let v: Vec<f64> = (0..nk * nk).map(|x| if x / nk == x % nk { 1.0 } else { 0.0 }).collect();
        let out = reference_attention(shape, &opts, &vec![0.0; nq], &vec![1.0; nk], &v);
        out.chunks(nk).map(|row| (0..nk).filter(|&j| row[j] > 0.0).collect()).collect()
    }

    #[test]
    fn a_window_of_w_sees_the_last_w_keys_up_to_the_query() {
        assert_eq!(seen(6, 2, None), [vec![0, 1, 2, 3, 4], vec![0, 1, 2, 3, 4, 5]]);
        assert_eq!(seen(6, 2, Some(3)), [vec![2, 3, 4], vec![3, 4, 5]]);
        assert_eq!(seen(6, 1, Some(1)), [vec![5]]);
        assert_eq!(seen(3, 3, Some(8)), [vec![0], vec![0, 1], vec![0, 1, 2]]);
        let w = |window| AttnOptions { window, ..AttnOptions::new(1) };
        assert!(key_visible(10, 7, &w(Some(4))) && !key_visible(10, 6, &w(Some(4))) && !key_visible(10, 11, &w(None)));
    }

    #[test]
    fn a_chunked_query_sees_its_chunk_up_to_itself() {
        // Chunks of 3: positions 0..3, 3..6, 6..9.
        let chunks = |nk, nq| seen_with(nk, nq, AttnOptions { chunk_size: Some(3), ..AttnOptions::new(1) });
        assert_eq!(chunks(8, 4), [vec![3, 4], vec![3, 4, 5], vec![6], vec![6, 7]]);
        assert_eq!(chunks(3, 3), [vec![0], vec![0, 1], vec![0, 1, 2]]);
        // With a window too, both cut: a window of 2 at position 7 sees 6 and 7, at 6 only 6.
        let both = seen_with(8, 2, AttnOptions { chunk_size: Some(3), window: Some(2), ..AttnOptions::new(1) });
        assert_eq!(both, [vec![6], vec![6, 7]]);
    }

    #[test]
    fn the_softcap_bounds_the_logits() {
        // Two keys, logits 3 and 0: softmax weights e^3 : 1, or with a cap of 1, e^tanh(3) : 1.
        let shape = RefShape { q_heads: 1, kv_heads: 1, dk: 1, dv: 1 };
        let (k, v) = ([3.0, 0.0], [1.0, 0.0]);
        let plain = reference_attention(shape, &AttnOptions::new(1), &[1.0], &k, &v);
        let capped = reference_attention(shape, &AttnOptions { softcap: Some(1.0), ..AttnOptions::new(1) }, &[1.0], &k, &v);
        let w = |s: f64| s.exp() / (s.exp() + 1.0);
        assert!((plain[0] - w(3.0)).abs() < 1e-12 && (capped[0] - w(3f64.tanh())).abs() < 1e-12, "{plain:?} {capped:?}");
    }

    #[test]
    fn bidirectional_queries_see_every_key() {
        // Three keys with one-hot values and a zero query: each query, the first included, sees
        // all three; causal, the first of three queries sees one.
        let shape = RefShape { q_heads: 1, kv_heads: 1, dk: 1, dv: 3 };
        let v = [1.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 1.0];
        let all = reference_attention_bidirectional(shape, &AttnOptions::new(1), &[0.0; 2], &[1.0; 3], &v);
        assert!(all.iter().all(|&x| (x - 1.0 / 3.0).abs() < 1e-12), "{all:?}");
        let causal = reference_attention(shape, &AttnOptions::new(1), &[0.0; 3], &[1.0; 3], &v);
        assert_eq!(&causal[..3], [1.0, 0.0, 0.0]);
    }

    #[test]
    fn query_heads_share_their_group_kv_head() {
        // Two kv heads, four query heads: heads 0, 1 read kv head 0 (value 1), heads 2, 3 kv head 1 (value 2).
        let shape = RefShape { q_heads: 4, kv_heads: 2, dk: 1, dv: 1 };
        let out = reference_attention(shape, &AttnOptions::new(1), &[1.0; 4], &[1.0, 1.0], &[1.0, 2.0]);
        assert_eq!(out, [1.0, 1.0, 2.0, 2.0]);
    }
}
