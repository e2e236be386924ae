//! The models the simulator plays: their attention configuration, layer count and what each
//! layer does (sliding window, soft-cap, chunked local attention, KV sharing; an encoder-decoder
//! model's encoder, decoder self-attention and cross-attention layers).

use attn_rs::backend::{Features, ModelConfig};
use attn_rs::forward::{AttentionType, LayerSpec};
use attn_rs::AttnOptions;
use attn_rs::DType;
use attn_rs::KvLayout;

/// A model's attention, as the simulated engine runs it.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SimModel {
    pub name: &'static str,
    pub config: ModelConfig,
    pub num_layers: usize,
    pub softmax_scale: f32,
    /// The logit soft-cap of every layer (`cap * tanh(logit / cap)`).
    pub softcap: Option<f32>,
    /// The sliding window of the even layers, the odd ones attending to the whole context (Gemma
    /// 2 alternates local and global layers, the first local).
    pub window: Option<u32>,
    /// The chunk of the chunked local layers, every layer but each fourth (Llama 4 attends
    /// within chunks of 8192 positions on three layers of four, and to the whole context on
    /// layers 3, 7, 11, ...).
    pub chunk: Option<u32>,
    /// Which layers read another layer's cache instead of keeping their own.
    pub kv_sharing: KvSharing,
    /// An encoder-decoder model's encoder input: tokens per request (Whisper: 1500 frames, its
    /// 30 s of audio). `None` for a decoder-only model. With an encoder, `num_layers` counts
    /// the encoder layers and, as many, the decoder blocks (see [`SimModel::layer_spec`]).
    pub encoder_len: Option<usize>,
}

/// Which layers of a run read another layer's cache (and write none).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum KvSharing {
    /// Every layer keeps its own cache.
    None,
    /// Of `n` layers, the last `n / 2` read the cache of the last layer before them: the first
    /// half keeps caches, the second half only queries them.
    SecondHalf,
}

impl SimModel {
    /// A model whose layers all attend alike: no window, no soft-cap, each its own cache.
    fn plain(name: &'static str, config: ModelConfig, num_layers: usize, softmax_scale: f32) -> Self {
        SimModel {
            name,
            config,
            num_layers,
            softmax_scale,
            softcap: None,
            window: None,
            chunk: None,
            kv_sharing: KvSharing::None,
            encoder_len: None,
        }
    }

    /// Llama-3-8B: 32 query heads over 8 kv heads of 128, 32 layers, blocks of 16.
    pub fn llama3_8b(dtype: DType) -> Self {
        let config = ModelConfig::standard(32, 8, 128, dtype, 16, KvLayout::FlashNhd);
        SimModel::plain("llama-3-8b-like", config, 32, 1.0 / (128f32).sqrt())
    }

    /// DeepSeek-V2-Lite: MLA with 16 heads over one latent of 512 + 64 rope, 27 layers, blocks
    /// of 64; the softmax scale of its 128 + 64 query/key head.
    pub fn deepseek_v2_lite(dtype: DType) -> Self {
        let config = ModelConfig::mla(16, dtype, 64);
        SimModel::plain("deepseek-v2-lite-like (MLA)", config, 27, 1.0 / (192f32).sqrt())
    }

    /// Gemma-2-2B: 8 query heads over 4 kv heads of 256, 26 layers, blocks of 16; every layer's
    /// logits soft-capped at 50, the even (local) layers with a sliding window of 4096 keys and
    /// the odd (global) ones over the whole context; softmax scale 1/sqrt(256) (its
    /// `query_pre_attn_scalar` is 256).
    ///
    /// The CPU preset ([`SimConfig::cpu_default`](super::SimConfig::cpu_default)) runs it with a
    /// window of 64 and a soft-cap of 0.5, so that both change the checked outputs at its short
    /// contexts and with its random activations (whose logits stay within about +-1, where a
    /// cap of 50 changes an output by about 1e-5).
    pub fn gemma2_2b(dtype: DType) -> Self {
        let features = Features { sliding_window: true, softcap: true, ..Features::NONE };
        let config = ModelConfig::standard(8, 4, 256, dtype, 16, KvLayout::FlashNhd).with_features(features);
        SimModel { softcap: Some(50.0), window: Some(4096), ..SimModel::plain("gemma-2-2b-like", config, 26, 1.0 / 16.0) }
    }

    /// Llama-4-Scout: 40 query heads over 8 kv heads of 128 (groups of 5), 48 layers, blocks of
    /// 16, softmax scale 1/sqrt(128); chunked local attention in chunks of 8192 positions on
    /// three layers of four, the fourth (layers 3, 7, ...) over the whole context. (Its global
    /// layers' query temperature scales the queries before attention and is not modelled.)
    ///
    /// The CPU preset ([`SimConfig::cpu_default`](super::SimConfig::cpu_default)) runs it with
    /// chunks of 40 positions (not a whole number of blocks), which its contexts cross.
    pub fn llama4_scout(dtype: DType) -> Self {
        let config = ModelConfig::standard(40, 8, 128, dtype, 16, KvLayout::FlashNhd);
        SimModel { chunk: Some(8192), ..SimModel::plain("llama-4-scout-like (chunked local)", config, 48, 1.0 / (128f32).sqrt()) }
    }

    /// A Llama-like model whose second half of the layers shares one cache: 32 query heads over
    /// 8 kv heads of 128, 16 layers, blocks of 16; layers 8..16 write nothing and read layer
    /// 7's cache ([`KvSharing::SecondHalf`]), as YOCO's cross-decoder layers all read the one
    /// cache made at the end of its self-decoder half, and as Gemma 3n's last layers reuse the
    /// cache of the last layer before them. Caches are allocated for layers 0..8 only.
    pub fn kv_shared(dtype: DType) -> Self {
        let config = ModelConfig::standard(32, 8, 128, dtype, 16, KvLayout::FlashNhd);
        SimModel { kv_sharing: KvSharing::SecondHalf, ..SimModel::plain("kv-shared-llama-like", config, 16, 1.0 / (128f32).sqrt()) }
    }

    /// Whisper-small: 12 heads of 64 (q = kv), 12 encoder layers over each request's 1500
    /// encoder tokens and 12 decoder blocks, blocks of 16, softmax scale 1/8. Encoder layers are
    /// bidirectional over the request's encoder input and write their own cache
    /// ([`LayerSpec::encoder`]); each decoder block is a causal self-attention layer
    /// ([`LayerSpec::decoder`]) and a cross-attention layer over a cache of its own
    /// ([`LayerSpec::cross_attention_own`]), which the engine fills once per request with
    /// `Attention::write_kv` in the request's encoder step (Whisper's decoder layers each
    /// project the encoder's output).
    ///
    /// The CPU preset ([`SimConfig::cpu_default`](super::SimConfig::cpu_default)) runs it with
    /// an encoder input of 75 tokens.
    pub fn whisper_small(dtype: DType) -> Self {
        let config = ModelConfig::standard(12, 12, 64, dtype, 16, KvLayout::FlashNhd);
        SimModel { encoder_len: Some(1500), ..SimModel::plain("whisper-small-like (encoder-decoder)", config, 12, 1.0 / 8.0) }
    }

    /// Phi-2: 32 heads of 80 (q = kv), 32 layers, blocks of 16, softmax scale 1/sqrt(80). Its
    /// head size runs on the GPU kernels of width 96, the columns past 80 zero-filled.
    pub fn phi2(dtype: DType) -> Self {
        let config = ModelConfig::standard(32, 32, 80, dtype, 16, KvLayout::FlashNhd);
        SimModel::plain("phi-2-like (head size 80)", config, 32, 1.0 / (80f32).sqrt())
    }

    /// A small standard-attention model for tests: 4 query heads over 2 kv heads of 64.
    pub fn tiny(dtype: DType) -> Self {
        let config = ModelConfig::standard(4, 2, 64, dtype, 16, KvLayout::FlashNhd);
        SimModel::plain("tiny", config, 2, 0.125)
    }

    /// A small MLA model for tests: 2 heads over the 512 + 64 latent, blocks of 16.
    pub fn tiny_mla(dtype: DType) -> Self {
        let config = ModelConfig::mla(2, dtype, 16);
        SimModel::plain("tiny-mla", config, 2, 1.0 / (192f32).sqrt())
    }

    pub fn with_layers(self, num_layers: usize) -> Self {
        SimModel { num_layers, ..self }
    }

    /// The same model with another window on its windowed layers and another soft-cap where it
    /// caps (`None`: its own); a model without a window or soft-cap gains none.
    pub fn with_window_and_softcap(self, window: Option<u32>, softcap: Option<f32>) -> Self {
        SimModel { window: self.window.map(|w| window.unwrap_or(w)), softcap: self.softcap.map(|c| softcap.unwrap_or(c)), ..self }
    }

    /// The same model with another chunk on its chunked layers (`None`: its own); a model
    /// without chunks gains none.
    pub fn with_chunk(self, chunk: Option<u32>) -> Self {
        SimModel { chunk: self.chunk.map(|c| chunk.unwrap_or(c)), ..self }
    }

    /// Whether decoder layer `layer` attends within chunks (each fourth layer, 3, 7, ..., does
    /// not).
    pub fn is_chunked_layer(&self, layer: usize) -> bool {
        self.chunk.is_some() && !(layer + 1).is_multiple_of(4)
    }

    pub fn is_mla(&self) -> bool {
        self.config.kind == attn_rs::backend::AttentionKind::Mla
    }

    /// Whether it has an encoder (and cross-attention layers).
    pub fn is_encoder_decoder(&self) -> bool {
        self.encoder_len.is_some()
    }

    /// The attention layers of a run of `layers` model layers: `layers`, or for an
    /// encoder-decoder model `3 * layers` (the encoder layers, then each decoder block's
    /// self-attention and cross-attention layer).
    pub fn attention_layers(&self, layers: usize) -> usize {
        if self.is_encoder_decoder() {
            3 * layers
        } else {
            layers
        }
    }

    /// The kind of attention layer `layer` of a run of `layers` model layers: of an
    /// encoder-decoder model, layers `0..layers` are the encoder's, then decoder block `i`'s
    /// self-attention is layer `layers + 2 i` and its cross-attention `layers + 2 i + 1`; every
    /// layer of a decoder-only model is a decoder.
    pub fn layer_kind(&self, layer: usize, layers: usize) -> AttentionType {
        match self.encoder_len {
            None => AttentionType::Decoder,
            Some(_) if layer < layers => AttentionType::Encoder,
            Some(_) if (layer - layers).is_multiple_of(2) => AttentionType::Decoder,
            Some(_) => AttentionType::EncoderDecoder,
        }
    }

    /// The layer whose cache layer `layer` of a run of `layers` reads: its own, or the one it
    /// shares.
    pub fn kv_source(&self, layer: usize, layers: usize) -> usize {
        match self.kv_sharing {
            KvSharing::None => layer,
            KvSharing::SecondHalf => layer.min((layers - layers / 2).saturating_sub(1)),
        }
    }

    /// Attention layer `layer`'s attention in a run of `layers` model layers (see
    /// [`attention_layers`](Self::attention_layers)).
    pub fn layer_spec(&self, layer: usize, layers: usize) -> LayerSpec {
        let opts = AttnOptions {
            softmax_scale: self.softmax_scale,
            softcap: self.softcap,
            window: self.window.filter(|_| layer.is_multiple_of(2)),
            chunk_size: self.chunk.filter(|_| self.is_chunked_layer(layer)),
            ..AttnOptions::new(self.config.head_size)
        };
        match self.layer_kind(layer, layers) {
            AttentionType::Encoder => return LayerSpec::encoder(opts),
            AttentionType::EncoderDecoder => return LayerSpec::cross_attention_own(opts),
            _ => {}
        }
        let spec = LayerSpec::decoder(opts);
        match self.kv_source(layer, layers) {
            source if source == layer => spec,
            source => spec.sharing_kv_of(source),
        }
    }

    /// Every attention layer's attention in a run of `layers` model layers.
    pub fn layer_specs(&self, layers: usize) -> Vec<LayerSpec> {
        (0..self.attention_layers(layers)).map(|l| self.layer_spec(l, layers)).collect()
    }

    /// The layers a run of `layers` model layers checks by default: the first and the last; of
    /// an encoder-decoder model, the first and the last of each kind (encoder, decoder
    /// self-attention, cross-attention).
    pub fn default_check_layers(&self, layers: usize) -> Vec<usize> {
        let n = self.attention_layers(layers);
        let mut l = if self.is_encoder_decoder() { vec![0, layers - 1, layers, layers + 1, n - 2, n - 1] } else { vec![0, n - 1] };
        l.sort_unstable();
        l.dedup();
        l
    }

    /// What the layers of a run of `layers` model layers do beyond plain attention, in words;
    /// `None` when nothing.
    pub fn describe_layers(&self, layers: usize) -> Option<String> {
        let mut parts = Vec::new();
        if let Some(len) = self.encoder_len {
            let n = self.attention_layers(layers);
            parts.push(format!(
                "{} encoder (bidirectional over each request's {len} encoder tokens, each writing its cache); {layers} decoder \
                 block{}: causal self-attention ({}) and cross-attention over a cache of its own, filled by write_kv in the \
                 request's encoder step ({})",
                every_other(0, 1, layers - 1),
                if layers == 1 { "" } else { "s" },
                every_other(layers, 2, n - 2),
                every_other(layers + 1, 2, n - 1)
            ));
        }
        if let Some(w) = self.window {
            parts.push(format!("sliding window {w} on the even layers (the odd ones see the whole context)"));
        }
        if let Some(c) = self.chunk {
            let global: Vec<usize> = (0..layers).filter(|&l| !self.is_chunked_layer(l)).collect();
            let rest = match global.len() {
                0 => "every layer".to_string(),
                _ => format!("every layer but {}", every_other(global[0], 4, global[global.len() - 1])),
            };
            parts.push(format!("chunked local attention in chunks of {c} positions on {rest}"));
        }
        if let Some(cap) = self.softcap {
            parts.push(format!("soft-cap {cap} on every layer"));
        }
        let sharing: Vec<usize> = (0..layers).filter(|&l| self.kv_source(l, layers) != l).collect();
        if let (Some(first), Some(last)) = (sharing.first(), sharing.last()) {
            let source = self.kv_source(*first, layers);
            let which = if first == last { format!("layer {first} reads") } else { format!("layers {first}..={last} read") };
            let writes = if first == last { "writes" } else { "write" };
            parts.push(format!("{which} layer {source}'s cache and {writes} none"));
        }
        (!parts.is_empty()).then(|| parts.join("; "))
    }

    /// Columns of one token's row of the simulated projection output:
    /// `[q heads | k heads | v heads]`, or `[q heads | kv_c | k_pe]` for MLA.
    pub fn row_layout(&self) -> RowLayout {
        let c = &self.config;
        let q = c.num_q_heads * c.head_size;
        if self.is_mla() {
            let rope = attn_rs::MlaCacheSpec::DEEPSEEK_ROPE;
            let latent = c.head_size - rope;
            RowLayout { q: 0, k: q, v: q + latent, width: q + c.head_size }
        } else {
            let kv = c.num_kv_heads * c.head_size;
            RowLayout { q: 0, k: q, v: q + kv, width: q + 2 * kv }
        }
    }
}

/// `layer 3`, `layers 3 and 5`, `layers 3, 5, ..., 11`: the layers `first..=last` `step` apart.
fn every_other(first: usize, step: usize, last: usize) -> String {
    match (last - first) / step {
        0 => format!("layer {first}"),
        1 => format!("layers {first} and {last}"),
        _ if step == 1 => format!("layers {first}..={last}"),
        _ => format!("layers {first}, {}, ..., {last}", first + step),
    }
}

/// Where q, k and v (MLA: q, kv_c and k_pe) start in a token's row, and the row's width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowLayout {
    pub q: usize,
    pub k: usize,
    pub v: usize,
    pub width: usize,
}
