//! What the simulator prints: a header, a progress line every few steps (plain lines, no
//! terminal needed) and the summary: throughput and each step's time split into metadata,
//! cache write and attention (an encoder-decoder model's encoder steps included, and counted
//! apart).

use super::check::{CheckStats, Sensitivity};
use super::model::SimModel;
use super::scheduler::{Batch, Scheduler};
use attn_rs::forward::{Attention, GraphBucket, PhaseTimes};
use std::time::Duration;

/// A run's totals.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct SimReport {
    pub model: String,
    /// The model's attention configuration, in words.
    pub model_config: String,
    /// What its layers do beyond plain attention (window, soft-cap, KV sharing), in words.
    pub layer_settings: Option<String>,
    pub backend: &'static str,
    pub on_gpu: bool,
    /// Attention layers run.
    pub layers: usize,
    /// Layers that keep a cache (the others read one of theirs).
    pub cache_layers: usize,
    /// The model's own attention layer count (runs may use fewer).
    pub model_layers: usize,
    /// Blocks of every layer's cache.
    pub num_blocks: usize,
    /// An encoder-decoder model's two block pools: the encoder's (encoder and cross-attention
    /// caches) and the decoder's (self-attention caches); `num_blocks` is the larger.
    pub pools: Option<(usize, usize)>,
    /// An encoder-decoder model's encoder input per request, and the encoder layers and
    /// decoder blocks run.
    pub encoder_len: Option<usize>,
    pub encoder_layers: usize,
    /// Bytes of KV cache over all the layers that keep one.
    pub cache_bytes: usize,
    pub requests: usize,
    pub finished: usize,
    pub steps: usize,
    pub prefill_tokens: usize,
    pub decode_tokens: usize,
    /// Encoder steps and their tokens (encoder-decoder models).
    pub encoder_steps: usize,
    pub encoder_tokens: usize,
    pub max_encoder_tokens: usize,
    pub max_batch_tokens: usize,
    pub max_batch_reqs: usize,
    /// Sum of the steps' wall times (scheduling, metadata, every layer, waiting for the GPU).
    pub wall: Duration,
    pub metadata: Duration,
    pub cache_write: Duration,
    pub attention: Duration,
    /// Bytes of step metadata uploaded to the GPU.
    pub upload_bytes: usize,
    /// Time the checks took (not part of the steps).
    pub check_time: Duration,
    pub tolerance: f64,
    pub check_layers: Vec<usize>,
    pub checks: CheckStats,
    /// Steps replayed from CUDA graphs, and the buckets captured (`None`: eager run).
    pub graph_steps: usize,
    pub graphs: Option<Vec<GraphBucket>>,
}

/// Totals at the last progress line.
#[derive(Clone, Copy, Debug, Default)]
pub struct Window {
    steps: usize,
    tokens: usize,
    encoder_tokens: usize,
    wall: Duration,
    metadata: Duration,
    cache_write: Duration,
    attention: Duration,
}

/// `1.50 GiB`, `12.0 MiB`.
fn bytes(n: usize) -> String {
    if n >= 1 << 30 {
        format!("{:.2} GiB", n as f64 / (1u64 << 30) as f64)
    } else {
        format!("{:.1} MiB", n as f64 / (1u64 << 20) as f64)
    }
}

fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

impl SimReport {
    /// `layers`: the model layers run (of an encoder-decoder model: encoder layers, and as many
    /// decoder blocks), the attention layers they make and those among them that keep a cache.
    pub(crate) fn new(
        model: &SimModel,
        attn: &Attention,
        (num_layers, layers, cache_layers): (usize, usize, usize),
        num_blocks: usize,
        requests: usize,
        tolerance: f64,
    ) -> Self {
        SimReport {
            model: model.name.to_string(),
            model_config: model.config.to_string(),
            layer_settings: model.describe_layers(num_layers),
            backend: attn.backend().name,
            on_gpu: attn.runs_on_gpu(),
            layers,
            cache_layers,
            model_layers: model.attention_layers(model.num_layers),
            num_blocks,
            encoder_len: model.encoder_len,
            encoder_layers: if model.is_encoder_decoder() { num_layers } else { 0 },
            cache_bytes: attn.cache_spec().num_elements() * cache_layers * model.config.cache_dtype.size_bytes(),
            requests,
            tolerance,
            ..SimReport::default()
        }
    }

    pub fn tokens(&self) -> usize {
        self.prefill_tokens + self.decode_tokens
    }

    pub fn tokens_per_s(&self) -> f64 {
        self.tokens() as f64 / self.wall.as_secs_f64().max(1e-9)
    }

    /// Whether every check passed (and, when checks ran, at least one comparison was made).
    pub fn passed(&self) -> bool {
        self.checks.failures == 0
    }

    pub(crate) fn book_step(&mut self, batch: &Batch, wall: Duration, metadata: Duration, times: PhaseTimes, upload_bytes: usize) {
        self.steps += 1;
        self.decode_tokens += batch.num_decode_tokens;
        self.prefill_tokens += batch.num_tokens() - batch.num_decode_tokens;
        self.max_batch_tokens = self.max_batch_tokens.max(batch.num_tokens());
        self.max_batch_reqs = self.max_batch_reqs.max(batch.reqs.len());
        let encoder = batch.num_encoder_tokens();
        self.encoder_steps += usize::from(encoder > 0);
        self.encoder_tokens += encoder;
        self.max_encoder_tokens = self.max_encoder_tokens.max(encoder);
        self.wall += wall;
        self.metadata += metadata;
        self.cache_write += times.cache_write;
        self.attention += times.attention;
        self.upload_bytes += upload_bytes;
    }

    pub(crate) fn window_start(&self) -> Window {
        Window {
            steps: self.steps,
            tokens: self.tokens(),
            encoder_tokens: self.encoder_tokens,
            wall: self.wall,
            metadata: self.metadata,
            cache_write: self.cache_write,
            attention: self.attention,
        }
    }

    /// What the checks can find. The reference is the simulator's own f64 attention, apart from
    /// the library's, so on either backend a check covers the attention arithmetic (with each
    /// layer's window and soft-cap) and what comes before it: which rows reached the cache, the
    /// block tables, positions and batch layout.
    pub fn check_scope(&self) -> &'static str {
        if self.on_gpu {
            "the backend's attention and bookkeeping"
        } else {
            "attn_rs::cpu's attention and the bookkeeping"
        }
    }

    /// Two lines about the run about to start (and one for its layers' settings, one for what
    /// the checks cover on the CPU backend).
    pub fn header(&self) -> String {
        let place = if self.on_gpu { "GPU" } else { "CPU (attn_rs::cpu, the reference implementation)" };
        let layers = self.layer_settings.as_ref().map_or(String::new(), |s| format!("\n   layers: {s}"));
        let scope = if self.on_gpu {
            String::new()
        } else {
            format!("\n   checks: {}, against the simulator's own f64 attention (not attn_rs::cpu's code)", self.check_scope())
        };
        let caches = if self.cache_layers == self.layers {
            String::new()
        } else {
            format!(" in {} of the {} layers", self.cache_layers, self.layers)
        };
        let pools = self.pools.map_or(String::new(), |(enc, dec)| {
            format!(
                "\n   blocks: two pools, {enc} encoder blocks (the encoder and cross-attention caches) and {dec} decoder blocks (the \
                 self-attention caches); every cache has the larger count"
            )
        });
        format!(
            "== {} [{}]: {}\n   backend {} on the {place}; {} of {} layers, {} blocks per layer ({} of KV cache{caches}); {} requests{pools}{layers}{scope}",
            self.model,
            self.backend,
            self.model_config,
            self.backend,
            self.layers,
            self.model_layers,
            self.num_blocks,
            bytes(self.cache_bytes),
            self.requests
        )
    }

    /// The closing lines.
    pub fn summary(&self) -> Vec<String> {
        let n = self.steps.max(1) as f64;
        let per = |d: Duration| ms(d) / n;
        let other = ms(self.wall) - ms(self.metadata) - ms(self.cache_write) - ms(self.attention);
        let mut lines = vec![
            format!("summary [{} on {}]:", self.model, self.backend),
            format!(
                "  {} steps, {}/{} requests finished, {} tokens ({} prefill, {} decode); largest batch {} tokens / {} requests",
                self.steps,
                self.finished,
                self.requests,
                self.tokens(),
                self.prefill_tokens,
                self.decode_tokens,
                self.max_batch_tokens,
                self.max_batch_reqs
            ),
            match self.encoder_len {
                None => format!(
                    "  throughput {:.1} tokens/s through {} layers, over {:.3} s of steps",
                    self.tokens_per_s(),
                    self.layers,
                    self.wall.as_secs_f64()
                ),
                Some(_) => format!(
                    "  throughput {:.1} decoder tokens/s ({:.1} with the encoder's tokens) through {} layers, over {:.3} s of steps",
                    self.tokens_per_s(),
                    (self.tokens() + self.encoder_tokens) as f64 / self.wall.as_secs_f64().max(1e-9),
                    self.layers,
                    self.wall.as_secs_f64()
                ),
            },
            format!(
                "  per step {:.3} ms: metadata {:.3} ms, cache write {:.3} ms, attention {:.3} ms, other {:.3} ms{}",
                per(self.wall),
                per(self.metadata),
                per(self.cache_write),
                per(self.attention),
                other.max(0.0) / n,
                if self.on_gpu {
                    format!(" (GPU times from CUDA events; {:.1} KiB metadata uploaded a step)", self.upload_bytes as f64 / n / 1024.0)
                } else {
                    String::new()
                }
            ),
        ];
        if let Some(buckets) = &self.graphs {
            let names: Vec<String> = buckets
                .iter()
                .map(|b| match b {
                    GraphBucket::Uniform { num_reqs, query_len } => format!("{num_reqs}x{query_len}"),
                    GraphBucket::Mixed { num_reqs, num_tokens } => format!("mixed {num_reqs}/{num_tokens}"),
                })
                .collect();
            lines.push(format!(
                "  CUDA graphs: {} of {} steps replayed, {} buckets captured ({}); cache write and attention times count the eager steps only",
                self.graph_steps,
                self.steps,
                buckets.len(),
                names.join(", ")
            ));
        }
        if let Some(len) = self.encoder_len {
            lines.insert(
                2,
                format!(
                    "  encoder: {} steps, {} tokens ({} requests of {len}; largest step {} tokens) through {} encoder layers, \
                     and write_kv into {} cross-attention caches",
                    self.encoder_steps,
                    self.encoder_tokens,
                    self.encoder_tokens / len.max(1),
                    self.max_encoder_tokens,
                    self.encoder_layers,
                    self.encoder_layers
                ),
            );
        }
        let c = &self.checks;
        let kinds = if c.encoder_comparisons + c.cross_comparisons == 0 {
            String::new()
        } else {
            format!(
                "; {} encoder, {} decoder self-attention, {} cross-attention",
                c.encoder_comparisons,
                c.comparisons - c.encoder_comparisons - c.cross_comparisons,
                c.cross_comparisons
            )
        };
        lines.push(if c.comparisons == 0 {
            "  check against the f64 reference: none made".to_string()
        } else {
            format!(
                "  check against the f64 reference ({}): {} comparisons ({} query tokens{kinds}) in layers {:?}, max rel error {:.2e} (tolerance {:.0e}) in {:.2} s: {}",
                self.check_scope(),
                c.comparisons,
                c.tokens,
                self.check_layers,
                c.worst_rel_error,
                self.tolerance,
                self.check_time.as_secs_f64(),
                if self.passed() { "PASS".to_string() } else { format!("FAIL ({} failed; first: {})", c.failures, c.first_failure.clone().unwrap_or_default()) }
            )
        });
        if let Some(line) = self.sensitivity_line() {
            lines.push(line);
        }
        lines
    }

    /// How many comparisons would have caught a backend ignoring the checked layers' window,
    /// chunks or soft-cap, applying a causal mask in the encoder and cross-attention layers, or reading
    /// another layer's encoder keys and values; `None` when no checked layer has any of these.
    fn sensitivity_line(&self) -> Option<String> {
        let c = &self.checks;
        let part =
            |what: &str, s: &Sensitivity| (s.comparisons > 0).then(|| format!("{what} in {} of {} comparisons", s.caught, s.comparisons));
        let parts: Vec<String> = [
            part("ignoring the window", &c.window),
            part("ignoring the chunks", &c.chunk),
            part("ignoring the soft-cap", &c.softcap),
            part("masking the encoder and cross-attention layers causally", &c.bidirectional),
            part("reading another layer's encoder K/V in a cross-attention layer", &c.cross_source),
        ]
        .into_iter()
        .flatten()
        .collect();
        (!parts.is_empty()).then(|| {
            format!(
                "  the check catches a backend {} (where the reference with that change differs by more than the tolerance)",
                parts.join(", ")
            )
        })
    }
}

/// The progress line after `step`, with rates over the steps since `window`.
pub(crate) fn progress_line(r: &SimReport, w: &Window, step: usize, batch: &Batch, sched: &Scheduler, checks: &CheckStats) -> String {
    let steps = (r.steps - w.steps).max(1) as f64;
    let wall = r.wall - w.wall;
    let tok_s = (r.tokens() - w.tokens) as f64 / wall.as_secs_f64().max(1e-9);
    let a = sched.allocator();
    let encoder = match sched.encoder_allocator() {
        None => String::new(),
        Some(e) => format!(
            " | enc {:>2} reqs {:>5} tok, blocks {:>5}/{}, {:.1} enc tok/s",
            batch.encoder_reqs.len(),
            batch.num_encoder_tokens(),
            e.num_used(),
            e.num_blocks(),
            (r.encoder_tokens - w.encoder_tokens) as f64 / wall.as_secs_f64().max(1e-9)
        ),
    };
    let check = if checks.comparisons == 0 {
        String::new()
    } else if checks.failures == 0 {
        format!(" | checks ok (max err {:.1e})", checks.worst_rel_error)
    } else {
        format!(" | checks FAILED {}", checks.failures)
    };
    format!(
        "step {step:>5} | batch {:>3} reqs ({} dec + {} pre) {:>5} tok | running {:>3}, waiting {:>3}, done {:>4}/{} | blocks {:>5}/{} | {:>9.1} tok/s | step {:.2} ms: meta {:.3}, write {:.3}, attn {:.3}{encoder}{check}",
        batch.reqs.len(),
        batch.num_decodes,
        batch.reqs.len() - batch.num_decodes,
        batch.num_tokens(),
        sched.num_running(),
        sched.num_waiting(),
        sched.num_finished(),
        r.requests,
        a.num_used(),
        a.num_blocks(),
        tok_s,
        ms(wall) / steps,
        ms(r.metadata - w.metadata) / steps,
        ms(r.cache_write - w.cache_write) / steps,
        ms(r.attention - w.attention) / steps,
    )
}
