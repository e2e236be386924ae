//! The main job: a simulated serving engine. A Llama-3-8B-like model and a DeepSeek-like MLA
//! model, each served to a deterministic stream of requests (varied prompt and generation
//! lengths, arriving and finishing) by a chunked-prefill scheduler with a block allocator; every
//! step's mixed batch goes through `host::forward` on every layer (random activations: there is
//! no model), a sample is checked against the CPU reference, and a progress line and a summary
//! (tokens/s, each step's time split into metadata, cache write and attention) are printed.
//!
//! The backend comes from the registry (`--backend NAME`, else `ATTN_BACKEND`, else automatic).
//! Without a GPU everything runs on the CPU backend with small sizes. On a GPU the models run
//! on their GPU backends (`tensor-core`, `mla`); a backend whose kernels are missing falls back
//! to the CPU backend, labelled so.
//!
//! `engine-sim [--model llama|deepseek|both] [--backend NAME] [--dtype bf16|f16|f32]
//!  [--layers N] [--requests N] [--steps N] [--max-running N] [--token-budget N]
//!  [--prompt MIN:MAX] [--gen MIN:MAX] [--blocks N] [--check-every N] [--check-layers A,B]
//!  [--check-reqs N] [--check-tokens N] [--progress-every N] [--decode-threshold N] [--seed N]`

use host::backend::{select_backend, select_backend_no_env, DeviceInfo, Selection};
use host::forward::GpuHandles;
use host::sim::{run_sim, SimConfig, SimError, SimModel};
use host::{AttnDevice, AttnError, DType};
use std::collections::HashMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

const USAGE: &str = "usage: engine-sim [--model llama|deepseek|both] [--backend NAME] [--dtype bf16|f16|f32] [--layers N] \
[--requests N] [--steps N] [--max-running N] [--token-budget N] [--prompt MIN:MAX] [--gen MIN:MAX] [--blocks N] \
[--check-every N] [--check-layers A,B] [--check-reqs N] [--check-tokens N] [--progress-every N] [--decode-threshold N] [--seed N]";

fn main() -> ExitCode {
    let args = match parse_args() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("engine-sim: {e}\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    match run(&args) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("engine-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

type Args = HashMap<String, String>;

const FLAGS: &[&str] = &[
    "model",
    "backend",
    "dtype",
    "layers",
    "requests",
    "steps",
    "max-running",
    "token-budget",
    "prompt",
    "gen",
    "blocks",
    "check-every",
    "check-layers",
    "check-reqs",
    "check-tokens",
    "progress-every",
    "decode-threshold",
    "seed",
];

fn parse_args() -> Result<Args, String> {
    let mut args = Args::new();
    let mut it = std::env::args().skip(1);
    while let Some(a) = it.next() {
        if a == "-h" || a == "--help" {
            println!("{USAGE}");
            std::process::exit(0);
        }
        let name = a.strip_prefix("--").filter(|n| FLAGS.contains(n)).ok_or_else(|| format!("unknown argument {a:?}"))?;
        let value = it.next().ok_or_else(|| format!("--{name} needs a value"))?;
        args.insert(name.to_string(), value);
    }
    Ok(args)
}

fn num(args: &Args, name: &str) -> Result<Option<usize>, String> {
    args.get(name).map(|v| v.parse::<usize>().map_err(|_| format!("--{name} {v:?}: not a number"))).transpose()
}

fn range(args: &Args, name: &str) -> Result<Option<(usize, usize)>, String> {
    let Some(v) = args.get(name) else { return Ok(None) };
    let bad = || format!("--{name} {v:?}: expected MIN:MAX with 1 <= MIN <= MAX");
    let (a, b) = v.split_once(':').ok_or_else(bad)?;
    let (a, b) = (a.parse::<usize>().map_err(|_| bad())?, b.parse::<usize>().map_err(|_| bad())?);
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok(Some((a, b)))
}

/// The preset for where the backend runs, with the flags applied.
fn sim_config(args: &Args, on_gpu: bool) -> Result<SimConfig, String> {
    let mut c = if on_gpu { SimConfig::gpu_default() } else { SimConfig::cpu_default() };
    if let Some(n) = num(args, "layers")? {
        c.num_layers = Some(n);
    }
    if let Some(n) = num(args, "requests")? {
        c.workload.num_requests = n;
        c.workload.initial = c.workload.initial.min(n);
    }
    if let Some(n) = num(args, "steps")? {
        c.max_steps = n;
    }
    if let Some(n) = num(args, "max-running")? {
        c.max_running = n;
    }
    if let Some(n) = num(args, "token-budget")? {
        c.token_budget = n;
    }
    if let Some(r) = range(args, "prompt")? {
        c.workload.prompt_len = r;
    }
    if let Some(r) = range(args, "gen")? {
        c.workload.gen_len = r;
    }
    c.num_blocks = num(args, "blocks")?.or(c.num_blocks);
    if let Some(n) = num(args, "check-every")? {
        c.check_every = n;
    }
    if let Some(v) = args.get("check-layers") {
        let layers: Result<Vec<usize>, _> = v.split(',').map(|x| x.trim().parse::<usize>()).collect();
        c.check_layers = Some(layers.map_err(|_| format!("--check-layers {v:?}: expected a list like 0,31"))?);
    }
    if let Some(n) = num(args, "check-reqs")? {
        c.check_reqs = n;
    }
    if let Some(n) = num(args, "check-tokens")? {
        c.check_tokens = n;
    }
    if let Some(n) = num(args, "progress-every")? {
        c.progress_every = n;
    }
    if let Some(n) = num(args, "decode-threshold")? {
        c.decode_threshold = n;
    }
    if let Some(n) = num(args, "seed")? {
        c.seed = n as u64;
    }
    Ok(c)
}

/// Opens GPU 0 if there is one (and loads its kernels), else says the run is on the CPU.
fn open_device() -> Result<(DeviceInfo, Option<GpuHandles>), Box<dyn std::error::Error>> {
    if !AttnDevice::driver_available() {
        println!(
            "engine-sim: no CUDA driver or GPU here: running on the CPU backend (host::cpu, the f64 reference \
             implementation) with small sizes; throughput figures are the CPU reference's, not a GPU's"
        );
        return Ok((DeviceInfo::no_gpu(), None));
    }
    let dev = AttnDevice::new(0)?;
    let t = Instant::now();
    dev.preload()?;
    let (major, minor) = dev.compute_capability();
    let name = dev.context().name().unwrap_or_else(|_| "GPU".into());
    println!(
        "engine-sim: GPU 0: {name} (sm_{major}{minor}, {} SMs), module {} ({}), kernels loaded in {:.0} ms",
        dev.sm_count(),
        dev.ptx_target(),
        if dev.loads_sass() { "SASS" } else { "PTX, JIT-compiled by the driver" },
        t.elapsed().as_secs_f64() * 1e3
    );
    let stream = dev.context().new_stream()?;
    let info = DeviceInfo::from_device(&dev);
    Ok((info, Some(GpuHandles { dev: Arc::new(dev), stream })))
}

fn run(args: &Args) -> Result<bool, Box<dyn std::error::Error>> {
    let dtype = match args.get("dtype").map(String::as_str).unwrap_or("bf16") {
        "bf16" => DType::BF16,
        "f16" => DType::F16,
        "f32" => DType::F32,
        other => return Err(format!("--dtype {other:?}: bf16, f16 or f32").into()),
    };
    let models = match args.get("model").map(String::as_str).unwrap_or("both") {
        "llama" => vec![SimModel::llama3_8b(dtype)],
        "deepseek" => vec![SimModel::deepseek_v2_lite(dtype)],
        "both" => vec![SimModel::llama3_8b(dtype), SimModel::deepseek_v2_lite(dtype)],
        other => return Err(format!("--model {other:?}: llama, deepseek or both").into()),
    };
    let (device, gpu) = open_device()?;
    let mut all_ok = true;
    for model in &models {
        println!();
        let selection = match select_backend(&model.config, &device, args.get("backend").map(String::as_str)) {
            Ok(s) => s,
            Err(e) => {
                println!("== {}: no backend: {e}", model.name);
                all_ok = false;
                continue;
            }
        };
        describe_choice(model, &selection);
        let mut result = run_one(model, &selection, gpu.clone(), args);
        if let Err(SimError::Attn(e @ AttnError::MissingKernel { .. })) = &result {
            // MLA on a GPU: its kernels are missing; run the configuration on the CPU instead.
            println!("   {e}\n   -> running {} on the CPU backend instead [cpu, not GPU figures]", model.name);
            let cpu = select_backend_no_env(&model.config, &DeviceInfo::no_gpu(), Some("cpu"))?;
            result = run_one(model, &cpu, None, args);
        }
        match result {
            Ok(report) => all_ok &= report.passed(),
            Err(e) => {
                println!("== {}: stopped: {e}", model.name);
                all_ok = false;
            }
        }
    }
    Ok(all_ok)
}

fn run_one(model: &SimModel, selection: &Selection, gpu: Option<GpuHandles>, args: &Args) -> Result<host::sim::SimReport, SimError> {
    let cfg = sim_config(args, selection.backend.needs_gpu).map_err(SimError::Config)?;
    let mut out = std::io::stdout();
    run_sim(model, &cfg, selection, gpu, &mut out)
}

/// Which backend was chosen, and why the better-ranked ones were not.
fn describe_choice(model: &SimModel, s: &Selection) {
    let how = match s.overridden_by {
        Some(source) => format!("override from {source}"),
        None => "automatic".into(),
    };
    println!("{}: backend \"{}\" ({how})", model.name, s.backend.name);
    for r in &s.refused {
        let reasons: Vec<String> = r.reasons.iter().map(ToString::to_string).collect();
        println!("   refused \"{}\": {}", r.backend.name, reasons.join("; "));
    }
}
