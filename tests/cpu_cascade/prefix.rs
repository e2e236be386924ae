//! The metadata side: `common_prefix` against a naive reference, and `use_cascade`'s
//! thresholds.

use crate::pick;
use attn_rs::metadata::{
    common_prefix, use_cascade, CascadeMode, CascadeStep, CommonPrefix, StepInput, MAX_CASCADE_ROWS_PER_REQ, MIN_CASCADE_PREFIX_TOKENS,
    MIN_CASCADE_REQS,
};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

// ---------------------------------------------------------------------------------------------
// common_prefix
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
// use_cascade
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
