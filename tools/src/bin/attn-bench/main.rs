//! Benchmark: measures the device-to-device copy ceiling and the read ceiling, then each kernel,
//! in one run, and prints a table (and JSON with `--json PATH`): shape, median time over
//! CUDA-event timings after warm-up, GB/s (bytes read + written), and the fractions of the
//! copy and read ceilings.
//!
//! `attn-bench [--json PATH] [--quick] [--only cache|decode|prefill|mla] [TUNING]`
//!
//! The split planners' knobs (`attn_rs::Tuning`; the measured defaults otherwise):
//! `--decode-waves N` (waves of resident CTAs a decode plan aims at), `--no-decode-even-waves`,
//! `--mla-waves N`, `--no-mla-clusters`.
//!
//! The groups of rows: [`cache`], [`decode`], [`prefill`], [`mla`]; what they share: [`bench`];
//! the read ceiling's kernel: [`read_ceiling`]; the table and the JSON: [`report`].

mod bench;
mod cache;
mod decode;
mod mla;
mod prefill;
mod read_ceiling;
mod report;

use attn_rs::{AttnDevice, DeviceStatus, Result, Tuning};
use bench::{copy_row, dev, Bench};
use clap::{Parser, ValueEnum};
use std::path::PathBuf;

/// Measures the device-to-device copy ceiling and the read ceiling, then each kernel (cache
/// writes, decode, prefill, MLA), and prints a table: shape, median time over CUDA-event timings
/// after warm-up, GB/s or TFLOP/s, and the share of the copy and read ceilings or of the dense
/// bf16 matmul rate.
#[derive(Parser, Debug)]
#[command(
    name = "attn-bench",
    after_long_help = "Environment variables (experiments): ATTN_BENCH_DECODE_SHAPES=64x4096,8x32768,64x4096x80,64x4096x128x2 (planned decode rows, bf16 and FP8 caches, \
of those batch x context [x head size [x kv heads of 32 query heads]] only), ATTN_BENCH_DECODE_LAYOUT=hnd|fi_nhd|fi_hnd (another decode cache layout), ATTN_BENCH_DECODE_HOT=N \
(every block-table entry within the first N blocks), ATTN_BENCH_DECODE_SPLITS=N (N splits a request), \
ATTN_BENCH_DECODE_CACHES=N (the timed decode calls take N caches in turn, as consecutive layers do; by default at least 2 and \
twice the L2 cache together), \
ATTN_BENCH_PREFILL_SHAPES=8x2048x32x32x64,8x512x32x8x128x8192 (batch x new tokens x q heads x kv heads x head size [x cached \
tokens], bf16 and FP8 caches), ATTN_BENCH_MLA_SHAPES=16x64x4096 (planned bf16 MLA rows of heads x batch x context)."
)]
struct Cli {
    /// Also write the rows as JSON to PATH.
    #[arg(long, value_name = "PATH")]
    json: Option<PathBuf>,
    /// Fewer warm-up calls and timed batches (5 and 10 instead of 20 and 50).
    #[arg(long)]
    quick: bool,
    /// Only this group of rows (the ceilings are always measured).
    #[arg(long, value_enum, value_name = "GROUP")]
    only: Option<Group>,
    /// Waves of resident CTAs a tensor-core decode plan aims at (0 counts as 1; default: the
    /// measured value for the head size).
    #[arg(long, value_name = "N")]
    decode_waves: Option<u64>,
    /// Do not split batches of requests of about equal length into even waves of CTAs.
    #[arg(long)]
    no_decode_even_waves: bool,
    /// Waves of resident CTAs an MLA plan aims at (0 counts as 1).
    #[arg(long, value_name = "N", default_value_t = Tuning::DEFAULT.mla_waves)]
    mla_waves: u64,
    /// No thread-block clusters for MLA's splits.
    #[arg(long)]
    no_mla_clusters: bool,
}

/// A group of rows (`--only`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum Group {
    /// The cache writes, against a copy of the same size.
    Cache,
    /// Paged decode.
    Decode,
    /// Causal paged prefill.
    Prefill,
    /// MLA decode over the latent cache.
    Mla,
}

impl Cli {
    /// The split planners' knobs.
    fn tuning(&self) -> Tuning {
        Tuning {
            decode_waves: self.decode_waves.or(Tuning::DEFAULT.decode_waves),
            decode_even_waves: !self.no_decode_even_waves,
            mla_waves: self.mla_waves,
            mla_clusters: !self.no_mla_clusters,
        }
    }

    fn wants(&self, group: Group) -> bool {
        self.only.is_none_or(|o| o == group)
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    if !AttnDevice::driver_available() {
        eprintln!("attn-bench: no CUDA driver or GPU; nothing to measure");
        std::process::exit(2);
    }
    let d = dev();
    let name = d.context().name()?;
    println!(
        "device: {name}, sm_{}{}, {} SMs, {} DRAM peak, module {} ({})",
        d.compute_capability().0,
        d.compute_capability().1,
        d.sm_count(),
        d.memory_bandwidth().map_or("unknown".to_string(), |b| format!("{:.2} TB/s", b / 1e12)),
        d.ptx_target(),
        if d.loads_sass() { "SASS" } else { "PTX JIT" }
    );
    let stream = d.context().new_stream()?;
    // The bench owns every buffer and uses one stream: cudarc's cross-stream event tracking
    // would only add host work between launches.
    unsafe { d.context().disable_event_tracking() };
    let (warmup, reps) = if cli.quick { (5, 10) } else { (20, 50) };
    let b = Bench { stream: stream.clone(), warmup, reps, batch: 10, tuning: cli.tuning() };
    let mut status = DeviceStatus::new(&stream)?;

    let copy = copy_row(&b, 1 << 30)?;
    let read = read_ceiling::read_row(&b, d.sm_count(), 1 << 30)?;
    let mut rows = vec![];
    if cli.wants(Group::Cache) {
        cache::cache_write_rows(&b, &mut rows, &mut status)?;
    }
    if cli.wants(Group::Prefill) {
        prefill::prefill_rows(&b, &mut rows, &mut status)?;
    }
    if cli.wants(Group::Decode) {
        decode::decode_rows(&b, &mut rows, &mut status)?;
    }
    if cli.wants(Group::Mla) {
        mla::mla_rows(&b, &mut rows, &mut status)?;
    }
    report::print_and_save(&copy, &read, &rows, &name, cli.json.as_deref())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    fn parse(args: &[&str]) -> std::result::Result<Cli, clap::Error> {
        Cli::try_parse_from(std::iter::once("attn-bench").chain(args.iter().copied()))
    }

    #[test]
    fn command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_take_both_spellings_and_give_the_tuning() {
        let cli = parse(&["--json=out.json", "--only", "decode", "--decode-waves=2", "--mla-waves", "3", "--no-mla-clusters"]).unwrap();
        assert_eq!(cli.json.as_deref(), Some(std::path::Path::new("out.json")));
        assert!(cli.wants(Group::Decode) && !cli.wants(Group::Mla));
        let t = cli.tuning();
        assert_eq!((t.decode_waves, t.decode_even_waves, t.mla_waves, t.mla_clusters), (Some(2), true, 3, false));
        assert_eq!(parse(&[]).unwrap().tuning(), Tuning::DEFAULT);
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for args in [&["--only", "attention"][..], &["--decode-waves", "x"], &["--json"], &["--layers", "2"]] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
        }
    }
}
