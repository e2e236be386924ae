//! The CPU reference of sparse MLA against a computation that shares none of its code: each
//! token's listed rows gathered by hand (block table, then cache offsets) into packed K/V
//! tensors, attended by the CPU prefill (every query sees every key) over them. And what it
//! must skip (padding, positions outside the request, bad block ids), what it reports, and the
//! checks that refuse bad index tensors, naming the argument.

use attn_rs::cpu::{self, KvRef, PrefillRef, SparseMlaRef, SparseResult};
use attn_rs::{AttnError, AttnOptions, BadBlock, BadIndex, MlaCacheSpec, RowsDesc};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const QK: usize = 576;
const V: usize = 512;

/// A batch over a small cache with a scattered block table.
struct Fixture {
    spec: MlaCacheSpec,
    cache: Vec<f32>,
    table: Vec<i32>,
    stride: usize,
    seq_lens: Vec<i32>,
    qsl: Vec<i32>,
    q: Vec<f32>,
    q_rows: RowsDesc,
    heads: usize,
}

impl Fixture {
    fn new(rng: &mut SmallRng, seq_lens: &[i32], q_lens: &[i32], heads: usize) -> Fixture {
        let block_size = 16;
        let blocks: Vec<usize> = seq_lens.iter().map(|&l| (l as usize).div_ceil(block_size)).collect();
        let stride = blocks.iter().copied().max().unwrap_or(1).max(1);
        let num_blocks = blocks.iter().sum::<usize>() + 3;
        let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
        ids.shuffle(rng);
        let mut table = vec![-1; seq_lens.len() * stride];
        let mut next = 0;
        for (r, &n) in blocks.iter().enumerate() {
            for b in 0..n {
                table[r * stride + b] = ids[next];
                next += 1;
            }
        }
        let spec = MlaCacheSpec::deepseek(num_blocks, block_size).unwrap();
        let cache: Vec<f32> = (0..spec.num_elements()).map(|_| rng.random_range(-1.0..1.0)).collect();
        let mut qsl = vec![0];
        for &q in q_lens {
            qsl.push(qsl.last().unwrap() + q);
        }
        let nt = *qsl.last().unwrap() as usize;
        let q_rows = RowsDesc::contiguous(nt, heads, QK);
        let q = (0..q_rows.required_len()).map(|_| rng.random_range(-1.0..1.0)).collect();
        Fixture { spec, cache, table, stride, seq_lens: seq_lens.to_vec(), qsl, q, q_rows, heads }
    }

    fn nt(&self) -> usize {
        *self.qsl.last().unwrap() as usize
    }

    fn request_of(&self, token: usize) -> usize {
        (0..self.seq_lens.len()).find(|&r| (self.qsl[r] as usize..self.qsl[r + 1] as usize).contains(&token)).unwrap()
    }

    fn sparse(&self, indices: &[i32], topk: usize, row_stride: usize) -> attn_rs::Result<SparseResult> {
        cpu::mla_sparse_attention(&SparseMlaRef {
            q: &self.q,
            q_rows: self.q_rows,
            cache: &self.cache,
            spec: self.spec,
            block_table: &self.table,
            block_table_stride: self.stride,
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            indices,
            topk,
            row_stride,
            softmax_scale: 0.06,
            scale: None,
        })
    }

    /// Token `token` against the rows at `positions` of its request, by hand: each position's
    /// block from the table and its row from the cache's own layout, packed, then the CPU
    /// prefill with no mask over exactly those keys. (output row-major [heads, 512], LSEs)
    fn brute_force(&self, token: usize, positions: &[i32]) -> (Vec<f64>, Vec<f64>) {
        if positions.is_empty() {
            return (vec![0.0; self.heads * V], vec![f64::NEG_INFINITY; self.heads]);
        }
        let r = self.request_of(token);
        let bs = self.spec.block_size;
        let mut k = Vec::new();
        for &pos in positions {
            let block = self.table[r * self.stride + pos as usize / bs] as usize;
            k.extend((0..QK).map(|c| self.cache[self.spec.offset(block, pos as usize % bs, c)]));
        }
        let n = positions.len();
        let k_rows = RowsDesc::contiguous(n, 1, QK);
        let q_rows = RowsDesc::contiguous(1, self.heads, QK);
        let q = self.q[self.q_rows.offset(token, 0, 0)..self.q_rows.offset(token, 0, 0) + self.heads * QK].to_vec();
        let got = cpu::prefill(&PrefillRef {
            q: &q,
            q_rows,
            kv: KvRef::Packed { k: &k, k_rows, v: &k, v_rows: k_rows, key_start_loc: &[0, n as i32] },
            head_size_v: V,
            query_start_loc: &[0, 1],
            seq_lens: &[n as i32],
            causal: false,
            opts: AttnOptions { softmax_scale: 0.06, ..AttnOptions::new(QK) },
            alibi_slopes: None,
            sinks: None,
            scales: None,
        })
        .unwrap();
        (got.out, got.lse)
    }
}

/// Random lists: `topk` entries of distinct positions (as many as the request has) and -1,
/// shuffled.
fn lists(rng: &mut SmallRng, f: &Fixture, topk: usize, row_stride: usize, padding: f64) -> Vec<i32> {
    let mut rows = vec![i32::MIN; f.nt() * row_stride];
    for t in 0..f.nt() {
        let len = f.seq_lens[f.request_of(t)];
        let mut pos: Vec<i32> = (0..len).collect();
        pos.shuffle(rng);
        let keep = ((topk as f64 * (1.0 - padding)) as usize).min(len as usize);
        let mut row = pos[..keep].to_vec();
        row.resize(topk, -1);
        row.shuffle(rng);
        rows[t * row_stride..t * row_stride + topk].copy_from_slice(&row);
    }
    rows
}

fn assert_close(got: &[f64], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_infinite() { g == w } else { (g - w).abs() <= 1e-9 * w.abs().max(1.0) };
        assert!(ok, "{what}[{i}]: {g} vs {w}");
    }
}

#[test]
fn reference_matches_gathered_rows_attended_densely() {
    let mut rng = SmallRng::seed_from_u64(11);
    let f = Fixture::new(&mut rng, &[1, 40, 300, 77], &[1, 2, 3, 1], 4);
    for (topk, gap, padding) in [(1, 0, 0.0), (7, 2, 0.0), (64, 0, 0.25), (300, 5, 0.5)] {
        let stride = topk + gap;
        let idx = lists(&mut rng, &f, topk, stride, padding);
        let got = f.sparse(&idx, topk, stride).unwrap();
        assert_eq!((got.bad_indices, got.bad_blocks), (0, 0));
        for t in 0..f.nt() {
            let positions: Vec<i32> = idx[t * stride..t * stride + topk].iter().copied().filter(|&p| p != -1).collect();
            let (out, lse) = f.brute_force(t, &positions);
            let h = f.heads;
            assert_close(&got.out[t * h * V..(t + 1) * h * V], &out, &format!("k {topk} token {t} out"));
            assert_close(&got.lse[t * h..(t + 1) * h], &lse, &format!("k {topk} token {t} lse"));
        }
    }
}

#[test]
fn order_and_padding_do_not_change_the_result() {
    let mut rng = SmallRng::seed_from_u64(12);
    let f = Fixture::new(&mut rng, &[500, 90], &[1, 1], 2);
    let topk = 64;
    let idx = lists(&mut rng, &f, topk, topk, 0.0);
    let base = f.sparse(&idx, topk, topk).unwrap();
    // The same entries reversed, with 36 padding entries mixed in (rows of 100).
    let wide = 100;
    let mut idx2 = vec![-1; 2 * wide];
    for t in 0..2 {
        let mut row: Vec<i32> = idx[t * topk..(t + 1) * topk].iter().rev().copied().collect();
        row.resize(wide, -1);
        row.shuffle(&mut rng);
        idx2[t * wide..(t + 1) * wide].copy_from_slice(&row);
    }
    let again = f.sparse(&idx2, wide, wide).unwrap();
    for (g, w) in again.out.iter().zip(&base.out) {
        assert!((g - w).abs() <= 1e-12, "{g} vs {w}");
    }
    for (g, w) in again.lse.iter().zip(&base.lse) {
        assert!((g - w).abs() <= 1e-12, "{g} vs {w}");
    }
}

#[test]
fn an_all_padding_list_gives_zeros_and_minus_infinity() {
    let mut rng = SmallRng::seed_from_u64(13);
    let f = Fixture::new(&mut rng, &[30, 30], &[1, 1], 3);
    let mut idx = lists(&mut rng, &f, 8, 8, 0.0);
    idx[..8].fill(-1);
    let got = f.sparse(&idx, 8, 8).unwrap();
    assert!(got.out[..3 * V].iter().all(|&x| x == 0.0));
    assert!(got.lse[..3].iter().all(|&x| x == f64::NEG_INFINITY));
    assert!(got.lse[3..].iter().all(|x| x.is_finite()));
    assert_eq!((got.bad_indices, got.bad_blocks), (0, 0));
}

#[test]
fn entries_outside_the_request_are_skipped_and_the_first_named() {
    let mut rng = SmallRng::seed_from_u64(14);
    let f = Fixture::new(&mut rng, &[30, 50], &[1, 2], 2);
    let topk = 10;
    let mut idx = lists(&mut rng, &f, topk, topk, 0.3);
    let clean = f.sparse(&idx, topk, topk).unwrap();
    // Token 1 (request 1, length 50): entry 4 one past its end; token 2: entry 9 negative.
    idx[topk + 4] = 50;
    idx[2 * topk + 9] = -3;
    let got = f.sparse(&idx, topk, topk).unwrap();
    assert_eq!(got.bad_indices, 2);
    assert_eq!(got.first_bad_index, Some(BadIndex { token: 1, entry: 4, index: 50, seq_len: 50 }));
    // Token 0 is untouched; the others equal their lists without those entries.
    assert_eq!(got.out[..2 * V], clean.out[..2 * V]);
    for t in 1..3 {
        let positions: Vec<i32> = idx[t * topk..(t + 1) * topk].iter().copied().filter(|&p| (0..50).contains(&p)).collect();
        let (out, lse) = f.brute_force(t, &positions);
        assert_close(&got.out[t * 2 * V..(t + 1) * 2 * V], &out, "out");
        assert_close(&got.lse[t * 2..(t + 1) * 2], &lse, "lse");
    }
}

#[test]
fn bad_block_ids_are_skipped_and_named() {
    let mut rng = SmallRng::seed_from_u64(15);
    let mut f = Fixture::new(&mut rng, &[40], &[1], 1);
    // Positions 16..32 live in the request's second block, made to point past the cache.
    f.table[1] = f.spec.num_blocks as i32 + 2;
    let idx = vec![3, 20, -1, 35];
    let got = f.sparse(&idx, 4, 4).unwrap();
    assert_eq!(got.bad_blocks, 1);
    assert_eq!(
        got.first_bad_block,
        Some(BadBlock { request: 0, entry: 1, block: f.spec.num_blocks as i64 + 2, num_blocks: f.spec.num_blocks as u64 })
    );
    let (out, _) = f.brute_force(0, &[3, 35]);
    assert_close(&got.out, &out, "out");
}

#[test]
fn bad_index_tensors_are_refused_naming_the_argument() {
    let mut rng = SmallRng::seed_from_u64(16);
    let f = Fixture::new(&mut rng, &[30, 30], &[1, 1], 2);
    let arg = |r: attn_rs::Result<SparseResult>| match r {
        Err(AttnError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected a refusal, got {:?}", other.map(|_| ())),
    };
    let idx = vec![0; 16];
    assert!(f.sparse(&idx, 8, 8).is_ok());
    // Rows 8 apart but only 15 elements: the second row's last entry is missing.
    assert_eq!(arg(f.sparse(&idx[..15], 8, 8)), "indices");
    assert_eq!(arg(f.sparse(&idx, 0, 8)), "topk");
    assert_eq!(arg(f.sparse(&idx, 8, 7)), "indices");
    assert_eq!(arg(f.sparse(&idx, 8, usize::MAX)), "indices");
    // The batch itself is checked as MLA's.
    let mut bad = Fixture::new(&mut rng, &[30, 30], &[1, 1], 2);
    bad.qsl = vec![0, 1, 3];
    assert_eq!(arg(bad.sparse(&idx, 8, 8)), "query_start_loc");
}
