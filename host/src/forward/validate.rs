//! Checks of one layer's inputs against the model, the cache and the step, before anything is
//! written or launched; every refusal names the argument and the value.

use super::config::ForwardConfig;
use super::host_buf::{HostIn, HostOut};
use super::io::{CacheSpec, KvCacheWrite, Layer, NewKv};
use super::layers::{AttentionType, LayerSpec};
use super::step::StepMetadata;
use crate::backend::AttentionKind;
use crate::batch::{validate_batch, validate_prefill_batch, DecodeBatch, PrefillBatch};
use crate::buffer::{DevIn, DevOut};
use crate::cache_write::latent_rows_len;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::layout::RowsDesc;

/// A buffer's dtype, length in elements and address, wherever it lives.
pub(crate) trait Buf {
    fn buf_dtype(&self) -> DType;
    fn buf_len(&self) -> usize;
    fn buf_addr(&self) -> u64;
}

macro_rules! buf {
    ($($t:ident: $addr:expr),*) => {$(
        impl Buf for $t<'_> {
            fn buf_dtype(&self) -> DType {
                self.dtype()
            }
            fn buf_len(&self) -> usize {
                self.len()
            }
            fn buf_addr(&self) -> u64 {
                $addr(self)
            }
        }
    )*};
}
buf!(DevIn: |b: &DevIn<'_>| b.ptr, DevOut: |b: &DevOut<'_>| b.ptr, HostIn: HostIn::addr, HostOut: HostOut::addr);

/// The decode part (`requests 0..num_decodes`) and the prefill part of a built step, as the
/// kernels' host metadata.
pub(crate) struct Parts<'s> {
    pub decode: DecodeBatch<'s>,
    pub prefill: PrefillBatch<'s>,
    pub num_decode_tokens: usize,
    pub num_prefill_tokens: usize,
}

impl<'s> Parts<'s> {
    pub(crate) fn of(step: &'s StepMetadata) -> Self {
        let split = step.split();
        let nd = split.num_decodes;
        Parts {
            decode: DecodeBatch { seq_lens: &step.seq_lens()[..nd], query_start_loc: &step.query_start_loc()[..=nd] },
            prefill: PrefillBatch {
                query_start_loc: step.prefill_query_start_loc(),
                seq_lens: &step.seq_lens()[nd..],
                key_start_loc: None,
            },
            num_decode_tokens: split.num_decode_tokens,
            num_prefill_tokens: split.num_prefill_tokens,
        }
    }
}

/// Everything about `layer` (layer `index`, whose attention is `ls`) that does not depend on
/// where it lives: dtypes, shapes and lengths against the model and cache, token counts against
/// the step, optional inputs against the layer's features, what a KV-sharing or encoder-only
/// layer takes, and each part of the step against its kernel's limits. `block_table_stride` is
/// the width of the rows the kernels will read.
pub(crate) fn validate_layer<I: Buf, O: Buf>(
    config: &ForwardConfig,
    (index, ls): (usize, &LayerSpec),
    spec: &CacheSpec,
    step: &StepMetadata,
    block_table_stride: usize,
    layer: &Layer<I, O>,
) -> Result<()> {
    ensure(step.is_built(), "step", || "holds no step: build it first (or its last build failed)".into())?;
    let m = &config.model;
    let nt = step.num_actual_tokens();
    let q_dtype = m.q_dtype;
    check_rows("q", &layer.q, &layer.q_rows, q_dtype, m.num_q_heads, spec.qk_head_size(), nt)?;
    let reads_only = ls.kv_sharing_target.is_some() || ls.attn_type == AttentionType::EncoderDecoder;
    match &layer.new_kv {
        NewKv::None => ensure(reads_only, "new_kv", || {
            format!("NewKv::None for layer {index}, which {} (only layers that read a cache written before take none)", writes_what(ls))
        })?,
        _ if reads_only => {
            return Err(AttnError::invalid(
                "new_kv",
                format!("given for layer {index}, which {} and writes nothing: pass NewKv::None", reads_what(index, ls)),
            ));
        }
        new_kv => check_new_kv(config, spec, nt, new_kv)?,
    }
    // An encoder-only layer neither reads nor writes `cache`.
    if ls.attn_type.uses_cache() {
        check_cache(config, spec, &layer.cache)?;
    }
    check_rows("out", &layer.out, &layer.out_rows, q_dtype, m.num_q_heads, spec.v_head_size(), nt)?;
    let what = |f: &str, field: &str| format!("layer {index}'s {f} (LayerSpec::{field}, by default the model's features.{field})");
    check_optional("alibi_slopes", layer.alibi_slopes.as_ref(), ls.alibi, &what("ALiBi", "alibi"), m.num_q_heads)?;
    check_optional("sinks", layer.sinks.as_ref(), ls.sinks, &what("attention sinks", "sinks"), m.num_q_heads)?;
    check_scales(config, (index, ls), layer.kv_scales.as_ref())?;

    if ls.attn_type.attends_new_kv() {
        return validate_encoder_step(step, index, ls.attn_type);
    }
    if ls.attn_type == AttentionType::EncoderDecoder {
        // Non-causal over the encoder cache: the whole step, as one prefill or as decodes and
        // a prefill part (each a part of the whole).
        let batch = PrefillBatch { query_start_loc: step.query_start_loc(), seq_lens: step.seq_lens(), key_start_loc: None };
        validate_prefill_batch(&batch, nt, false, Some((spec.block_size(), block_table_stride)))?;
    }
    let parts = Parts::of(step);
    if step.split().num_decodes > 0 {
        validate_batch(&parts.decode, parts.num_decode_tokens, spec.block_size(), block_table_stride)?;
    }
    if step.split().num_prefills > 0 {
        let causal = ls.attn_type.is_causal();
        validate_prefill_batch(&parts.prefill, parts.num_prefill_tokens, causal, Some((spec.block_size(), block_table_stride)))?;
    }
    Ok(())
}

/// What [`Attention::write_kv`](super::Attention::write_kv) takes for layer `index`: a
/// cross-attention layer with a cache of its own, the step's new K/V, its cache, its scales.
pub(crate) fn validate_write<I: Buf, O: Buf>(
    config: &ForwardConfig,
    (index, ls): (usize, &LayerSpec),
    spec: &CacheSpec,
    step: &StepMetadata,
    write: &KvCacheWrite<I, O>,
) -> Result<()> {
    ensure(ls.attn_type == AttentionType::EncoderDecoder && ls.kv_sharing_target.is_none(), "layer", || {
        format!(
            "layer {index} is {} (write_kv fills the cache of a cross-attention layer that has its own; other layers write theirs in forward_layer)",
            match ls.kv_sharing_target {
                Some(t) if ls.attn_type == AttentionType::EncoderDecoder => format!("a cross-attention layer reading layer {t}'s cache"),
                _ => format!("an {} layer", ls.attn_type),
            }
        )
    })?;
    ensure(step.is_built(), "step", || "holds no step: build it first (or its last build failed)".into())?;
    match &write.new_kv {
        NewKv::None => return Err(AttnError::invalid("new_kv", "NewKv::None: write_kv writes the K/V it is given")),
        new_kv => check_new_kv(config, spec, step.num_actual_tokens(), new_kv)?,
    }
    check_cache(config, spec, &write.cache)?;
    check_scales(config, (index, ls), write.kv_scales.as_ref())
}

/// New K/V (`NewKv::Standard` or `NewKv::Mla`) for `nt` tokens of the model.
fn check_new_kv(config: &ForwardConfig, spec: &CacheSpec, nt: usize, new_kv: &NewKv<impl Buf>) -> Result<()> {
    let q_dtype = config.model.q_dtype;
    match (new_kv, spec) {
        (NewKv::None, _) => Ok(()),
        (NewKv::Standard { k, k_rows, v, v_rows }, CacheSpec::Paged(s)) => {
            check_rows("k", k, k_rows, q_dtype, s.num_kv_heads, s.head_size, nt)?;
            check_rows("v", v, v_rows, q_dtype, s.num_kv_heads, s.head_size, nt)
        }
        (NewKv::Mla { kv_c, kv_c_token_stride, k_pe, k_pe_token_stride }, CacheSpec::Mla(s)) => {
            check_latent("kv_c", kv_c, *kv_c_token_stride, q_dtype, s.latent_dim, nt)?;
            check_latent("k_pe", k_pe, *k_pe_token_stride, q_dtype, s.rope_dim, nt)
        }
        (NewKv::Standard { .. }, CacheSpec::Mla(_)) => {
            Err(AttnError::invalid("new_kv", "standard K/V given for an MLA model (it takes NewKv::Mla: kv_c and k_pe)"))
        }
        (NewKv::Mla { .. }, CacheSpec::Paged(_)) => {
            Err(AttnError::invalid("new_kv", "MLA latents given for a standard-attention model (it takes NewKv::Standard)"))
        }
    }
}

/// A layer's cache: the model's cache dtype, at least the layout's elements.
fn check_cache(config: &ForwardConfig, spec: &CacheSpec, cache: &impl Buf) -> Result<()> {
    let m = &config.model;
    ensure(cache.buf_dtype() == m.cache_dtype, "cache", || {
        format!("dtype {:?}, the model's cache is {:?}", cache.buf_dtype(), m.cache_dtype)
    })?;
    ensure(cache.buf_len() >= spec.num_elements(), "cache", || {
        format!("buffer of {} elements is smaller than the layout's {} ({spec:?})", cache.buf_len(), spec.num_elements())
    })
}

/// The K and V scales: given exactly when the layer uses an FP8 cache; one f32 each, or one per
/// kv head each.
fn check_scales<I: Buf>(config: &ForwardConfig, (index, ls): (usize, &LayerSpec), scales: Option<&(I, I)>) -> Result<()> {
    let m = &config.model;
    let fp8 = m.cache_dtype.is_fp8() && ls.attn_type.uses_cache();
    match scales {
        None => ensure(!fp8, "kv_scales", || "missing: an FP8 cache needs its k and v scales".into()),
        Some((k, v)) => {
            ensure(fp8, "kv_scales", || match ls.attn_type.uses_cache() {
                true => format!("given for a {:?} cache (only FP8 caches are scaled)", m.cache_dtype),
                false => format!("given for layer {index}, an {} layer, which keeps no cache", ls.attn_type),
            })?;
            let heads = if m.kind == AttentionKind::Mla { 1 } else { m.num_kv_heads };
            for b in [k, v] {
                ensure(b.buf_dtype() == DType::F32 && (b.buf_len() == 1 || b.buf_len() == heads), "kv_scales", || {
                    format!("must be 1 f32 (per tensor) or {heads} (one per kv head) each, got {} x {:?}", b.buf_len(), b.buf_dtype())
                })?;
            }
            ensure(k.buf_len() == v.buf_len(), "kv_scales", || {
                format!("{} K and {} V scales: give both per tensor or both per head", k.buf_len(), v.buf_len())
            })
        }
    }
}

fn reads_what(index: usize, ls: &LayerSpec) -> String {
    match ls.kv_sharing_target {
        Some(t) => format!("reads layer {t}'s cache"),
        None => format!("is a cross-attention layer reading its own cache (written by write_kv for layer {index})"),
    }
}

fn writes_what(ls: &LayerSpec) -> String {
    match ls.attn_type {
        AttentionType::EncoderOnly => format!("is {} and attends its new K/V", ls.attn_type),
        _ => "writes its own cache".into(),
    }
}

/// An encoder(-only) layer attends each request's own tokens: the step must hold every
/// request's whole sequence (`seq_len` = its query tokens). A graph step's padding requests
/// have none.
fn validate_encoder_step(step: &StepMetadata, index: usize, kind: AttentionType) -> Result<()> {
    let qsl = step.query_start_loc();
    for (r, &len) in step.seq_lens()[..step.step_reqs()].iter().enumerate() {
        let q = qsl[r + 1] - qsl[r];
        ensure(len == q, "step", || {
            format!(
                "request {r} has seq_len {len} but {q} query tokens: {kind} layer {index} attends only the step's tokens (a prompt comes whole, seq_len = its tokens)"
            )
        })?;
    }
    Ok(())
}

/// `[>= num_tokens, heads, head_size]` rows of `dtype` inside their buffer.
fn check_rows(arg: &'static str, b: &impl Buf, rows: &RowsDesc, dtype: DType, heads: usize, head_size: usize, nt: usize) -> Result<()> {
    ensure(b.buf_dtype() == dtype, arg, || format!("dtype {:?}, expected the model's {dtype:?}", b.buf_dtype()))?;
    ensure(rows.num_heads == heads, arg, || format!("has {} heads, the model {heads}", rows.num_heads))?;
    ensure(rows.head_size == head_size, arg, || format!("head_size {}, expected {head_size}", rows.head_size))?;
    ensure(rows.num_tokens >= nt, arg, || format!("has {} tokens, the step {nt}", rows.num_tokens))?;
    rows.validate(arg)?;
    ensure(b.buf_len() >= rows.required_len(), arg, || {
        format!("buffer of {} elements is too small for {rows:?} ({} needed)", b.buf_len(), rows.required_len())
    })
}

/// `[>= num_tokens, dim]` latent rows `stride` apart.
fn check_latent(arg: &'static str, b: &impl Buf, stride: usize, dtype: DType, dim: usize, nt: usize) -> Result<()> {
    ensure(b.buf_dtype() == dtype, arg, || format!("dtype {:?}, expected the model's {dtype:?}", b.buf_dtype()))?;
    ensure(stride >= dim || nt <= 1, arg, || format!("token stride {stride} is smaller than its row of {dim}"))?;
    let needed = latent_rows_len(nt, stride, dim)
        .ok_or_else(|| AttnError::invalid(arg, format!("{nt} rows of {dim}, {stride} apart, span more elements than a usize holds")))?;
    ensure(b.buf_len() >= needed, arg, || {
        format!("buffer of {} elements is too small for {nt} rows of {dim} ({needed} needed)", b.buf_len())
    })
}

/// An optional `[num_q_heads]` f32 input: given exactly when the model declares its feature.
fn check_optional(arg: &'static str, b: Option<&impl Buf>, declared: bool, feature: &str, hq: usize) -> Result<()> {
    match b {
        None => ensure(!declared, arg, || format!("missing: {feature} is on")),
        Some(b) => {
            ensure(declared, arg, || format!("given, but {feature} is off"))?;
            ensure(b.buf_dtype() == DType::F32 && b.buf_len() >= hq, arg, || {
                format!("must be {hq} f32 values, got {} x {:?}", b.buf_len(), b.buf_dtype())
            })
        }
    }
}
