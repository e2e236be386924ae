//! The benchmark: `requests` concurrent requests of `prompt_len` tokens generating `new_tokens`
//! each, through our engine (paged attention, continuous batching, chunked prefill) and through
//! candle-transformers' `quantized_llama` (its attention over a concatenating cache) run as one
//! batch of the same equal-length prompts.

use crate::engine::{Request, StepReport};
use crate::error::{Result, ServeError};
use crate::reference::Reference;
use crate::setup::{engine, Loaded, Sizes};
use candle_core::Device;
use serde::Serialize;
use std::path::Path;
use std::time::{Duration, Instant};

#[derive(Clone, Copy, Debug, Serialize)]
pub struct BenchSizes {
    pub requests: usize,
    pub prompt_len: usize,
    pub new_tokens: usize,
}

/// Our engine's figures.
#[derive(Clone, Debug, Serialize)]
pub struct OursReport {
    pub backend: &'static str,
    pub token_budget: usize,
    pub block_size: usize,
    pub num_blocks: usize,
    pub wall_s: f64,
    pub generated_tokens: usize,
    /// Generated tokens per second of wall time.
    pub gen_tokens_per_s: f64,
    /// Prompt and generated tokens per second.
    pub total_tokens_per_s: f64,
    pub steps: usize,
    pub mean_step_ms: f64,
    /// attn-rs's cache write + attention per step, all layers (GPU: CUDA events; CPU: the
    /// calls' wall time).
    pub mean_attn_ms_per_step: f64,
    pub attn_share: f64,
    /// The same over the steps after the last prompt chunk (decode only).
    pub decode_steps: usize,
    pub decode_mean_step_ms: f64,
    pub decode_mean_attn_ms_per_step: f64,
    pub ttft_mean_ms: f64,
    pub ttft_max_ms: f64,
}

/// The reference's figures.
#[derive(Clone, Debug, Serialize)]
pub struct ReferenceReport {
    pub wall_s: f64,
    pub gen_tokens_per_s: f64,
    pub total_tokens_per_s: f64,
    /// The prompt step (all prompts at once), which also makes the first token.
    pub prefill_ms: f64,
    pub mean_decode_step_ms: f64,
    /// Tokens equal to ours, from the start of each request until the first difference, over
    /// all requests.
    pub agreeing_prefix_mean: f64,
}

#[derive(Clone, Debug, Serialize)]
pub struct BenchReport {
    pub device: String,
    pub model: String,
    pub sizes: BenchSizes,
    pub ours: OursReport,
    pub reference: Option<ReferenceReport>,
    /// Our generated tokens/s over the reference's.
    pub speedup: Option<f64>,
}

impl BenchReport {
    pub fn table(&self) -> String {
        let s = &self.sizes;
        let o = &self.ours;
        let mut t =
            format!("{} requests x {} prompt tokens, {} new tokens each; {}\n", s.requests, s.prompt_len, s.new_tokens, self.device);
        t += &format!("{:<34} {:>14} {:>16}\n", "", "ours (attn-rs)", "quantized_llama");
        let r = self.reference.as_ref();
        let f = |x: Option<f64>, p: usize| x.map_or("-".to_owned(), |x| format!("{x:.p$}"));
        let mut row = |name: &str, a: String, b: String| t += &format!("{name:<34} {a:>14} {b:>16}\n");
        row("wall time (s)", format!("{:.2}", o.wall_s), f(r.map(|r| r.wall_s), 2));
        row("generated tokens/s", format!("{:.1}", o.gen_tokens_per_s), f(r.map(|r| r.gen_tokens_per_s), 1));
        row("prompt + generated tokens/s", format!("{:.1}", o.total_tokens_per_s), f(r.map(|r| r.total_tokens_per_s), 1));
        row("steps", o.steps.to_string(), r.map_or("-".into(), |_| (s.new_tokens).to_string()));
        row("mean step (ms)", format!("{:.2}", o.mean_step_ms), "-".into());
        row("mean decode step (ms)", format!("{:.2}", o.decode_mean_step_ms), f(r.map(|r| r.mean_decode_step_ms), 2));
        row("attention per step (ms)", format!("{:.3}", o.mean_attn_ms_per_step), "-".into());
        row("attention per decode step (ms)", format!("{:.3}", o.decode_mean_attn_ms_per_step), "-".into());
        row("attention share of step time", format!("{:.1}%", 100.0 * o.attn_share), "-".into());
        row("time to first token, mean (ms)", format!("{:.1}", o.ttft_mean_ms), f(r.map(|r| r.prefill_ms), 1));
        row("time to first token, max (ms)", format!("{:.1}", o.ttft_max_ms), f(r.map(|r| r.prefill_ms), 1));
        row("greedy tokens agreeing (mean prefix)", "-".into(), f(r.map(|r| r.agreeing_prefix_mean), 1));
        if let Some(x) = self.speedup {
            t += &format!("generated tokens/s, ours / quantized_llama: {x:.2}x\n");
        }
        t
    }
}

/// `n` prompts of exactly `len` tokens: windows at different offsets of a long chat prompt
/// (the same text repeated), so that the requests differ and read like text.
pub fn bench_prompts(loaded: &Loaded, n: usize, len: usize) -> Result<Vec<Vec<u32>>> {
    let para = "The paged key-value cache stores each sequence's keys and values in fixed-size blocks, \
                so that many requests of different lengths share one pool of memory without copying. \
                A scheduler mixes the prompt chunks of new requests with one decode token of every running one. ";
    let mut text = String::new();
    let mut tokens = Vec::new();
    while tokens.len() < len + 7 * n {
        text += para;
        tokens = loaded.tokenizer.encode(&text);
    }
    Ok((0..n).map(|i| tokens[7 * i..7 * i + len].to_vec()).collect())
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// What to run.
#[derive(Clone, Debug)]
pub struct BenchOptions {
    pub sizes: BenchSizes,
    /// Our engine's scheduler and cache.
    pub engine: Sizes,
    /// Also run candle-transformers' model.
    pub reference: bool,
    /// The device, in words (for the report).
    pub device_line: String,
}

/// Runs the benchmark on `device`, logging progress to `log`.
pub fn run_bench(
    loaded: &Loaded,
    model_path: &Path,
    device: &Device,
    opts: &BenchOptions,
    log: &mut dyn std::io::Write,
) -> Result<BenchReport> {
    let (bs, sizes, reference) = (opts.sizes, opts.engine, opts.reference);
    let prompts = bench_prompts(loaded, bs.requests, bs.prompt_len)?;
    let mut eng = engine(loaded, sizes, false)?;
    let backend = eng.attention().backend();
    let num_blocks = eng.attention().num_blocks();
    // A warm-up request: kernels loaded, allocations made.
    eng.add(Request { id: usize::MAX, prompt: prompts[0][..bs.prompt_len.min(32)].to_vec(), max_new_tokens: 2, stop_at_eos: false })?;
    eng.run(&mut |_| {})?;
    for (id, p) in prompts.iter().enumerate() {
        eng.add(Request { id, prompt: p.clone(), max_new_tokens: bs.new_tokens, stop_at_eos: false })?;
    }
    eng.attention().set_timing(true);
    eng.restart_clock();
    let started = Instant::now();
    let mut reports: Vec<StepReport> = Vec::new();
    while let Some(r) = eng.step(&mut |_| {})? {
        reports.push(r);
        if reports.len().is_multiple_of(64) {
            writeln!(log, "ours: step {} ({} running, {} waiting)", reports.len(), eng.num_running(), eng.num_waiting())?;
        }
    }
    let wall = started.elapsed();
    let mut outputs = eng.take_finished();
    outputs.sort_by_key(|o| o.id);
    drop(eng);
    let attn_time = |r: &StepReport| if r.attn.layers > 0 { r.attn.cache_write + r.attn.attention } else { r.attn_calls };
    let generated: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    let total_step: Duration = reports.iter().map(|r| r.wall).sum();
    let total_attn: Duration = reports.iter().map(attn_time).sum();
    let decode: Vec<&StepReport> = reports.iter().filter(|r| r.prefill_tokens == 0).collect();
    let mean = |xs: &[&StepReport], f: &dyn Fn(&StepReport) -> Duration| {
        if xs.is_empty() {
            0.0
        } else {
            xs.iter().map(|r| ms(f(r))).sum::<f64>() / xs.len() as f64
        }
    };
    let all: Vec<&StepReport> = reports.iter().collect();
    let ttfts: Vec<f64> = outputs.iter().map(|o| ms(o.ttft)).collect();
    let ours = OursReport {
        backend,
        token_budget: sizes.token_budget,
        block_size: sizes.block_size,
        num_blocks,
        wall_s: wall.as_secs_f64(),
        generated_tokens: generated,
        gen_tokens_per_s: generated as f64 / wall.as_secs_f64(),
        total_tokens_per_s: (generated + bs.requests * bs.prompt_len) as f64 / wall.as_secs_f64(),
        steps: reports.len(),
        mean_step_ms: mean(&all, &|r| r.wall),
        mean_attn_ms_per_step: mean(&all, &attn_time),
        attn_share: total_attn.as_secs_f64() / total_step.as_secs_f64().max(1e-12),
        decode_steps: decode.len(),
        decode_mean_step_ms: mean(&decode, &|r| r.wall),
        decode_mean_attn_ms_per_step: mean(&decode, &attn_time),
        ttft_mean_ms: ttfts.iter().sum::<f64>() / ttfts.len().max(1) as f64,
        ttft_max_ms: ttfts.iter().fold(0.0, |m: f64, &x| m.max(x)),
    };
    writeln!(log, "ours: {:.2} s, {:.1} generated tokens/s", ours.wall_s, ours.gen_tokens_per_s)?;

    let reference = if reference {
        let mut model = Reference::load(model_path, device)?;
        // Warm-up, as for ours.
        model.generate_batch(&prompts[..1], 2, |_, _| {})?;
        let mut steps = Vec::with_capacity(bs.new_tokens);
        let started = Instant::now();
        let tokens = model.generate_batch(&prompts, bs.new_tokens, |_, d| steps.push(d))?;
        let wall = started.elapsed();
        let generated = bs.requests * bs.new_tokens;
        let agree: usize = outputs.iter().zip(&tokens).map(|(o, r)| o.tokens.iter().zip(r).take_while(|(a, b)| a == b).count()).sum();
        let decode_steps = &steps[1.min(steps.len())..];
        let r = ReferenceReport {
            wall_s: wall.as_secs_f64(),
            gen_tokens_per_s: generated as f64 / wall.as_secs_f64(),
            total_tokens_per_s: (generated + bs.requests * bs.prompt_len) as f64 / wall.as_secs_f64(),
            prefill_ms: steps.first().map_or(0.0, |d| ms(*d)),
            mean_decode_step_ms: decode_steps.iter().map(|d| ms(*d)).sum::<f64>() / decode_steps.len().max(1) as f64,
            agreeing_prefix_mean: agree as f64 / bs.requests as f64,
        };
        writeln!(log, "quantized_llama: {:.2} s, {:.1} generated tokens/s", r.wall_s, r.gen_tokens_per_s)?;
        Some(r)
    } else {
        None
    };
    if outputs.len() != bs.requests {
        return Err(ServeError::Config(format!("{} of {} requests finished", outputs.len(), bs.requests)));
    }
    let speedup = reference.as_ref().map(|r| ours.gen_tokens_per_s / r.gen_tokens_per_s);
    Ok(BenchReport { device: opts.device_line.clone(), model: loaded.describe(), sizes: bs, ours, reference, speedup })
}
