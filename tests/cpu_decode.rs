//! CPU tests of decode (no GPU): the split-K planning math (`attn_math::split`), the host's batch
//! plan and validation (`host::decode`), the online softmax and LSE combination
//! (`attn_math::softmax`), and properties of the CPU reference `cpu::paged_decode` checked
//! against an explicit f64 softmax-attention written here.

use approx::assert_relative_eq;
use half::bf16;
use host::attn_math::decode::HEAD_SIZES;
use host::attn_math::softmax::{combine_lse, partial_weight, OnlineSoftmax};
use host::attn_math::split::{ctas_for_chunk, even_waves_chunk, num_splits, plan_chunk, EVEN_WAVES_MAX_SPLITS};
use host::cpu::{self, DecodeRef, DecodeResult};
use host::decode::{plan_decode_tc, validate_batch, AttnOptions, DecodeBatch, DecodePlan, SplitMode, TcShape, MAX_QUERY_LEN};
use host::{AttnError, Element, Fp8E4m3, KvCacheSpec, KvLayout, RowsDesc};
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

const NEG_INF: f32 = f32::NEG_INFINITY;

/// Mirrors `host::decode`'s private planning constant (smallest auto chunk).
const MIN_CHUNK: u32 = 256;

fn pick<T: Copy>(rng: &mut SmallRng, xs: &[T]) -> T {
    xs[rng.random_range(0..xs.len())]
}

// ---------------------------------------------------------------------------------------------
// 1. attn_math::split
// ---------------------------------------------------------------------------------------------

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
        (plan_decode_tc(&batch, 32, 4, shape, 264, 264, mode, 1 << 20), qsl)
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
    use host::attn_math::params::merge_counter_index;
    let mut rng = SmallRng::seed_from_u64(21);
    for iter in 0..300 {
        let lens: Vec<i32> = random_lens(&mut rng).into_iter().map(|l| l as i32).collect();
        let (kv_heads, group) = (pick(&mut rng, &[1u32, 2, 8, 16]), pick(&mut rng, &[1u32, 2, 4, 8]));
        let q_lens: Vec<i32> = lens.iter().map(|_| rng.random_range(1..=(8 / group) as i32)).collect();
        let mut qsl = vec![0];
        q_lens.iter().for_each(|q| qsl.push(qsl.last().unwrap() + q));
        let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
        let hq = (kv_heads * group) as usize;
        let mode = if rng.random_bool(0.5) { SplitMode::Auto } else { SplitMode::Fixed(rng.random_range(1..40)) };
        let capacity = rng.random_range(1..200_000usize);
        let shape = TcShape::attention(128, 128, true, false, kv_heads);
        let plan = plan_decode_tc(&batch, hq, group, shape, 264, 264, mode, capacity);
        let mut seen = std::collections::HashSet::new();
        for (r, &splits) in plan.req_num_splits.iter().enumerate().filter(|(_, &s)| s > 1) {
            for h in 0..kv_heads {
                let i = merge_counter_index(plan.req_partial_base[r] as u64, hq as u32, group, h);
                assert!(seen.insert(i), "iter {iter}: request {r} kv head {h}: counter {i} taken ({splits} splits)");
                assert!((i as usize) < plan.partial_rows / 2 + 1 && plan.partial_rows <= capacity, "iter {iter}: counter {i}");
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

// ---------------------------------------------------------------------------------------------
// 2. host::decode::plan_decode_tc
// ---------------------------------------------------------------------------------------------

fn q_lens_of(qsl: &[i32]) -> Vec<u32> {
    qsl.windows(2).map(|w| (w[1] - w[0]) as u32).collect()
}

fn start_locs(q_lens: &[usize]) -> Vec<i32> {
    let mut locs = vec![0i32];
    for &q in q_lens {
        locs.push(locs.last().unwrap() + q as i32);
    }
    locs
}

/// Partial rows and the largest split count a chunk gives.
fn partial_need(lens: &[u32], q_lens: &[u32], num_q_heads: usize, chunk: u32) -> (usize, u32) {
    let rows = lens
        .iter()
        .zip(q_lens)
        .map(|(&l, &q)| (num_splits(l, chunk), q))
        .filter(|(s, _)| *s > 1)
        .map(|(s, q)| (s * q) as usize * num_q_heads)
        .sum();
    (rows, lens.iter().map(|&l| num_splits(l, chunk)).max().unwrap_or(1))
}

/// The keys-split shape (16 rows, 64 keys a tile) with a CTA per kv head.
fn keys_shape(num_kv_heads: usize) -> TcShape {
    TcShape::attention(128, 128, true, false, num_kv_heads as u32)
}

/// Checks a plan of `plan_decode_tc` made with no even waves (`slots` 0).
#[allow(clippy::too_many_arguments)]
fn check_plan(
    plan: &DecodePlan,
    seq_lens: &[i32],
    qsl: &[i32],
    hq: usize,
    group: u32,
    shape: TcShape,
    target: u64,
    mode: SplitMode,
    capacity: usize,
) {
    let ctx = format!("lens {seq_lens:?} qsl {qsl:?} hq {hq} group {group} {shape:?} target {target} {mode:?} cap {capacity}: {plan:?}");
    let ctx = if ctx.len() > 2000 { format!("{}...", &ctx[..2000]) } else { ctx };
    let lens: Vec<u32> = seq_lens.iter().map(|&l| l as u32).collect();
    let q_lens = q_lens_of(qsl);
    let tiles_of = |q: u32| (q * group).div_ceil(shape.block_m);

    // Rows per CTA and the row tiles of the request with the most rows.
    let row_tiles = tiles_of(q_lens.iter().copied().max().unwrap()).max(1);
    assert_eq!((plan.rows_per_cta, plan.row_groups), (shape.block_m, row_tiles), "{ctx}");

    // Chunk: the split planner's, doubled until the partials fit.
    let forced = match mode {
        SplitMode::Auto => None,
        SplitMode::Fixed(n) => Some(n),
    };
    let base = plan_chunk(&lens, shape.ctas_per_item * row_tiles, target, shape.block_n, MIN_CHUNK, forced);
    assert!(plan.chunk >= base && plan.chunk.is_multiple_of(base) && (plan.chunk / base).is_power_of_two(), "{ctx}: base chunk {base}");
    let (need, most) = partial_need(&lens, &q_lens, hq, plan.chunk);
    assert!(need <= capacity && most <= 0xffff, "{ctx}: needs {need} rows, {most} splits");
    if plan.chunk > base {
        let (need, most) = partial_need(&lens, &q_lens, hq, plan.chunk / 2);
        assert!(need > capacity || most > 0xffff, "{ctx}: half the chunk would fit too");
    }

    // Per request: splits, partial bases, work items (row tile by row tile), token -> request.
    assert_eq!(plan.req_num_splits.len(), lens.len(), "{ctx}");
    let mut base_rows = 0usize;
    let mut items = Vec::new();
    let mut token_request = Vec::new();
    for (r, (&len, &q)) in lens.iter().zip(&q_lens).enumerate() {
        let splits = plan.req_num_splits[r];
        assert_eq!(splits, num_splits(len, plan.chunk), "{ctx}: request {r}");
        if len == 0 {
            assert_eq!(splits, 1, "{ctx}: an empty request has one split");
        }
        assert_eq!(plan.req_partial_base[r] as usize, base_rows, "{ctx}: request {r}");
        if splits > 1 {
            base_rows += (splits * q) as usize * hq;
        }
        for tile in 0..tiles_of(q) {
            items.extend((0..splits).flat_map(|s| [r as u32, tile << 16 | s]));
        }
        token_request.extend(std::iter::repeat_n(r as u32, q as usize));
    }
    assert_eq!(plan.partial_rows, base_rows, "{ctx}");
    assert!(plan.partial_rows <= capacity, "{ctx}");
    assert_eq!(plan.items, items, "{ctx}");
    assert_eq!(plan.token_request, token_request, "{ctx}");
    assert_eq!(plan.token_request.len(), *qsl.last().unwrap() as usize, "{ctx}");
    assert_eq!(plan.needs_merge(), plan.req_num_splits.iter().any(|&s| s > 1), "{ctx}");
}

#[test]
fn plan_decode_tc_random_batches() {
    let mut rng = SmallRng::seed_from_u64(20);
    for _ in 0..300 {
        let num_reqs = rng.random_range(1..40);
        let cap_len = pick(&mut rng, &[8i32, 500, 20_000, 200_000]);
        let mut q_lens = Vec::new();
        let mut seq_lens = Vec::new();
        for _ in 0..num_reqs {
            let q = rng.random_range(1..=MAX_QUERY_LEN);
            q_lens.push(q);
            seq_lens.push(if rng.random_bool(0.1) { 0 } else { rng.random_range(q as i32..=cap_len.max(q as i32)) });
        }
        let qsl = start_locs(&q_lens);
        let hkv = pick(&mut rng, &[1usize, 2, 4, 8]);
        let group = pick(&mut rng, &[1u32, 2, 4, 8]);
        let hq = hkv * group as usize;
        let d = pick(&mut rng, &HEAD_SIZES);
        // The keys-split shape, or the prefill shape for more rows per kv head.
        let keys = q_lens.iter().all(|&q| q as u32 * group <= 16);
        let shape = TcShape::attention(d, d, keys, rng.random_bool(0.5), hkv as u32);
        let target = rng.random_range(1..=4000u64);
        let mode = if rng.random_bool(0.7) { SplitMode::Auto } else { SplitMode::Fixed(rng.random_range(1..=64)) };
        let capacity = pick(&mut rng, &[0usize, 1, 17, 500, 5000, 100_000, usize::MAX]);
        let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
        let plan = plan_decode_tc(&batch, hq, group, shape, target, 0, mode, capacity);
        check_plan(&plan, &seq_lens, &qsl, hq, group, shape, target, mode, capacity);
        if capacity == 0 {
            assert!(plan.req_num_splits.iter().all(|&s| s == 1) && !plan.needs_merge());
        }
    }
}

#[test]
fn plan_decode_tc_small_workspace_forces_bigger_chunks() {
    // 4 requests of 10000 tokens, 8 q heads over 1 kv head, a CTA budget that never binds: the
    // planner's chunk is the minimum (256 -> 40 splits, 4 * 40 * 8 = 1280 partial rows).
    let seq_lens = [10_000; 4];
    let qsl = [0, 1, 2, 3, 4];
    let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
    let shape = keys_shape(1);
    let plan = |cap| plan_decode_tc(&batch, 8, 8, shape, 1 << 30, 0, SplitMode::Auto, cap);
    for (cap, chunk, splits) in [(usize::MAX, 256, 40), (1280, 256, 40), (1279, 512, 20), (320, 1024, 10), (319, 2048, 5), (0, 16384, 1)] {
        let p = plan(cap);
        assert_eq!((p.chunk, p.req_num_splits[0]), (chunk, splits), "capacity {cap}");
        assert_eq!(p.partial_rows, if splits > 1 { 4 * splits as usize * 8 } else { 0 }, "capacity {cap}");
        check_plan(&p, &seq_lens, &qsl, 8, 8, shape, 1 << 30, SplitMode::Auto, cap);
    }
    // A short request (one split) takes no partial rows and does not push the chunk up.
    let seq_lens = [10_000, 100, 10_000, 0];
    let qsl = [0, 2, 3, 11, 12];
    let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
    let shape = keys_shape(2);
    let p = plan_decode_tc(&batch, 4, 2, shape, 1 << 30, 0, SplitMode::Auto, 4000);
    check_plan(&p, &seq_lens, &qsl, 4, 2, shape, 1 << 30, SplitMode::Auto, 4000);
    assert_eq!(p.req_num_splits, [40, 1, 40, 1]);
    assert_eq!(p.req_partial_base, [0, 320, 320, 1600]);
    assert_eq!(p.partial_rows, 40 * 2 * 4 + 40 * 8 * 4);
    assert_eq!(p.token_request, [0, 0, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3]);
    // max_q 8 x group 2 = 16 rows: one row tile of 16.
    assert_eq!((p.rows_per_cta, p.row_groups), (16, 1));
}

#[test]
fn plan_decode_tc_empty_requests_and_fixed_modes() {
    let seq_lens = [0, 0, 5000, 1];
    let qsl = [0, 1, 2, 3, 4];
    let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
    let shape = keys_shape(1);
    for mode in [SplitMode::Auto, SplitMode::Fixed(1), SplitMode::Fixed(4), SplitMode::Fixed(0)] {
        let p = plan_decode_tc(&batch, 2, 2, shape, 1 << 20, 0, mode, usize::MAX);
        check_plan(&p, &seq_lens, &qsl, 2, 2, shape, 1 << 20, mode, usize::MAX);
        assert_eq!((p.req_num_splits[0], p.req_num_splits[1], p.req_num_splits[3]), (1, 1, 1), "{mode:?}");
        match mode {
            SplitMode::Fixed(1) | SplitMode::Fixed(0) => {
                assert!(p.chunk >= 5000 && !p.needs_merge(), "{mode:?}: {p:?}")
            }
            SplitMode::Fixed(4) => assert_eq!(p.req_num_splits[2], 4),
            SplitMode::Auto => {}
            SplitMode::Fixed(_) => unreachable!(),
        }
    }
    // Fixed(1) is the same plan whatever else is in the batch (deterministic mode).
    let single = DecodeBatch { seq_lens: &[5000], query_start_loc: &[0, 1] };
    let alone = plan_decode_tc(&single, 2, 2, shape, 64, 0, SplitMode::Fixed(1), 0);
    let with_others = plan_decode_tc(&batch, 2, 2, shape, 64, 0, SplitMode::Fixed(1), 0);
    assert_eq!((alone.chunk, alone.req_num_splits[0]), (with_others.chunk, with_others.req_num_splits[2]));
    // A batch of only empty requests.
    let empty = DecodeBatch { seq_lens: &[0, 0], query_start_loc: &[0, 1, 2] };
    let p = plan_decode_tc(&empty, 4, 1, keys_shape(4), 1, 0, SplitMode::Auto, 0);
    assert_eq!((p.items.as_slice(), p.req_num_splits.as_slice()), (&[0u32, 0, 1, 0][..], &[1u32, 1][..]));
}

#[test]
fn plan_decode_tc_caps_splits_per_request() {
    // Fixed(200000) over 2M tokens would be 125000 splits of 16 tokens: items hold a 16-bit split
    // index, so the plan doubles the chunk to 32 (62500 splits).
    let seq_lens = [2_000_000, 3];
    let qsl = [0, 1, 2];
    let batch = DecodeBatch { seq_lens: &seq_lens, query_start_loc: &qsl };
    let mode = SplitMode::Fixed(200_000);
    let shape = TcShape { block_m: 16, block_n: 16, ctas_per_item: 1 };
    let p = plan_decode_tc(&batch, 1, 1, shape, 1, 0, mode, usize::MAX);
    check_plan(&p, &seq_lens, &qsl, 1, 1, shape, 1, mode, usize::MAX);
    assert_eq!((p.chunk, p.req_num_splits.as_slice()), (32, &[62_500u32, 1][..]));
}

// ---------------------------------------------------------------------------------------------
// 3. host::decode::validate_batch
// ---------------------------------------------------------------------------------------------

fn refused_arg(r: host::Result<()>) -> &'static str {
    match r {
        Err(AttnError::InvalidArgument { arg, .. }) => arg,
        other => panic!("expected InvalidArgument, got {other:?}"),
    }
}

#[test]
fn validate_batch_refusals() {
    let v = |seq_lens: &[i32], qsl: &[i32], nt: usize, stride: usize| {
        validate_batch(&DecodeBatch { seq_lens, query_start_loc: qsl }, nt, 16, stride)
    };
    // query_start_loc: wrong length, not starting at 0, not ending at num_tokens.
    assert_eq!(refused_arg(v(&[5, 5], &[0, 1], 1, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[5, 5], &[0, 1, 2, 3], 3, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[], &[], 0, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[5, 5], &[1, 2, 3], 3, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[5, 5], &[0, 1, 2], 3, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[5, 5], &[0, 1, 2], 1, 4)), "query_start_loc");
    // 9 or a negative number of query tokens.
    assert_eq!(refused_arg(v(&[20, 5], &[0, 9, 10], 10, 4)), "query_start_loc");
    assert_eq!(refused_arg(v(&[20, 5, 5], &[0, 3, 2, 4], 4, 4)), "query_start_loc");
    // A nonzero length shorter than its queries.
    assert_eq!(refused_arg(v(&[2, 5], &[0, 3, 4], 4, 4)), "seq_lens");
    assert_eq!(refused_arg(v(&[7, 5], &[0, 8, 9], 9, 4)), "seq_lens");
    // More blocks than a block-table row holds.
    assert_eq!(refused_arg(v(&[33], &[0, 1], 1, 2)), "block_table");
    assert_eq!(refused_arg(v(&[5, 1], &[0, 1, 2], 2, 0)), "block_table");

    // Accepted: a len-0 request with one query, 1..=8 queries, rows exactly full, a request
    // with no query tokens (an empty decode: it attends nothing and writes nothing).
    v(&[0, 7, 100, 32], &[0, 1, 4, 12, 13], 13, 7).unwrap();
    v(&[5, 5], &[0, 0, 2], 2, 4).unwrap();
    v(&[8], &[0, 8], 8, 1).unwrap();
    v(&[32], &[0, 1], 1, 2).unwrap();
    v(&[0], &[0, 1], 1, 0).unwrap();
    v(&[], &[0], 0, 0).unwrap();
}

// ---------------------------------------------------------------------------------------------
// 4. attn_math::softmax
// ---------------------------------------------------------------------------------------------

/// Streams base-2 scores in random chunks the way a kernel does: (state, accumulator).
fn stream(rng: &mut SmallRng, scores: &[f32], values: &[[f32; 4]]) -> (OnlineSoftmax, [f32; 4]) {
    let mut st = OnlineSoftmax::EMPTY;
    let mut acc = [0.0f32; 4];
    let mut i = 0;
    while i < scores.len() {
        let end = (i + rng.random_range(1..=32)).min(scores.len());
        let chunk_max = scores[i..end].iter().copied().fold(NEG_INF, f32::max);
        let f = st.rescale_to(chunk_max);
        acc.iter_mut().for_each(|a| *a *= f);
        for (s, v) in scores[i..end].iter().zip(&values[i..end]) {
            let p = st.weight(*s);
            acc.iter_mut().zip(v).for_each(|(a, x)| *a += p * x);
        }
        i = end;
    }
    (st, acc)
}

#[test]
fn online_softmax_streaming_matches_direct() {
    let mut rng = SmallRng::seed_from_u64(40);
    for iter in 0..300 {
        let n = rng.random_range(1..300);
        let spread = pick(&mut rng, &[0.5f32, 5.0, 40.0]);
        let offset = rng.random_range(-100.0f32..100.0);
        let mut scores: Vec<f32> =
            (0..n).map(|_| if rng.random_bool(0.05) { NEG_INF } else { offset + rng.random_range(-spread..spread) }).collect();
        scores[rng.random_range(0..n)] = offset; // at least one finite score
        let values: Vec<[f32; 4]> = (0..n).map(|_| std::array::from_fn(|_| rng.random_range(-1.0..1.0))).collect();

        // Direct f64: lse = ln(sum 2^s), out = sum 2^s v / sum 2^s.
        let m = scores.iter().copied().fold(NEG_INF, f32::max) as f64;
        let w: Vec<f64> = scores.iter().map(|&s| (s as f64 - m).exp2()).collect();
        let sum: f64 = w.iter().sum();
        let lse = (m + sum.log2()) * std::f64::consts::LN_2;
        let out: Vec<f64> = (0..4).map(|k| w.iter().zip(&values).map(|(w, v)| w * v[k] as f64).sum::<f64>() / sum).collect();

        // Two streamed halves, merged.
        let cut = rng.random_range(0..=n);
        let (mut a, acc_a) = stream(&mut rng, &scores[..cut], &values[..cut]);
        let (b, acc_b) = stream(&mut rng, &scores[cut..], &values[cut..]);
        let (fa, fb) = a.merge(b);
        let acc: Vec<f32> = acc_a.iter().zip(&acc_b).map(|(x, y)| x * fa + y * fb).collect();

        let ctx = format!("iter {iter}: n {n} cut {cut} spread {spread} offset {offset}");
        assert_eq!(a.max as f64, m, "{ctx}: max");
        assert_relative_eq!(a.sum as f64, sum, max_relative = 1e-5);
        assert_relative_eq!(a.lse() as f64, lse, epsilon = 1e-5, max_relative = 1e-6);
        for k in 0..4 {
            assert!((acc[k] / a.sum - out[k] as f32).abs() < 1e-5, "{ctx}: out[{k}] {} vs {}", acc[k] / a.sum, out[k]);
        }
        // One stream over everything agrees with the merge.
        let (whole, _) = stream(&mut rng, &scores, &values);
        assert_eq!(whole.max, a.max, "{ctx}");
        assert_relative_eq!(whole.sum, a.sum, max_relative = 1e-5);
    }
}

#[test]
fn online_softmax_empty_states() {
    let mut rng = SmallRng::seed_from_u64(41);
    let scores = [NEG_INF; 20];
    let values = [[1.0f32; 4]; 20];
    let (mut st, acc) = stream(&mut rng, &scores, &values);
    assert_eq!(st.sum, 0.0);
    assert_eq!(st.lse(), f32::NEG_INFINITY);
    assert!(acc.iter().all(|&x| x == 0.0), "{acc:?}");
    assert_eq!(st.merge(OnlineSoftmax::EMPTY), (0.0, 0.0));
    assert_eq!(st.lse(), f32::NEG_INFINITY);
    assert_eq!(OnlineSoftmax::EMPTY.lse(), f32::NEG_INFINITY);
    // Merging into an empty state takes the other unchanged.
    let mut e = OnlineSoftmax::EMPTY;
    let other = OnlineSoftmax { max: 3.0, sum: 2.5 };
    assert_eq!(e.merge(other), (0.0, 1.0));
    assert_eq!((e.max, e.sum), (3.0, 2.5));
    let mut s = other;
    assert_eq!(s.merge(OnlineSoftmax::EMPTY), (1.0, 0.0));
    assert_eq!((s.max, s.sum), (3.0, 2.5));
}

/// ln(sum exp(x)) in f64.
fn logsumexp(xs: &[f64]) -> f64 {
    let m = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if m == f64::NEG_INFINITY {
        return m;
    }
    m + xs.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
}

#[test]
fn combine_lse_matches_logsumexp() {
    let mut rng = SmallRng::seed_from_u64(42);
    for iter in 0..1000 {
        let k = rng.random_range(0..8);
        let lses: Vec<f32> = (0..k).map(|_| if rng.random_bool(0.2) { NEG_INF } else { rng.random_range(-50.0..50.0) }).collect();
        let sink = if rng.random_bool(0.5) { NEG_INF } else { rng.random_range(-50.0..50.0) };
        let (lse, max, sum) = combine_lse(lses.iter().copied(), sink);
        let all: Vec<f64> = lses.iter().chain([&sink]).map(|&x| x as f64).collect();
        let want = logsumexp(&all);
        let weights: Vec<f32> = lses.iter().map(|&l| partial_weight(l, max, sum)).collect();
        let ctx = format!("iter {iter}: lses {lses:?} sink {sink}: ({lse}, {max}, {sum}), weights {weights:?}");
        assert!(!lse.is_nan() && weights.iter().all(|w| !w.is_nan()), "{ctx}");
        if want == f64::NEG_INFINITY {
            assert_eq!(lse, NEG_INF, "{ctx}");
            assert!(weights.iter().all(|&w| w == 0.0), "{ctx}");
            continue;
        }
        assert!((lse as f64 - want).abs() <= 1e-5 * want.abs().max(1.0), "{ctx}: want {want}");
        for (&l, &w) in lses.iter().zip(&weights) {
            assert!((w as f64 - (l as f64 - want).exp()).abs() < 1e-5, "{ctx}");
        }
        let total = weights.iter().map(|&w| w as f64).sum::<f64>() + (sink as f64 - want).exp();
        assert!((total - 1.0).abs() < 1e-5, "{ctx}: weights and sink sum to {total}");
    }
}

#[test]
fn combine_lse_edge_cases() {
    let (lse, max, sum) = combine_lse([NEG_INF, NEG_INF].into_iter(), NEG_INF);
    assert_eq!((lse, max, sum), (NEG_INF, 0.0, 0.0));
    assert_eq!(partial_weight(NEG_INF, max, sum), 0.0);
    assert_eq!(combine_lse(std::iter::empty(), NEG_INF).0, NEG_INF);
    // Only the sink: the LSE is the sink, partials weigh nothing.
    let (lse, max, sum) = combine_lse([NEG_INF].into_iter(), 2.5);
    assert_eq!(lse, 2.5);
    assert_eq!(partial_weight(NEG_INF, max, sum), 0.0);
    // One partial, no sink: its LSE and weight 1.
    let (lse, max, sum) = combine_lse([-7.25f32].into_iter(), NEG_INF);
    assert_eq!(lse, -7.25);
    assert_eq!(partial_weight(-7.25, max, sum), 1.0);
    // Two equal partials: + ln 2, weights 1/2.
    let (lse, max, sum) = combine_lse([1.0f32, 1.0].into_iter(), NEG_INF);
    assert_relative_eq!(lse, 1.0 + std::f32::consts::LN_2, max_relative = 1e-6);
    assert_relative_eq!(partial_weight(1.0, max, sum), 0.5, max_relative = 1e-6);
}

// ---------------------------------------------------------------------------------------------
// 5. cpu::paged_decode
// ---------------------------------------------------------------------------------------------

const BLOCK: usize = 16;

/// Requests' K/V in a FlashNhd cache of 16-token blocks, each request's blocks drawn from a
/// shuffled pool (with spare blocks); every element random in [-1, 1).
struct Paged<C> {
    spec: KvCacheSpec,
    cache: Vec<C>,
    block_table: Vec<i32>,
    stride: usize,
    seq_lens: Vec<i32>,
}

impl<C: Element> Paged<C> {
    fn new(rng: &mut SmallRng, lens: &[usize], num_kv_heads: usize, head_size: usize) -> Self {
        let need: Vec<usize> = lens.iter().map(|l| l.div_ceil(BLOCK)).collect();
        let num_blocks = need.iter().sum::<usize>() + 3;
        let stride = need.iter().copied().max().unwrap_or(0) + 1;
        let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, BLOCK, num_kv_heads, head_size).unwrap();
        let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
        pool.shuffle(rng);
        let mut pool = pool.into_iter();
        let mut block_table = vec![-1; lens.len() * stride]; // unused entries: never read
        for (r, &n) in need.iter().enumerate() {
            for i in 0..n {
                block_table[r * stride + i] = pool.next().unwrap();
            }
        }
        let cache = (0..spec.num_elements()).map(|_| C::from_f32(rng.random_range(-1.0..1.0))).collect();
        Paged { spec, cache, block_table, stride, seq_lens: lens.iter().map(|&l| l as i32).collect() }
    }

    fn addr(&self, plane: usize, r: usize, t: usize, h: usize, dim: usize) -> usize {
        let block = self.block_table[r * self.stride + t / BLOCK];
        assert!(block >= 0);
        self.spec.offset(plane, block as usize, t % BLOCK, h, dim)
    }

    /// K (plane 0) or V (plane 1) of token `t` of request `r`, kv head `h`, as stored.
    fn row(&self, plane: usize, r: usize, t: usize, h: usize) -> Vec<f64> {
        (0..self.spec.head_size).map(|dim| self.cache[self.addr(plane, r, t, h, dim)].to_f32() as f64).collect()
    }

    fn randomize(&mut self, rng: &mut SmallRng, r: usize, t: usize) {
        for plane in 0..2 {
            for h in 0..self.spec.num_kv_heads {
                for dim in 0..self.spec.head_size {
                    let at = self.addr(plane, r, t, h, dim);
                    self.cache[at] = C::from_f32(rng.random_range(-1.0..1.0));
                }
            }
        }
    }
}

fn random_q<Q: Element>(rng: &mut SmallRng, n: usize, amp: f32) -> Vec<Q> {
    (0..n).map(|_| Q::from_f32(rng.random_range(-amp..amp))).collect()
}

fn q_row<Q: Element>(q: &[Q], rows: &RowsDesc, token: usize, h: usize) -> Vec<f64> {
    (0..rows.head_size).map(|dim| q[rows.offset(token, h, dim)].to_f32() as f64).collect()
}

struct Call<'a> {
    q_lens: &'a [usize],
    num_q_heads: usize,
    opts: AttnOptions,
    alibi: Option<&'a [f32]>,
    sinks: Option<&'a [f32]>,
    scales: Option<(f32, f32)>,
}

impl<'a> Call<'a> {
    fn new(q_lens: &'a [usize], num_q_heads: usize, head_size: usize) -> Self {
        Call { q_lens, num_q_heads, opts: AttnOptions::new(head_size), alibi: None, sinks: None, scales: None }
    }

    fn rows(&self, head_size: usize) -> RowsDesc {
        RowsDesc::contiguous(self.q_lens.iter().sum(), self.num_q_heads, head_size)
    }

    fn run<Q: Element, C: Element>(&self, p: &Paged<C>, q: &[Q]) -> DecodeResult {
        let qsl = start_locs(self.q_lens);
        let res = cpu::paged_decode(&DecodeRef {
            q,
            q_rows: self.rows(p.spec.head_size),
            cache: &p.cache,
            spec: p.spec,
            block_table: &p.block_table,
            block_table_stride: p.stride,
            batch: DecodeBatch { seq_lens: &p.seq_lens, query_start_loc: &qsl },
            opts: self.opts,
            alibi_slopes: self.alibi,
            sinks: self.sinks,
            scales: self.scales,
        })
        .unwrap();
        assert_eq!(res.bad_blocks, 0);
        assert!(res.out.iter().all(|x| x.is_finite()) && res.lse.iter().all(|x| !x.is_nan()));
        res
    }
}

fn dot(a: &[f64], b: &[f64]) -> f64 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// Softmax attention in f64, written out: (sum_i e^(l_i - m) v_i / Z, m + ln Z) with
/// Z = sum_i e^(l_i - m) + e^(sink - m); no keys and no sink give (0, -inf).
fn attend(logits: &[f64], values: &[Vec<f64>], sink: f64, head_size: usize) -> (Vec<f64>, f64) {
    let m = logits.iter().copied().fold(sink, f64::max);
    if m == f64::NEG_INFINITY {
        return (vec![0.0; head_size], f64::NEG_INFINITY);
    }
    let e: Vec<f64> = logits.iter().map(|l| (l - m).exp()).collect();
    let z = e.iter().sum::<f64>() + (sink - m).exp();
    let mut out = vec![0.0; head_size];
    for (w, v) in e.iter().zip(values) {
        for (o, x) in out.iter_mut().zip(v) {
            *o += w * x;
        }
    }
    out.iter_mut().for_each(|o| *o /= z);
    (out, m + z.ln())
}

/// [`attend`] for query `q` over keys `ts` of request `r`, kv head `kvh` (plain scaled dot
/// products).
fn attend_keys<C: Element>(p: &Paged<C>, r: usize, kvh: usize, q: &[f64], ts: std::ops::Range<usize>, scale: f64) -> (Vec<f64>, f64) {
    let logits: Vec<f64> = ts.clone().map(|t| scale * dot(q, &p.row(0, r, t, kvh))).collect();
    let values: Vec<Vec<f64>> = ts.map(|t| p.row(1, r, t, kvh)).collect();
    attend(&logits, &values, f64::NEG_INFINITY, p.spec.head_size)
}

/// `|got - want| <= tol * max(1e-300, max |want|)` elementwise.
fn assert_close(got: &[f64], want: &[f64], tol: f64, ctx: &str) {
    assert_eq!(got.len(), want.len(), "{ctx}");
    let norm = want.iter().fold(1e-300f64, |m, x| m.max(x.abs()));
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!((g - w).abs() <= tol * norm, "{ctx}: [{i}] {g} vs {w} (scale {norm})");
    }
}

fn assert_lse_close(got: f64, want: f64, tol: f64, ctx: &str) {
    if want == f64::NEG_INFINITY {
        assert_eq!(got, want, "{ctx}: lse");
    } else {
        assert!((got - want).abs() <= tol * want.abs().max(1.0), "{ctx}: lse {got} vs {want}");
    }
}

fn out_row(res: &DecodeResult, token: usize, h: usize, num_q_heads: usize, d: usize) -> &[f64] {
    &res.out[(token * num_q_heads + h) * d..(token * num_q_heads + h + 1) * d]
}

#[test]
fn single_key_gives_its_value() {
    let mut rng = SmallRng::seed_from_u64(50);
    let (hq, hkv, d) = (4, 2, 64);
    let call = Call::new(&[1], hq, d);
    let scale = call.opts.softmax_scale as f64;

    // f32 cache, no scales: out = V exactly, lse = the logit.
    let p = Paged::<f32>::new(&mut rng, &[1], hkv, d);
    let q: Vec<f32> = random_q(&mut rng, hq * d, 2.0);
    let res = call.run(&p, &q);
    let rows = call.rows(d);
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        assert_eq!(out_row(&res, 0, h, hq, d), p.row(1, 0, 0, kvh).as_slice(), "head {h}");
        assert_relative_eq!(res.lse[h], scale * dot(&q_row(&q, &rows, 0, h), &p.row(0, 0, 0, kvh)), max_relative = 1e-12);
    }

    // FP8 cache with scales: out = v_scale * V, lse = k_scale * the logit.
    let p = Paged::<Fp8E4m3>::new(&mut rng, &[1], hkv, d);
    let q: Vec<bf16> = random_q(&mut rng, hq * d, 2.0);
    let call = Call { scales: Some((0.5, 3.0)), ..Call::new(&[1], hq, d) };
    let res = call.run(&p, &q);
    for h in 0..hq {
        let kvh = h / (hq / hkv);
        let want: Vec<f64> = p.row(1, 0, 0, kvh).iter().map(|v| v * 3.0).collect();
        assert_close(out_row(&res, 0, h, hq, d), &want, 1e-15, &format!("fp8 head {h}"));
        let logit = 0.5 * scale * dot(&q_row(&q, &rows, 0, h), &p.row(0, 0, 0, kvh));
        assert_relative_eq!(res.lse[h], logit, max_relative = 1e-12);
    }
}

#[test]
fn context_parallel_halves_merge_to_the_whole() {
    let mut rng = SmallRng::seed_from_u64(51);
    for iter in 0..12 {
        let (hq, hkv) = pick(&mut rng, &[(4, 2), (2, 1), (4, 4)]);
        let d = pick(&mut rng, &[64, 128]);
        let len = rng.random_range(1..200);
        let p = Paged::<bf16>::new(&mut rng, &[len], hkv, d);
        let q: Vec<bf16> = random_q(&mut rng, hq * d, 3.0); // peaky enough to matter
        let call = Call::new(&[1], hq, d);
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        for h in 0..hq {
            let kvh = h / (hq / hkv);
            let qh = q_row(&q, &rows, 0, h);
            let split = rng.random_range(0..=len);
            let ctx = format!("iter {iter}: len {len} split {split} hq {hq} hkv {hkv} d {d} head {h}");
            let (full, full_lse) = attend_keys(&p, 0, kvh, &qh, 0..len, scale);
            let (a, a_lse) = attend_keys(&p, 0, kvh, &qh, 0..split, scale);
            let (b, b_lse) = attend_keys(&p, 0, kvh, &qh, split..len, scale);
            let (merged, merged_lse) = cpu::merge_states_row(&a, a_lse, &b, b_lse);
            assert_close(&merged, &full, 1e-9, &format!("{ctx}: merge vs whole"));
            assert_lse_close(merged_lse, full_lse, 1e-9, &format!("{ctx}: merge vs whole"));
            assert_close(out_row(&res, 0, h, hq, d), &full, 1e-9, &format!("{ctx}: cpu::paged_decode vs whole"));
            assert_lse_close(res.lse[h], full_lse, 1e-9, &format!("{ctx}: cpu::paged_decode vs whole"));
        }
    }
}

#[test]
fn sinks_scale_the_output_down_and_raise_the_lse() {
    let mut rng = SmallRng::seed_from_u64(52);
    let (hq, hkv, d) = (4, 2, 64);
    let lens = [120, 7];
    let q_lens = [3, 1];
    let p = Paged::<f32>::new(&mut rng, &lens, hkv, d);
    let nt: usize = q_lens.iter().sum();
    let q: Vec<f32> = random_q(&mut rng, nt * hq * d, 2.0);
    let sinks = [-2.0f32, 0.5, 3.0, 30.0];
    let plain = Call::new(&q_lens, hq, d).run(&p, &q);
    let with = Call { sinks: Some(&sinks), ..Call::new(&q_lens, hq, d) }.run(&p, &q);
    for token in 0..nt {
        for (h, &sink) in sinks.iter().enumerate() {
            let ctx = format!("token {token} head {h}");
            let (lse, lse_s) = (plain.lse[token * hq + h], with.lse[token * hq + h]);
            assert!(lse_s > lse, "{ctx}: {lse_s} <= {lse}");
            assert_relative_eq!(lse_s, logsumexp(&[lse, sink as f64]), max_relative = 1e-12);
            let (o, o_s) = (out_row(&plain, token, h, hq, d), out_row(&with, token, h, hq, d));
            let want: Vec<f64> = o.iter().map(|x| x * (lse - lse_s).exp()).collect();
            assert_close(o_s, &want, 1e-12, &ctx);
            let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!(norm(o_s) < norm(o), "{ctx}: {} >= {}", norm(o_s), norm(o));
        }
    }
}

#[test]
fn window_hides_older_keys() {
    let mut rng = SmallRng::seed_from_u64(53);
    let (hq, hkv, d) = (2, 1, 64);
    for iter in 0..10 {
        let q_len = rng.random_range(1..=4);
        let len = rng.random_range(q_len + 1..180);
        let window = rng.random_range(1..=len as u32 + 5);
        let mut p = Paged::<bf16>::new(&mut rng, &[len], hkv, d);
        let q: Vec<bf16> = random_q(&mut rng, q_len * hq * d, 2.0);
        let q_lens = [q_len];
        let call = Call { opts: AttnOptions { window: Some(window), ..AttnOptions::new(d) }, ..Call::new(&q_lens, hq, d) };
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let ctx = format!("iter {iter}: len {len} q_len {q_len} window {window}");
        let before = call.run(&p, &q);

        // Each query token j at position pos = len - q_len + j sees keys [pos - W + 1, pos].
        let first_of = |j: usize| (len - q_len + j + 1).saturating_sub(window as usize);
        for j in 0..q_len {
            let pos = len - q_len + j;
            for h in 0..hq {
                let (want, want_lse) = attend_keys(&p, 0, h / (hq / hkv), &q_row(&q, &rows, j, h), first_of(j)..pos + 1, scale);
                assert_close(out_row(&before, j, h, hq, d), &want, 1e-9, &format!("{ctx}: token {j} head {h}"));
                assert_lse_close(before.lse[j * hq + h], want_lse, 1e-9, &format!("{ctx}: token {j} head {h}"));
            }
        }

        // Keys older than every token's window: new values change nothing.
        for t in 0..first_of(0) {
            p.randomize(&mut rng, 0, t);
        }
        let after = call.run(&p, &q);
        assert_eq!(before.out, after.out, "{ctx}");
        assert_eq!(before.lse, after.lse, "{ctx}");

        // The first key of token 0's window matters to token 0 only (if token 1 exists, its
        // window starts one later), unless the window reaches the start of the context.
        if len - q_len + 1 > window as usize {
            let t = first_of(0);
            p.randomize(&mut rng, 0, t);
            let changed = call.run(&p, &q);
            let tok = |res: &DecodeResult, j: usize| res.out[j * hq * d..(j + 1) * hq * d].to_vec();
            assert_ne!(tok(&changed, 0), tok(&after, 0), "{ctx}: key {t} is in token 0's window");
            for j in 1..q_len {
                assert_eq!(tok(&changed, j), tok(&after, j), "{ctx}: key {t} is outside token {j}'s window");
            }
        }
    }
}

#[test]
fn empty_context_gives_zero_and_neg_inf() {
    let mut rng = SmallRng::seed_from_u64(54);
    let (hq, hkv, d) = (4, 2, 128);
    let lens = [0, 40, 0];
    let q_lens = [1, 2, 1];
    let p = Paged::<bf16>::new(&mut rng, &lens, hkv, d);
    let nt: usize = q_lens.iter().sum();
    let q: Vec<bf16> = random_q(&mut rng, nt * hq * d, 1.0);
    let sinks = [0.25f32, -3.0, 7.5, -0.0];
    for sinks in [None, Some(&sinks[..])] {
        let res = Call { sinks, ..Call::new(&q_lens, hq, d) }.run(&p, &q);
        for token in [0, 3] {
            for h in 0..hq {
                assert!(out_row(&res, token, h, hq, d).iter().all(|&x| x == 0.0), "token {token} head {h}");
                let want = sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                assert_eq!(res.lse[token * hq + h], want, "token {token} head {h} sinks {sinks:?}");
            }
        }
        // The non-empty request attends as if alone.
        let mut alone = Paged::<bf16>::new(&mut rng, &[40], hkv, d);
        for t in 0..40 {
            for plane in 0..2 {
                for h in 0..hkv {
                    for dim in 0..d {
                        let (dst, src) = (alone.addr(plane, 0, t, h, dim), p.addr(plane, 1, t, h, dim));
                        alone.cache[dst] = p.cache[src];
                    }
                }
            }
        }
        let res1 = Call { sinks, ..Call::new(&[2], hq, d) }.run(&alone, &q[hq * d..3 * hq * d]);
        assert_eq!(res1.out, res.out[hq * d..3 * hq * d]);
        assert_eq!(res1.lse, res.lse[hq..3 * hq]);
    }
}

#[test]
fn gqa_query_heads_read_their_kv_head() {
    let mut rng = SmallRng::seed_from_u64(55);
    for (hq, hkv) in [(8, 2), (6, 3), (4, 4), (4, 1)] {
        let group = hq / hkv;
        let d = 64;
        let len = 50;
        let p = Paged::<f32>::new(&mut rng, &[len], hkv, d);
        // Every query head gets the same vector: outputs can differ only through the kv head.
        let one: Vec<f32> = random_q(&mut rng, d, 3.0);
        let q: Vec<f32> = (0..hq).flat_map(|_| one.iter().copied()).collect();
        let call = Call::new(&[1], hq, d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        let qh: Vec<f64> = one.iter().map(|&x| x as f64).collect();
        let per_kv: Vec<(Vec<f64>, f64)> = (0..hkv).map(|kvh| attend_keys(&p, 0, kvh, &qh, 0..len, scale)).collect();
        for h in 0..hq {
            let ctx = format!("hq {hq} hkv {hkv} head {h}");
            let got = out_row(&res, 0, h, hq, d);
            assert_close(got, &per_kv[h / group].0, 1e-9, &ctx);
            assert_lse_close(res.lse[h], per_kv[h / group].1, 1e-9, &ctx);
            assert_eq!(got, out_row(&res, 0, (h / group) * group, hq, d), "{ctx}: same group, same output");
            for (kvh, (other, _)) in per_kv.iter().enumerate().filter(|(k, _)| *k != h / group) {
                // `f64::max` drops a NaN: check for one first, so that a NaN output fails.
                assert!(got.iter().chain(other).all(|x| !x.is_nan()), "{ctx}: a NaN output");
                let diff = got.iter().zip(other).fold(0.0f64, |m, (a, b)| m.max((a - b).abs()));
                assert!(diff > 1e-3, "{ctx}: output matches kv head {kvh} too");
            }
        }
    }
}

#[test]
fn batch_matches_explicit_attention() {
    // Several requests, 1..=8 causal query tokens each, soft-cap and ALiBi: every (token, head)
    // against the explicit f64 attention over its visible keys.
    let mut rng = SmallRng::seed_from_u64(56);
    for iter in 0..4 {
        let (hq, hkv, d) = (4, 2, 64);
        let num_reqs = rng.random_range(1..5);
        let q_lens: Vec<usize> = (0..num_reqs).map(|_| rng.random_range(1..=MAX_QUERY_LEN)).collect();
        let lens: Vec<usize> = q_lens.iter().map(|&q| if rng.random_bool(0.15) { 0 } else { rng.random_range(q..150) }).collect();
        let p = Paged::<bf16>::new(&mut rng, &lens, hkv, d);
        let nt: usize = q_lens.iter().sum();
        let q: Vec<bf16> = random_q(&mut rng, nt * hq * d, 3.0);
        let softcap = if iter % 2 == 1 { Some(5.0f32) } else { None };
        let slopes: Vec<f32> = (0..hq).map(|h| 0.5f32.powi(h as i32 + 1)).collect();
        let alibi = if iter >= 2 { Some(slopes.as_slice()) } else { None };
        let call = Call { opts: AttnOptions { softcap, ..AttnOptions::new(d) }, alibi, ..Call::new(&q_lens, hq, d) };
        let rows = call.rows(d);
        let scale = call.opts.softmax_scale as f64;
        let res = call.run(&p, &q);
        let mut token = 0;
        for r in 0..num_reqs {
            for j in 0..q_lens[r] {
                let pos = (lens[r] + j).saturating_sub(q_lens[r]);
                for h in 0..hq {
                    let kvh = h / (hq / hkv);
                    let qh = q_row(&q, &rows, token, h);
                    let keys = 0..lens[r].min(pos + 1);
                    let logits: Vec<f64> = keys
                        .clone()
                        .map(|t| {
                            let mut l = scale * dot(&qh, &p.row(0, r, t, kvh));
                            if let Some(c) = softcap {
                                l = c as f64 * (l / c as f64).tanh();
                            }
                            l + alibi.map_or(0.0, |s| s[h] as f64 * (t as f64 - pos as f64))
                        })
                        .collect();
                    let values: Vec<Vec<f64>> = keys.map(|t| p.row(1, r, t, kvh)).collect();
                    let (want, want_lse) = attend(&logits, &values, f64::NEG_INFINITY, d);
                    let ctx = format!("iter {iter}: request {r} (len {}, q {}) token {j} head {h}", lens[r], q_lens[r]);
                    assert_close(out_row(&res, token, h, hq, d), &want, 1e-9, &ctx);
                    assert_lse_close(res.lse[token * hq + h], want_lse, 1e-9, &ctx);
                }
                token += 1;
            }
        }
    }
}

#[test]
fn cpu_decode_refuses_invalid_batches() {
    let mut rng = SmallRng::seed_from_u64(57);
    let p = Paged::<f32>::new(&mut rng, &[40], 1, 64);
    let q: Vec<f32> = random_q(&mut rng, 9 * 64, 1.0);
    let call = |seq_lens: &[i32], qsl: &[i32], stride: usize| {
        cpu::paged_decode(&DecodeRef {
            q: &q,
            q_rows: RowsDesc::contiguous(*qsl.last().unwrap() as usize, 1, 64),
            cache: &p.cache,
            spec: p.spec,
            block_table: &p.block_table,
            block_table_stride: stride,
            batch: DecodeBatch { seq_lens, query_start_loc: qsl },
            opts: AttnOptions::new(64),
            alibi_slopes: None,
            sinks: None,
            scales: None,
        })
        .map(|_| ())
    };
    assert_eq!(refused_arg(call(&[40], &[0, 9], p.stride)), "query_start_loc");
    assert_eq!(refused_arg(call(&[40], &[0, 1], 2)), "block_table");
    assert_eq!(refused_arg(call(&[2], &[0, 3], p.stride)), "seq_lens");
    call(&[40], &[0, 8], p.stride).unwrap();
}

// ---------------------------------------------------------------------------------------------
// The long-context masking inputs of the GPU tests (`common::masking`)
// ---------------------------------------------------------------------------------------------

#[allow(dead_code)]
#[path = "common/compare.rs"]
mod compare;
#[allow(dead_code)]
#[path = "common/masking.rs"]
mod masking;

/// The reference over packed keys (`keys` rows; the first `seq_len` are the sequence) for the
/// last `q_len` positions, under `window`.
fn packed_reference(
    q: &[bf16],
    q_rows: RowsDesc,
    k: &[bf16],
    v: &[bf16],
    kv_rows: RowsDesc,
    seq_len: usize,
    window: usize,
) -> DecodeResult {
    let mut opts = AttnOptions::new(q_rows.head_size);
    opts.window = Some(window as u32);
    cpu::prefill(&cpu::PrefillRef {
        q,
        q_rows,
        kv: cpu::KvRef::Packed { k, k_rows: kv_rows, v, v_rows: kv_rows, key_start_loc: &[0, kv_rows.num_tokens as i32] },
        head_size_v: q_rows.head_size,
        query_start_loc: &[0, q_rows.num_tokens as i32],
        seq_lens: &[seq_len as i32],
        causal: true,
        opts,
        alibi_slopes: None,
        sinks: None,
        scales: None,
    })
    .unwrap()
}

/// With the planted inputs, a kernel whose mask is one key off at either edge moves every row
/// far past the per-row tolerance: the reference with the window one key wider (the key just
/// outside it admitted) or narrower (its first key dropped), and with every query one position
/// later (the next token's key admitted; not the last token, whose next key does not exist)
/// or earlier (its own key dropped), the window's first key kept, differs from the true one by
/// at least 5x the bf16 row tolerance in every row. The GPU cases' shapes (query tokens,
/// window, head size) on one head (a group's heads share their queries), the prefill chunks
/// under windows a little longer than the chunk to keep this quick: the chunk's query count
/// sets how many planted keys a row sees, while a window's random keys add only about 1/300
/// of the two dominant keys' weight per 1000 keys, which the 9000-key window covers.
#[test]
fn edge_markers_make_one_key_masking_errors_visible_in_every_row() {
    let mut rng = SmallRng::seed_from_u64(58);
    let floor = 5.0 * compare::row_tolerance(host::DType::BF16);
    let shapes =
        [(1, 4093, 128), (4, 3001, 128), (3, 9000, 128), (2, 5003, 128), (1, 2050, 64), (128, 181, 64), (200, 257, 64), (96, 150, 128)];
    for (q_len, window, d) in shapes {
        // Only the window's keys enter the reference: a shorter sequence than the GPU cases'
        // 20000 keys gives the same rows.
        let seq_len = window + q_len + 100;
        let q_rows = RowsDesc::contiguous(q_len, 1, d);
        // One key past the sequence, for the queries moved one position later.
        let kv_rows = RowsDesc::contiguous(seq_len + 1, 1, d);
        let mut q: Vec<bf16> = random_q(&mut rng, q_rows.required_len(), 1.0);
        let mut k: Vec<bf16> = random_q(&mut rng, kv_rows.required_len(), 1.0);
        let v: Vec<bf16> = random_q(&mut rng, kv_rows.required_len(), 1.0);
        let m = masking::MarkedRequest { q0: 0, q_len, seq_len, window, num_kv_heads: 1, softmax_scale: AttnOptions::new(d).softmax_scale };
        masking::plant_edge_markers(&mut rng, &m, &mut q, q_rows, &mut k, |pos, kvh, x| kv_rows.offset(pos, kvh, x));
        let run = |len: usize, w: usize| packed_reference(&q, q_rows, &k, &v, kv_rows, len, w);
        let base = run(seq_len, window);
        for (what, off, rows) in [
            ("window one key wider", run(seq_len, window + 1), q_len),
            ("window one key narrower", run(seq_len, window - 1), q_len),
            ("diagonal one key later", run(seq_len + 1, window + 1), q_len - 1),
            ("diagonal one key earlier", run(seq_len - 1, window - 1), q_len),
        ] {
            let n = rows * d;
            let least = compare::row_errors(&off.out[..n], &base.out[..n], d).fold(f64::INFINITY, f64::min);
            assert!(least >= floor, "q_len {q_len}, window {window}, d {d}: {what} moves a row by only {least:.2e}");
        }
    }
}
