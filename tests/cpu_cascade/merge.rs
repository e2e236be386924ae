//! The decompositions, with the f64 reference: cascade (shared prefix merged with each
//! request's suffix) equals plain attention, and a decode's context split in two shares merged
//! by LSE equals the whole.

use crate::{pick, start_locs};
use attn_rs::cpu::{self, DecodeRef, DecodeResult, KvRef, PrefillRef};
use attn_rs::decode::{DecodeBatch, MAX_QUERY_LEN};
use attn_rs::metadata::{common_prefix, CommonPrefix, StepInput};
use attn_rs::AttnOptions;
use attn_rs::{Element, KvCacheSpec, KvLayout, RowsDesc};
use half::bf16;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// Cascade = plain (f64 reference)
// ---------------------------------------------------------------------------------------------

/// Max |got - want| over max |want| (the absolute error when the reference is all zeros); NaN
/// when either has a NaN (`f64::max` alone would drop it).
fn max_rel_error(got: &[f64], want: &[f64]) -> f64 {
    assert_eq!(got.len(), want.len());
    if got.iter().chain(want).any(|x| x.is_nan()) {
        return f64::NAN;
    }
    let scale = want.iter().fold(0.0f64, |m, w| m.max(w.abs()));
    let err = got.iter().zip(want).fold(0.0f64, |m, (g, w)| m.max((g - w).abs()));
    if scale == 0.0 {
        err
    } else {
        err / scale
    }
}

fn check_lse_close(got: &[f64], want: &[f64], ctx: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let ok = if w == f64::NEG_INFINITY { g == w } else { (g - w).abs() <= 1e-9 * w.abs().max(1.0) };
        assert!(ok, "{ctx}: lse[{i}] = {g}, want {w}");
    }
}

/// A paged cache and the query rows of one test batch.
struct Attn<Q, C> {
    q: Vec<Q>,
    q_rows: RowsDesc,
    cache: Vec<C>,
    spec: KvCacheSpec,
    opts: AttnOptions,
}

impl<Q: Element, C: Element> Attn<Q, C> {
    /// Causal attention of `q_lens` query tokens over paged contexts (`paged_decode` when every
    /// request is decode-sized, else the prefill reference).
    fn causal(&self, q_lens: &[usize], seq_lens: &[i32], block_table: &[i32], stride: usize) -> DecodeResult {
        let qsl = start_locs(q_lens);
        if q_lens.iter().all(|&q| q <= MAX_QUERY_LEN) {
            cpu::paged_decode(&DecodeRef {
                q: &self.q,
                q_rows: self.q_rows,
                cache: &self.cache,
                spec: self.spec,
                block_table,
                block_table_stride: stride,
                batch: DecodeBatch { seq_lens, query_start_loc: &qsl },
                opts: self.opts,
                alibi_slopes: None,
                sinks: None,
                scales: None,
            })
            .unwrap()
        } else {
            self.prefill(&qsl, seq_lens, block_table, stride, true)
        }
    }

    fn prefill(&self, qsl: &[i32], seq_lens: &[i32], block_table: &[i32], stride: usize, causal: bool) -> DecodeResult {
        cpu::prefill(&PrefillRef {
            q: &self.q,
            q_rows: self.q_rows,
            kv: KvRef::Paged { cache: &self.cache, spec: self.spec, block_table, block_table_stride: stride },
            head_size_v: self.spec.head_size,
            query_start_loc: qsl,
            seq_lens,
            causal,
            opts: self.opts,
            alibi_slopes: None,
            sinks: None,
            scales: None,
        })
        .unwrap()
    }
}

/// Random options: the default scale or another, with or without a soft-cap.
fn random_opts(rng: &mut SmallRng, head_size: usize) -> AttnOptions {
    let mut opts = AttnOptions::new(head_size);
    if rng.random_bool(0.5) {
        opts.softmax_scale = rng.random_range(0.05..0.5);
    }
    if rng.random_bool(0.5) {
        opts.softcap = Some(pick(rng, &[5.0, 30.0]));
    }
    opts
}

/// Row-by-row `merge_states_row` of two results over the same query rows.
fn merge(a: &DecodeResult, b: &DecodeResult, rows: usize, dv: usize) -> (Vec<f64>, Vec<f64>) {
    let (mut out, mut lse) = (Vec::with_capacity(rows * dv), Vec::with_capacity(rows));
    for i in 0..rows {
        let (o, l) = cpu::merge_states_row(&a.out[i * dv..][..dv], a.lse[i], &b.out[i * dv..][..dv], b.lse[i]);
        out.extend(o);
        lse.push(l);
    }
    (out, lse)
}

/// Requests `(q_len, suffix_len)` sharing `prefix_blocks` blocks: plain attention over each
/// whole context against (a) all query tokens as one non-causal request over the shared blocks,
/// (b) each request's suffix (rows shifted past the shared blocks), causal, merged by LSE.
fn check_cascade<C: Element>(rng: &mut SmallRng, prefix_blocks: usize, reqs: &[(usize, usize)], ctx: &str) {
    let (bs, hkv, group, d) = (pick(rng, &[8usize, 16]), 2, pick(rng, &[1usize, 4]), pick(rng, &[32usize, 64]));
    let hq = hkv * group;
    let n = reqs.len();
    let q_lens: Vec<usize> = reqs.iter().map(|r| r.0).collect();
    let suffix_blocks: Vec<usize> = reqs.iter().map(|r| r.1.div_ceil(bs)).collect();
    let seq_lens: Vec<i32> = reqs.iter().map(|r| (prefix_blocks * bs + r.1) as i32).collect();
    // Scattered ids: the shared ones, each request's own, spares.
    let num_blocks = prefix_blocks + suffix_blocks.iter().sum::<usize>() + 3;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(rng);
    let stride = prefix_blocks + suffix_blocks.iter().copied().max().unwrap() + 1;
    let mut table = vec![-1i32; n * stride];
    let mut next = prefix_blocks;
    for r in 0..n {
        table[r * stride..][..prefix_blocks].copy_from_slice(&ids[..prefix_blocks]);
        table[r * stride + prefix_blocks..][..suffix_blocks[r]].copy_from_slice(&ids[next..next + suffix_blocks[r]]);
        next += suffix_blocks[r];
    }
    let num_tokens: usize = q_lens.iter().sum();
    let spec = KvCacheSpec::new(pick(rng, &KvLayout::ALL), num_blocks, bs, hkv, d).unwrap();
    let a = Attn::<bf16, C> {
        q: (0..num_tokens * hq * d).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect(),
        q_rows: RowsDesc::contiguous(num_tokens, hq, d),
        cache: (0..spec.num_elements()).map(|_| C::from_f32(rng.random_range(-1.0..1.0))).collect(),
        spec,
        opts: random_opts(rng, d),
    };
    let ctx = format!("{ctx}: {prefix_blocks} shared blocks of {bs}, reqs (q_len, suffix) {reqs:?}, group {group}, d {d}, {:?}", a.opts);

    // The metadata finds exactly the shared blocks.
    let qsl = start_locs(&q_lens);
    let slots = vec![-1i64; num_tokens];
    let input = StepInput {
        query_start_loc: &qsl,
        seq_lens: &seq_lens,
        block_table: &table,
        block_table_stride: stride,
        slot_mapping: &slots,
        num_actual_tokens: num_tokens,
        num_blocks,
        block_size: bs,
    };
    attn_rs::metadata::validate(&input).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let found = common_prefix(&input);
    if n > 1 {
        assert_eq!(found, CommonPrefix { blocks: prefix_blocks, tokens: prefix_blocks * bs }, "{ctx}");
    } else {
        assert!(found.blocks >= prefix_blocks, "{ctx}: {found:?}");
    }

    let plain = a.causal(&q_lens, &seq_lens, &table, stride);

    // (b) Suffixes: rows shifted past the shared blocks.
    let s_stride = stride - prefix_blocks;
    let s_table: Vec<i32> = table.chunks(stride).flat_map(|row| row[prefix_blocks..].to_vec()).collect();
    let s_lens: Vec<i32> = reqs.iter().map(|r| r.1 as i32).collect();
    let suffix = a.causal(&q_lens, &s_lens, &s_table, s_stride);

    let (out, lse) = if prefix_blocks == 0 {
        (suffix.out, suffix.lse)
    } else {
        // (a) The prefix: every query token as one request, not causal.
        let p_lens = [(prefix_blocks * bs) as i32];
        let prefix = a.prefill(&[0, num_tokens as i32], &p_lens, &ids[..prefix_blocks], prefix_blocks, false);
        assert!(prefix.lse.iter().all(|l| l.is_finite()), "{ctx}: every query token sees the prefix");
        merge(&prefix, &suffix, num_tokens * hq, d)
    };
    let err = max_rel_error(&out, &plain.out);
    assert!(err < 1e-9, "{ctx}: cascade out differs from plain by {err:e}");
    check_lse_close(&lse, &plain.lse, &ctx);
}

/// Decode batches of 1..=4 query tokens: mixed suffixes, one exactly its query tokens.
fn decode_reqs(rng: &mut SmallRng, n: usize) -> Vec<(usize, usize)> {
    let mut reqs: Vec<(usize, usize)> = (0..n)
        .map(|_| {
            let q = rng.random_range(1..=4usize);
            (q, q + pick(rng, &[0usize, 1, 7, 16, 40, 100]))
        })
        .collect();
    let q = reqs[0].0;
    reqs[0].1 = q; // the suffix is exactly the query tokens
    reqs.shuffle(rng);
    reqs
}

fn cascade_equals_plain<C: Element>(salt: u64) {
    let mut rng = SmallRng::seed_from_u64(salt);
    for prefix_blocks in [0usize, 1, 2, 5] {
        for iter in 0..4 {
            let n = pick(&mut rng, &[1usize, 2, 5, 9]);
            let reqs = decode_reqs(&mut rng, n);
            check_cascade::<C>(&mut rng, prefix_blocks, &reqs, &format!("{:?} iter {iter}", C::DTYPE));
        }
    }
}

#[test]
fn cascade_equals_plain_decode_f32_cache() {
    cascade_equals_plain::<f32>(20);
}

#[test]
fn cascade_equals_plain_decode_bf16_cache() {
    cascade_equals_plain::<bf16>(21);
}

#[test]
fn cascade_equals_plain_with_prefills() {
    let mut rng = SmallRng::seed_from_u64(22);
    for prefix_blocks in [0usize, 1, 3] {
        // A 20-token prefill (its whole suffix, then with earlier context) among decodes.
        check_cascade::<bf16>(&mut rng, prefix_blocks, &[(20, 20)], "one prefill, suffix = queries");
        check_cascade::<f32>(&mut rng, prefix_blocks, &[(2, 30), (20, 20), (1, 1), (20, 53), (4, 9)], "prefills among decodes");
        let mut reqs = decode_reqs(&mut rng, 6);
        reqs.push((20, 37));
        check_cascade::<bf16>(&mut rng, prefix_blocks, &reqs, "decodes then a prefill");
    }
}

// ---------------------------------------------------------------------------------------------
// Context parallel: a decode's context in two shares, merged by LSE
// ---------------------------------------------------------------------------------------------

/// Each request's context split at a block boundary `splits[r]`: share 1 = keys `[0, s)`
/// (its row as is, length `s`), share 2 = keys `[s, len)` (its row shifted by `s / block_size`,
/// length `len - s`). One query token each, so each share is seen whole; the merge must equal
/// the whole decode.
fn check_context_parallel<C: Element>(a: &Attn<bf16, C>, seq_lens: &[i32], table: &[i32], stride: usize, splits: &[usize], ctx: &str) {
    let (n, bs, d) = (seq_lens.len(), a.spec.block_size, a.spec.head_size);
    let hq = a.q_rows.num_heads;
    let ones = vec![1usize; n];
    let whole = a.causal(&ones, seq_lens, table, stride);

    let lens1: Vec<i32> = splits.iter().map(|&s| s as i32).collect();
    let lens2: Vec<i32> = seq_lens.iter().zip(splits).map(|(&l, &s)| l - s as i32).collect();
    let mut table2 = vec![-1i32; n * stride];
    for r in 0..n {
        let shift = splits[r] / bs;
        table2[r * stride..][..stride - shift].copy_from_slice(&table[r * stride + shift..][..stride - shift]);
    }
    let share1 = a.causal(&ones, &lens1, table, stride);
    let share2 = a.causal(&ones, &lens2, &table2, stride);
    for (r, &l) in lens1.iter().enumerate() {
        let lse = &share1.lse[r * hq..][..hq];
        assert!(lse.iter().all(|&x| (l == 0) == (x == f64::NEG_INFINITY)), "{ctx}: share 1 of {l} keys has LSE {lse:?}");
    }
    let (out, lse) = merge(&share1, &share2, n * hq, d);
    let err = max_rel_error(&out, &whole.out);
    assert!(err < 1e-9, "{ctx}: splits {splits:?} of {seq_lens:?}: merged out differs from the whole by {err:e}");
    check_lse_close(&lse, &whole.lse, &format!("{ctx}: splits {splits:?} of {seq_lens:?}"));
}

fn context_parallel<C: Element>(salt: u64) {
    let mut rng = SmallRng::seed_from_u64(salt);
    let (bs, hkv, group, d) = (16usize, 2, 4, 64);
    let hq = hkv * group;
    let n = 4;
    let seq_lens: Vec<i32> = (0..n).map(|_| rng.random_range(1000..=3000)).collect();
    let blocks: Vec<usize> = seq_lens.iter().map(|&l| (l as usize).div_ceil(bs)).collect();
    let num_blocks = blocks.iter().sum::<usize>() + 2;
    let stride = blocks.iter().copied().max().unwrap() + 1;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(&mut rng);
    let mut table = vec![-1i32; n * stride];
    let mut next = 0;
    for r in 0..n {
        table[r * stride..][..blocks[r]].copy_from_slice(&ids[next..next + blocks[r]]);
        next += blocks[r];
    }
    let spec = KvCacheSpec::new(pick(&mut rng, &KvLayout::ALL), num_blocks, bs, hkv, d).unwrap();
    let a = Attn::<bf16, C> {
        q: (0..n * hq * d).map(|_| bf16::from_f32(rng.random_range(-1.0..1.0))).collect(),
        q_rows: RowsDesc::contiguous(n, hq, d),
        cache: (0..spec.num_elements()).map(|_| C::from_f32(rng.random_range(-1.0..1.0))).collect(),
        spec,
        opts: random_opts(&mut rng, d),
    };
    let ctx = format!("{:?} cache, {:?}", C::DTYPE, a.opts);
    // Random block boundaries inside each context.
    let splits: Vec<usize> = seq_lens.iter().map(|&l| rng.random_range(1..(l as usize).div_ceil(bs)) * bs).collect();
    check_context_parallel(&a, &seq_lens, &table, stride, &splits, &ctx);
    // Near the ends: the first block alone, the last (partial) block alone.
    let splits: Vec<usize> = seq_lens.iter().map(|&l| if l % 2 == 0 { bs } else { (l as usize - 1) / bs * bs }).collect();
    check_context_parallel(&a, &seq_lens, &table, stride, &splits, &ctx);
    // Degenerate: share 1 empty (s = 0, LSE -inf) gives the whole.
    check_context_parallel(&a, &seq_lens, &table, stride, &vec![0; n], &format!("{ctx}, s = 0"));
}

#[test]
fn context_parallel_two_way_split_equals_whole_f32_cache() {
    context_parallel::<f32>(30);
}

#[test]
fn context_parallel_two_way_split_equals_whole_bf16_cache() {
    context_parallel::<bf16>(31);
}
