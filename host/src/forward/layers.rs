//! What each layer of a model does ([`LayerSpec`]), in the terms of vLLM's
//! `Attention(num_heads, head_size, scale, sliding_window, logits_soft_cap, attn_type,
//! kv_sharing_target_layer_name)`: the heads, head size and cache are the model's
//! ([`ModelConfig`](crate::backend::ModelConfig)); the rest is per layer here. A
//! [`ForwardConfig`](super::ForwardConfig) without a list gives every layer its one setting.

use crate::backend::{AttentionKind, ModelConfig};
use crate::error::{AttnError, Result};
use crate::options::AttnOptions;
use std::fmt;

/// The kind of a layer's attention (vLLM's `AttentionType`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum AttentionType {
    /// Causal self-attention over the request's paged cache, which the layer's new keys and
    /// values are written into (decoder-only models; today's behaviour).
    #[default]
    Decoder,
    /// Bidirectional self-attention over the step's own tokens (BERT-like encoders): every
    /// request's prompt comes whole in one step (its `seq_len` is its query tokens), and
    /// nothing is cached. A [`symmetric_window`](AttnOptions::symmetric_window) limits it to
    /// the keys at most that many positions away.
    EncoderOnly,
    /// The encoder of an encoder-decoder model: bidirectional self-attention over the step's
    /// own tokens, as [`EncoderOnly`](Self::EncoderOnly), which also writes its new keys and
    /// values into its paged cache at the step's slots, for the cross-attention layers that
    /// read it in the decoder's later steps.
    Encoder,
    /// Encoder-decoder cross-attention: the decoder's query tokens attend, non-causally, to
    /// every key of the request's encoder sequence, in the cache an [`Encoder`](Self::Encoder)
    /// layer wrote (named by [`kv_sharing_target`](LayerSpec::kv_sharing_target)), or in its
    /// own cache, which [`Attention::write_kv`](super::Attention::write_kv) fills. It writes
    /// nothing in `forward_layer`. Its step is built over the encoder cache: each request's
    /// `seq_len` is its encoder length and its block-table row the encoder's blocks (slots are
    /// not used).
    EncoderDecoder,
}

impl AttentionType {
    /// Whether its queries see only earlier keys.
    pub fn is_causal(self) -> bool {
        matches!(self, AttentionType::Decoder)
    }

    /// Whether the layer reads or writes a paged cache.
    pub fn uses_cache(self) -> bool {
        !matches!(self, AttentionType::EncoderOnly)
    }

    /// Whether the layer writes its new keys and values into a cache of its own (then other
    /// layers may read that cache).
    pub fn writes_cache(self) -> bool {
        matches!(self, AttentionType::Decoder | AttentionType::Encoder)
    }

    /// Whether it attends the step's own new keys and values (bidirectionally, each request
    /// whole) rather than the cache.
    pub fn attends_new_kv(self) -> bool {
        matches!(self, AttentionType::EncoderOnly | AttentionType::Encoder)
    }
}

impl fmt::Display for AttentionType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            AttentionType::Decoder => "decoder",
            AttentionType::EncoderOnly => "encoder-only",
            AttentionType::Encoder => "encoder",
            AttentionType::EncoderDecoder => "encoder-decoder (cross-attention)",
        })
    }
}

/// One layer's attention.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct LayerSpec {
    /// Decoder (causal, paged cache), encoder-only (bidirectional, no cache), encoder
    /// (bidirectional, writes its cache) or cross-attention (reads an encoder's cache).
    pub attn_type: AttentionType,
    /// Softmax scale, sliding window (causal layers), soft-cap, chunked local attention
    /// (`chunk_size`, causal layers) and symmetric window (encoder-only layers). A window or
    /// soft-cap must be among the model's `features` (the backend was selected for them).
    pub opts: AttnOptions,
    /// The layer takes ALiBi slopes (`alibi_slopes` of its [`Layer`](super::Layer)); the model
    /// must declare `features.alibi`.
    pub alibi: bool,
    /// The layer takes attention sinks (`sinks`); the model must declare `features.sinks`.
    pub sinks: bool,
    /// KV sharing (vLLM's `kv_sharing_target_layer_name`): the index of an earlier decoder
    /// layer whose cache this layer reads, or for a cross-attention layer (required there) the
    /// encoder layer whose cache it reads. It writes nothing: its `forward` takes
    /// [`NewKv::None`](super::NewKv::None) and that layer's cache buffer.
    pub kv_sharing_target: Option<usize>,
}

impl LayerSpec {
    /// A decoder layer with `opts`, no ALiBi, no sinks, its own cache.
    pub fn decoder(opts: AttnOptions) -> Self {
        LayerSpec { attn_type: AttentionType::Decoder, opts, alibi: false, sinks: false, kv_sharing_target: None }
    }

    /// An encoder-only layer with `opts` (a `symmetric_window` or none).
    pub fn encoder_only(opts: AttnOptions) -> Self {
        LayerSpec { attn_type: AttentionType::EncoderOnly, ..LayerSpec::decoder(opts) }
    }

    /// An encoder layer of an encoder-decoder model with `opts` (a `symmetric_window` or
    /// none): bidirectional, and it writes its cache.
    pub fn encoder(opts: AttnOptions) -> Self {
        LayerSpec { attn_type: AttentionType::Encoder, ..LayerSpec::decoder(opts) }
    }

    /// A cross-attention layer with `opts` (scale, soft-cap) reading the cache of encoder layer
    /// `encoder`.
    pub fn cross_attention(opts: AttnOptions, encoder: usize) -> Self {
        LayerSpec { kv_sharing_target: Some(encoder), ..LayerSpec::cross_attention_own(opts) }
    }

    /// A cross-attention layer with `opts` reading a cache of its own, which
    /// [`Attention::write_kv`](super::Attention::write_kv) fills with its projection of the
    /// encoder's output (Whisper's and BART's decoder layers).
    pub fn cross_attention_own(opts: AttnOptions) -> Self {
        LayerSpec { attn_type: AttentionType::EncoderDecoder, ..LayerSpec::decoder(opts) }
    }

    /// The same layer reading layer `target`'s cache instead of writing its own.
    pub fn sharing_kv_of(self, target: usize) -> Self {
        LayerSpec { kv_sharing_target: Some(target), ..self }
    }

    /// The one setting every layer has when a config lists none: a decoder with `opts`, ALiBi
    /// and sinks as the model declares them.
    pub fn uniform(model: &ModelConfig, opts: AttnOptions) -> Self {
        LayerSpec { alibi: model.features.alibi, sinks: model.features.sinks, ..LayerSpec::decoder(opts) }
    }

    /// The same layer without its chunks: how a chunked local layer runs on a local batch
    /// ([`LocalBatch`](crate::metadata::LocalBatch)), whose requests each lie in one chunk.
    /// Its other terms (window, ALiBi) read a key's distance to the query, which the cut keeps.
    pub(crate) fn without_chunks(&self) -> Self {
        LayerSpec { opts: AttnOptions { chunk_size: None, ..self.opts }, ..*self }
    }

    /// Whether the step's shared-prefix cascade can run this layer: a decoder without a window,
    /// chunks, ALiBi or sinks (whose terms depend on where a key is in the whole context).
    pub(crate) fn takes_cascade(&self) -> bool {
        let o = &self.opts;
        self.attn_type == AttentionType::Decoder
            && o.window.is_none()
            && o.chunk_size.is_none()
            && o.symmetric_window.is_none()
            && !self.alibi
            && !self.sinks
    }
}

/// Checks a model's layer list (`layers`, each refusal naming the layer and the value): each
/// layer's options for its kind, its features against the model's, and each KV-sharing target.
pub(crate) fn validate_layers(model: &ModelConfig, layers: &[LayerSpec]) -> Result<()> {
    for (i, l) in layers.iter().enumerate() {
        check_layer(model, l).map_err(|reason| AttnError::invalid("layers", format!("layer {i}: {reason}")))?;
        if let Some(t) = l.kv_sharing_target {
            check_sharing(layers, i, t).map_err(|reason| AttnError::invalid("layers", format!("layer {i}: {reason}")))?;
        }
    }
    Ok(())
}

/// One layer against the model; the reason it is refused.
pub(crate) fn check_layer(model: &ModelConfig, l: &LayerSpec) -> std::result::Result<(), String> {
    let (o, f) = (&l.opts, &model.features);
    let s = o.softmax_scale;
    let fail = |ok: bool, why: &dyn Fn() -> String| if ok { Ok(()) } else { Err(why()) };
    fail(s.is_finite() && s > 0.0, &|| format!("softmax_scale {s} must be positive and finite"))?;
    if let Some(cap) = o.softcap {
        fail(cap.is_finite() && cap > 0.0, &|| format!("softcap {cap} must be positive and finite"))?;
    }
    o.validate_masks("layers", l.attn_type.is_causal()).map_err(|e| match e {
        AttnError::InvalidArgument { reason, .. } => reason,
        other => other.to_string(),
    })?;
    fail(o.window.is_none() || f.sliding_window, &|| {
        format!("window {:?}: the model config does not declare a sliding window (features.sliding_window)", o.window)
    })?;
    fail(o.softcap.is_none() || f.softcap, &|| {
        format!("softcap {:?}: the model config does not declare a soft-cap (features.softcap)", o.softcap)
    })?;
    fail(!l.alibi || f.alibi, &|| "ALiBi: the model config does not declare it (features.alibi)".into())?;
    fail(!l.sinks || f.sinks, &|| "sinks: the model config does not declare them (features.sinks)".into())?;
    let mla = model.kind == AttentionKind::Mla;
    fail(!mla || (l.attn_type == AttentionType::Decoder && l.kv_sharing_target.is_none()), &|| {
        format!("{} attention{}: MLA layers are decoders with their own cache", l.attn_type, sharing_note(l))
    })?;
    fail(!mla || (o.chunk_size.is_none() && o.window.is_none() && o.softcap.is_none() && !l.alibi && !l.sinks), &|| {
        "MLA layers take only a softmax scale (no window, chunks, soft-cap, ALiBi or sinks)".into()
    })?;
    if l.attn_type.attends_new_kv() {
        let t = l.attn_type;
        fail(o.chunk_size.is_none(), &|| format!("chunk_size {:?} on an {t} layer (chunks are causal)", o.chunk_size))?;
        fail(o.window.is_none(), &|| format!("window {:?} on an {t} layer (it takes symmetric_window)", o.window))?;
    }
    if l.attn_type == AttentionType::EncoderDecoder {
        // A decoder token and an encoder token share no position: no mask or bias by distance.
        fail(o.window.is_none() && o.chunk_size.is_none() && o.symmetric_window.is_none() && !l.alibi, &|| {
            format!(
                "window {:?}, chunk_size {:?}, symmetric_window {:?}, ALiBi {}: a cross-attention layer's keys have no position relative to its queries",
                o.window, o.chunk_size, o.symmetric_window, l.alibi
            )
        })?;
    }
    Ok(())
}

fn sharing_note(l: &LayerSpec) -> String {
    l.kv_sharing_target.map_or(String::new(), |t| format!(" sharing layer {t}'s cache"))
}

/// Layer `i` reading layer `t`'s cache: an earlier layer that writes a cache of its own, a
/// decoder for a decoder and an encoder for a cross-attention layer.
fn check_sharing(layers: &[LayerSpec], i: usize, t: usize) -> std::result::Result<(), String> {
    if t >= i {
        return Err(format!("kv_sharing_target {t} is not an earlier layer (the target's cache must be written first)"));
    }
    let (kind, target) = (layers[i].attn_type, &layers[t]);
    let wanted = match kind {
        AttentionType::Decoder => AttentionType::Decoder,
        AttentionType::EncoderDecoder => AttentionType::Encoder,
        _ => return Err(format!("kv_sharing_target {t} on an {kind} layer, which reads no cache")),
    };
    if !target.attn_type.writes_cache() {
        return Err(format!("kv_sharing_target {t} is an {} layer, which keeps no cache", target.attn_type));
    }
    if target.attn_type != wanted {
        return Err(format!(
            "kv_sharing_target {t} is of kind {}, but layers of kind {kind} read the cache of kind {wanted}",
            target.attn_type
        ));
    }
    if let Some(owner) = target.kv_sharing_target {
        return Err(format!("kv_sharing_target {t} itself reads layer {owner}'s cache: name layer {owner}"));
    }
    Ok(())
}
