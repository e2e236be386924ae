//! The `cpu` backend's forward: the same steps as on the GPU through [`crate::cpu`] (the
//! reference implementations): the cache write, then the decode part through
//! [`cpu::paged_decode`] and the prefill part through [`cpu::prefill`] over the paged cache. MLA
//! attends over each request's latent rows gathered from its cache (V is their first
//! `latent_dim` columns).

use super::config::ForwardConfig;
use super::host_buf::{HostElement, HostIn, HostOut};
use super::io::{CacheSpec, CpuLayer, Layer, NewKv};
use super::step::StepMetadata;
use super::timing::Timer;
use super::validate::Parts;
use crate::cpu::{self, DecodeRef, DecodeResult, KvRef, PrefillRef, WriteReport};
use crate::dtype::{DType, Element};
use crate::error::{AttnError, Result};
use crate::layout::{MlaCacheSpec, RowsDesc};
use half::{bf16, f16};

/// Runs a validated layer on the CPU.
pub(crate) fn forward_cpu(
    config: &ForwardConfig,
    spec: &CacheSpec,
    step: &StepMetadata,
    layer: CpuLayer<'_>,
    timer: &mut Timer,
) -> Result<()> {
    match config.model.q_dtype {
        DType::F16 => run::<f16>(config, spec, step, layer, timer),
        DType::BF16 => run::<bf16>(config, spec, step, layer, timer),
        DType::F32 => run::<f32>(config, spec, step, layer, timer),
        other => Err(AttnError::UnsupportedDType { arg: "q", dtype: other, reason: "queries are f16, bf16 or f32" }),
    }
}

fn typed_in<'a, T: HostElement>(b: &HostIn<'a>, arg: &'static str) -> Result<&'a [T]> {
    T::from_in(b).ok_or(AttnError::UnsupportedDType { arg, dtype: b.dtype(), reason: "must be the query dtype" })
}

fn typed_out<'s, T: HostElement>(b: &'s mut HostOut<'_>, arg: &'static str) -> Result<&'s mut [T]> {
    let dtype = b.dtype();
    T::from_out(b).ok_or(AttnError::UnsupportedDType { arg, dtype, reason: "must be the query dtype" })
}

fn f32_in<'a>(b: Option<&HostIn<'a>>, arg: &'static str) -> Result<Option<&'a [f32]>> {
    b.map(|b| f32::from_in(b).ok_or(AttnError::UnsupportedDType { arg, dtype: b.dtype(), reason: "must be f32" })).transpose()
}

fn run<T: HostElement>(
    config: &ForwardConfig,
    spec: &CacheSpec,
    step: &StepMetadata,
    layer: CpuLayer<'_>,
    timer: &mut Timer,
) -> Result<()> {
    let Layer { q, q_rows, new_kv, mut cache, mut out, out_rows, alibi_slopes, sinks } = layer;
    let q = typed_in::<T>(&q, "q")?;
    let cache = typed_out::<T>(&mut cache, "cache")?;
    let out = typed_out::<T>(&mut out, "out")?;
    let alibi = f32_in(alibi_slopes.as_ref(), "alibi_slopes")?;
    let sinks = f32_in(sinks.as_ref(), "sinks")?;
    let nt = step.num_actual_tokens();
    let slots = step.host_slot_mapping();

    let start = timer.mark(None)?;
    let report = match (&new_kv, spec) {
        (NewKv::Standard { k, k_rows, v, v_rows }, CacheSpec::Paged(s)) => {
            let (k_rows, v_rows) = (RowsDesc { num_tokens: nt, ..*k_rows }, RowsDesc { num_tokens: nt, ..*v_rows });
            cpu::reshape_and_cache(typed_in::<T>(k, "k")?, k_rows, typed_in::<T>(v, "v")?, v_rows, slots, cache, s, None)?
        }
        (NewKv::Mla { kv_c, kv_c_token_stride, k_pe, k_pe_token_stride }, CacheSpec::Mla(s)) => cpu::concat_and_cache_mla(
            typed_in::<T>(kv_c, "kv_c")?,
            *kv_c_token_stride,
            typed_in::<T>(k_pe, "k_pe")?,
            *k_pe_token_stride,
            nt,
            slots,
            cache,
            s,
            None,
        )?,
        _ => return Err(AttnError::invalid("new_kv", "does not match the model's attention kind")),
    };
    check_report(report)?;
    let written = timer.mark(None)?;

    let parts = Parts::of(step);
    let (bt, stride) = step.host_block_table();
    let split = step.split();
    let (nd, ndt) = (split.num_decodes, split.num_decode_tokens);
    let cache: &[T] = cache;
    let opts = config.opts;
    let hq = q_rows.num_heads;
    let dv = spec.v_head_size();
    let q_decode = RowsDesc { num_tokens: ndt, ..q_rows };
    let q_prefill = RowsDesc { num_tokens: split.num_prefill_tokens, ..q_rows };
    let q_tail = &q[(ndt * q_rows.token_stride).min(q.len())..];
    match spec {
        CacheSpec::Paged(s) => {
            if nd > 0 {
                let res = cpu::paged_decode(&DecodeRef {
                    q,
                    q_rows: q_decode,
                    cache,
                    spec: *s,
                    block_table: bt,
                    block_table_stride: stride,
                    batch: parts.decode,
                    opts,
                    alibi_slopes: alibi,
                    sinks,
                    scales: None,
                })?;
                store(out, &out_rows, 0, hq, dv, &res)?;
            }
            if split.num_prefills > 0 {
                let res = cpu::prefill(&PrefillRef {
                    q: q_tail,
                    q_rows: q_prefill,
                    kv: KvRef::Paged { cache, spec: *s, block_table: &bt[nd * stride..], block_table_stride: stride },
                    head_size_v: dv,
                    query_start_loc: parts.prefill.query_start_loc,
                    seq_lens: parts.prefill.seq_lens,
                    causal: true,
                    opts,
                    alibi_slopes: alibi,
                    sinks,
                    scales: None,
                })?;
                store(out, &out_rows, ndt, hq, dv, &res)?;
            }
        }
        CacheSpec::Mla(s) => {
            let mla = |q: &[T], q_rows: RowsDesc, qsl: &[i32], seq_lens: &[i32], first_req: usize| {
                let (keys, key_start_loc) = gather_latents(cache, s, &bt[first_req * stride..], stride, seq_lens);
                let total = *key_start_loc.last().unwrap_or(&0) as usize;
                let w = s.row_width();
                let k_rows = RowsDesc { num_tokens: total, num_heads: 1, head_size: w, token_stride: w, head_stride: w };
                cpu::prefill(&PrefillRef {
                    q,
                    q_rows,
                    kv: KvRef::Packed {
                        k: &keys,
                        k_rows,
                        v: &keys,
                        v_rows: RowsDesc { head_size: s.latent_dim, ..k_rows },
                        key_start_loc: &key_start_loc,
                    },
                    head_size_v: s.latent_dim,
                    query_start_loc: qsl,
                    seq_lens,
                    causal: true,
                    opts,
                    alibi_slopes: alibi,
                    sinks,
                    scales: None,
                })
            };
            if nd > 0 {
                let res = mla(q, q_decode, parts.decode.query_start_loc, parts.decode.seq_lens, 0)?;
                store(out, &out_rows, 0, hq, dv, &res)?;
            }
            if split.num_prefills > 0 {
                let res = mla(q_tail, q_prefill, parts.prefill.query_start_loc, parts.prefill.seq_lens, nd)?;
                store(out, &out_rows, ndt, hq, dv, &res)?;
            }
        }
    }
    let end = timer.mark(None)?;
    timer.layer([start, written, end]);
    Ok(())
}

/// Each request's `seq_len` latent rows from the paged MLA cache, packed, with their start rows.
fn gather_latents<C: Element>(
    cache: &[C],
    spec: &MlaCacheSpec,
    block_table: &[i32],
    stride: usize,
    seq_lens: &[i32],
) -> (Vec<C>, Vec<i32>) {
    let w = spec.row_width();
    let mut key_start_loc = vec![0i32];
    let mut keys = Vec::new();
    for (r, &len) in seq_lens.iter().enumerate() {
        for t in 0..len.max(0) as usize {
            let block = block_table[r * stride + t / spec.block_size] as usize;
            let at = spec.offset(block, t % spec.block_size, 0);
            keys.extend_from_slice(&cache[at..at + w]);
        }
        key_start_loc.push(key_start_loc[r] + len.max(0));
    }
    (keys, key_start_loc)
}

/// Writes a CPU result (f64, `[tokens, hq, dv]`) into `out` from row `first_token`.
fn store<T: Element>(out: &mut [T], rows: &RowsDesc, first_token: usize, hq: usize, dv: usize, res: &DecodeResult) -> Result<()> {
    if res.bad_blocks > 0 {
        return Err(AttnError::BlockOutOfRange);
    }
    for (i, row) in res.out.chunks_exact(dv).enumerate() {
        let (t, h) = (first_token + i / hq, i % hq);
        let at = rows.offset(t, h, 0);
        for (o, &x) in out[at..at + dv].iter_mut().zip(row) {
            *o = T::from_f32(x as f32);
        }
    }
    Ok(())
}

fn check_report(report: WriteReport) -> Result<()> {
    if report.out_of_range > 0 {
        Err(AttnError::SlotOutOfRange)
    } else {
        Ok(())
    }
}
