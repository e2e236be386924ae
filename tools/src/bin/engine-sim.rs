//! The main job: a simulated serving engine. A Llama-3-8B-like model, a DeepSeek-like MLA model,
//! a Gemma-2-like model (sliding window on every other layer, soft-capped logits), a
//! Llama-4-like model (chunked local attention on three layers of four), a Llama-like
//! model whose second half of the layers reads one earlier layer's cache (KV sharing) and a
//! Whisper-like encoder-decoder model (bidirectional encoder layers over each request's encoder
//! input, then decoder blocks of causal self-attention and cross-attention over a cache each
//! fills once per request), each served to a deterministic stream of requests (varied prompt and
//! generation lengths, arriving and finishing) by a chunked-prefill scheduler with a block
//! allocator (Whisper: an encoder step for the requests admitted in a step, which then join the
//! decoder batch); every step's mixed batch goes through `attn_rs::forward` on every layer with
//! that layer's settings (random activations: there is no model), a sample is checked against
//! an f64 reference, and a progress line and a summary (tokens/s, each step's time split into
//! metadata, cache write and attention) are printed.
//!
//! The backend comes from the registry (`--backend NAME`, else `ATTN_BACKEND`, else automatic).
//! Without a GPU everything runs on the CPU backend with small sizes. On a GPU the models run
//! on their GPU backends (`tensor-core`, `mla`); a backend whose kernels are missing falls back
//! to the CPU backend, labelled so.
//!
//! `engine-sim [--model llama|deepseek|gemma2|llama4|kv-shared|whisper|phi2|both|all] [--backend NAME]
//!  [--dtype bf16|f16|f32] [--layers N] [--window N] [--softcap X] [--chunk N] [--encoder-len N]
//!  [--encoder-budget N] [--requests N] [--steps N]
//!  [--max-running N] [--token-budget N] [--prompt MIN:MAX] [--gen MIN:MAX] [--blocks N]
//!  [--check-every N] [--check-layers A,B] [--check-reqs N] [--check-tokens N]
//!  [--progress-every N] [--decode-threshold N] [--seed N] [--graphs]`
//! (`--help` describes each; flags not given take the preset's value for where the backend
//! runs, `SimConfig::cpu_default` or `SimConfig::gpu_default`, with prompts stretched past a
//! model's window or first chunk when the preset's would not reach it, and decoder prompts of 1 to 8 tokens for
//! the Whisper-like model).

use attn_rs::backend::{find_backend, select_backend, select_backend_no_env, DeviceInfo, Selection};
use attn_rs::forward::GpuHandles;
use attn_rs::{AttnDevice, AttnError, DType};
use attn_tools::sim::{run_sim, SimConfig, SimError, SimModel};
use clap::error::ErrorKind;
use clap::{CommandFactory, Parser, ValueEnum};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;

/// A simulated serving engine: Llama-3-8B-like, DeepSeek-like MLA, Gemma-2-like, Llama-4-like,
/// KV-sharing and Whisper-like encoder-decoder models served to a deterministic stream of requests by a
/// chunked-prefill scheduler, every step's mixed batch through `attn_rs::forward` on every
/// layer, a sample checked against an f64 reference.
///
/// Flags not given take the preset's value for where the backend runs (listed below).
#[derive(Parser, Debug)]
#[command(name = "engine-sim", after_long_help = presets_help())]
struct Cli {
    /// The model to serve (both, all: one after the other).
    #[arg(long, value_enum, default_value_t = ModelChoice::Both)]
    model: ModelChoice,
    /// A backend by its registry name (tensor-core, mla, cpu); else `ATTN_BACKEND`, else the
    /// automatic choice.
    #[arg(long, value_name = "NAME", value_parser = backend_name)]
    backend: Option<String>,
    /// The activations' and the cache's dtype.
    #[arg(long, value_enum, default_value_t = DtypeChoice::Bf16)]
    dtype: DtypeChoice,
    /// Layers run, at most the model's (32 Llama, 27 DeepSeek, 26 Gemma-2, 48 Llama-4, 16 KV-shared; 12
    /// Whisper, whose N are N encoder layers and N decoder blocks, 3 N attention layers);
    /// default: the preset's (2 on the CPU, the model's on a GPU).
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    layers: Option<usize>,
    /// The sliding window of the windowed layers (Gemma-2's even layers; models without a
    /// window ignore it); default: the preset's (64 on the CPU, the model's 4096 on a GPU).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    window: Option<u32>,
    /// The logit soft-cap of the soft-capped layers (Gemma-2's; models without one ignore it);
    /// default: the preset's (0.5 on the CPU, the model's 50 on a GPU).
    #[arg(long, value_name = "X", value_parser = positive)]
    softcap: Option<f32>,
    /// The chunk of the chunked local layers (Llama-4's three layers of four; models without
    /// chunks ignore it); default: the preset's (40 on the CPU, the model's 8192 on a GPU).
    #[arg(long, value_name = "N", value_parser = clap::value_parser!(u32).range(1..))]
    chunk: Option<u32>,
    /// Tokens of each request's encoder input (Whisper's; models without an encoder ignore
    /// it); default: the preset's (75 on the CPU, the model's 1500 on a GPU).
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    encoder_len: Option<usize>,
    /// Encoder tokens an encoder step may take: whole requests, at least one (Whisper's;
    /// models without an encoder ignore it).
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    encoder_budget: Option<usize>,
    /// Requests in the stream.
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    requests: Option<usize>,
    /// Stop after this many steps even if requests remain.
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    steps: Option<usize>,
    /// Requests running at once.
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    max_running: Option<usize>,
    /// Tokens a step computes (chunked prefill fills what decodes leave); at least
    /// --max-running.
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    token_budget: Option<usize>,
    /// Prompt lengths, drawn from MIN..=MAX (1 <= MIN <= MAX); Whisper's decoder prompts.
    #[arg(long, value_name = "MIN:MAX", value_parser = len_range)]
    prompt: Option<(usize, usize)>,
    /// Generation lengths, drawn from MIN..=MAX (1 <= MIN <= MAX).
    #[arg(long, value_name = "MIN:MAX", value_parser = len_range)]
    gen: Option<(usize, usize)>,
    /// Cache blocks per layer; default: three quarters of what --max-running requests of the
    /// longest length take. Whisper: the decoder pool's (its encoder pool takes three quarters
    /// of what --max-running encoder inputs take).
    #[arg(long, value_name = "N", value_parser = at_least(1))]
    blocks: Option<usize>,
    /// Check against the f64 reference every this many steps (0: never).
    #[arg(long, value_name = "N")]
    check_every: Option<usize>,
    /// The layers checked, a comma-separated list below the (attention) layer count; default:
    /// the first and the last (Whisper: of each kind).
    #[arg(long, value_name = "A,B", value_delimiter = ',', num_args = 1)]
    check_layers: Option<Vec<usize>>,
    /// Requests checked in a checked step.
    #[arg(long, value_name = "N")]
    check_reqs: Option<usize>,
    /// Query tokens checked per checked request.
    #[arg(long, value_name = "N")]
    check_tokens: Option<usize>,
    /// A progress line every this many steps (0: none).
    #[arg(long, value_name = "N")]
    progress_every: Option<usize>,
    /// Requests of at most this many query tokens are decodes.
    #[arg(long, value_name = "N")]
    decode_threshold: Option<usize>,
    /// The request stream's and the activations' seed.
    #[arg(long, value_name = "N")]
    seed: Option<u64>,
    /// Replay the steps from CUDA graphs (GPU): one-token decode steps in uniform buckets,
    /// other steps in mixed buckets (MLA: eagerly), each captured the first time a step takes
    /// it. An encoder-decoder model's decoder steps (self- and cross-attention) replay so; its
    /// encoder steps run eagerly.
    #[arg(long)]
    graphs: bool,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum ModelChoice {
    /// Llama-3-8B-like: 32 query heads over 8 kv heads of 128, 32 layers.
    Llama,
    /// DeepSeek-V2-Lite-like: MLA, 16 heads over one 512 + 64 latent, 27 layers.
    Deepseek,
    /// Gemma-2-2B-like: 8 query heads over 4 kv heads of 256, 26 layers, soft-cap 50, sliding
    /// window 4096 on the even layers.
    Gemma2,
    /// Llama-4-Scout-like: 40 query heads over 8 kv heads of 128, 48 layers, chunked local
    /// attention (chunks of 8192) on every layer but each fourth.
    Llama4,
    /// Llama-like, 32 query heads over 8 kv heads of 128, 16 layers, of which the second half
    /// reads the last first-half layer's cache.
    KvShared,
    /// Whisper-small-like encoder-decoder: 12 heads of 64 (MHA), 12 encoder layers over 1500
    /// encoder tokens a request, 12 decoder blocks of self-attention and cross-attention.
    Whisper,
    /// Phi-2-like: 32 heads of 80 (MHA), 32 layers.
    Phi2,
    /// Llama, then DeepSeek.
    Both,
    /// Every model: Llama, DeepSeek, Gemma-2, Llama-4, KV-shared, Whisper, Phi-2.
    All,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
enum DtypeChoice {
    Bf16,
    F16,
    F32,
}

/// A parser of counts of at least `min`.
fn at_least(min: usize) -> impl Fn(&str) -> Result<usize, String> + Clone + Send + Sync + 'static {
    move |v| match v.parse::<usize>() {
        Ok(n) if n >= min => Ok(n),
        Ok(n) => Err(format!("{n} is below {min}")),
        Err(e) => Err(e.to_string()),
    }
}

/// A positive, finite number.
fn positive(v: &str) -> Result<f32, String> {
    match v.parse::<f32>() {
        Ok(x) if x.is_finite() && x > 0.0 => Ok(x),
        Ok(x) => Err(format!("{x} is not positive and finite")),
        Err(e) => Err(e.to_string()),
    }
}

/// `MIN:MAX` with 1 <= MIN <= MAX.
fn len_range(v: &str) -> Result<(usize, usize), String> {
    let bad = || format!("expected MIN:MAX with 1 <= MIN <= MAX, got {v:?}");
    let (a, b) = v.split_once(':').ok_or_else(bad)?;
    let (a, b) = (a.trim().parse::<usize>().map_err(|_| bad())?, b.trim().parse::<usize>().map_err(|_| bad())?);
    if a == 0 || a > b {
        return Err(bad());
    }
    Ok((a, b))
}

/// A registered backend's name (as `attn_rs::backend::find_backend` reads it).
fn backend_name(v: &str) -> Result<String, String> {
    match find_backend(v) {
        Some(b) => Ok(b.name.to_string()),
        None => Err(format!("no backend {v:?}; known backends: {}", attn_rs::backend::backend_names().join(", "))),
    }
}

/// The two presets, for `--help`.
fn presets_help() -> String {
    let line = |what: &str, c: &SimConfig| {
        let or_models = |x: Option<String>| x.unwrap_or_else(|| "the model's".to_string());
        let layers = or_models(c.num_layers.map(|n| n.to_string()));
        let (window, softcap) = (or_models(c.window.map(|n| n.to_string())), or_models(c.softcap.map(|x| x.to_string())));
        let chunk = or_models(c.chunk.map(|n| n.to_string()));
        let encoder_len = or_models(c.encoder_len.map(|n| n.to_string()));
        let w = &c.workload;
        format!(
            "  {what}: --layers {layers}, --window {window}, --softcap {softcap}, --chunk {chunk}, --encoder-len {encoder_len}, --encoder-budget {}, \
             --requests {}, --steps {}, --max-running {}, \
             --token-budget {}, --prompt {}:{}, --gen {}:{}, --check-every {}, --check-reqs {}, --check-tokens {}, --progress-every {}, \
             --decode-threshold {}, --seed {}",
            c.encoder_budget,
            w.num_requests,
            c.max_steps,
            c.max_running,
            c.token_budget,
            w.prompt_len.0,
            w.prompt_len.1,
            w.gen_len.0,
            w.gen_len.1,
            c.check_every,
            c.check_reqs,
            c.check_tokens,
            c.progress_every,
            c.decode_threshold,
            c.seed
        )
    };
    format!(
        "Presets (where the backend runs):\n{}\n{}\n  Without --prompt, a model whose window or first chunk no context of the preset would pass \
         (Gemma-2 and Llama-4 on a GPU) takes prompts of up to one and a half windows or chunks; Whisper's decoder prompts are 1:8.",
        line("CPU backend", &SimConfig::cpu_default()),
        line("GPU backend", &SimConfig::gpu_default())
    )
}

impl Cli {
    fn dtype(&self) -> DType {
        match self.dtype {
            DtypeChoice::Bf16 => DType::BF16,
            DtypeChoice::F16 => DType::F16,
            DtypeChoice::F32 => DType::F32,
        }
    }

    fn models(&self) -> Vec<SimModel> {
        let dtype = self.dtype();
        let (llama, deepseek, gemma2, llama4, kv_shared, whisper, phi2) = (
            SimModel::llama3_8b(dtype),
            SimModel::deepseek_v2_lite(dtype),
            SimModel::gemma2_2b(dtype),
            SimModel::llama4_scout(dtype),
            SimModel::kv_shared(dtype),
            SimModel::whisper_small(dtype),
            SimModel::phi2(dtype),
        );
        match self.model {
            ModelChoice::Llama => vec![llama],
            ModelChoice::Deepseek => vec![deepseek],
            ModelChoice::Gemma2 => vec![gemma2],
            ModelChoice::Llama4 => vec![llama4],
            ModelChoice::KvShared => vec![kv_shared],
            ModelChoice::Whisper => vec![whisper],
            ModelChoice::Phi2 => vec![phi2],
            ModelChoice::Both => vec![llama, deepseek],
            ModelChoice::All => vec![llama, deepseek, gemma2, llama4, kv_shared, whisper, phi2],
        }
    }

    /// What the flags' types cannot say: the layers against the models', the checked layers
    /// against the layers, the token budget against the running requests.
    fn check(&self) -> Result<(), clap::Error> {
        let error = |msg: String| Err(Cli::command().error(ErrorKind::ValueValidation, msg));
        let fewest = self.models().into_iter().min_by_key(|m| m.num_layers).expect("a model");
        if let Some(n) = self.layers.filter(|&n| n > fewest.num_layers) {
            return error(format!("invalid value '{n}' for '--layers <N>': {} has {} layers", fewest.name, fewest.num_layers));
        }
        // The attention layers of the model that has the fewest (Whisper: 3 per layer).
        let attention_layers = |m: &SimModel| m.attention_layers(self.layers.unwrap_or(m.num_layers));
        let narrowest = self.models().into_iter().min_by_key(attention_layers).expect("a model");
        let layers = attention_layers(&narrowest);
        if let Some(l) = self.check_layers.iter().flatten().find(|&&l| l >= layers) {
            let of = match self.layers {
                Some(n) if narrowest.is_encoder_decoder() => format!("{} makes of the {n} given by --layers", narrowest.name),
                Some(_) => "given by --layers".to_string(),
                None => format!("of {}", narrowest.name),
            };
            return error(format!("invalid value for '--check-layers <A,B>': layer {l} is past the {layers} layers {of}"));
        }
        if let (Some(budget), Some(running)) = (self.token_budget, self.max_running) {
            if budget < running {
                return error(format!("'--token-budget {budget}' is below '--max-running {running}'"));
            }
        }
        Ok(())
    }

    /// The preset for where the backend runs, with the flags applied; without `--prompt`,
    /// prompts that pass `model`'s window, or of a few tokens for an encoder-decoder model.
    fn sim_config(&self, on_gpu: bool, model: &SimModel) -> SimConfig {
        let mut c = if on_gpu { SimConfig::gpu_default() } else { SimConfig::cpu_default() };
        c.num_layers = self.layers.or(c.num_layers);
        c.window = self.window.or(c.window);
        c.softcap = self.softcap.or(c.softcap);
        c.chunk = self.chunk.or(c.chunk);
        c.encoder_len = self.encoder_len.or(c.encoder_len);
        c.encoder_budget = self.encoder_budget.unwrap_or(c.encoder_budget);
        if self.prompt.is_none() {
            c = c.with_contexts_past_window(model).with_encoder_decoder_prompts(model);
        }
        if let Some(n) = self.requests {
            c.workload.num_requests = n;
            c.workload.initial = c.workload.initial.min(n);
        }
        c.max_steps = self.steps.unwrap_or(c.max_steps);
        c.max_running = self.max_running.unwrap_or(c.max_running);
        c.token_budget = self.token_budget.unwrap_or(c.token_budget);
        c.workload.prompt_len = self.prompt.unwrap_or(c.workload.prompt_len);
        c.workload.gen_len = self.gen.unwrap_or(c.workload.gen_len);
        c.num_blocks = self.blocks.or(c.num_blocks);
        c.check_every = self.check_every.unwrap_or(c.check_every);
        c.check_layers = self.check_layers.clone().or(c.check_layers);
        c.check_reqs = self.check_reqs.unwrap_or(c.check_reqs);
        c.check_tokens = self.check_tokens.unwrap_or(c.check_tokens);
        c.progress_every = self.progress_every.unwrap_or(c.progress_every);
        c.decode_threshold = self.decode_threshold.unwrap_or(c.decode_threshold);
        c.seed = self.seed.unwrap_or(c.seed);
        c.graphs = self.graphs;
        c
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    if let Err(e) = cli.check() {
        e.exit();
    }
    match run(&cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("engine-sim: {e}");
            ExitCode::FAILURE
        }
    }
}

/// Opens GPU 0 if there is one (and loads its kernels), else says the run is on the CPU.
fn open_device() -> Result<(DeviceInfo, Option<GpuHandles>), Box<dyn std::error::Error>> {
    if !AttnDevice::driver_available() {
        println!(
            "engine-sim: no CUDA driver or GPU here: running on the CPU backend (attn_rs::cpu, the f64 reference \
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

fn run(cli: &Cli) -> Result<bool, Box<dyn std::error::Error>> {
    let models = cli.models();
    let (device, gpu) = open_device()?;
    let mut all_ok = true;
    for model in &models {
        println!();
        let selection = match select_backend(&model.config, &device, cli.backend.as_deref()) {
            Ok(s) => s,
            Err(e) => {
                println!("== {}: no backend: {e}", model.name);
                all_ok = false;
                continue;
            }
        };
        describe_choice(model, &selection);
        let mut result = run_one(model, &selection, gpu.clone(), cli);
        if let Err(SimError::Attn(e @ AttnError::MissingKernel { .. })) = &result {
            // MLA on a GPU: its kernels are missing; run the configuration on the CPU instead.
            println!("   {e}\n   -> running {} on the CPU backend instead [cpu, not GPU figures]", model.name);
            let cpu = select_backend_no_env(&model.config, &DeviceInfo::no_gpu(), Some("cpu"))?;
            result = run_one(model, &cpu, None, cli);
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

fn run_one(model: &SimModel, selection: &Selection, gpu: Option<GpuHandles>, cli: &Cli) -> Result<attn_tools::sim::SimReport, SimError> {
    let cfg = cli.sim_config(selection.backend.needs_gpu, model);
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

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(args: &[&str]) -> Result<Cli, clap::Error> {
        let cli = Cli::try_parse_from(std::iter::once("engine-sim").chain(args.iter().copied()))?;
        cli.check().map(|()| cli)
    }

    #[test]
    fn command_is_well_formed() {
        Cli::command().debug_assert();
    }

    #[test]
    fn flags_take_both_spellings_and_override_the_preset() {
        let cli =
            parse(&["--layers=2", "--model", "llama", "--prompt=8:16", "--check-layers", "0,1", "--seed=7", "--backend=CPU"]).unwrap();
        let llama = SimModel::llama3_8b(DType::BF16);
        let c = cli.sim_config(true, &llama);
        assert_eq!((c.num_layers, c.workload.prompt_len, c.check_layers.as_deref(), c.seed), (Some(2), (8, 16), Some(&[0, 1][..]), 7));
        assert_eq!(c.token_budget, SimConfig::gpu_default().token_budget);
        assert_eq!(cli.backend.as_deref(), Some("cpu"));
        assert_eq!(cli.models().len(), 1);
        assert_eq!(parse(&[]).unwrap().sim_config(false, &llama), SimConfig::cpu_default());
        let cli = parse(&["--model=gemma2", "--window", "100", "--softcap=2.5"]).unwrap();
        let c = cli.sim_config(false, &cli.models()[0]);
        assert_eq!((c.window, c.softcap), (Some(100), Some(2.5)));
        let cli = parse(&["--model=llama4", "--chunk", "24"]).unwrap();
        let c = cli.sim_config(false, &cli.models()[0]);
        assert_eq!((c.chunk, c.run_model(&cli.models()[0]).chunk), (Some(24), Some(24)));
    }

    #[test]
    fn model_choices_name_their_models() {
        let names = |m: &str| parse(&["--model", m]).unwrap().models().iter().map(|m| m.name).collect::<Vec<_>>();
        let (llama, deepseek, gemma2, llama4, kv_shared, whisper, phi2) = (
            "llama-3-8b-like",
            "deepseek-v2-lite-like (MLA)",
            "gemma-2-2b-like",
            "llama-4-scout-like (chunked local)",
            "kv-shared-llama-like",
            "whisper-small-like (encoder-decoder)",
            "phi-2-like (head size 80)",
        );
        assert_eq!(names("gemma2"), [gemma2]);
        assert_eq!(names("llama4"), [llama4]);
        assert_eq!(names("kv-shared"), [kv_shared]);
        assert_eq!(names("whisper"), [whisper]);
        assert_eq!(names("both"), [llama, deepseek], "both stays Llama and DeepSeek");
        assert_eq!(parse(&[]).unwrap().models().len(), 2);
        assert_eq!(names("phi2"), [phi2]);
        assert_eq!(names("all"), [llama, deepseek, gemma2, llama4, kv_shared, whisper, phi2]);
    }

    #[test]
    fn whisper_takes_short_decoder_prompts_and_its_encoder_flags() {
        let whisper = SimModel::whisper_small(DType::BF16);
        let c = parse(&["--model", "whisper"]).unwrap().sim_config(false, &whisper);
        assert_eq!((c.workload.prompt_len, c.encoder_len, c.encoder_budget), ((1, 8), Some(75), 150));
        assert_eq!(c.run_model(&whisper).encoder_len, Some(75));
        let c = parse(&["--model", "whisper"]).unwrap().sim_config(true, &whisper);
        assert_eq!((c.workload.prompt_len, c.encoder_len, c.encoder_budget), ((1, 8), None, 6000));
        assert_eq!(c.run_model(&whisper).encoder_len, Some(1500));
        let cli = parse(&["--model=whisper", "--encoder-len", "40", "--encoder-budget=100", "--prompt", "3:30"]).unwrap();
        let c = cli.sim_config(false, &whisper);
        assert_eq!((c.workload.prompt_len, c.encoder_len, c.encoder_budget), ((3, 30), Some(40), 100));
        // Other models keep their prompts.
        let llama = SimModel::llama3_8b(DType::BF16);
        assert_eq!(parse(&["--encoder-len", "40"]).unwrap().sim_config(false, &llama).workload, SimConfig::cpu_default().workload);
        // Check layers count attention layers: three a Whisper layer.
        assert!(parse(&["--model", "whisper", "--check-layers", "0,35"]).is_ok());
        assert!(parse(&["--model", "whisper", "--layers", "2", "--check-layers", "5"]).is_ok());
        assert!(parse(&["--model", "all", "--layers", "12", "--check-layers", "11"]).is_ok());
    }

    #[test]
    fn the_gpu_preset_reaches_past_the_window_unless_prompts_are_given() {
        let gemma2 = SimModel::gemma2_2b(DType::BF16);
        let c = parse(&["--model", "gemma2"]).unwrap().sim_config(true, &gemma2);
        assert_eq!(c.window, None, "the model's window: 4096");
        assert_eq!(c.workload.prompt_len, (128, 6144));
        assert!(c.workload.max_model_len() > 4096);
        let c = parse(&["--model", "gemma2", "--prompt", "100:200"]).unwrap().sim_config(true, &gemma2);
        assert_eq!(c.workload.prompt_len, (100, 200));
        // The CPU preset's window (64) is passed already; other models keep the preset.
        assert_eq!(parse(&[]).unwrap().sim_config(false, &gemma2).workload, SimConfig::cpu_default().workload);
        assert_eq!(parse(&[]).unwrap().sim_config(true, &SimModel::kv_shared(DType::BF16)), SimConfig::gpu_default());
        // Llama-4's first chunk (8192) is passed as well; on the CPU its chunks of 40 already are.
        let llama4 = SimModel::llama4_scout(DType::BF16);
        assert_eq!(parse(&["--model", "llama4"]).unwrap().sim_config(true, &llama4).workload.prompt_len, (128, 12288));
        assert_eq!(parse(&[]).unwrap().sim_config(false, &llama4).workload, SimConfig::cpu_default().workload);
    }

    #[test]
    fn bad_values_are_usage_errors() {
        for args in [
            &["--layers", "99"][..],
            &["--layers", "30"],
            &["--layers", "0"],
            &["--model", "llama", "--layers", "33"],
            &["--layers", "x"],
            &["--model", "gpt"],
            &["--dtype", "fp8"],
            &["--backend", "nope"],
            &["--prompt", "0:4"],
            &["--gen", "9:3"],
            &["--check-layers", "0,a"],
            &["--layers", "4", "--check-layers", "0,4"],
            &["--model", "deepseek", "--check-layers", "27"],
            &["--model", "gemma2", "--layers", "27"],
            &["--model", "all", "--layers", "17"],
            &["--model", "kv-shared", "--check-layers", "16"],
            &["--model", "whisper", "--layers", "13"],
            &["--model", "whisper", "--check-layers", "36"],
            &["--model", "whisper", "--layers", "2", "--check-layers", "6"],
            &["--model", "all", "--layers", "13"],
            &["--encoder-len", "0"],
            &["--encoder-budget", "0"],
            &["--window", "0"],
            &["--chunk", "0"],
            &["--model", "llama4", "--layers", "49"],
            &["--window", "-3"],
            &["--softcap", "0"],
            &["--softcap", "-1"],
            &["--softcap", "inf"],
            &["--softcap", "NaN"],
            &["--max-running", "8", "--token-budget", "4"],
            &["--steps"],
            &["--layer", "2"],
        ] {
            let e = parse(args).unwrap_err();
            assert_eq!(e.exit_code(), 2, "{args:?}: {e}");
        }
        assert!(parse(&["--model", "llama", "--layers", "32", "--check-layers", "31"]).is_ok());
        assert!(parse(&["--model", "gemma2", "--layers", "26", "--check-layers", "0,25"]).is_ok());
    }
}
