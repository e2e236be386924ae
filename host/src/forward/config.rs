//! [`ForwardConfig`]: what an [`Attention`](super::Attention) is made for (the model, its caches,
//! each layer's attention and the largest step), checked once at start-up.

use super::io::CacheSpec;
use super::layers::{validate_layers, AttentionType, LayerSpec};
use crate::backend::{AttentionKind, ModelConfig};
use crate::batch::MAX_QUERY_LEN;
use crate::context_parallel::CpShard;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::layout::{KvCacheSpec, MlaCacheSpec};
use crate::metadata::{CascadeMode, LocalBatch};
use crate::options::{AttnOptions, PlanOptions, SplitMode, Tuning};

/// The largest step an [`Attention`](super::Attention) takes (its GPU workspaces and upload
/// buffers are sized for it once).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ForwardLimits {
    /// Tokens of a step (`num_actual_tokens`).
    pub max_num_tokens: usize,
    /// Requests of a step.
    pub max_num_reqs: usize,
    /// The longest context a request reaches (prompt and generated tokens).
    pub max_model_len: usize,
}

/// An attention layer stack's configuration: the model and its caches, shared by every layer,
/// and each layer's attention ([`layers`](Self::layers), else [`opts`](Self::opts) for all).
#[derive(Clone, Debug, PartialEq)]
pub struct ForwardConfig {
    /// The model's attention (the one the backend was selected for).
    pub model: ModelConfig,
    /// Blocks in each layer's cache.
    pub num_blocks: usize,
    /// Softmax scale, sliding window and soft-cap of every layer when [`layers`](Self::layers)
    /// is empty (decoder layers, with ALiBi and sinks as `model.features` declares them); a
    /// window or soft-cap must be declared in `model.features` (the backend was chosen for them).
    pub opts: AttnOptions,
    /// Each layer's attention, indexed as [`Attention::forward_layer`](super::Attention::forward_layer)
    /// takes them: kind (decoder, encoder-only), options, ALiBi, sinks, KV sharing. Empty: every
    /// layer is [`LayerSpec::uniform`] of `opts`, and [`Attention::forward`](super::Attention::forward)
    /// runs any of them.
    pub layers: Vec<LayerSpec>,
    /// Requests with at most this many query tokens go to the decode kernel (1..=8), the rest
    /// to prefill. The batch must be ordered decodes first
    /// ([`decode_first_order`](crate::metadata::decode_first_order)).
    pub decode_threshold: usize,
    /// How decode splits long contexts (`SplitMode::Fixed(1)`: batch-independent results).
    pub split_mode: SplitMode,
    /// The split planners' tuning knobs (the measured defaults unless benchmarking).
    pub tuning: Tuning,
    /// Cascade attention for a prefix of blocks every request shares (`tensor-core` only; not
    /// with a sliding window, ALiBi or sinks): decided per step by
    /// [`use_cascade`](crate::metadata::use_cascade), or forced on or off. `Auto` stays off with
    /// `SplitMode::Fixed(1)`, whose results must not depend on the rest of the batch.
    pub cascade: CascadeMode,
    /// The largest step (tokens, requests, context length).
    pub limits: ForwardLimits,
    /// Decode context parallelism: this rank's place in its group. Each rank's `Attention`
    /// holds its share of every context in its own cache, writes the step's tokens it holds
    /// and attends over its share; the ranks' results are exchanged through the exchange
    /// given to [`Attention::set_cp_exchange`](super::Attention::set_cp_exchange) and merged
    /// on every rank. Steps are built from the group's metadata as they come
    /// ([`StepMetadata::build`](super::StepMetadata::build) shards them) and are decodes of up
    /// to `decode_threshold` tokens a request (speculative tokens are decoded as a request a
    /// token); prompts are written and attended with the ops (docs/context-parallel.md). `tensor-core` and `mla`; no window, ALiBi, chunked or
    /// non-decoder layers, no cascade, no CUDA graphs.
    pub context_parallel: Option<CpShard>,
}

impl ForwardConfig {
    /// `model` with `num_blocks` blocks per layer, the default softmax scale
    /// (`1 / sqrt(head_size)`), decode threshold 1 and automatic splits.
    pub fn new(model: ModelConfig, num_blocks: usize, limits: ForwardLimits) -> Self {
        ForwardConfig {
            model,
            num_blocks,
            opts: AttnOptions::new(model.head_size),
            layers: Vec::new(),
            decode_threshold: 1,
            split_mode: SplitMode::Auto,
            tuning: Tuning::DEFAULT,
            cascade: CascadeMode::Auto,
            limits,
            context_parallel: None,
        }
    }

    /// The same config with one [`LayerSpec`] per layer (see [`layers`](Self::layers)).
    pub fn with_layers(self, layers: Vec<LayerSpec>) -> Self {
        ForwardConfig { layers, ..self }
    }

    /// The attention of layer `layer`: its entry of [`layers`](Self::layers), or the uniform
    /// setting when the list is empty.
    ///
    /// Errors: `layer` past the list, naming both.
    pub fn layer(&self, layer: usize) -> Result<LayerSpec> {
        if self.layers.is_empty() {
            return Ok(LayerSpec::uniform(&self.model, self.opts));
        }
        self.layers.get(layer).copied().ok_or_else(|| {
            AttnError::invalid("layer", format!("{layer}: the config lists {} layers (0..{})", self.layers.len(), self.layers.len()))
        })
    }

    /// Whether every layer can run the step's shared prefix as cascade attention.
    pub(crate) fn every_layer_takes_cascade(&self) -> bool {
        if self.layers.is_empty() {
            LayerSpec::uniform(&self.model, self.opts).takes_cascade()
        } else {
            self.layers.iter().all(LayerSpec::takes_cascade)
        }
    }

    /// Each layer's cache: the model's K/V layout, or the MLA latent cache (`head_size` =
    /// latent + 64 rope columns).
    pub fn cache_spec(&self) -> Result<CacheSpec> {
        let m = &self.model;
        match m.kind {
            AttentionKind::Standard => {
                let layout = m.kv_layout.ok_or_else(|| AttnError::invalid("model", "standard attention needs a kv_layout"))?;
                Ok(CacheSpec::Paged(KvCacheSpec::new(layout, self.num_blocks, m.block_size, m.num_kv_heads, m.head_size)?))
            }
            AttentionKind::Mla => {
                let rope = MlaCacheSpec::DEEPSEEK_ROPE;
                ensure(m.head_size > rope, "model", || format!("MLA head_size {} must exceed the {rope} rope columns", m.head_size))?;
                ensure(m.num_kv_heads == 1, "model", || format!("MLA has one latent (num_kv_heads 1), not {}", m.num_kv_heads))?;
                Ok(CacheSpec::Mla(MlaCacheSpec::new(self.num_blocks, m.block_size, m.head_size - rope, rope)?))
            }
        }
    }

    /// The options of the decode and MLA split plans: [`split_mode`](Self::split_mode) and
    /// [`tuning`](Self::tuning).
    pub fn plan_options(&self) -> PlanOptions {
        PlanOptions { split: self.split_mode, tuning: self.tuning }
    }

    /// The largest step as the kernels see it: a context-parallel rank decodes speculative
    /// tokens as a request a token, so its steps may hold as many requests as tokens; a local
    /// batch ([`local_batch_chunks`](Self::local_batch_chunks)) cuts requests at chunk starts.
    pub(crate) fn kernel_limits(&self) -> ForwardLimits {
        let l = self.limits;
        let mut reqs = match self.context_parallel {
            Some(_) => l.max_num_reqs.max(l.max_num_tokens),
            None => l.max_num_reqs,
        };
        for chunk in self.local_batch_chunks() {
            reqs = reqs.max(LocalBatch::max_reqs(l.max_num_reqs, l.max_num_tokens, chunk));
        }
        ForwardLimits { max_num_reqs: reqs, ..l }
    }

    /// The chunk sizes of the chunked local decoder layers that run as local batches on the
    /// GPU (each request cut at chunk starts, then the decode and prefill kernels unmasked:
    /// [`LocalBatch`]): those whose chunk is a whole number of blocks. Others run the
    /// local-mask prefill kernel over the whole step.
    pub(crate) fn local_batch_chunks(&self) -> Vec<usize> {
        let uniform = [LayerSpec::uniform(&self.model, self.opts)];
        let specs: &[LayerSpec] = if self.layers.is_empty() { &uniform } else { &self.layers };
        let mut chunks: Vec<usize> = specs
            .iter()
            .filter(|l| l.attn_type == AttentionType::Decoder)
            .filter_map(|l| l.opts.chunk_size.map(|c| c as usize))
            .filter(|&c| self.chunk_of_whole_blocks(c))
            .collect();
        chunks.sort_unstable();
        chunks.dedup();
        chunks
    }

    /// Whether a chunk of `chunk` positions is a whole number of the model's blocks (a decoder
    /// layer with such chunks runs as a local batch).
    pub(crate) fn chunk_of_whole_blocks(&self, chunk: usize) -> bool {
        chunk.is_multiple_of(self.model.block_size.max(1))
    }

    /// Blocks a request's row of the block table may need.
    pub fn max_blocks_per_req(&self) -> usize {
        self.limits.max_model_len.div_ceil(self.model.block_size.max(1))
    }

    /// What context parallelism takes: decoder layers that need no key position (no window,
    /// ALiBi or chunks).
    fn validate_context_parallel(&self, shard: &CpShard) -> Result<()> {
        shard.validate()?;
        for i in 0..self.layers.len().max(1) {
            let l = self.layer(i)?;
            let reason = match () {
                _ if l.attn_type != AttentionType::Decoder => Some("a layer that is not a decoder layer"),
                _ if l.opts.window.is_some() => Some("a sliding window (it needs each key's position in the whole context)"),
                _ if l.alibi => Some("ALiBi (it needs each key's position in the whole context)"),
                _ if l.opts.chunk_size.is_some() => Some("chunked local attention"),
                _ => None,
            };
            if let Some(r) = reason {
                return Err(AttnError::invalid("context_parallel", format!("layer {i} has {r}")));
            }
        }
        Ok(())
    }

    /// Checks what every backend needs, naming the field.
    pub(crate) fn validate(&self) -> Result<()> {
        let m = &self.model;
        ensure(m.num_q_heads > 0 && m.num_kv_heads > 0 && m.num_q_heads.is_multiple_of(m.num_kv_heads), "model", || {
            format!("num_q_heads {} is not a positive multiple of num_kv_heads {}", m.num_q_heads, m.num_kv_heads)
        })?;
        ensure(matches!(m.q_dtype, DType::F16 | DType::BF16 | DType::F32), "model", || {
            format!("q_dtype {:?}: queries are f16, bf16 or f32", m.q_dtype)
        })?;
        let fp8_cache = m.cache_dtype.is_fp8() && matches!(m.q_dtype, DType::F16 | DType::BF16);
        ensure(m.cache_dtype == m.q_dtype || fp8_cache, "model", || {
            format!(
                "cache_dtype {:?} with {:?} queries: forward takes caches of the query dtype, or FP8 with f16/bf16 queries",
                m.cache_dtype, m.q_dtype
            )
        })?;
        // The sparse kernels are called directly (`mla::mla_sparse_attention`, with each step's
        // index lists); `forward` runs dense attention only.
        ensure(m.sparse_topk.is_none(), "model", || {
            "sparse_topk: forward runs dense attention; sparse MLA is mla::mla_sparse_attention".into()
        })?;
        let t = self.decode_threshold;
        ensure((1..=MAX_QUERY_LEN).contains(&t), "decode_threshold", || format!("{t} (decode takes 1..={MAX_QUERY_LEN} query tokens)"))?;
        ensure(!matches!(self.split_mode, SplitMode::Fixed(0)), "split_mode", || "Fixed(0): at least one split".into())?;
        ensure(self.opts.window.is_none() || m.features.sliding_window, "opts", || {
            "a sliding window that the model config does not declare (features.sliding_window)".into()
        })?;
        ensure(self.opts.softcap.is_none() || m.features.softcap, "opts", || {
            "a soft-cap that the model config does not declare (features.softcap)".into()
        })?;
        ensure(self.opts.window != Some(0), "opts", || "a sliding window of 0 keys".into())?;
        self.opts.validate_masks("opts", true)?;
        match self.layers.is_empty() {
            true => validate_layers(m, &[LayerSpec::uniform(m, self.opts)])?,
            false => validate_layers(m, &self.layers)?,
        }
        if let Some(shard) = &self.context_parallel {
            self.validate_context_parallel(shard)?;
        }
        let l = &self.limits;
        ensure(l.max_num_tokens > 0 && l.max_num_reqs > 0 && l.max_model_len > 0, "limits", || format!("{l:?} has a zero"))?;
        ensure(l.max_num_tokens <= i32::MAX as usize && l.max_model_len <= i32::MAX as usize, "limits", || format!("{l:?} overflow i32"))?;
        self.cache_spec().map(|_| ())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::KvLayout;

    #[test]
    fn chunks_of_whole_blocks_run_as_local_batches_and_widen_the_kernel_limits() {
        let model = ModelConfig::standard(8, 2, 128, DType::BF16, 16, KvLayout::FlashNhd);
        let limits = ForwardLimits { max_num_tokens: 1000, max_num_reqs: 10, max_model_len: 4096 };
        let chunked = |c| LayerSpec::decoder(AttnOptions { chunk_size: Some(c), ..AttnOptions::new(128) });
        let plain = ForwardConfig::new(model, 64, limits);
        assert!(plain.local_batch_chunks().is_empty());
        assert_eq!(plain.kernel_limits(), limits);
        // Chunks of 64 and 48 (twice) are whole blocks of 16; 40 is not (the local-mask kernel).
        let layers = vec![chunked(64), chunked(48), chunked(40), chunked(48), LayerSpec::decoder(AttnOptions::new(128))];
        let config = plain.clone().with_layers(layers);
        assert_eq!(config.local_batch_chunks(), [48, 64]);
        // Up to 2 x 10 + 1000 / 48 requests, the smaller chunk's.
        assert_eq!(config.kernel_limits(), ForwardLimits { max_num_reqs: 20 + 20, ..limits });
        let uniform = ForwardConfig { opts: AttnOptions { chunk_size: Some(32), ..AttnOptions::new(128) }, ..plain };
        assert_eq!(uniform.local_batch_chunks(), [32]);
    }
}
