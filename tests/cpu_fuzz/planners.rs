//! The decode and prefill validators and planners.

use crate::{batch, fuzz, mode, named, plannable, size, valid_tokens, wild_i32, wild_u32, wild_usize};
use attn_math::split::{ctas_for_chunk, even_waves_chunk, num_splits, plan_chunk};
use attn_rs::decode::{plan_decode_tc, validate_batch, DecodeBatch, DecodePlan, TcShape, MAX_QUERY_LEN};
use attn_rs::prefill::{plan_prefill, validate_prefill_batch, PrefillBatch};
use attn_rs::SplitMode;
use rand::Rng;
use std::fmt::Debug;

#[derive(Debug)]
struct DecodeCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    num_tokens: usize,
    block_size: usize,
    stride: usize,
    heads: (usize, usize),
    target: u64,
    mode: SplitMode,
    capacity: usize,
    shape: TcShape,
    group: u32,
    slots: u64,
    max_chunk: Option<u32>,
    groups: u32,
}

/// Work items (`request, row_tile << 16 | split` for `group` query heads per kv head and `bm`
/// rows a tile), splits, partial bases and token requests of a plan within the batch.
fn check_plan(p: &DecodePlan, q_lens: &[u64], num_q_heads: usize, capacity: usize, (group, bm): (u32, u32)) -> Result<(), String> {
    let n = q_lens.len();
    check!(p.req_num_splits.len() == n && p.req_partial_base.len() == n, "{} split counts for {n} requests", p.req_num_splits.len());
    check!(p.token_request.len() as u64 == q_lens.iter().sum::<u64>(), "{} token requests", p.token_request.len());
    check!(p.token_request.iter().all(|&r| (r as usize) < n), "a token of no request");
    check!(p.partial_rows <= capacity && p.partial_rows <= u32::MAX as usize, "{} partial rows, capacity {capacity}", p.partial_rows);
    let mut rows = 0u128;
    for (r, &q) in q_lens.iter().enumerate() {
        let s = p.req_num_splits[r];
        check!((1..=0xffff).contains(&s), "request {r} has {s} splits");
        if s > 1 {
            check!(p.req_partial_base[r] as u128 == rows, "request {r}'s partials start at {}, not {rows}", p.req_partial_base[r]);
            rows += s as u128 * q as u128 * num_q_heads as u128;
        }
    }
    check!(rows == p.partial_rows as u128, "the plan says {} partial rows, its splits need {rows}", p.partial_rows);
    check!(p.items.len().is_multiple_of(2), "odd items");
    for it in p.items.chunks(2) {
        let (r, tile, s) = (it[0] as usize, it[1] >> 16, it[1] & 0xffff);
        check!(r < n && s < p.req_num_splits[r], "item {it:?}");
        let tiles = (q_lens[r] as u128 * group as u128).div_ceil(bm.max(1) as u128);
        check!((tile as u128) < tiles, "item {it:?}: request {r} has {tiles} row tiles");
    }
    Ok(())
}

#[test]
fn decode_validators_and_planners() {
    fuzz(
        "decode",
        3,
        |rng| {
            let (qsl, seq_lens) = batch(rng, 0..=9, 3000);
            let num_tokens = if rng.random_bool(0.9) { qsl.last().map_or(0, |&t| t as usize) } else { wild_usize(rng) };
            let group = [0, 1, 4, 16, 128][rng.random_range(0..5)];
            let shape = TcShape {
                block_m: [0, 1, 16, 64][rng.random_range(0..4)],
                block_n: [0, 16, 64][rng.random_range(0..3)],
                ctas_per_item: wild_u32(rng),
            };
            let hkv = size(rng, 1..5);
            let hq = if rng.random_bool(0.8) { hkv.saturating_mul(rng.random_range(1..5)) } else { wild_usize(rng) };
            DecodeCase {
                qsl,
                seq_lens,
                num_tokens,
                block_size: size(rng, 1..33),
                stride: size(rng, 0..200),
                heads: (hq, hkv),
                target: [0, 1, 132 * 8, u64::MAX][rng.random_range(0..4)],
                mode: mode(rng),
                capacity: if rng.random_bool(0.2) { wild_usize(rng) } else { rng.random_range(0..5000) },
                shape,
                group,
                slots: [0, 1, 264, u64::MAX][rng.random_range(0..4)],
                max_chunk: [None, Some(0), Some(1), Some(1024), Some(u32::MAX)][rng.random_range(0..5)],
                groups: wild_u32(rng),
            }
        },
        |c| {
            let n = c.seq_lens.len();
            let batch = DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &c.qsl };
            let v = validate_batch(&batch, c.num_tokens, c.block_size, c.stride);
            named(&v)?;
            let tokens = valid_tokens(&c.qsl, n);
            let q_lens: Vec<u64> = if tokens.is_some() { c.qsl.windows(2).map(|w| (w[1] - w[0]) as u64).collect() } else { Vec::new() };
            if v.is_ok() {
                check!(tokens == Some(c.num_tokens as u64), "validate took start locations {:?} for {} tokens", c.qsl, c.num_tokens);
                check!(c.block_size > 0 && n < 1 << 16, "validate took block size {} / {n} requests", c.block_size);
                for (r, (&q, &len)) in q_lens.iter().zip(&c.seq_lens).enumerate() {
                    check!(q <= MAX_QUERY_LEN as u64 && len >= 0 && (len == 0 || len as u64 >= q), "validate took request {r}");
                    check!((len as usize).div_ceil(c.block_size) <= c.stride, "validate took request {r} past its block-table row");
                }
            }
            if !plannable(&c.qsl, n) {
                return Ok(());
            }
            let (hq, _hkv) = c.heads;
            // The infallible planners, over batches they can hold in memory.
            let lens_small = c.seq_lens.iter().all(|&l| l <= 1 << 16);
            let forced_small = !matches!(c.mode, SplitMode::Fixed(k) if k > 64);
            if tokens.is_some_and(|t| t <= 64) && lens_small && forced_small && hq <= 1 << 12 {
                let p = plan_decode_tc(&batch, hq, c.group, c.shape, c.target, c.slots, c.max_chunk, c.mode, c.capacity);
                let q: Vec<u64> = q_lens.clone();
                check_plan(&p, &q, hq, c.capacity, (c.group, c.shape.block_m))?;
            }
            // The split math.
            let lens: Vec<u32> = c.seq_lens.iter().map(|&l| l as u32).collect();
            let chunk = plan_chunk(&lens, c.shape.ctas_per_item, c.target, c.shape.block_n, c.shape.block_m, Some(c.groups));
            check!(chunk >= 1, "forced chunk 0");
            let chunk = plan_chunk(&lens, c.shape.ctas_per_item, c.target, c.shape.block_n, c.shape.block_m, None);
            check!(chunk >= 1, "chunk 0");
            let _ = even_waves_chunk(&lens, c.shape.ctas_per_item, c.slots, c.shape.block_n, c.shape.block_m, chunk);
            let _ = ctas_for_chunk(&lens, c.group, c.shape.ctas_per_item);
            check!(lens.iter().all(|&l| num_splits(l, c.group) >= 1), "a request with no split");
            Ok(())
        },
    );
}

#[derive(Debug)]
struct PrefillCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    key_start_loc: Option<Vec<i32>>,
    num_tokens: usize,
    causal: bool,
    paged: Option<(usize, usize)>,
    group: usize,
    block_m: u32,
    window: Option<u32>,
}

#[test]
fn prefill_validators_and_planners() {
    fuzz(
        "prefill",
        4,
        |rng| {
            let (qsl, seq_lens) = batch(rng, 0..=40, 200);
            let key_start_loc = rng.random_bool(0.3).then(|| {
                let mut k = vec![0];
                seq_lens.iter().for_each(|&l| k.push(k.last().copied().unwrap_or(0i32).wrapping_add(l)));
                if rng.random_bool(0.3) {
                    let i = rng.random_range(0..k.len());
                    k[i] = wild_i32(rng);
                }
                k
            });
            PrefillCase {
                num_tokens: if rng.random_bool(0.9) { qsl.last().map_or(0, |&t| t as usize) } else { wild_usize(rng) },
                qsl,
                seq_lens,
                key_start_loc,
                causal: rng.random(),
                paged: rng.random_bool(0.6).then(|| (size(rng, 1..33), size(rng, 0..200))),
                group: size(rng, 1..9),
                block_m: [0, 1, 16, 64, u32::MAX][rng.random_range(0..5)],
                window: rng.random_bool(0.3).then(|| wild_u32(rng)),
            }
        },
        |c| {
            let n = c.seq_lens.len();
            let pb = PrefillBatch { query_start_loc: &c.qsl, seq_lens: &c.seq_lens, key_start_loc: c.key_start_loc.as_deref() };
            let v = validate_prefill_batch(&pb, c.num_tokens, c.causal, c.paged);
            named(&v)?;
            let tokens = valid_tokens(&c.qsl, n);
            if v.is_ok() {
                check!(tokens == Some(c.num_tokens as u64), "validate took start locations {:?} for {} tokens", c.qsl, c.num_tokens);
                for r in 0..n {
                    let (q, len) = (c.qsl[r + 1] as i64 - c.qsl[r] as i64, c.seq_lens[r]);
                    check!(len >= 0 && (!c.causal || len == 0 || len as i64 >= q), "validate took request {r}");
                    if let Some((bs, stride)) = c.paged {
                        check!(bs > 0 && (len as usize).div_ceil(bs) <= stride, "validate took request {r} past its row");
                    }
                    if let Some(k) = &c.key_start_loc {
                        check!(k[r + 1] as i64 - k[r] as i64 == len as i64, "validate took key rows of request {r}");
                    }
                }
            }
            // Planning: bounded tiles only (it allocates one entry per tile).
            let tiles: u128 = (0..n.min(c.qsl.len().saturating_sub(1)))
                .map(|r| {
                    let rows = ((c.qsl[r + 1] as i64 - c.qsl[r] as i64).max(0) as u64).saturating_mul(c.group.max(1) as u64);
                    rows.div_ceil(c.block_m.max(1) as u64).min(1 << 16) as u128
                })
                .sum();
            if tiles <= 1 << 12 {
                let plan = plan_prefill(&pb, c.group, c.causal, c.window, c.block_m);
                check!(plan.items.len() as u128 == tiles, "{} items for {tiles} tiles", plan.items.len());
                let mut seen = std::collections::HashSet::new();
                for &[r, t] in &plan.items {
                    check!((r as usize) < n && t & 0xffff == 0 && seen.insert((r, t)), "item [{r}, {t:#x}]");
                }
            }
            Ok(())
        },
    );
}
