//! `attn_math::split`: split counts, CTAs per chunk, the auto and forced chunk, even waves,
//! plans that need no device copy, splits derived from the CTA index, merge counters.

use crate::pick;
use attn_math::split::{ctas_for_chunk, even_waves_chunk, num_splits, plan_chunk, EVEN_WAVES_MAX_SPLITS};
use attn_rs::decode::{plan_decode_tc, DecodeBatch, DecodePlan, TcShape};
use attn_rs::SplitMode;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// 1..300 lengths in 0..50000, with a random share of empty requests and a random spread.
fn random_lens(rng: &mut SmallRng) -> Vec<u32> {
    let n = rng.random_range(1..300);
    let cap = pick(rng, &[1u32, 40, 300, 3000, 49_999]);
    let zero_p = pick(rng, &[0.0, 0.1, 0.5, 1.0]);
    (0..n).map(|_| if rng.random_bool(zero_p) { 0 } else { rng.random_range(0..=cap) }).collect()
}

#[test]
fn num_splits_and_ctas_for_chunk() {
    assert_eq!(num_splits(0, 16), 1, "an empty request still has one split");
    assert_eq!(num_splits(1, 16), 1);
    assert_eq!(num_splits(16, 16), 1);
    assert_eq!(num_splits(17, 16), 2);
    assert_eq!(ctas_for_chunk(&[], 16, 7), 0);
    let mut rng = SmallRng::seed_from_u64(10);
    for _ in 0..2000 {
        let (len, chunk) = (rng.random_range(1..1_000_000u32), rng.random_range(1..5000u32));
        assert_eq!(num_splits(len, chunk) as u64, (len as u64).div_ceil(chunk as u64), "len {len} chunk {chunk}");
    }
    for _ in 0..100 {
        let lens = random_lens(&mut rng);
        let (chunk, cps) = (rng.random_range(1..3000u32), rng.random_range(1..64u32));
        let want: u64 = lens.iter().map(|&l| if l == 0 { 1 } else { (l as u64).div_ceil(chunk as u64) }).sum::<u64>() * cps as u64;
        assert_eq!(ctas_for_chunk(&lens, chunk, cps), want);
    }
}

#[test]
fn plan_chunk_auto_is_the_smallest_chunk_within_target() {
    let mut rng = SmallRng::seed_from_u64(11);
    for iter in 0..600 {
        let lens = random_lens(&mut rng);
        let cps = rng.random_range(1..=32u32);
        let target = rng.random_range(1..=20_000u64);
        let tile = pick(&mut rng, &[1u32, 16, 32, 64]);
        let min_chunk = pick(&mut rng, &[0u32, 1, 16, 100, 256, 1024]);
        let chunk = plan_chunk(&lens, cps, target, tile, min_chunk, None);

        let max_len = lens.iter().copied().max().unwrap().max(1);
        let top = max_len.div_ceil(tile) * tile;
        let lower = min_chunk.div_ceil(tile).max(1).min(max_len.div_ceil(tile)) * tile;
        let ctas = |c: u32| ctas_for_chunk(&lens, c, cps);
        let ctx = format!(
            "iter {iter}: {} reqs, max_len {max_len}, cps {cps}, target {target}, tile {tile}, min_chunk {min_chunk}: chunk {chunk}",
            lens.len()
        );

        assert!(chunk >= tile && chunk.is_multiple_of(tile), "{ctx}: not a positive multiple of the tile");
        assert!(chunk >= lower, "{ctx}: below the lower bound {lower}");
        assert!(chunk <= top, "{ctx}: above one split per request ({top})");
        let one_each = lens.len() as u64 * cps as u64;
        assert_eq!(ctas(top), one_each, "{ctx}");
        if one_each <= target {
            assert!(ctas(chunk) <= target, "{ctx}: {} CTAs over the target", ctas(chunk));
        } else {
            assert_eq!(chunk, top, "{ctx}: the target is unreachable, so one split per request");
        }
        assert!(chunk == lower || ctas(chunk - tile) > target, "{ctx}: chunk - tile also fits ({} CTAs)", ctas(chunk - tile));
    }
}

#[test]
fn even_waves_split_equal_requests_whose_last_round_is_mostly_empty() {
    // 64 requests x 8 kv heads, one split each, on 396 slots (3 CTAs per SM): 1.3 rounds
    // cost 2; three splits of 1408 keys make 3.9 rounds.
    let lens = vec![4096u32; 64];
    assert_eq!(even_waves_chunk(&lens, 8, 396, 64, 256, 4096), 1408);
    // On 264 slots (2 per SM) 1.94 rounds are nearly full: one split stays.
    assert_eq!(even_waves_chunk(&lens, 8, 264, 64, 256, 4096), 4096);
    // 256 requests of 1024 keys on 396 slots: 5.2 rounds; two splits measured slower.
    assert_eq!(even_waves_chunk(&[1024; 256], 8, 396, 64, 256, 1024), 1024);
    // Fits in one round, already split, mixed lengths, no slots given: unchanged.
    assert_eq!(even_waves_chunk(&lens[..40], 8, 396, 64, 256, 4096), 4096);
    assert_eq!(even_waves_chunk(&lens, 8, 396, 64, 256, 2048), 2048);
    let mixed: Vec<u32> = (0..64).map(|i| 1000 + 50 * i).collect();
    assert_eq!(even_waves_chunk(&mixed, 8, 396, 64, 256, 4150), 4150);
    assert_eq!(even_waves_chunk(&lens, 8, 0, 64, 256, 4096), 4096);

    // Whatever it picks: whole tiles, at least the minimum, at most EVEN_WAVES_MAX_SPLITS
    // splits, and never more rounds x chunk than one split per request.
    let mut rng = SmallRng::seed_from_u64(13);
    for iter in 0..400 {
        let len = rng.random_range(1..=40_000u32);
        let lens: Vec<u32> = (0..rng.random_range(1..=300)).map(|_| len - rng.random_range(0..=len / 5)).collect();
        let (cps, slots) = (rng.random_range(1..=16u32), rng.random_range(1..=2000u64));
        let tile = pick(&mut rng, &[16u32, 32, 64]);
        let max_len = *lens.iter().max().unwrap();
        let one = max_len.div_ceil(tile) * tile;
        let chunk = even_waves_chunk(&lens, cps, slots, tile, 256, one);
        let ctx = format!("iter {iter}: {} reqs of ~{len}, cps {cps}, slots {slots}, tile {tile}: chunk {chunk}", lens.len());
        assert!(chunk.is_multiple_of(tile) && (chunk >= 256 || chunk == one), "{ctx}");
        assert!(num_splits(max_len, chunk) <= EVEN_WAVES_MAX_SPLITS, "{ctx}");
        let rounds = |c: u32| ctas_for_chunk(&lens, c, cps).div_ceil(slots) * c.min(max_len) as u64;
        assert!(rounds(chunk) <= rounds(one), "{ctx}");
    }
}

#[test]
fn plans_that_need_no_device_copy() {
    // Work items as `plan_decode_tc` makes them: `request, row_tile << 16 | split`.
    let plan = |items: &[(u32, u32)], splits: &[u32], cluster: u32| DecodePlan {
        items: items.iter().flat_map(|&(r, ts)| [r, ts]).collect(),
        req_num_splits: splits.to_vec(),
        cluster,
        ..DecodePlan::default()
    };
    // One CTA per request: CTA i is request i, nothing to copy or merge.
    let one = plan(&[(0, 0), (1, 0), (2, 0)], &[1, 1, 1], 0);
    assert!(!one.needs_device_plan() && !one.needs_merge());
    // A request with no query tokens has no item: CTA i is not request i any more.
    assert!(plan(&[(1, 0), (3, 0)], &[1, 1, 1, 1], 0).needs_device_plan());
    // Two row tiles, or a request with two splits: the items are needed.
    assert!(plan(&[(0, 0), (0, 1 << 16), (1, 0)], &[1, 1], 0).needs_device_plan());
    let split = plan(&[(0, 0), (0, 1), (1, 0)], &[2, 1], 0);
    assert!(split.needs_device_plan() && split.needs_merge());
    // A cluster plan: CTA i is split i % cluster of request i / cluster, combined in the cluster.
    let cluster = plan(&[(0, 0), (0, 1), (1, 0), (1, 1)], &[2, 2], 2);
    assert!(!cluster.needs_device_plan() && !cluster.needs_merge());
    assert!(plan(&[(1, 0), (1, 1)], &[2, 2], 2).needs_device_plan());
}

#[test]
fn uniform_splits_are_derived_from_the_cta_index() {
    let shape = TcShape::attention(128, 128, true, false, 8);
    let plan_for = |lens: &[i32], q_lens: &[i32], mode| {
        let mut qsl = vec![0];
        q_lens.iter().for_each(|q| qsl.push(qsl.last().unwrap() + q));
        let batch = DecodeBatch { seq_lens: lens, query_start_loc: &qsl };
        (plan_decode_tc(&batch, 32, 4, shape, 264, 264, None, mode, 1 << 20), qsl)
    };
    // Equal requests in equal splits: CTA i is split i % 4 of request i / 4, and request r's
    // partial rows start at 4 x num_q_heads x query_start_loc[r] (what the kernel computes).
    let (plan, qsl) = plan_for(&[3001; 6], &[1, 2, 1, 2, 2, 1], SplitMode::Fixed(4));
    assert_eq!(plan.uniform_splits(), Some(4));
    for (r, &base) in plan.req_partial_base.iter().enumerate() {
        assert_eq!(base, 4 * 32 * qsl[r] as u32, "request {r}");
    }
    // Unequal splits, or one split each: not uniform.
    assert_eq!(plan_for(&[3001, 1000], &[1, 1], SplitMode::Fixed(4)).0.uniform_splits(), None);
    assert_eq!(plan_for(&[3001; 3], &[1; 3], SplitMode::Fixed(1)).0.uniform_splits(), None);
}

#[test]
fn merge_counters_are_distinct_and_fit_the_workspace() {
    use attn_math::params::{merge_counter_index, merge_group_counter_index, merge_group_splits};
    let mut rng = SmallRng::seed_from_u64(21);
    for iter in 0..300 {
        let lens: Vec<i32> = random_lens(&mut rng).into_iter().map(|l| l as i32).collect();
        // Up to 16 rows per kv head: the keys-as-rows kernels' one row tile.
        let (kv_heads, group) = (pick(&mut rng, &[1u32, 2, 8, 16]), pick(&mut rng, &[1u32, 2, 4, 8, 16]));
        let q_lens: Vec<i32> = lens.iter().map(|_| rng.random_range(1..=(16 / group) as i32)).collect();
        let mut qsl = vec![0];
        q_lens.iter().for_each(|q| qsl.push(qsl.last().unwrap() + q));
        let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
        let hq = (kv_heads * group) as usize;
        // Up to 300 splits: the two-level merge's group counters from 16 on.
        let mode = if rng.random_bool(0.5) { SplitMode::Auto } else { SplitMode::Fixed(rng.random_range(1..300)) };
        let capacity = rng.random_range(1..200_000usize);
        let shape = TcShape { block_m: attn_math::keys_rows::WIDE_ROWS, ..TcShape::attention(128, 128, true, false, kv_heads) };
        let plan = plan_decode_tc(&batch, hq, group, shape, 264, 264, None, mode, capacity);
        assert!(plan.items.chunks(2).all(|it| it[1] >> 16 == 0), "one row tile per request");
        let mut seen = std::collections::HashSet::new();
        for (r, &splits) in plan.req_num_splits.iter().enumerate().filter(|(_, &s)| s > 1) {
            for h in 0..kv_heads {
                let base = plan.req_partial_base[r] as u64;
                let per_group = merge_group_splits(splits);
                let groups = if per_group < splits { splits.div_ceil(per_group) } else { 0 };
                let counters = std::iter::once(merge_counter_index(base, hq as u32, group, h))
                    .chain((0..groups).map(|g| merge_group_counter_index(base, hq as u32, group, h, g)));
                for i in counters {
                    assert!(seen.insert(i), "iter {iter}: request {r} kv head {h}: counter {i} taken ({splits} splits)");
                    assert!((i as usize) < plan.partial_rows / 2 + 1 && plan.partial_rows <= capacity, "iter {iter}: counter {i}");
                }
            }
        }
    }
}

#[test]
fn plan_chunk_forced_splits() {
    let mut rng = SmallRng::seed_from_u64(12);
    for iter in 0..400 {
        let lens = random_lens(&mut rng);
        let cps = rng.random_range(1..=32u32);
        let target = rng.random_range(1..=20_000u64);
        let tile = pick(&mut rng, &[1u32, 16, 32, 64]);
        let min_chunk = pick(&mut rng, &[0u32, 256, 1024]);
        let n = pick(&mut rng, &[0u32, 1, 2, 3, 4, 7, 16, 100, 5000, u32::MAX]);
        let chunk = plan_chunk(&lens, cps, target, tile, min_chunk, Some(n));
        let max_len = lens.iter().copied().max().unwrap().max(1);
        let n_eff = n.max(1);
        let ctx = format!("iter {iter}: max_len {max_len}, tile {tile}, Some({n}): chunk {chunk}");

        assert!(chunk >= tile && chunk.is_multiple_of(tile), "{ctx}: not a positive multiple of the tile");
        assert!(num_splits(max_len, chunk) <= n_eff, "{ctx}: {} splits", num_splits(max_len, chunk));
        // The smallest such chunk: one tile less splits the longest request into more than n.
        assert!(chunk == tile || num_splits(max_len, chunk - tile) > n_eff, "{ctx}: chunk - tile also gives <= n splits");
        // Forced splits do not depend on the CTA budget or the minimum chunk.
        assert_eq!(chunk, plan_chunk(&lens, 1, 1, tile, 0, Some(n)), "{ctx}");
        if n_eff == 1 {
            assert!(chunk >= max_len, "{ctx}");
            assert!(lens.iter().all(|&l| num_splits(l, chunk) == 1), "{ctx}");
        }
        if n_eff <= max_len.div_ceil(tile) && max_len.is_multiple_of(tile) && max_len.div_ceil(tile).is_multiple_of(n_eff) {
            assert_eq!(num_splits(max_len, chunk), n_eff, "{ctx}: tiles divide evenly into n");
        }
    }
}
