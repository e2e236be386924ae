//! Orders: `decode_first_order` (a stable partition) and `plan_prefill`'s order of row tiles.

use crate::{assemble, pick, random_reqs, ref_split, Batch};
use attn_rs::metadata::{decode_first_order, split_decodes, validate};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// The batch with its requests in `order` (rows, lengths, slots move with their request).
fn reordered(b: &Batch, order: &[usize]) -> Batch {
    let mut qsl = vec![0];
    let (mut seq_lens, mut block_table, mut slots) = (Vec::new(), Vec::new(), Vec::new());
    for &r in order {
        qsl.push(qsl.last().unwrap() + b.q_len(r));
        seq_lens.push(b.seq_lens[r]);
        block_table.extend_from_slice(b.row(r));
        slots.extend_from_slice(&b.slots[b.qsl[r] as usize..b.qsl[r + 1] as usize]);
    }
    Batch { qsl, seq_lens, block_table, slots, ..b.clone() }
}

#[test]
fn decode_first_order_is_a_stable_partition() {
    let mut rng = SmallRng::seed_from_u64(5);
    let mut out_of_order = 0;
    for _ in 0..300 {
        let threshold = rng.random_range(1..=8);
        let reqs = random_reqs(&mut rng, threshold, true);
        let b = assemble(&mut rng, &reqs, 16);
        let order = decode_first_order(&b.input(), threshold);
        let mut sorted = order.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, (0..b.n()).collect::<Vec<_>>(), "a permutation");
        let is_decode = |r: usize| b.q_len(r) <= threshold as i32;
        let nd = (0..b.n()).filter(|&r| is_decode(r)).count();
        assert!(order[..nd].iter().all(|&r| is_decode(r)) && order[nd..].iter().all(|&r| !is_decode(r)), "decodes first");
        assert!(order[..nd].windows(2).all(|w| w[0] < w[1]), "decodes keep their order");
        assert!(order[nd..].windows(2).all(|w| w[0] < w[1]), "prefills keep their order");

        out_of_order += split_decodes(&b.input(), threshold).is_err() as usize;
        let ordered = reordered(&b, &order);
        validate(&ordered.input()).unwrap();
        let split = split_decodes(&ordered.input(), threshold).unwrap();
        assert_eq!(Ok(split), ref_split(&ordered, threshold));
        assert_eq!(split.num_decodes, nd);
        // Already ordered: the identity.
        assert_eq!(decode_first_order(&ordered.input(), threshold), (0..b.n()).collect::<Vec<_>>());
    }
    assert!(out_of_order > 50, "{out_of_order} shuffled batches needed reordering");
}

/// `plan_prefill` on random batches (chunked, empty and causal/non-causal requests, GQA): every
/// row tile once; requests in the order of their longest tile, each one's tiles contiguous and
/// longest first.
#[test]
fn prefill_plan_takes_requests_by_longest_tile_and_their_tiles_longest_first() {
    use attn_rs::prefill::{plan_prefill, PrefillBatch};
    let mut rng = SmallRng::seed_from_u64(41);
    for case in 0..200 {
        let n = rng.random_range(1..12);
        let q_lens: Vec<i32> = (0..n).map(|_| pick(&mut rng, &[0, 1, 17, 128, 500, 2048])).collect();
        let seq_lens: Vec<i32> = q_lens.iter().map(|&q| q + pick(&mut rng, &[0, 0, 300, 8192])).collect();
        let qsl: Vec<i32> = std::iter::once(0)
            .chain(q_lens.iter().scan(0, |a, &q| {
                *a += q;
                Some(*a)
            }))
            .collect();
        let (group, causal, block_m) = (pick(&mut rng, &[1, 4, 8]), rng.random_bool(0.7), pick(&mut rng, &[64, 128]));
        let batch = PrefillBatch { query_start_loc: &qsl, seq_lens: &seq_lens, key_start_loc: None };
        let plan = plan_prefill(&batch, group, causal, None, block_m);
        // Keys a tile attends (the plan's own bound): causal, the last token's; else all.
        let keys = |[req, tile]: [u32; 2]| {
            let (r, t) = (req as usize, (tile >> 16) as usize);
            let rows = q_lens[r] as usize * group;
            let last_token = ((t + 1) * block_m as usize).min(rows).div_ceil(group);
            if causal {
                seq_lens[r] as usize - q_lens[r] as usize + last_token
            } else {
                seq_lens[r] as usize
            }
        };
        let mut expected: Vec<[u32; 2]> = (0..n)
            .flat_map(|r| (0..(q_lens[r] as usize * group).div_ceil(block_m as usize)).map(move |t| [r as u32, (t as u32) << 16]))
            .collect();
        let mut got = plan.items.clone();
        got.sort();
        expected.sort();
        assert_eq!(got, expected, "case {case}: every tile once");
        let mut seen_done = std::collections::HashSet::new();
        for w in plan.items.windows(2) {
            let ([ra, _], [rb, _]) = (w[0], w[1]);
            if ra == rb {
                assert!(keys(w[0]) >= keys(w[1]), "case {case}: request {ra}'s tiles longest first");
            } else {
                assert!(seen_done.insert(ra), "case {case}: request {ra}'s tiles are contiguous");
                let longest = |r: u32| plan.items.iter().filter(|i| i[0] == r).map(|&i| keys(i)).max().unwrap();
                assert!(longest(ra) >= longest(rb), "case {case}: requests by their longest tile");
            }
        }
    }
}
