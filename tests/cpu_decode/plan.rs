//! `attn_rs::decode::plan_decode_tc` on random batches, small workspaces, empty requests, fixed
//! modes and the split cap; `attn_rs::decode::validate_batch`'s refusals.

use crate::{pick, refused_arg, start_locs};
use attn_math::decode::HEAD_SIZES;
use attn_math::split::{num_splits, plan_chunk};
use attn_rs::decode::{plan_decode_tc, validate_batch, DecodeBatch, DecodePlan, TcShape, MAX_QUERY_LEN};
use attn_rs::SplitMode;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Mirrors `attn_rs::decode`'s private planning constant (smallest auto chunk).
const MIN_CHUNK: u32 = 256;

fn q_lens_of(qsl: &[i32]) -> Vec<u32> {
    qsl.windows(2).map(|w| (w[1] - w[0]) as u32).collect()
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
        let plan = plan_decode_tc(&batch, hq, group, shape, target, 0, None, mode, capacity);
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
    let plan = |cap| plan_decode_tc(&batch, 8, 8, shape, 1 << 30, 0, None, SplitMode::Auto, cap);
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
    let p = plan_decode_tc(&batch, 4, 2, shape, 1 << 30, 0, None, SplitMode::Auto, 4000);
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
        let p = plan_decode_tc(&batch, 2, 2, shape, 1 << 20, 0, None, mode, usize::MAX);
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
    let alone = plan_decode_tc(&single, 2, 2, shape, 64, 0, None, SplitMode::Fixed(1), 0);
    let with_others = plan_decode_tc(&batch, 2, 2, shape, 64, 0, None, SplitMode::Fixed(1), 0);
    assert_eq!((alone.chunk, alone.req_num_splits[0]), (with_others.chunk, with_others.req_num_splits[2]));
    // A batch of only empty requests.
    let empty = DecodeBatch { seq_lens: &[0, 0], query_start_loc: &[0, 1, 2] };
    let p = plan_decode_tc(&empty, 4, 1, keys_shape(4), 1, 0, None, SplitMode::Auto, 0);
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
    let p = plan_decode_tc(&batch, 1, 1, shape, 1, 0, None, mode, usize::MAX);
    check_plan(&p, &seq_lens, &qsl, 1, 1, shape, 1, mode, usize::MAX);
    assert_eq!((p.chunk, p.req_num_splits.as_slice()), (32, &[62_500u32, 1][..]));
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

/// The chunk cap (`TcKernel::max_chunk`, 16-bit NHD rows that are not whole 128-byte lines):
/// splits of at most `cap` keys under `Auto`, but never more than four splits of the longest
/// request (what `TcKernel::max_items` allows for) and never under 256 keys; fixed modes ignore it.
#[test]
fn plan_decode_tc_caps_the_chunk() {
    let shape = keys_shape(8);
    let plan = |lens: &[i32], cap: Option<u32>, mode: SplitMode| {
        let qsl: Vec<i32> = (0..=lens.len() as i32).collect();
        let batch = DecodeBatch { seq_lens: lens, query_start_loc: &qsl };
        let p = plan_decode_tc(&batch, 32, 4, shape, 528, 0, cap, mode, 1 << 20);
        if cap.is_none() {
            check_plan(&p, lens, &qsl, 32, 4, shape, 528, mode, 1 << 20);
        }
        p
    };
    // 64 x 4096 fills the 528 CTAs with one split each; the cap makes four of 1024.
    let batch = vec![4096; 64];
    assert_eq!(plan(&batch, None, SplitMode::Auto).chunk, 4096);
    let p = plan(&batch, Some(1024), SplitMode::Auto);
    assert_eq!((p.chunk, p.req_num_splits[0]), (1024, 4));
    // 8 x 32768 is split in eight already: the cap would need 32, so the plan stays.
    let long = vec![32768; 8];
    assert_eq!(plan(&long, Some(1024), SplitMode::Auto), plan(&long, None, SplitMode::Auto));
    // 64 x 2048: two splits of 1024; 64 x 600: one split (under the cap already).
    assert_eq!(plan(&vec![2048; 64], Some(1024), SplitMode::Auto).req_num_splits[0], 2);
    assert_eq!(plan(&vec![600; 64], Some(1024), SplitMode::Auto).req_num_splits[0], 1);
    // A cap under a quarter of the longest request gives four splits; fixed modes take no cap.
    assert_eq!(plan(&batch, Some(1), SplitMode::Auto).chunk, 1024);
    assert_eq!(plan(&batch, Some(1024), SplitMode::Fixed(1)).req_num_splits[0], 1);
}
