//! The CPU implementation of every op: the reference the GPU tests compare with (written for
//! clarity, element by element) and the path the library runs on when there is no GPU.

use crate::cache_write::{check_kv_shapes, check_mla_shapes, check_write_dtypes};
use crate::dtype::Element;
use crate::error::Result;
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};
use attn_math::paging::{resolve_slot, SlotTarget};

/// What a CPU cache write did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteReport {
    pub written: usize,
    pub padding: usize,
    /// Tokens whose slot was past the cache (not written; the GPU raises `SLOT_OUT_OF_RANGE`).
    pub out_of_range: usize,
}

impl WriteReport {
    fn count(&mut self, target: SlotTarget) -> Option<(usize, usize)> {
        match target {
            SlotTarget::Padding => self.padding += 1,
            SlotTarget::OutOfRange => self.out_of_range += 1,
            SlotTarget::At { block, offset } => {
                self.written += 1;
                return Some((block as usize, offset as usize));
            }
        }
        None
    }
}

/// Cache-element value of `x`: a plain conversion, or `x / scale` quantised for an FP8 cache.
fn store<C: Element>(x: f32, scale: f32) -> C {
    if C::DTYPE == crate::dtype::DType::Fp8E4m3 {
        C::from_f32(x * (1.0 / scale))
    } else {
        C::from_f32(x)
    }
}

/// CPU `reshape_and_cache`. `scales` = (k_scale, v_scale), needed for an FP8 cache.
#[allow(clippy::too_many_arguments)]
pub fn reshape_and_cache<T: Element, C: Element>(
    key: &[T],
    key_rows: RowsDesc,
    value: &[T],
    value_rows: RowsDesc,
    slot_mapping: &[i64],
    cache: &mut [C],
    spec: &KvCacheSpec,
    scales: Option<(f32, f32)>,
) -> Result<WriteReport> {
    check_write_dtypes(T::DTYPE, T::DTYPE, C::DTYPE, scales.is_some())?;
    check_kv_shapes(key.len(), &key_rows, value.len(), &value_rows, slot_mapping.len(), cache.len(), spec)?;
    let (k_scale, v_scale) = scales.unwrap_or((1.0, 1.0));
    let mut report = WriteReport::default();
    for (token, &slot) in slot_mapping.iter().take(key_rows.num_tokens).enumerate() {
        let Some((block, offset)) = report.count(resolve_slot(slot, spec.block_size as u32, spec.num_slots() as u64)) else { continue };
        for head in 0..spec.num_kv_heads {
            for dim in 0..spec.head_size {
                cache[spec.offset(0, block, offset, head, dim)] = store(key[key_rows.offset(token, head, dim)].to_f32(), k_scale);
                cache[spec.offset(1, block, offset, head, dim)] = store(value[value_rows.offset(token, head, dim)].to_f32(), v_scale);
            }
        }
    }
    Ok(report)
}

/// CPU `concat_and_cache_mla`.
#[allow(clippy::too_many_arguments)]
pub fn concat_and_cache_mla<T: Element, C: Element>(
    kv_c: &[T],
    kv_c_token_stride: usize,
    k_pe: &[T],
    k_pe_token_stride: usize,
    num_tokens: usize,
    slot_mapping: &[i64],
    cache: &mut [C],
    spec: &MlaCacheSpec,
    scale: Option<f32>,
) -> Result<WriteReport> {
    check_write_dtypes(T::DTYPE, T::DTYPE, C::DTYPE, scale.is_some())?;
    check_mla_shapes(kv_c.len(), kv_c_token_stride, k_pe.len(), k_pe_token_stride, num_tokens, slot_mapping.len(), cache.len(), spec)?;
    let scale = scale.unwrap_or(1.0);
    let mut report = WriteReport::default();
    for (token, &slot) in slot_mapping.iter().take(num_tokens).enumerate() {
        let Some((block, offset)) = report.count(resolve_slot(slot, spec.block_size as u32, spec.num_slots() as u64)) else { continue };
        for col in 0..spec.latent_dim {
            cache[spec.offset(block, offset, col)] = store(kv_c[token * kv_c_token_stride + col].to_f32(), scale);
        }
        for col in 0..spec.rope_dim {
            cache[spec.offset(block, offset, spec.latent_dim + col)] = store(k_pe[token * k_pe_token_stride + col].to_f32(), scale);
        }
    }
    Ok(report)
}

/// Inputs of the CPU [`paged_decode`].
pub struct DecodeRef<'a, Q, C> {
    pub q: &'a [Q],
    pub q_rows: RowsDesc,
    pub cache: &'a [C],
    pub spec: KvCacheSpec,
    pub block_table: &'a [i32],
    pub block_table_stride: usize,
    pub batch: crate::decode::DecodeBatch<'a>,
    pub opts: crate::decode::AttnOptions,
    pub alibi_slopes: Option<&'a [f32]>,
    pub sinks: Option<&'a [f32]>,
    /// (k_scale, v_scale) for an FP8 cache.
    pub scales: Option<(f32, f32)>,
}

/// Result of the CPU decode, in f64: `out[token][head][dim]` flattened, and `lse[token][head]`
/// (natural log, the sink included; -inf when nothing is attended).
pub struct DecodeResult {
    pub out: Vec<f64>,
    pub lse: Vec<f64>,
    /// Keys skipped because their block id was outside the cache.
    pub bad_blocks: usize,
}

/// CPU paged decode: every query token of every request against its visible keys (causal among
/// the request's query tokens, the sliding window, soft-cap, ALiBi, sinks), in f64.
pub fn paged_decode<Q: Element, C: Element>(a: &DecodeRef<'_, Q, C>) -> Result<DecodeResult> {
    let (nt, hq, d) = (a.q_rows.num_tokens, a.q_rows.num_heads, a.q_rows.head_size);
    crate::decode::validate_batch(&a.batch, nt, a.spec.block_size, a.block_table_stride)?;
    crate::error::ensure(hq % a.spec.num_kv_heads == 0, "num_q_heads", || {
        format!("{hq} is not a multiple of num_kv_heads {}", a.spec.num_kv_heads)
    })?;
    let group = hq / a.spec.num_kv_heads;
    let (ks, vs) = a.scales.map_or((1.0, 1.0), |(k, v)| (k as f64, v as f64));
    let scale = a.opts.softmax_scale as f64;
    let mut res = DecodeResult { out: vec![0.0; nt * hq * d], lse: vec![f64::NEG_INFINITY; nt * hq], bad_blocks: 0 };
    for r in 0..a.batch.seq_lens.len() {
        let (q0, q1) = (a.batch.query_start_loc[r] as usize, a.batch.query_start_loc[r + 1] as usize);
        let len = a.batch.seq_lens[r] as usize;
        for token in q0..q1 {
            let pos = (len + token - q0).saturating_sub(q1 - q0);
            let first = a.opts.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
            for h in 0..hq {
                let kvh = h / group;
                let mut logits = Vec::new();
                let mut values: Vec<Vec<f64>> = Vec::new();
                for t in first..len.min(pos + 1) {
                    let block = a.block_table[r * a.block_table_stride + t / a.spec.block_size];
                    if block < 0 || block as usize >= a.spec.num_blocks {
                        res.bad_blocks += 1;
                        continue;
                    }
                    let at = |plane: usize, dim: usize| a.spec.offset(plane, block as usize, t % a.spec.block_size, kvh, dim);
                    let mut dot = 0.0f64;
                    for dim in 0..d {
                        dot += a.q[a.q_rows.offset(token, h, dim)].to_f32() as f64 * a.cache[at(0, dim)].to_f32() as f64 * ks;
                    }
                    let mut logit = dot * scale;
                    if let Some(cap) = a.opts.softcap {
                        logit = cap as f64 * (logit / cap as f64).tanh();
                    }
                    if let Some(slopes) = a.alibi_slopes {
                        logit += slopes[h] as f64 * (t as f64 - pos as f64);
                    }
                    logits.push(logit);
                    values.push((0..d).map(|dim| a.cache[at(1, dim)].to_f32() as f64 * vs).collect());
                }
                let sink = a.sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                let max = logits.iter().copied().fold(sink, f64::max);
                if max == f64::NEG_INFINITY {
                    continue; // nothing attended: output 0, LSE -inf
                }
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let denom = weights.iter().sum::<f64>() + (sink - max).exp();
                let out = &mut res.out[(token * hq + h) * d..(token * hq + h + 1) * d];
                for (w, v) in weights.iter().zip(&values) {
                    for (o, x) in out.iter_mut().zip(v) {
                        *o += w / denom * x;
                    }
                }
                res.lse[token * hq + h] = max + denom.ln();
            }
        }
    }
    Ok(res)
}

/// CPU `merge_attn_states` for one (token, head) row: `(out, lse)` of two partials over
/// disjoint keys, by the same weights as the GPU (`attn_math::softmax::combine_lse`).
pub fn merge_states_row(prefix: &[f64], prefix_lse: f64, suffix: &[f64], suffix_lse: f64) -> (Vec<f64>, f64) {
    let max = prefix_lse.max(suffix_lse);
    if max == f64::NEG_INFINITY {
        return (vec![0.0; prefix.len()], f64::NEG_INFINITY);
    }
    let (wp, ws) = ((prefix_lse - max).exp(), (suffix_lse - max).exp());
    let sum = wp + ws;
    let out = prefix.iter().zip(suffix).map(|(p, s)| (wp * p + ws * s) / sum).collect();
    (out, max + sum.ln())
}
