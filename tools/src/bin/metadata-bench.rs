//! CPU micro-benchmark of per-step metadata: validate + split + pack for 256 decode
//! requests (context lengths 100..8000, block size 16), the target being 20 us a step.
//!
//! `metadata-bench [--runs N] [--reqs N] [--builder-only]` (build with `--release`). Prints the
//! median and percentiles of one build, for the free functions (`build_tensor_core_metadata` +
//! `pack`, allocating) and for `MetadataBuilder` (buffers reused), after a warm-up; and what a
//! model with chunked local layers adds: the step cut at chunk starts (chunks of 4096, so about
//! half the requests are past their first chunk) and that local batch's own build.

use attn_rs::metadata::{
    build_tensor_core_metadata, pack, pack_into, split_decodes, validate, BatchSplit, LocalBatch, MetadataBuilder, PlanConfig, StepInput,
};
use clap::Parser;
use std::hint::black_box;
use std::time::Instant;

/// A deterministic generator (no dev-dependency in a binary).
struct SplitMix(u64);

impl SplitMix {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo)
    }
}

/// The engine's arrays for `num_reqs` single-token decodes.
struct Step {
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    stride: usize,
    slot_mapping: Vec<i64>,
    num_blocks: usize,
}

const BLOCK_SIZE: usize = 16;
const MAX_LEN: usize = 8000;
/// The chunk of the local-batch rows (Llama 4's is 8192; 4096 puts about half the contexts
/// past their first chunk).
const CHUNK: usize = 4096;

impl Step {
    fn decodes(num_reqs: usize, rng: &mut SplitMix) -> Step {
        let stride = MAX_LEN.div_ceil(BLOCK_SIZE);
        let num_blocks = num_reqs * stride;
        let seq_lens: Vec<i32> = (0..num_reqs).map(|_| rng.range(100, MAX_LEN as u64) as i32).collect();
        let block_table: Vec<i32> = (0..num_reqs * stride).map(|_| rng.range(0, num_blocks as u64) as i32).collect();
        let slot_mapping = (0..num_reqs)
            .map(|r| {
                let pos = seq_lens[r] as usize - 1;
                (block_table[r * stride + pos / BLOCK_SIZE] as usize * BLOCK_SIZE + pos % BLOCK_SIZE) as i64
            })
            .collect();
        Step { query_start_loc: (0..=num_reqs as i32).collect(), seq_lens, block_table, stride, slot_mapping, num_blocks }
    }

    fn input(&self) -> StepInput<'_> {
        StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            slot_mapping: &self.slot_mapping,
            num_actual_tokens: self.seq_lens.len(),
            num_blocks: self.num_blocks,
            block_size: BLOCK_SIZE,
        }
    }
}

/// Median and 10th/90th percentiles of `runs` timings of `f` (microseconds), after warm-up.
fn measure(runs: usize, mut f: impl FnMut()) -> [f64; 3] {
    for _ in 0..runs.min(2000) {
        f();
    }
    let mut us: Vec<f64> = (0..runs)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64() * 1e6
        })
        .collect();
    us.sort_by(f64::total_cmp);
    [us[runs / 10], us[runs / 2], us[runs * 9 / 10]]
}

/// CPU micro-benchmark of per-step metadata: validate + split + pack for decode requests
/// (context lengths 100..8000, block size 16), the target being 20 us a step. Build with
/// `--release`.
#[derive(Parser, Debug)]
#[command(name = "metadata-bench")]
struct Cli {
    /// Timed builds per measurement (after as many warm-up builds, at most 2000).
    #[arg(long, value_name = "N", default_value_t = 10_000, value_parser = at_least(1000))]
    runs: usize,
    /// Decode requests in the step.
    #[arg(long, value_name = "N", default_value_t = 256, value_parser = at_least(1))]
    reqs: usize,
    /// Only the reused builder, one line (for profilers).
    #[arg(long)]
    builder_only: bool,
}

/// A parser of counts of at least `min`.
fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |v| match v.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!("{n} is below {min}")),
        Err(e) => Err(e.to_string()),
    }
}

fn main() {
    let Cli { runs, reqs: num_reqs, builder_only } = Cli::parse();
    // Llama-3-8B-like layer on an H100.
    let config = PlanConfig { decode_threshold: 1, num_q_heads: 32, num_kv_heads: 8, head_size: 128 };
    let step = Step::decodes(num_reqs, &mut SplitMix(0x5eed));
    let input = step.input();
    let c = config;

    let mut builder = MetadataBuilder::new(config).expect("valid config");
    if builder_only {
        // For profilers: nothing but the reused builder.
        let [p10, median, p90] = measure(runs, || {
            black_box(builder.build(black_box(&input)).expect("valid step").words.len());
        });
        println!("median_us {median:.2} (MetadataBuilder, {num_reqs} decode requests; p10 {p10:.2}, p90 {p90:.2})");
        return;
    }
    let free = measure(runs, || {
        let meta = build_tensor_core_metadata(black_box(&input), c.decode_threshold, c.num_q_heads, c.num_kv_heads, c.head_size)
            .expect("valid step");
        black_box(pack(&meta, &input));
    });
    let reused = measure(runs, || {
        black_box(builder.build(black_box(&input)).expect("valid step").words.len());
    });
    // Where the time goes: each stage alone (reused buffers where it has any).
    let meta = build_tensor_core_metadata(&input, 1, 32, 8, 128).expect("valid step");
    let mut words = Vec::new();
    let stages = [
        ("validate", measure(runs, || validate(black_box(&input)).expect("valid step"))),
        (
            "split_decodes",
            measure(runs, || {
                black_box(split_decodes(black_box(&input), 1).expect("ordered"));
            }),
        ),
        (
            "pack_into (reused)",
            measure(runs, || {
                black_box(pack_into(black_box(&meta), &input, &mut words));
            }),
        ),
    ];
    // A chunked local layer's extra work a step: the cut, then the local batch's build.
    let split = builder.build(&input).expect("valid step").metadata.split;
    let mut local = LocalBatch::new(CHUNK, BLOCK_SIZE).expect("chunk of whole blocks");
    let mut local_builder = MetadataBuilder::new(config).expect("valid config");
    let cut = measure(runs, || local.build(black_box(&input), black_box(split)));
    let local_build = measure(runs, || {
        let split: BatchSplit = local.split();
        black_box(local_builder.build_split(black_box(&local.input(&input)), split).expect("valid local batch").words.len());
    });
    let built = builder.build(&input).expect("valid step");
    println!(
        "metadata for {num_reqs} decode requests (lengths 100..{MAX_LEN}, block size {BLOCK_SIZE}, stride {}): {} words packed",
        step.stride,
        built.words.len(),
    );
    println!("median of {runs} builds after warm-up (p10 / median / p90, microseconds):");
    for (name, [p10, p50, p90]) in [("build_tensor_core_metadata + pack", free), ("MetadataBuilder::build (reused)", reused)] {
        println!("  {name:<36} {p10:8.2} {p50:8.2} {p90:8.2}");
    }
    println!("stages alone:");
    for (name, [p10, p50, p90]) in stages {
        println!("  {name:<36} {p10:8.2} {p50:8.2} {p90:8.2}");
    }
    let local_words = local_builder.build_split(&local.input(&input), local.split()).expect("valid local batch").words.len();
    println!("a chunked local layer's local batch (chunks of {CHUNK}; {local_words} words packed), beside the step's build:");
    for (name, [p10, p50, p90]) in [("LocalBatch::build (the cut)", cut), ("MetadataBuilder::build_split (reused)", local_build)] {
        println!("  {name:<36} {p10:8.2} {p50:8.2} {p90:8.2}");
    }
    println!("median_us {:.2} (MetadataBuilder; target <= 20)", reused[1]);
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::CommandFactory;

    #[test]
    fn command_is_well_formed_and_checks_its_ranges() {
        Cli::command().debug_assert();
        let parse = |args: &[&str]| Cli::try_parse_from(std::iter::once("metadata-bench").chain(args.iter().copied()));
        let cli = parse(&["--runs=2000", "--reqs", "8", "--builder-only"]).unwrap();
        assert_eq!((cli.runs, cli.reqs, cli.builder_only), (2000, 8, true));
        for args in [&["--runs", "999"][..], &["--reqs=0"], &["--reqs", "x"], &["--runs"]] {
            assert_eq!(parse(args).unwrap_err().exit_code(), 2, "{args:?}");
        }
    }
}
