//! What every mode starts from: the device, the GGUF's model, tokenizer and chat template, and
//! the attention sized for the requests.

use crate::chat::ChatTemplate;
use crate::engine::{Engine, EngineConfig};
use crate::error::Result;
use crate::gguf::Gguf;
use crate::glue::PagedAttention;
use crate::model::Llama;
use crate::tokenizer::Tokenizer;
use attn_rs::forward::ForwardLimits;
use candle_core::Device;
use std::path::Path;

/// The prompts used when none is given.
pub const DEFAULT_PROMPTS: [&str; 4] = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in one sentence what a KV cache is in LLM inference.",
    "List three prime numbers and say why they are prime.",
];

/// The device to run on and a line that says which and why.
pub fn select_device(force_cpu: bool) -> (Device, String) {
    let why = if force_cpu {
        "--cpu".to_owned()
    } else {
        #[cfg(feature = "cuda")]
        match Device::new_cuda_with_stream(0) {
            Ok(d) => return (d, "GPU 0 (CUDA): candle CUDA, attn-rs f16 kernels".to_owned()),
            Err(e) => format!("no usable GPU ({e})"),
        }
        #[cfg(not(feature = "cuda"))]
        "built without the `cuda` feature".to_owned()
    };
    (Device::Cpu, format!("CPU ({why}): candle CPU, attn-rs's CPU backend, f32"))
}

/// A GGUF loaded for serving.
pub struct Loaded {
    pub model: Llama,
    pub tokenizer: Tokenizer,
    pub chat: ChatTemplate,
}

impl Loaded {
    pub fn load(path: &Path, device: &Device) -> Result<Self> {
        let mut g = Gguf::open(path)?;
        let tokenizer = Tokenizer::from_gguf(&g)?;
        let token = |id| tokenizer.token(id).unwrap_or_default().to_owned();
        let chat = ChatTemplate::from_gguf(&g, &token(tokenizer.bos_id), &token(tokenizer.eos_id))?;
        let model = Llama::load(&mut g, device)?;
        Ok(Loaded { model, tokenizer, chat })
    }

    /// A user prompt through the chat template, tokenized.
    pub fn chat_tokens(&self, prompt: &str) -> Result<Vec<u32>> {
        Ok(self.tokenizer.encode(&self.chat.user_prompt(prompt)?))
    }

    pub fn describe(&self) -> String {
        let c = &self.model.cfg;
        format!(
            "Llama: {} layers, hidden {}, {} query heads / {} KV heads of {}, FFN {}, vocab {}, RoPE theta {}",
            c.num_layers, c.hidden, c.num_heads, c.num_kv_heads, c.head_dim, c.ffn, c.vocab, c.rope_theta
        )
    }
}

/// Scheduler and cache sizes.
#[derive(Clone, Copy, Debug)]
pub struct Sizes {
    pub max_running: usize,
    pub token_budget: usize,
    pub block_size: usize,
    /// `None`: enough for `max_running` requests of `max_model_len` tokens.
    pub num_blocks: Option<usize>,
    /// The longest request (prompt + new tokens).
    pub max_model_len: usize,
}

impl Sizes {
    pub fn blocks(&self) -> usize {
        self.num_blocks.unwrap_or(self.max_running * self.max_model_len.div_ceil(self.block_size))
    }
}

/// The paged attention and an engine over it, for `loaded`'s model.
pub fn engine<'m>(loaded: &'m Loaded, sizes: Sizes, record_logits: bool) -> Result<Engine<'m>> {
    engine_for(&loaded.model, &loaded.tokenizer, sizes, record_logits)
}

/// The paged attention and an engine over it, for `model`.
pub fn engine_for<'m>(model: &'m Llama, tokenizer: &Tokenizer, sizes: Sizes, record_logits: bool) -> Result<Engine<'m>> {
    let limits = ForwardLimits { max_num_tokens: sizes.token_budget, max_num_reqs: sizes.max_running, max_model_len: sizes.max_model_len };
    let attn = PagedAttention::new(&model.cfg, model.device(), sizes.blocks(), sizes.block_size, limits)?;
    let cfg = EngineConfig { max_running: sizes.max_running, token_budget: sizes.token_budget, record_logits };
    Engine::new(model, attn, cfg, tokenizer.stop_ids().to_vec())
}
