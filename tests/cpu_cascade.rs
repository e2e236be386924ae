//! CPU tests of cascade attention and of merging attention shares by LSE (no GPU):
//! `host::metadata::common_prefix` against a naive reference (identical, diverging and capped
//! prefixes, odd input, random tables), `use_cascade`'s thresholds on each side, and, with the
//! f64 reference (`host::cpu`), that the decompositions are exact: shared prefix (all query
//! tokens of the batch as one non-causal request) merged with each request's own suffix equals
//! plain attention, and a decode's context split in two shares (context parallel) merged by LSE
//! equals the whole.

use half::bf16;
use host::cpu::{self, DecodeRef, DecodeResult, KvRef, PrefillRef};
use host::decode::{AttnOptions, DecodeBatch, MAX_QUERY_LEN};
use host::metadata::{
    common_prefix, use_cascade, CascadeMode, CascadeStep, CommonPrefix, StepInput, MAX_CASCADE_ROWS_PER_REQ, MIN_CASCADE_PREFIX_TOKENS,
    MIN_CASCADE_REQS,
};
use host::{Element, KvCacheSpec, KvLayout, RowsDesc};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

fn start_locs(q_lens: &[usize]) -> Vec<i32> {
    let mut locs = vec![0i32];
    for &q in q_lens {
        locs.push(locs.last().unwrap() + q as i32);
    }
    locs
}

// ---------------------------------------------------------------------------------------------
// 1. common_prefix
// ---------------------------------------------------------------------------------------------

/// One step's block-table side (owned).
#[derive(Clone, Debug)]
struct Table {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    num_blocks: usize,
    block_size: usize,
}

impl Table {
    /// Requests `(q_len, seq_len, row)`; rows padded with -1 to the longest.
    fn new(block_size: usize, num_blocks: usize, reqs: &[(i32, i32, Vec<i32>)]) -> Self {
        let stride = reqs.iter().map(|r| r.2.len()).max().unwrap_or(0);
        let mut block_table = vec![-1; reqs.len() * stride];
        for (r, (_, _, row)) in reqs.iter().enumerate() {
            block_table[r * stride..][..row.len()].copy_from_slice(row);
        }
        let mut qsl = vec![0];
        for (q, _, _) in reqs {
            qsl.push(qsl.last().unwrap() + q);
        }
        Table { qsl, seq_lens: reqs.iter().map(|r| r.1).collect(), block_table, stride, num_blocks, block_size }
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &[],
            num_actual_tokens: self.qsl.last().map_or(0, |&t| t.max(0) as usize),
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }
}

/// The definition, spelled out: the largest `k` such that every request has `k` whole blocks
/// before its first query token, in its row, and its first `k` entries equal request 0's.
fn naive_common_prefix(t: &Table) -> usize {
    let n = t.seq_lens.len();
    if n == 0 || t.block_size == 0 {
        return 0;
    }
    let fits = |k: usize| {
        (0..n).all(|r| {
            let (q, len) = ((t.qsl[r + 1] - t.qsl[r]) as i64, t.seq_lens[r] as i64);
            q >= 0
                && len >= q
                && (k * t.block_size) as i64 <= len - q
                && k <= t.stride
                && (0..k).all(|b| {
                    let id = t.block_table[b];
                    id >= 0 && (id as usize) < t.num_blocks && t.block_table[r * t.stride + b] == id
                })
        })
    };
    (0..=t.stride).take_while(|&k| fits(k)).last().unwrap_or(0)
}

fn check_prefix(t: &Table, want_blocks: usize) {
    let got = common_prefix(&t.input());
    assert_eq!(got, CommonPrefix { blocks: want_blocks, tokens: want_blocks * t.block_size }, "{t:?}");
    assert_eq!(naive_common_prefix(t), want_blocks, "naive reference disagrees with the expectation: {t:?}");
}

#[test]
fn common_prefix_identical_rows() {
    let bs = 16;
    for k in [1usize, 2, 5, 12] {
        let shared: Vec<i32> = (100..100 + k as i32).collect();
        let reqs: Vec<(i32, i32, Vec<i32>)> = (0..6)
            .map(|r| {
                let own: Vec<i32> = (0..3).map(|b| 10 * r + b).collect();
                let row = [shared.clone(), own].concat();
                // Every context reaches past the prefix; q_len 1..=4.
                let q = 1 + r % 4;
                (q, (k * bs) as i32 + q + 17 * r, row)
            })
            .collect();
        check_prefix(&Table::new(bs, 1000, &reqs), k);
    }
    // Rows identical through their last used block: the cap is the context before the queries.
    let row: Vec<i32> = (0..8).collect();
    let reqs: Vec<_> = (0..4).map(|_| (1, 8 * 16, row.clone())).collect();
    check_prefix(&Table::new(16, 8, &reqs), 7); // 127 tokens before the query: 7 whole blocks
}

#[test]
fn common_prefix_different_first_block() {
    let reqs = vec![(1, 100, vec![1, 2, 3, 4, 5, 6, 7]), (1, 100, vec![9, 2, 3, 4, 5, 6, 7]), (1, 100, vec![1, 2, 3, 4, 5, 6, 7])];
    check_prefix(&Table::new(16, 16, &reqs), 0);
    // Diverging later: the shortest agreement wins, whichever request it is.
    let reqs = vec![(1, 100, vec![1, 2, 3, 4, 5, 6, 7]), (1, 100, vec![1, 2, 3, 4, 8, 6, 7]), (1, 100, vec![1, 2, 9, 4, 5, 6, 7])];
    check_prefix(&Table::new(16, 16, &reqs), 2);
}

#[test]
fn common_prefix_one_request() {
    // Everything before the first query token, in whole blocks: (100 - 1) / 16 = 6.
    check_prefix(&Table::new(16, 16, &[(1, 100, vec![3, 1, 4, 15, 9, 2, 6])]), 6);
    // A prefill of the whole context shares nothing.
    check_prefix(&Table::new(16, 16, &[(100, 100, vec![3, 1, 4, 15, 9, 2, 6])]), 0);
    assert_eq!(common_prefix(&Table::new(16, 16, &[]).input()), CommonPrefix::default(), "no requests");
}

#[test]
fn common_prefix_capped_before_the_first_query_token() {
    let row: Vec<i32> = (0..8).collect();
    let bs = 16;
    // Request 1's context ends inside block 3 (55 tokens) and has 5 query tokens: its queries
    // start at token 50, inside block 3, so only blocks 0..3 lie wholly before them.
    let reqs = vec![(1, 120, row.clone()), (5, 3 * 16 + 7, row.clone()), (2, 110, row.clone())];
    check_prefix(&Table::new(bs, 8, &reqs), 3);
    // Its queries starting exactly at block 3 (48 tokens before them) still share 3 blocks...
    let reqs = vec![(1, 120, row.clone()), (5, 48 + 5, row.clone())];
    check_prefix(&Table::new(bs, 8, &reqs), 3);
    // ...one token earlier, 2.
    let reqs = vec![(1, 120, row.clone()), (5, 47 + 5, row.clone())];
    check_prefix(&Table::new(bs, 8, &reqs), 2);
}

#[test]
fn common_prefix_longer_than_a_requests_blocks() {
    // The rows agree on 6 blocks, but request 1 uses only 3 (33 tokens, 1 query: 2 whole blocks
    // before it); its stale entries past them do not count.
    let row: Vec<i32> = (10..16).collect();
    let reqs = vec![(1, 96, row.clone()), (1, 33, row.clone()), (1, 90, row.clone())];
    check_prefix(&Table::new(16, 16, &reqs), 2);
    // The same with -1 past its used blocks.
    let reqs = vec![(1, 96, row.clone()), (1, 33, vec![10, 11, 12, -1, -1, -1]), (1, 90, row)];
    check_prefix(&Table::new(16, 16, &reqs), 2);
}

#[test]
fn common_prefix_zero_length_requests() {
    let row: Vec<i32> = (0..6).collect();
    // An empty request (no context, no query tokens) has no blocks, so the batch shares none.
    let reqs = vec![(1, 90, row.clone()), (0, 0, vec![]), (1, 90, row.clone())];
    check_prefix(&Table::new(16, 8, &reqs), 0);
    // A request with context but no query tokens this step shares its whole blocks.
    let reqs = vec![(1, 90, row.clone()), (0, 40, row.clone())];
    check_prefix(&Table::new(16, 8, &reqs), 2);
    // All empty.
    check_prefix(&Table::new(16, 8, &[(0, 0, vec![]), (0, 0, vec![])]), 0);
}

#[test]
fn common_prefix_odd_input_is_zero_not_a_panic() {
    let row: Vec<i32> = (0..6).collect();
    let good = Table::new(16, 8, &[(1, 90, row.clone()), (1, 90, row.clone())]);
    assert_eq!(common_prefix(&good.input()).blocks, 5);
    // A negative length or a decreasing query_start_loc.
    let mut t = good.clone();
    t.seq_lens[1] = -5;
    check_prefix(&t, 0);
    let mut t = good.clone();
    t.qsl = vec![0, 3, 1];
    check_prefix(&t, 0);
    // Longer query than context.
    let mut t = good.clone();
    t.qsl = vec![0, 1, 200];
    check_prefix(&t, 0);
    // Block ids outside the cache end the prefix (-1, or past num_blocks).
    let mut t = good.clone();
    t.block_table[2] = -1;
    t.block_table[t.stride + 2] = -1;
    check_prefix(&t, 2);
    let mut t = good.clone();
    t.num_blocks = 3;
    check_prefix(&t, 3);
    // Shapes that do not hold the batch: no panic, nothing shared.
    let mut t = good.clone();
    t.qsl.pop();
    assert_eq!(common_prefix(&t.input()), CommonPrefix::default());
    let mut t = good.clone();
    t.block_table.truncate(t.stride + 1); // request 1's row holds one entry
    assert_eq!(common_prefix(&t.input()).blocks, 1);
    t.block_table.truncate(t.stride);
    assert_eq!(common_prefix(&t.input()).blocks, 0);
    let mut t = good.clone();
    t.block_size = 0;
    assert_eq!(common_prefix(&t.input()), CommonPrefix::default());
    let mut t = good;
    t.stride = 0;
    t.block_table.clear();
    assert_eq!(common_prefix(&t.input()), CommonPrefix::default());
}

#[test]
fn common_prefix_matches_naive_on_random_tables() {
    let mut rng = SmallRng::seed_from_u64(1);
    let mut shared_some = 0;
    for iter in 0..3000 {
        let n = pick(&mut rng, &[1usize, 2, 3, 8, 40, 200]);
        let bs = pick(&mut rng, &[1usize, 2, 16, 32]);
        let shared_len = rng.random_range(0..12usize);
        let num_blocks = 64;
        let shared: Vec<i32> = (0..shared_len).map(|_| rng.random_range(0..num_blocks as i32)).collect();
        let reqs: Vec<(i32, i32, Vec<i32>)> = (0..n)
            .map(|_| {
                // Each row: a random part of the shared run, then random ids (often the next shared one).
                let keep = if rng.random_bool(0.7) { shared_len } else { rng.random_range(0..=shared_len) };
                let mut row = shared[..keep].to_vec();
                while row.len() < 14 {
                    let id = if rng.random_bool(0.3) && row.len() < shared_len {
                        shared[row.len()]
                    } else {
                        rng.random_range(-1..num_blocks as i32 + 2)
                    };
                    row.push(id);
                }
                let q = pick(&mut rng, &[0, 1, 1, 2, 4, 20]);
                let len = if rng.random_bool(0.05) { 0 } else { rng.random_range(q..=q.max((14 * bs) as i32)) };
                (q, len, row)
            })
            .collect();
        let t = Table::new(bs, num_blocks, &reqs);
        let want = naive_common_prefix(&t);
        assert_eq!(common_prefix(&t.input()), CommonPrefix { blocks: want, tokens: want * bs }, "iter {iter}: {t:?}");
        shared_some += (want > 0) as usize;
    }
    assert!(shared_some > 300, "only {shared_some} of 3000 random tables share a block");
}

// ---------------------------------------------------------------------------------------------
// 2. use_cascade
// ---------------------------------------------------------------------------------------------

fn step(prefix_tokens: usize, block_size: usize, num_reqs: usize, num_query_tokens: usize, group: usize) -> CascadeStep {
    let blocks = prefix_tokens / block_size;
    CascadeStep { prefix: CommonPrefix { blocks, tokens: blocks * block_size }, num_reqs, num_query_tokens, group }
}

#[test]
fn use_cascade_off_on_and_nothing_shared() {
    let big = step(4096, 16, 64, 64, 8);
    assert!(use_cascade(CascadeMode::Auto, &big));
    assert!(!use_cascade(CascadeMode::Off, &big), "Off never");
    let none = step(0, 16, 64, 64, 8);
    for mode in [CascadeMode::Auto, CascadeMode::On, CascadeMode::Off] {
        assert!(!use_cascade(mode, &none), "{mode:?}: no shared block");
    }
    // On: any shared block, whatever the heuristic would say.
    let small = step(16, 16, 1, 500, 16);
    assert!(use_cascade(CascadeMode::On, &small));
    assert!(!use_cascade(CascadeMode::Auto, &small));
    assert_eq!(CascadeMode::default(), CascadeMode::Auto);
}

#[test]
fn use_cascade_auto_thresholds() {
    assert_eq!((MIN_CASCADE_PREFIX_TOKENS, MIN_CASCADE_REQS, MAX_CASCADE_ROWS_PER_REQ), (256, 8, 64));
    let auto = |s: CascadeStep| use_cascade(CascadeMode::Auto, &s);
    // (1) prefix tokens: 256 yes, below no (block sizes 1 and 16).
    assert!(auto(step(256, 16, 8, 8, 8)));
    assert!(!auto(step(240, 16, 8, 8, 8)));
    assert!(auto(step(256, 1, 8, 8, 8)));
    assert!(!auto(step(255, 1, 8, 8, 8)));
    // (2) requests: 8 yes, 7 no.
    assert!(auto(step(1024, 16, 8, 8, 4)));
    assert!(!auto(step(1024, 16, 7, 7, 4)));
    // (3) rows per request per kv head: 64 yes, just above no.
    assert!(auto(step(1024, 16, 8, 64, 8))); // 64 * 8 / 8 = 64
    assert!(!auto(step(1024, 16, 8, 65, 8))); // 65
    assert!(auto(step(1024, 16, 16, 256, 4))); // 64
    assert!(!auto(step(1024, 16, 16, 257, 4))); // 64.25: compared exactly, not rounded down
    assert!(auto(step(1024, 16, 10, 160, 4))); // 64
    assert!(!auto(step(1024, 16, 10, 161, 4)));
    // Decodes under a long system prompt: yes; a batch of long prefills: no.
    assert!(auto(step(2000, 16, 256, 256, 8)));
    assert!(!auto(step(2000, 16, 8, 8 * 512, 1)));
}

#[test]
fn cascade_step_from_a_step_input() {
    let shared: Vec<i32> = (0..20).collect();
    let reqs: Vec<(i32, i32, Vec<i32>)> = (0..8).map(|r| (1, 20 * 16 + 1, [shared.clone(), vec![100 + r]].concat())).collect();
    let t = Table::new(16, 200, &reqs);
    let s = CascadeStep::new(&t.input(), 4);
    assert_eq!((s.prefix, s.num_reqs, s.num_query_tokens, s.group), (CommonPrefix { blocks: 20, tokens: 320 }, 8, 8, 4));
    assert!(use_cascade(CascadeMode::Auto, &s));
}

// ---------------------------------------------------------------------------------------------
// 3. Cascade = plain (f64 reference)
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
    host::metadata::validate(&input).unwrap_or_else(|e| panic!("{ctx}: {e}"));
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
// 4. Context parallel: a decode's context in two shares, merged by LSE
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
