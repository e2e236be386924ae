//! Property checks over random and adversarial inputs: every public validator, planner and
//! metadata builder, the CPU cache writes and `attn_rs::forward` on the `cpu` backend get numbers
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

use attn_rs::AttnError;
use attn_rs::SplitMode;
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
fn named<T>(r: &attn_rs::Result<T>) -> Result<(), String> {
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

// The targets, by what they take (`check!` above is in scope in each).
mod cpu_ops;
mod layouts;
mod planners;
mod steps;
