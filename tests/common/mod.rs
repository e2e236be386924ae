//! Helpers shared by the GPU test binaries: the device, random data, poisoned buffers, and a
//! libtest-mimic runner that counts GPU tests as ignored (skipped) when there is no driver.
#![allow(dead_code)]

mod compare;
mod gaps;
mod masking;
#[allow(unused_imports)]
pub use compare::{
    bounds, check_lse, check_lse_within, check_rows, check_rows_within, max_row_error, rel_error, row_errors, row_tolerance, tolerance,
    within, RowError, E4M3_TOLERANCE,
};
#[allow(unused_imports)]
pub use gaps::{check_gaps, gapped_rows, packed, spread};
#[allow(unused_imports)]
pub use masking::{plant_edge_markers, MarkedRequest};

use attn_rs::{AttnDevice, Element};
use cudarc::driver::{CudaSlice, CudaStream};
use libtest_mimic::{Arguments, Failed, Trial};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::sync::{Arc, OnceLock};

pub type TestResult = Result<(), Failed>;

/// Checks an MLA output (`[tokens, heads, v]` rows of `Q`) and its log-sum-exp against the f64
/// reference: every element finite, then the global and worst-row relative errors and the
/// log-sum-exp within [`bounds`] (e4m3's where the kernel rounds to e4m3; its errors printed).
pub fn check_latent_output<Q: Element>(
    out: &[Q],
    lse: &[f32],
    want: (&[f64], &[f64]),
    (nt, hq, v): (usize, usize, usize),
    e4m3: bool,
    plan: &attn_rs::decode::DecodePlan,
) -> TestResult {
    let (want_out, want_lse) = want;
    let got: Vec<f64> = out.iter().take(nt * hq * v).map(|x| x.to_f32() as f64).collect();
    if let Some(i) = got.iter().position(|x| !x.is_finite()) {
        let (token, head, col) = (i / (hq * v), i / v % hq, i % v);
        return Err(format!("output element {i} (token {token}, head {head}, col {col}) is {}; plan chunk {}", got[i], plan.chunk).into());
    }
    let err = rel_error(&got, want_out);
    let (tol, row_tol, lse_tol) = bounds(Q::DTYPE, e4m3);
    let items = plan.items.len() / 2;
    if !within(err, tol) {
        return Err(format!("relative error {err:.2e} > {tol:.0e} (plan: chunk {}, {items} items)", plan.chunk).into());
    }
    // Row by row too: one row wrong alone (a key masked wrongly) hardly moves the global norm.
    check_rows_within(&got, want_out, v, hq, row_tol).map_err(|e| format!("{e} (plan: chunk {}, {items} items)", plan.chunk))?;
    check_lse_within(&lse[..nt * hq], &want_lse[..nt * hq], hq, lse_tol)?;
    if e4m3 {
        eprintln!("e4m3: relative error {err:.3e}, worst row {:.3e}", max_row_error(&got, want_out, v).err);
    }
    Ok(())
}

/// The process-wide device (tests run in parallel threads, each on its own stream).
pub fn device() -> &'static AttnDevice {
    static DEV: OnceLock<AttnDevice> = OnceLock::new();
    DEV.get_or_init(|| AttnDevice::new(0).expect("open GPU 0"))
}

/// The device as `forward` takes it (an `Arc`; its own handle, so the kernels load once more).
pub fn arc_device() -> Arc<AttnDevice> {
    static DEV: OnceLock<Arc<AttnDevice>> = OnceLock::new();
    DEV.get_or_init(|| Arc::new(AttnDevice::new(0).expect("open GPU 0"))).clone()
}

pub fn new_stream() -> Arc<CudaStream> {
    device().context().new_stream().expect("create stream")
}

/// `ATTN_TEST_QUICK=1` (used under compute-sanitizer) runs a smaller matrix.
pub fn quick() -> bool {
    std::env::var("ATTN_TEST_QUICK").is_ok_and(|v| v == "1")
}

/// A fresh seed per test run (printed, so a failure can be replayed with ATTN_TEST_SEED).
pub fn rng(salt: u64) -> SmallRng {
    static SEED: OnceLock<u64> = OnceLock::new();
    let seed = *SEED.get_or_init(|| {
        let s = std::env::var("ATTN_TEST_SEED")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_nanos() as u64);
        eprintln!("random seed: {s} (replay with ATTN_TEST_SEED={s})");
        s
    });
    SmallRng::seed_from_u64(seed ^ salt.wrapping_mul(0x9e37_79b9_7f4a_7c15))
}

/// Uniform random values in [-range, range), converted to `T`.
pub fn random_vec<T: Element>(rng: &mut SmallRng, len: usize, range: f32) -> Vec<T> {
    (0..len).map(|_| T::from_f32(rng.random_range(-range..range))).collect()
}

pub fn poison<T: Element>() -> T {
    T::from_f32(f32::NAN)
}

pub fn upload<T: Element>(stream: &Arc<CudaStream>, host: &[T]) -> CudaSlice<T> {
    stream.clone_htod(host).expect("upload")
}

pub fn download<T: Element>(stream: &Arc<CudaStream>, dev: &CudaSlice<T>) -> Vec<T> {
    stream.clone_dtoh(dev).expect("download")
}

/// Runs `trials`, marking them ignored (reported as skipped, never passed) without a GPU.
pub fn run_gpu_trials(trials: Vec<Trial>) -> ! {
    let args = Arguments::from_args();
    let gpu = AttnDevice::driver_available();
    if !gpu {
        eprintln!("no CUDA driver or GPU: {} GPU tests skipped (reported as ignored)", trials.len());
    }
    let trials = trials.into_iter().map(|t| t.with_ignored_flag(!gpu)).collect();
    libtest_mimic::run(&args, trials).exit()
}

/// Elements that differ bit for bit, as "index: got vs want" lines (at most 8).
pub fn bitwise_mismatches<T: Element + std::fmt::Debug>(got: &[T], want: &[T], bits: impl Fn(&T) -> u64) -> Vec<String> {
    got.iter()
        .zip(want)
        .enumerate()
        .filter(|(_, (g, w))| bits(g) != bits(w))
        .take(8)
        .map(|(i, (g, w))| format!("{i}: got {g:?} want {w:?}"))
        .collect()
}

/// Scattered block tables, as a serving engine's allocator leaves them.
pub struct BlockTables {
    /// `[num_reqs, stride]`, unused entries -1.
    pub table: Vec<i32>,
    pub stride: usize,
    /// Blocks of the cache: those the requests use, plus spares.
    pub num_blocks: usize,
}

/// Every request's blocks drawn from a random permutation of a cache of the needed blocks plus
/// `spare`; rows one entry longer than the longest request needs. With `bad_block`, the second
/// block of the first request that has two points past the cache.
pub fn scattered_block_tables(rng: &mut SmallRng, seq_lens: &[i32], block_size: usize, spare: usize, bad_block: bool) -> BlockTables {
    use rand::seq::SliceRandom;
    let blocks_per_req: Vec<usize> = seq_lens.iter().map(|&l| (l.max(0) as usize).div_ceil(block_size)).collect();
    let stride = blocks_per_req.iter().copied().max().unwrap_or(1).max(1) + 1;
    let num_blocks = blocks_per_req.iter().sum::<usize>() + spare;
    let mut ids: Vec<i32> = (0..num_blocks as i32).collect();
    ids.shuffle(rng);
    let mut table = vec![-1i32; seq_lens.len() * stride];
    let mut next = 0;
    for (r, &n) in blocks_per_req.iter().enumerate() {
        for b in 0..n {
            table[r * stride + b] = ids[next];
            next += 1;
        }
    }
    if bad_block {
        let r = blocks_per_req.iter().position(|&n| n > 1).expect("a request with 2+ blocks");
        table[r * stride + 1] = num_blocks as i32 + 5;
    }
    BlockTables { table, stride, num_blocks }
}

/// The status after an attention call whose reference skipped `want.bad_blocks` keys: the bit,
/// and a recorded offence that names a bad entry of `block_table` (`stride` per request) as it
/// is, with the cache's `num_blocks`; `into_result` must report it. `unrecorded_ok`: the kernel
/// may raise the bit without a record (the attention kernels do: see `kernels/src/blocks/status.rs`).
/// When the reference skipped keys of bad blocks and the kernels raised the status bit without a
/// record, [`attn_rs::BatchMetadata::find_bad_block`] must name the reference's first one.
pub fn check_found_bad_block(
    batch: &attn_rs::BatchMetadata,
    block_table: &CudaSlice<i32>,
    stream: &Arc<CudaStream>,
    stride: usize,
    block_size: usize,
    num_blocks: usize,
    want: &attn_rs::cpu::DecodeResult,
) -> Result<(), String> {
    if want.bad_blocks == 0 {
        return Ok(());
    }
    let found = batch
        .find_bad_block(&attn_rs::DevIn::new(block_table, stream), stride, block_size, num_blocks)
        .map_err(|e| format!("find_bad_block: {e}"))?;
    if found != want.first_bad_block {
        return Err(format!("find_bad_block names {found:?}, the reference met {:?}", want.first_bad_block));
    }
    Ok(())
}

pub fn check_block_status(
    flags: attn_rs::StatusFlags,
    want: &attn_rs::cpu::DecodeResult,
    block_table: &[i32],
    stride: usize,
    num_blocks: usize,
    unrecorded_ok: bool,
) -> Result<(), String> {
    use attn_rs::AttnError;
    if flags.block_out_of_range() != (want.bad_blocks > 0) {
        return Err(format!("status {flags:?}, reference skipped {} keys", want.bad_blocks));
    }
    let first = match (flags.first_bad_block(), want.bad_blocks) {
        (None, 0) => return if flags.first.is_none() { Ok(()) } else { Err(format!("status {flags:?} records an offence")) },
        (None, _) if unrecorded_ok && flags.first.is_none() => return Ok(()),
        (None, _) => return Err(format!("status {flags:?}: the bit without the offending block-table entry")),
        (Some(b), _) => b,
    };
    let at = first.request as usize * stride + first.entry as usize;
    let held = ((first.entry as usize) < stride).then(|| block_table.get(at).copied()).flatten();
    let outside = first.block < 0 || first.block >= num_blocks as i64;
    if held.map(i64::from) != Some(first.block) || !outside || first.num_blocks != num_blocks as u64 {
        return Err(format!("status names {first:?}, but that entry holds {held:?} (cache of {num_blocks} blocks)"));
    }
    if let Some(cpu_first) = want.first_bad_block.filter(|_| want.bad_blocks > 0) {
        // Only one entry is bad in the tests' tables: every kernel must name the reference's.
        let bad_entries = block_table.iter().filter(|&&b| b >= num_blocks as i32 || b < -1).count();
        if bad_entries == 1 && cpu_first != first {
            return Err(format!("status names {first:?}, the reference met {cpu_first:?}"));
        }
    }
    let message = match flags.into_result() {
        Err(e @ AttnError::BlockOutOfRange { first: Some(f) }) if f == first => e.to_string(),
        other => return Err(format!("into_result gave {other:?} for {flags:?}")),
    };
    let expected = format!("block id {} at request {}, block-table entry {}", first.block, first.request, first.entry);
    if !message.contains(&expected) {
        return Err(format!("error message {message:?} does not say {expected:?}"));
    }
    Ok(())
}
