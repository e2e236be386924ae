//! Property checks over random and adversarial inputs: every public validator, planner and
//! metadata builder, the CPU cache writes and `host::forward` on the `cpu` backend get numbers
//! at the edges (i32::MIN/MAX, usize::MAX, strides of 2^62, negative lengths, unsorted start
//! locations, zero sizes, block size 0, no heads, empty batches, huge block counts) mixed into
//! mostly valid inputs. Each must give `Ok` with results in range (checked against sizes
//! recomputed here in u128) or an error naming the argument; a panic is a failure reported with
//! the input that caused it.
//!
//! The inputs are random: the seed is printed, `ATTN_TEST_SEED=<seed>` replays it. Each target
//! runs for its share of `ATTN_FUZZ_SECONDS` (default 20 s for the whole file), at least a few
//! hundred cases. Planners allocate in proportion to the batch's tokens, so batches of more than
//! 2^20 tokens go to the validators only.

use host::attn_math::split::{ctas_for_chunk, even_waves_chunk, num_splits, plan_chunk};
use host::backend::{select_backend_no_env, DeviceInfo, ModelConfig};
use host::decode::{merge_attn_states_sizes, plan_decode_tc, validate_batch, DecodeBatch, DecodePlan, SplitMode, TcShape, MAX_QUERY_LEN};
use host::forward::{Attention, CacheSpec, CpuLayer, ForwardConfig, ForwardLimits, LayerIo, NewKv};
use host::metadata::{
    build_tensor_core_metadata, common_prefix, decode_first_order, pack, split_decodes, use_cascade, validate, CascadeMode, CascadeStep,
    MetadataBuilder, PlanConfig, StagingLayout, StagingSizes, StepInput,
};
use host::prefill::{plan_prefill, validate_prefill_batch, PrefillBatch};
use host::{AttnError, DType, KvCacheSpec, KvLayout, MlaCacheSpec, RowsDesc};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::fmt::Debug;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

// ---------------------------------------------------------------------------------------------
// The runner
// ---------------------------------------------------------------------------------------------

/// Targets (test functions) sharing the time budget.
const TARGETS: u32 = 7;
/// Cases every target runs whatever the budget.
const MIN_CASES: usize = 200;

fn seed() -> u64 {
    static SEED: OnceLock<u64> = OnceLock::new();
    *SEED.get_or_init(|| {
        let s = std::env::var("ATTN_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64);
        eprintln!("random seed: {s} (replay with ATTN_TEST_SEED={s})");
        s
    })
}

/// This target's share of `ATTN_FUZZ_SECONDS` (20 s for the whole file by default).
fn budget() -> Duration {
    let total = std::env::var("ATTN_FUZZ_SECONDS").ok().and_then(|s| s.parse::<f64>().ok()).unwrap_or(20.0).max(0.0);
    Duration::from_secs_f64(total / TARGETS as f64)
}

/// Runs `check` on inputs from `generate` until the budget is spent. A check's `Err` or panic
/// fails the test with the seed, the case and the input.
fn fuzz<I: Debug>(name: &str, salt: u64, generate: impl Fn(&mut SmallRng) -> I, check: impl Fn(&I) -> Result<(), String>) {
    let seed = seed();
    let mut rng = SmallRng::seed_from_u64(seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15));
    let deadline = Instant::now() + budget();
    let mut cases = 0;
    while cases < MIN_CASES || Instant::now() < deadline {
        let input = generate(&mut rng);
        let outcome = catch_unwind(AssertUnwindSafe(|| check(&input)));
        let failure = match outcome {
            Ok(Ok(())) => None,
            Ok(Err(msg)) => Some(msg),
            Err(payload) => {
                let msg = payload.downcast_ref::<String>().cloned().or_else(|| payload.downcast_ref::<&str>().map(|s| s.to_string()));
                Some(format!("panicked: {}", msg.unwrap_or_default()))
            }
        };
        if let Some(msg) = failure {
            panic!("{name}: case {cases} (ATTN_TEST_SEED={seed}): {msg}\ninput: {input:?}");
        }
        cases += 1;
    }
    eprintln!("{name}: {cases} cases");
}

/// `Err(msg)` unless `cond`.
macro_rules! check {
    ($cond:expr, $($msg:tt)+) => {
        if !$cond {
            return Err(format!($($msg)+));
        }
    };
}

/// An error that names an argument (not a panic, not a driver error).
fn named<T>(r: &host::Result<T>) -> Result<(), String> {
    match r {
        Ok(_) | Err(AttnError::InvalidArgument { .. }) | Err(AttnError::UnsupportedDType { .. }) => Ok(()),
        Err(e) => Err(format!("an unnamed error: {e}")),
    }
}

// ---------------------------------------------------------------------------------------------
// Adversarial numbers
// ---------------------------------------------------------------------------------------------

fn wild_usize(rng: &mut SmallRng) -> usize {
    match rng.random_range(0..12) {
        0 => 0,
        1 => usize::MAX,
        2 => 1 << 62,
        3 => (1 << 56) + 1,
        4 => u32::MAX as usize,
        5 => u32::MAX as usize + 1,
        6 => i32::MAX as usize,
        7 => rng.random::<u64>() as usize,
        8 => 1usize << rng.random_range(0..64),
        _ => rng.random_range(0..20),
    }
}

fn wild_i32(rng: &mut SmallRng) -> i32 {
    match rng.random_range(0..9) {
        0 => i32::MIN,
        1 => i32::MAX,
        2 => -1,
        3 => i32::MIN + rng.random_range(0..8),
        4 => i32::MAX - rng.random_range(0..8),
        5 => rng.random(),
        _ => rng.random_range(-4..40),
    }
}

fn wild_u32(rng: &mut SmallRng) -> u32 {
    match rng.random_range(0..6) {
        0 => 0,
        1 => u32::MAX,
        2 => rng.random(),
        _ => rng.random_range(1..300),
    }
}

/// Mostly small, sometimes wild.
fn size(rng: &mut SmallRng, small: std::ops::Range<usize>) -> usize {
    if rng.random_bool(0.15) {
        wild_usize(rng)
    } else {
        rng.random_range(small)
    }
}

fn mode(rng: &mut SmallRng) -> SplitMode {
    match rng.random_range(0..5) {
        0 => SplitMode::Fixed(0),
        1 => SplitMode::Fixed(rng.random_range(1..70)),
        2 => SplitMode::Fixed(1),
        _ => SplitMode::Auto,
    }
}

/// A batch of `n` requests: start locations from query lengths drawn from `q_range`, lengths
/// that hold them plus up to `ctx` keys; then, now and then, a wild value anywhere, a wrong
/// length, or a shuffled entry.
fn batch(rng: &mut SmallRng, q_range: std::ops::RangeInclusive<i32>, ctx: i32) -> (Vec<i32>, Vec<i32>) {
    let n = if rng.random_bool(0.1) { 0 } else { rng.random_range(1..7) };
    let mut qsl = vec![0];
    let mut seq_lens = Vec::new();
    for _ in 0..n {
        let q = rng.random_range(q_range.clone());
        qsl.push(qsl.last().unwrap() + q);
        seq_lens.push(q + rng.random_range(0..=ctx));
    }
    if rng.random_bool(0.3) {
        match rng.random_range(0..5) {
            0 => {
                let i = rng.random_range(0..qsl.len());
                qsl[i] = wild_i32(rng);
            }
            1 if n > 0 => seq_lens[rng.random_range(0..n)] = wild_i32(rng),
            2 => {
                if rng.random_bool(0.5) {
                    qsl.pop();
                } else {
                    qsl.push(wild_i32(rng));
                }
            }
            3 if n > 1 => qsl.swap(1, n),
            _ => {
                let i = rng.random_range(0..qsl.len());
                qsl[i] = qsl[i].wrapping_add(rng.random_range(-3..3));
            }
        }
    }
    (qsl, seq_lens)
}

/// The batch's tokens when its start locations are valid (`num_reqs + 1`, from 0, not
/// decreasing), recomputed here.
fn valid_tokens(qsl: &[i32], n: usize) -> Option<u64> {
    let ok = qsl.len() == n + 1 && qsl[0] == 0 && qsl.windows(2).all(|w| w[1] >= w[0]);
    ok.then(|| *qsl.last().unwrap() as u64)
}

/// Planners allocate per token: keep them to batches of at most 2^20 tokens (or invalid ones,
/// which they refuse before allocating).
fn plannable(qsl: &[i32], n: usize) -> bool {
    valid_tokens(qsl, n).is_none_or(|t| t <= 1 << 20) && qsl.iter().all(|&x| x <= 1 << 20)
}

// ---------------------------------------------------------------------------------------------
// Rows and cache specs
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct RowsCase {
    rows: RowsDesc,
    lse_strides: (usize, usize),
}

#[test]
fn rows_sizes_are_exact_or_refused() {
    fuzz(
        "rows",
        1,
        |rng| {
            let mut rows = RowsDesc::contiguous(size(rng, 0..9), size(rng, 0..5), size(rng, 0..65));
            if rng.random_bool(0.5) {
                rows.token_stride = wild_usize(rng);
            }
            if rng.random_bool(0.5) {
                rows.head_stride = wild_usize(rng);
            }
            RowsCase { rows, lse_strides: (size(rng, 0..9), size(rng, 0..9)) }
        },
        |c| {
            let r = c.rows;
            // Exact in u128 (each product of two usizes fits; the sum of three saturates far
            // past a usize).
            let exact = if r.num_tokens == 0 || r.num_heads == 0 || r.head_size == 0 {
                0
            } else {
                ((r.num_tokens as u128 - 1) * r.token_stride as u128)
                    .saturating_add((r.num_heads as u128 - 1) * r.head_stride as u128)
                    .saturating_add(r.head_size as u128)
            };
            let fits = usize::try_from(exact).ok();
            check!(r.checked_required_len() == fits, "checked_required_len {:?}, exact {exact}", r.checked_required_len());
            check!(r.required_len() == fits.unwrap_or(usize::MAX), "required_len {} wraps (exact {exact})", r.required_len());
            let v = r.validate("rows");
            named(&v)?;
            if v.is_ok() {
                check!(fits.is_some(), "validate took rows of {exact} elements");
                check!((r.num_tokens as u128 * r.num_heads as u128) <= usize::MAX as u128, "validate took tokens x heads past a usize");
                check!(r.num_heads <= 1 || r.head_stride >= r.head_size, "validate took overlapping heads");
                let span = (r.num_heads.max(1) as u128 - 1) * r.head_stride as u128 + r.head_size as u128;
                check!(r.num_tokens <= 1 || r.token_stride as u128 >= span, "validate took overlapping tokens");
            }
            let m = merge_attn_states_sizes(&r, c.lse_strides);
            named(&m)?;
            if let Ok((out, lse)) = m {
                check!(v.is_ok() && out == r.required_len(), "merge sizes {out} for rows {exact}");
                let want = if r.num_tokens == 0 || r.num_heads == 0 {
                    0
                } else {
                    ((r.num_tokens as u128 - 1) * c.lse_strides.0 as u128)
                        .saturating_add((r.num_heads as u128 - 1) * c.lse_strides.1 as u128)
                        .saturating_add(1)
                };
                check!(lse as u128 == want, "merge LSE size {lse}, exact {want}");
                check!(r.num_tokens as u128 * r.num_heads as u128 <= u32::MAX as u128, "merge took more rows than a u32");
            }
            Ok(())
        },
    );
}

#[derive(Debug)]
struct SpecCase {
    kv: KvCacheSpec,
    mla: MlaCacheSpec,
    key_rows: RowsDesc,
    key_len: usize,
    cache_len: usize,
    slots: Vec<i64>,
    latent_stride: usize,
    num_tokens: usize,
}

#[test]
fn cache_specs_and_writes_stay_in_range() {
    fuzz(
        "specs",
        2,
        |rng| {
            let layout = KvLayout::ALL[rng.random_range(0..4)];
            let kv = KvCacheSpec {
                layout,
                num_blocks: size(rng, 1..6),
                block_size: size(rng, 1..5),
                num_kv_heads: size(rng, 1..3),
                head_size: size(rng, 1..9),
            };
            let mla = MlaCacheSpec {
                num_blocks: size(rng, 1..4),
                block_size: size(rng, 1..5),
                latent_dim: size(rng, 1..9),
                rope_dim: size(rng, 0..5),
            };
            let num_tokens = size(rng, 0..6);
            let mut key_rows = RowsDesc::contiguous(num_tokens, kv.num_kv_heads, kv.head_size);
            if rng.random_bool(0.2) {
                key_rows.token_stride = wild_usize(rng);
            }
            // Buffers never larger than 4096 elements: specs and rows past that must be refused.
            let cap = |want: usize| want.min(4096);
            let key_len = if rng.random_bool(0.8) { cap(key_rows.required_len()) } else { rng.random_range(0..64) };
            let cache_len = if rng.random_bool(0.8) { cap(kv.num_elements().max(mla.num_elements())) } else { rng.random_range(0..64) };
            let slots =
                (0..num_tokens.min(8)).map(|_| if rng.random_bool(0.2) { rng.random::<i64>() } else { rng.random_range(-2..24) }).collect();
            let latent_stride = if rng.random_bool(0.2) { wild_usize(rng) } else { mla.latent_dim.saturating_add(rng.random_range(0..3)) };
            SpecCase { kv, mla, key_rows, key_len, cache_len, slots, latent_stride, num_tokens }
        },
        |c| {
            // The standard cache.
            let s = c.kv;
            let product = |xs: &[usize]| xs.iter().fold(1u128, |a, &x| a.saturating_mul(x as u128));
            let exact = product(&[2, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size]);
            let v = s.validate("spec");
            let made = KvCacheSpec::new(s.layout, s.num_blocks, s.block_size, s.num_kv_heads, s.head_size);
            named(&v)?;
            named(&made)?;
            check!(v.is_ok() == made.is_ok(), "validate and new disagree");
            check!(s.checked_num_elements().map(|e| e as u128) == (exact <= usize::MAX as u128).then_some(exact), "checked_num_elements");
            check!(v.is_err() || s.num_elements() as u128 == exact, "num_elements {} of {exact}", s.num_elements());
            check!(s.num_elements() as u128 <= exact || exact > usize::MAX as u128, "num_elements over-counts");
            if v.is_ok() {
                check!(s.num_slots() as u128 == s.num_blocks as u128 * s.block_size as u128, "num_slots");
                // The last element of the V plane is the last of the cache.
                let st = s.strides();
                let (_, v_origin) = s.kv_origins();
                let last = v_origin as u128
                    + (s.num_blocks as u128 - 1) * st.block as u128
                    + (s.block_size as u128 - 1) * st.token as u128
                    + (s.num_kv_heads as u128 - 1) * st.head as u128
                    + s.head_size as u128
                    - 1;
                check!(last + 1 == exact, "the last element is {last}, the cache has {exact}");
            } else {
                check!(s.num_elements() == usize::MAX || exact <= usize::MAX as u128, "an invalid spec's size wraps");
            }
            // A write into it.
            let (key, mut cache) = (vec![1f32; c.key_len], vec![0f32; c.cache_len]);
            let w = host::cpu::reshape_and_cache(&key, c.key_rows, &key, c.key_rows, &c.slots, &mut cache, &s, None);
            named(&w)?;
            if let Ok(rep) = w {
                check!(v.is_ok(), "an invalid spec took a write");
                check!(c.cache_len as u128 >= exact && c.key_len >= c.key_rows.required_len(), "a write into short buffers");
                check!(rep.written + rep.padding + rep.out_of_range == c.key_rows.num_tokens.min(c.slots.len()), "report {rep:?}");
            }

            // The MLA cache.
            let m = c.mla;
            let width = m.latent_dim as u128 + m.rope_dim as u128;
            let exact = product(&[m.num_blocks, m.block_size]).saturating_mul(width);
            let v = m.validate("spec");
            named(&v)?;
            check!(
                v.is_ok() == MlaCacheSpec::new(m.num_blocks, m.block_size, m.latent_dim, m.rope_dim).is_ok(),
                "validate and new disagree"
            );
            check!(v.is_err() || m.num_elements() as u128 == exact, "MLA num_elements {} of {exact}", m.num_elements());
            check!(v.is_ok() || m.num_elements() == usize::MAX || exact <= usize::MAX as u128, "an invalid MLA spec's size wraps");
            let kv_c = vec![1f32; c.key_len];
            let w =
                host::cpu::concat_and_cache_mla(&kv_c, c.latent_stride, &kv_c, m.rope_dim, c.num_tokens, &c.slots, &mut cache, &m, None);
            named(&w)?;
            if w.is_ok() {
                check!(v.is_ok() && c.cache_len as u128 >= exact, "an MLA write into a short or invalid cache");
                let need = if c.num_tokens == 0 { 0 } else { (c.num_tokens as u128 - 1) * c.latent_stride as u128 + m.latent_dim as u128 };
                check!(c.key_len as u128 >= need, "an MLA write from a short kv_c ({} of {need})", c.key_len);
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Decode and prefill validators and planners
// ---------------------------------------------------------------------------------------------

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
                let p = plan_decode_tc(&batch, hq, c.group, c.shape, c.target, c.slots, c.mode, c.capacity);
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

// ---------------------------------------------------------------------------------------------
// The CPU attention ops
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct CpuOpCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    spec: KvCacheSpec,
    mla: MlaCacheSpec,
    q_rows: RowsDesc,
    q_len: usize,
    cache_len: usize,
    block_table: Vec<i32>,
    stride: usize,
    key_start_loc: Vec<i32>,
    head_size_v: usize,
    per_head: (usize, usize),
    causal: bool,
}

/// `cpu::paged_decode` and `cpu::prefill` (paged, packed and MLA keys): refused with a named
/// error or run, never a panic; a run's output has one row per query token and head.
#[test]
fn cpu_attention_ops_check_what_they_read() {
    fuzz(
        "cpu ops",
        7,
        |rng| {
            let (qsl, seq_lens) = batch(rng, 0..=9, 30);
            let spec = KvCacheSpec {
                layout: KvLayout::ALL[rng.random_range(0..4)],
                num_blocks: size(rng, 1..12),
                block_size: size(rng, 1..9),
                num_kv_heads: size(rng, 1..3),
                head_size: size(rng, 1..9),
            };
            let mla = MlaCacheSpec {
                num_blocks: size(rng, 1..12),
                block_size: size(rng, 1..9),
                latent_dim: size(rng, 1..9),
                rope_dim: size(rng, 0..4),
            };
            let tokens = qsl.last().map_or(0, |&t| t.max(0) as usize);
            let mut q_rows =
                RowsDesc::contiguous(if rng.random_bool(0.9) { tokens } else { wild_usize(rng) }, size(rng, 1..5), size(rng, 1..9));
            if rng.random_bool(0.1) {
                q_rows.token_stride = wild_usize(rng);
            }
            let stride = size(rng, 0..12);
            let table_len = if rng.random_bool(0.8) { seq_lens.len().saturating_mul(stride).min(256) } else { rng.random_range(0..8) };
            let block_table = (0..table_len).map(|_| if rng.random_bool(0.1) { wild_i32(rng) } else { rng.random_range(0..12) }).collect();
            let mut key_start_loc = vec![0];
            seq_lens.iter().for_each(|&l| key_start_loc.push(key_start_loc.last().copied().unwrap_or(0i32).saturating_add(l.max(0))));
            if rng.random_bool(0.2) {
                let i = rng.random_range(0..key_start_loc.len());
                key_start_loc[i] = wild_i32(rng);
            }
            CpuOpCase {
                q_len: q_rows.required_len().min(4096) - if rng.random_bool(0.1) { 1.min(q_rows.required_len()) } else { 0 },
                cache_len: if rng.random_bool(0.9) {
                    spec.num_elements().max(mla.num_elements()).min(8192)
                } else {
                    rng.random_range(0..64)
                },
                qsl,
                seq_lens,
                spec,
                mla,
                q_rows,
                block_table,
                stride,
                key_start_loc,
                head_size_v: size(rng, 0..9),
                per_head: (rng.random_range(0..6), rng.random_range(0..6)),
                causal: rng.random(),
            }
        },
        |c| {
            let q = vec![0.5f32; c.q_len];
            let cache = vec![0.25f32; c.cache_len];
            let (slopes, sinks) = (vec![0.1f32; c.per_head.0], vec![0.0f32; c.per_head.1]);
            let (slopes, sinks) =
                (c.per_head.0.is_multiple_of(2).then_some(&slopes[..]), c.per_head.1.is_multiple_of(2).then_some(&sinks[..]));
            let opts = host::decode::AttnOptions::new(8);
            let rows = |r: &host::cpu::DecodeResult, dv: usize| -> Result<(), String> {
                let (nt, hq) = (c.q_rows.num_tokens, c.q_rows.num_heads);
                check!(r.out.len() == nt * hq * dv && r.lse.len() == nt * hq, "{} outputs for {nt} x {hq} x {dv}", r.out.len());
                Ok(())
            };
            let batch = DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &c.qsl };
            let d = host::cpu::paged_decode::<f32, f32>(&host::cpu::DecodeRef {
                q: &q,
                q_rows: c.q_rows,
                cache: &cache,
                spec: c.spec,
                block_table: &c.block_table,
                block_table_stride: c.stride,
                batch,
                opts,
                alibi_slopes: slopes,
                sinks,
                scales: None,
            });
            named(&d)?;
            if let Ok(r) = &d {
                check!(c.spec.validate("spec").is_ok(), "decode took an invalid spec");
                rows(r, c.q_rows.head_size)?;
            }
            let packed_rows = RowsDesc::contiguous(*c.key_start_loc.last().unwrap_or(&0) as usize, c.spec.num_kv_heads, c.spec.head_size);
            let kvs = [
                host::cpu::KvRef::Paged { cache: &cache, spec: c.spec, block_table: &c.block_table, block_table_stride: c.stride },
                host::cpu::KvRef::Mla { cache: &cache, spec: c.mla, block_table: &c.block_table, block_table_stride: c.stride },
                host::cpu::KvRef::Packed {
                    k: &cache,
                    k_rows: packed_rows,
                    v: &cache,
                    v_rows: packed_rows,
                    key_start_loc: &c.key_start_loc,
                },
            ];
            for kv in kvs {
                let p = host::cpu::prefill::<f32, f32>(&host::cpu::PrefillRef {
                    q: &q,
                    q_rows: c.q_rows,
                    kv,
                    head_size_v: c.head_size_v,
                    query_start_loc: &c.qsl,
                    seq_lens: &c.seq_lens,
                    causal: c.causal,
                    opts,
                    alibi_slopes: slopes,
                    sinks,
                    scales: None,
                });
                named(&p)?;
                if let Ok(r) = &p {
                    rows(r, c.head_size_v)?;
                }
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// Step metadata
// ---------------------------------------------------------------------------------------------

#[derive(Debug)]
struct StepCase {
    qsl: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slots: Vec<i64>,
    num_actual_tokens: usize,
    num_blocks: usize,
    block_size: usize,
    config: PlanConfig,
}

impl StepCase {
    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.qsl,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &self.slots,
            num_actual_tokens: self.num_actual_tokens,
            num_blocks: self.num_blocks,
            block_size: self.block_size,
        }
    }
}

/// How [`step`] draws a step.
struct StepShape {
    threshold: usize,
    /// `None`: 1, 4 or 16.
    block_size: Option<usize>,
    /// Query tokens of a prefill below this, cached keys below `max_ctx`.
    max_q: i32,
    max_ctx: i32,
}

/// A step ordered decodes first (mostly): block tables from a shuffled pool, slots of the new
/// tokens, padding slots; then wild values now and then.
fn step(rng: &mut SmallRng, shape: &StepShape) -> StepCase {
    let threshold = shape.threshold;
    let n = if rng.random_bool(0.1) { 0 } else { rng.random_range(1..7) };
    let block_size = shape.block_size.unwrap_or([1, 4, 16][rng.random_range(0..3)]);
    let mut q: Vec<i32> = (0..n)
        .map(|_| if rng.random_bool(0.6) { rng.random_range(0..=threshold as i32) } else { rng.random_range(0..shape.max_q) })
        .collect();
    if rng.random_bool(0.8) {
        q.sort_by_key(|&x| x > threshold as i32);
    }
    let seq_lens: Vec<i32> = q.iter().map(|&x| x + rng.random_range(0..shape.max_ctx)).collect();
    let used: Vec<usize> = seq_lens.iter().map(|&l| (l as usize).div_ceil(block_size)).collect();
    let stride = used.iter().copied().max().unwrap_or(0) + rng.random_range(0..3);
    let num_blocks = used.iter().sum::<usize>() + rng.random_range(0..4);
    let mut pool: Vec<i32> = (0..num_blocks as i32).collect();
    use rand::seq::SliceRandom;
    pool.shuffle(rng);
    let mut block_table = vec![-1; n * stride];
    let mut next = 0;
    for r in 0..n {
        for b in 0..used[r] {
            block_table[r * stride + b] = pool[next];
            next += 1;
        }
    }
    let mut qsl = vec![0];
    let mut slots = Vec::new();
    for r in 0..n {
        qsl.push(qsl[r] + q[r]);
        for i in 0..q[r] {
            let pos = (seq_lens[r] - q[r] + i) as usize;
            let block = block_table[r * stride + pos / block_size] as i64;
            slots.push(if rng.random_bool(0.05) { -1 } else { block * block_size as i64 + (pos % block_size) as i64 });
        }
    }
    let mut c = StepCase {
        num_actual_tokens: slots.len(),
        qsl,
        seq_lens,
        block_table,
        stride,
        slots,
        num_blocks,
        block_size,
        config: PlanConfig { decode_threshold: threshold, num_q_heads: 8, num_kv_heads: 2, head_size: 128 },
    };
    if rng.random_bool(0.4) {
        match rng.random_range(0..12) {
            0 => {
                let i = rng.random_range(0..c.qsl.len());
                c.qsl[i] = wild_i32(rng);
            }
            1 if n > 0 => c.seq_lens[rng.random_range(0..n)] = wild_i32(rng),
            2 if !c.block_table.is_empty() => {
                let i = rng.random_range(0..c.block_table.len());
                c.block_table[i] = wild_i32(rng);
            }
            3 if !c.slots.is_empty() => {
                let i = rng.random_range(0..c.slots.len());
                c.slots[i] = if rng.random() { rng.random() } else { i64::MIN };
            }
            4 => c.stride = wild_usize(rng),
            5 => c.num_blocks = wild_usize(rng),
            6 => c.block_size = wild_usize(rng),
            7 => c.num_actual_tokens = wild_usize(rng),
            8 => {
                c.config.num_q_heads = wild_usize(rng);
                c.config.num_kv_heads = size(rng, 0..4);
            }
            9 => c.config.head_size = [0, 7, 64, 96, 256, 512][rng.random_range(0..6)],
            10 => c.config.decode_threshold = size(rng, 0..10),
            _ => {
                c.qsl.pop();
            }
        }
    }
    c
}

#[test]
fn step_metadata_is_checked_split_and_planned_in_range() {
    fuzz(
        "metadata",
        5,
        |rng| {
            let threshold = rng.random_range(1..=MAX_QUERY_LEN);
            step(rng, &StepShape { threshold, block_size: None, max_q: 30, max_ctx: 60 })
        },
        |c| {
            let input = c.input();
            let n = c.seq_lens.len();
            let v = validate(&input);
            named(&v)?;
            if v.is_ok() {
                check!(valid_tokens(&c.qsl, n) == Some(c.num_actual_tokens as u64), "validate took start locations {:?}", c.qsl);
                check!(c.block_size > 0 && (n as u128 * c.stride as u128) <= c.block_table.len() as u128, "validate took the table shape");
                for r in 0..n {
                    let (len, q) = (c.seq_lens[r], c.qsl[r + 1] - c.qsl[r]);
                    check!(len >= 0 && (q == 0 || len >= q), "validate took request {r}");
                    let used = (len as usize).div_ceil(c.block_size);
                    check!(used <= c.stride, "validate took request {r} past its row");
                    for (e, &b) in c.block_table[r * c.stride..][..used].iter().enumerate() {
                        check!(
                            b >= 0 && (b as usize) < c.num_blocks,
                            "validate took request {r} entry {e} = {b} of {} blocks",
                            c.num_blocks
                        );
                    }
                }
                let slots = c.num_blocks as u128 * c.block_size as u128;
                for (t, &s) in c.slots[..c.num_actual_tokens].iter().enumerate() {
                    check!(s == -1 || (s >= 0 && (s as u128) < slots), "validate took token {t}'s slot {s}");
                }
            }
            let threshold = c.config.decode_threshold;
            let split = split_decodes(&input, threshold);
            named(&split)?;
            if let Ok(s) = split {
                check!(s.num_decodes + s.num_prefills == n, "split {s:?}");
                check!(s.num_decode_tokens + s.num_prefill_tokens == c.num_actual_tokens, "split {s:?}");
            }
            if c.qsl.len() == n + 1 {
                let mut order = decode_first_order(&input, threshold);
                order.sort_unstable();
                check!(order == (0..n).collect::<Vec<_>>(), "decode_first_order is not a permutation");
            }
            let prefix = common_prefix(&input);
            if v.is_ok() && n > 0 {
                for r in 0..n {
                    let before = c.seq_lens[r] as i64 - (c.qsl[r + 1] - c.qsl[r]) as i64;
                    check!(prefix.tokens as i64 <= before, "prefix {prefix:?} past request {r}'s first query");
                    check!(c.block_table[r * c.stride..][..prefix.blocks] == c.block_table[..prefix.blocks], "prefix not shared by {r}");
                }
            }
            let _ = use_cascade(CascadeMode::Auto, &CascadeStep::new(&input, 4));
            let sizes = StagingSizes {
                num_reqs: n,
                block_table_stride: c.stride,
                num_actual_tokens: c.num_actual_tokens,
                num_decodes: c.config.num_kv_heads,
                num_prefills: c.config.num_q_heads,
                num_work_items: c.num_blocks,
                num_decode_tokens: c.block_size,
            };
            let layout = StagingLayout::new(&sizes);
            check!(layout.regions().iter().all(|(_, r)| r.end() <= layout.total_words), "a region past the layout's end");
            let _ = (layout.prefill_seq_lens(), layout.prefill_block_table(), layout.total_bytes());
            // The builders agree with each other and stay in range.
            let cfg = c.config;
            let meta = build_tensor_core_metadata(&input, threshold, cfg.num_q_heads, cfg.num_kv_heads, cfg.head_size);
            named(&meta)?;
            if let Ok(m) = &meta {
                check!(v.is_ok(), "the builder took a step validate refuses");
                let (s, p) = (m.split, &m.decode.plan);
                // The decode part is not planned: a zero split count and partial base a decode.
                check!(p.items.is_empty() && p.token_request.is_empty() && p.partial_rows == 0, "a planned decode part {p:?}");
                check!(p.req_num_splits == vec![0; s.num_decodes] && p.req_partial_base == vec![0; s.num_decodes], "decode part {p:?}");
                check!(m.prefill.query_start_loc.len() == s.num_prefills + 1, "prefill part");
            }
            if let Ok(mut builder) = MetadataBuilder::new(cfg) {
                let built = builder.build(&input);
                named(&built)?;
                match (&meta, built) {
                    (Ok(m), Ok(b)) => {
                        check!(b.metadata == m, "the builder's metadata differs from build_tensor_core_metadata's");
                        let (words, layout) = pack(m, &input);
                        check!(b.layout == &layout && b.words.len() == words.len(), "the builder's words differ from pack's");
                    }
                    (Err(_), Err(_)) => {}
                    (m, b) => return Err(format!("build_tensor_core_metadata {:?}, MetadataBuilder {:?}", m.is_ok(), b.is_ok())),
                }
            }
            Ok(())
        },
    );
}

// ---------------------------------------------------------------------------------------------
// forward on the CPU backend
// ---------------------------------------------------------------------------------------------

const NB: usize = 72;

#[derive(Debug)]
struct ForwardCase {
    mla: bool,
    step: StepCase,
    /// Extra rows in the layer's tensors past the step's tokens (padding).
    pad: usize,
    /// A layer field made wrong (`None`: a correct layer).
    edit: Option<(usize, usize)>,
    seed: u64,
}

/// `forward` after `build`: a step `build` takes runs on every layer (with correct tensors) and
/// its outputs are finite; one it refuses is refused by `forward` too ("step"); wrong tensors
/// are refused with a named error. Nothing panics.
#[test]
fn cpu_forward_agrees_with_build() {
    let limits = ForwardLimits { max_num_tokens: 80, max_num_reqs: 8, max_model_len: 64 };
    // Steps that ran (a suite whose steps are all refused would test little).
    let ran = std::sync::atomic::AtomicUsize::new(0);
    fuzz(
        "forward",
        6,
        |rng| {
            let mla = rng.random_bool(0.15);
            let mut s = step(rng, &StepShape { threshold: 2, block_size: Some(4), max_q: 13, max_ctx: 30 });
            // The caches' block count, unless a wild one was drawn (the pool's ids stay below it).
            if s.num_blocks <= NB {
                s.num_blocks = NB;
            }
            let edit = rng.random_bool(0.2).then(|| (rng.random_range(0..6), wild_usize(rng)));
            ForwardCase { mla, step: s, pad: rng.random_range(0..3), edit, seed: rng.random() }
        },
        |c| {
            let model = if c.mla {
                ModelConfig::mla(2, DType::F32, 4)
            } else {
                ModelConfig::standard(4, 2, 8, DType::F32, 4, KvLayout::ALL[(c.seed % 4) as usize])
            };
            let sel = select_backend_no_env(&model, &DeviceInfo::no_gpu(), None).map_err(|e| e.to_string())?;
            let mut attn = Attention::new(&sel, ForwardConfig { decode_threshold: 2, ..ForwardConfig::new(model, NB, limits) }, None)
                .map_err(|e| e.to_string())?;
            let mut meta = attn.new_step_metadata().map_err(|e| e.to_string())?;
            let built = meta.build(&c.step.input());
            named(&built)?;
            let spec = attn.cache_spec();
            let (hq, dk, dv, hkv) = (4usize.min(model.num_q_heads), spec.qk_head_size(), spec.v_head_size(), spec.num_kv_heads());
            let nt = c.step.num_actual_tokens.min(1 << 10) + c.pad;
            let mut rng = SmallRng::seed_from_u64(c.seed);
            let mut random = |len: usize| (0..len).map(|_| rng.random_range(-1.0f32..1.0)).collect::<Vec<_>>();
            let q = random(nt * hq * dk);
            let (k, v) = (random(nt * hkv * dk), random(nt * hkv * dk));
            let mut cache = vec![0f32; spec.num_elements()];
            let mut out = vec![f32::NAN; nt * hq * dv];
            let mut q_rows = RowsDesc::contiguous(nt, hq, dk);
            let mut k_rows = RowsDesc::contiguous(nt, hkv, dk);
            let mut out_rows = RowsDesc::contiguous(nt, hq, dv);
            let mut kv_c_stride = dk;
            if let Some((field, value)) = c.edit {
                match field {
                    0 => q_rows.token_stride = value,
                    1 => q_rows.num_tokens = value,
                    2 => k_rows.head_stride = value,
                    3 => out_rows.token_stride = value,
                    4 => out_rows.num_heads = value,
                    _ => kv_c_stride = value,
                }
            }
            let new_kv = match spec {
                CacheSpec::Paged(_) => NewKv::Standard { k: k.as_slice().into(), k_rows, v: v.as_slice().into(), v_rows: k_rows },
                CacheSpec::Mla(m) => NewKv::Mla {
                    kv_c: k.as_slice().into(),
                    kv_c_token_stride: kv_c_stride,
                    k_pe: v.get(m.latent_dim..).unwrap_or(&[]).into(),
                    k_pe_token_stride: kv_c_stride,
                },
            };
            let layer = CpuLayer {
                q: q.as_slice().into(),
                q_rows,
                new_kv,
                cache: cache.as_mut_slice().into(),
                out: out.as_mut_slice().into(),
                out_rows,
                alibi_slopes: None,
                sinks: None,
                kv_scales: None,
            };
            let r = attn.forward(&meta, LayerIo::Cpu(layer));
            named(&r)?;
            match (&built, &r) {
                (Err(_), Ok(())) => return Err("forward ran a step build refused".into()),
                (Err(_), Err(AttnError::InvalidArgument { arg, .. })) => check!(*arg == "step", "forward on a refused step names {arg}"),
                (Ok(_), Err(e)) if c.edit.is_none() => return Err(format!("build took the step, forward refused it: {e}")),
                _ => {}
            }
            if r.is_ok() && c.edit.is_none() {
                ran.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let rows = c.step.num_actual_tokens * hq * dv;
                check!(out[..rows].iter().all(|x| x.is_finite()), "a non-finite output row");
                check!(out[rows..].iter().all(|x| x.is_nan()), "a padding row was written");
            }
            Ok(())
        },
    );
    let ran = ran.into_inner();
    eprintln!("forward: {ran} steps ran");
    assert!(ran > 0, "no step ran");
}
