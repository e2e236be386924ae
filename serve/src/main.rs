//! `serve`: SmolLM2-135M-Instruct (or another Llama GGUF) on attn-rs's paged attention.
//!
//! Default mode: the prompts are served together and each request's text is streamed; then
//! time to first token, tokens/s and attention's share of the step time. `--check` compares
//! greedy tokens and logits with candle-transformers' `quantized_llama`; `--bench` measures
//! many concurrent requests against it.

use attn_serve::bench::{run_bench, BenchOptions, BenchSizes};
use attn_serve::check::{run_check, Weights};
use attn_serve::engine::{Request, Stop};
use attn_serve::error::Result;
use attn_serve::setup::{engine, select_device, Loaded, Sizes, DEFAULT_PROMPTS};
use attn_serve::stream::Streamer;
use candle_core::Device;
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser};
use std::io::Write;
use std::path::PathBuf;
use std::time::{Duration, Instant};

#[derive(Parser, Debug)]
#[command(name = "serve", version, about = "SmolLM2-135M served end to end on attn-rs's paged attention (candle ops around it)")]
struct Cli {
    /// The GGUF model (fetch SmolLM2 with scripts/fetch-smollm2.sh)
    #[arg(long, default_value = "models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    model: PathBuf,
    /// A user prompt, sent through the model's chat template (repeat for more requests)
    /// [default: four built-in prompts]
    #[arg(long = "prompt", value_name = "TEXT")]
    prompts: Vec<String>,
    /// New tokens per request (a request also stops at its end-of-turn token)
    /// [default: 256 on a GPU, 12 on the CPU]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=8192))]
    max_tokens: Option<u32>,
    /// Run on the CPU even when a GPU is available
    #[arg(long)]
    cpu: bool,
    /// Requests running at once (continuous batching) [default: all the requests, at most 64
    /// unless --bench]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=4096))]
    max_running: Option<u32>,
    /// Tokens a step computes: one per decoding request, prompt chunks fill the rest (chunked
    /// prefill) [default: 2048 on a GPU, 256 on the CPU, 24 for --check]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..=1 << 20))]
    token_budget: Option<u32>,
    /// Tokens per KV-cache block (a multiple of 16 on the GPU)
    #[arg(long, value_name = "N", default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=1024))]
    block_size: u32,
    /// KV-cache blocks per layer [default: enough for every running request's whole length]
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    num_blocks: Option<u32>,
    /// Check greedy tokens and logits against candle-transformers' quantized_llama
    #[arg(long, conflicts_with = "bench")]
    check: bool,
    /// Tokens compared per prompt by --check
    #[arg(long, value_name = "N", default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    check_tokens: u32,
    /// Benchmark concurrent requests against quantized_llama (table, and JSON with --json)
    #[arg(long)]
    bench: bool,
    /// --bench: concurrent requests [default: 64 on a GPU, 4 on the CPU]
    #[arg(long, value_name = "N", requires = "bench", value_parser = clap::value_parser!(u32).range(1..=4096))]
    requests: Option<u32>,
    /// --bench: prompt tokens per request [default: 512 on a GPU, 64 on the CPU]
    #[arg(long, value_name = "N", requires = "bench", value_parser = clap::value_parser!(u32).range(1..=3072))]
    prompt_len: Option<u32>,
    /// --bench: new tokens per request [default: 256 on a GPU, 8 on the CPU]
    #[arg(long, value_name = "N", requires = "bench", value_parser = clap::value_parser!(u32).range(1..=1024))]
    new_tokens: Option<u32>,
    /// --bench: skip quantized_llama (ours only)
    #[arg(long, requires = "bench")]
    no_reference: bool,
    /// --bench: also write the report as JSON to this file
    #[arg(long, value_name = "PATH", requires = "bench")]
    json: Option<PathBuf>,
}

fn usage_error(msg: String) -> ! {
    Cli::command().error(ErrorKind::ValueValidation, msg).exit()
}

fn main() {
    let cli = Cli::parse();
    if !cli.model.is_file() {
        usage_error(format!("--model {}: no such file (run scripts/fetch-smollm2.sh)", cli.model.display()));
    }
    if let Some(p) = cli.prompts.iter().find(|p| p.trim().is_empty()) {
        usage_error(format!("--prompt {p:?}: empty"));
    }
    let (device, device_line) = select_device(cli.cpu);
    let gpu = !device.is_cpu();
    if gpu && cli.block_size % 16 != 0 {
        usage_error(format!("--block-size {}: the GPU kernels take multiples of 16", cli.block_size));
    }
    let cpu = device.is_cpu();
    let pick = |x: Option<u32>, gpu: usize, cpu_default: usize| x.map_or(if cpu { cpu_default } else { gpu }, |n| n as usize);
    let bench_sizes = BenchSizes {
        requests: pick(cli.requests, 64, 4),
        prompt_len: pick(cli.prompt_len, 512, 64),
        new_tokens: pick(cli.new_tokens, 256, 8),
    };
    // By default every request runs at once: --check's and the prompts (up to 64), --bench's.
    let requests = if cli.bench { bench_sizes.requests } else { prompts(&cli).len().min(64) };
    let max_running = cli.max_running.map_or(requests, |n| n as usize);
    let token_budget = cli.token_budget.map_or(
        if cli.check {
            24
        } else if gpu {
            2048
        } else {
            256
        },
        |n| n as usize,
    );
    if token_budget < max_running {
        usage_error(format!("--token-budget {token_budget} must be at least --max-running {max_running} (every decode takes one token)"));
    }
    let sizes = Sizes {
        max_running,
        token_budget,
        block_size: cli.block_size as usize,
        num_blocks: cli.num_blocks.map(|n| n as usize),
        max_model_len: 0,
    };
    println!("device: {device_line}");
    let result = if cli.check {
        check(&cli, &device, sizes)
    } else if cli.bench {
        bench(&cli, &device, &device_line, sizes, bench_sizes)
    } else {
        generate(&cli, &device, sizes)
    };
    match result {
        Ok(true) => {}
        Ok(false) => std::process::exit(1),
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(1);
        }
    }
}

fn prompts(cli: &Cli) -> Vec<String> {
    if cli.prompts.is_empty() {
        DEFAULT_PROMPTS.iter().map(|s| s.to_string()).collect()
    } else {
        cli.prompts.clone()
    }
}

fn load(cli: &Cli, device: &Device) -> Result<Loaded> {
    let started = Instant::now();
    let loaded = Loaded::load(&cli.model, device)?;
    println!("model: {} ({}; loaded in {:.2} s)", cli.model.display(), loaded.describe(), started.elapsed().as_secs_f64());
    Ok(loaded)
}

/// Serves the prompts together, streaming each request's text.
fn generate(cli: &Cli, device: &Device, mut sizes: Sizes) -> Result<bool> {
    let loaded = load(cli, device)?;
    let prompts = prompts(cli);
    let max_new = cli.max_tokens.map_or(if device.is_cpu() { 12 } else { 256 }, |n| n as usize);
    if device.is_cpu() && cli.max_tokens.is_none() {
        println!("(CPU: stopping after {max_new} new tokens per request; --max-tokens to change)");
    }
    let encoded: Vec<Vec<u32>> = prompts.iter().map(|p| loaded.chat_tokens(p)).collect::<Result<_>>()?;
    sizes.max_model_len = encoded.iter().map(Vec::len).max().unwrap_or(0) + max_new;
    let mut eng = engine(&loaded, sizes, false)?;
    println!(
        "attention: attn-rs backend \"{}\", {} KV-cache blocks of {} tokens per layer ({:.1} MiB), {} running at most, {} tokens per step",
        eng.attention().backend(),
        eng.attention().num_blocks(),
        sizes.block_size,
        eng.attention().cache_bytes() as f64 / (1 << 20) as f64,
        sizes.max_running,
        sizes.token_budget
    );
    // One throwaway request first: the first launches on a GPU load and JIT-compile modules
    // (candle's and cuBLAS's), seconds that belong to start-up, not to time to first token.
    eng.add(Request { id: usize::MAX, prompt: encoded[0][..1].to_vec(), max_new_tokens: 2, stop_at_eos: false })?;
    eng.run(&mut |_| {})?;
    for (id, p) in encoded.iter().enumerate() {
        eng.add(Request { id, prompt: p.clone(), max_new_tokens: max_new, stop_at_eos: true })?;
    }
    eng.attention().set_timing(true);
    eng.restart_clock();
    let started = Instant::now();
    let stdout = std::io::stdout();
    let mut streamer = Streamer::new(&loaded.tokenizer, stdout.lock());
    let mut io_err = None;
    let (mut outputs, reports) = eng.run(&mut |ev| {
        if let Err(e) = streamer.token(ev.id, ev.token, ev.finished.is_some()) {
            io_err.get_or_insert(e);
        }
    })?;
    let wall = started.elapsed();
    if let Some(e) = io_err {
        return Err(e.into());
    }
    drop(streamer);
    outputs.sort_by_key(|o| o.id);

    println!("\n{:>3} {:>7} {:>9} {:>10} {:>10}  prompt", "id", "prompt", "generated", "TTFT (ms)", "stop");
    for o in &outputs {
        let stop = match o.stop {
            Stop::Eos => "end",
            Stop::Length => "length",
        };
        let p: String = prompts[o.id].chars().take(48).collect();
        println!("{:>3} {:>7} {:>9} {:>10.1} {:>10}  {p}", o.id, o.prompt_len, o.tokens.len(), o.ttft.as_secs_f64() * 1e3, stop);
    }
    let generated: usize = outputs.iter().map(|o| o.tokens.len()).sum();
    let prompt_tokens: usize = outputs.iter().map(|o| o.prompt_len).sum();
    let step_time: Duration = reports.iter().map(|r| r.wall).sum();
    let attn: Duration = reports.iter().map(|r| r.attn.cache_write + r.attn.attention).sum();
    let cache_write: Duration = reports.iter().map(|r| r.attn.cache_write).sum();
    let ttft_mean = outputs.iter().map(|o| o.ttft.as_secs_f64()).sum::<f64>() / outputs.len().max(1) as f64;
    println!(
        "{} requests, {prompt_tokens} prompt + {generated} generated tokens in {:.2} s, {} steps: {:.1} generated tokens/s ({:.1} tokens/s with the prompts); mean time to first token {:.1} ms",
        outputs.len(),
        wall.as_secs_f64(),
        reports.len(),
        generated as f64 / wall.as_secs_f64(),
        (generated + prompt_tokens) as f64 / wall.as_secs_f64(),
        ttft_mean * 1e3
    );
    println!(
        "attention (attn-rs cache write + attention, all layers{}): {:.1}% of step time ({:.1} ms of {:.1} ms; cache write {:.1} ms)",
        if device.is_cpu() { ", timed on the host" } else { ", CUDA events" },
        100.0 * attn.as_secs_f64() / step_time.as_secs_f64().max(1e-12),
        attn.as_secs_f64() * 1e3,
        step_time.as_secs_f64() * 1e3,
        cache_write.as_secs_f64() * 1e3
    );
    Ok(true)
}

fn check(cli: &Cli, device: &Device, mut sizes: Sizes) -> Result<bool> {
    let loaded = load(cli, device)?;
    let prompts = prompts(cli);
    let tokens = cli.check_tokens as usize;
    let longest = prompts.iter().map(|p| loaded.chat_tokens(p).map(|t| t.len())).collect::<Result<Vec<_>>>()?;
    sizes.max_model_len = longest.into_iter().max().unwrap_or(0) + tokens;
    println!(
        "check: {} prompts x {tokens} greedy tokens, ours (served together, {} tokens per step) against candle-transformers' quantized_llama (each alone)",
        prompts.len(),
        sizes.token_budget
    );
    let started = Instant::now();
    let report = run_check(&loaded, &cli.model, device, &prompts, tokens, sizes, &[Weights::F32, Weights::Served])?;
    print!("{}", report.table());
    let ok = report.passed();
    println!("check {} in {:.1} s", if ok { "passed" } else { "FAILED" }, started.elapsed().as_secs_f64());
    Ok(ok)
}

fn bench(cli: &Cli, device: &Device, device_line: &str, mut sizes: Sizes, bs: BenchSizes) -> Result<bool> {
    if device.is_cpu() && (cli.requests.is_none() || cli.prompt_len.is_none() || cli.new_tokens.is_none()) {
        println!("(CPU: small default sizes; --requests, --prompt-len, --new-tokens to change)");
    }
    sizes.max_model_len = bs.prompt_len + bs.new_tokens;
    let loaded = load(cli, device)?;
    let opts = BenchOptions { sizes: bs, engine: sizes, reference: !cli.no_reference, device_line: device_line.to_owned() };
    let report = run_bench(&loaded, &cli.model, device, &opts, &mut std::io::stderr())?;
    print!("{}", report.table());
    let json = serde_json::to_string_pretty(&report).map_err(|e| attn_serve::error::ServeError::Config(e.to_string()))?;
    match &cli.json {
        Some(path) => {
            std::fs::write(path, json + "\n")?;
            println!("JSON: {}", path.display());
        }
        None => {
            let mut out = std::io::stdout().lock();
            writeln!(out, "{json}")?;
        }
    }
    Ok(true)
}
