//! The `cpu` backend's forward: the same steps as on the GPU through [`crate::cpu`] (the
//! reference implementations): the cache write, then the decode part through
//! [`cpu::paged_decode`] and the prefill part through [`cpu::prefill`] over the paged cache. MLA
//! attends over each request's latent rows gathered from its cache (V is their first
//! `latent_dim` columns).
//!
//! Each part is cut into pieces of about equal work (whole requests, or runs of a long request's
//! query tokens: causal attention aligned to the end of the sequence lets a run stand alone),
//! one thread each (`ATTN_CPU_THREADS`, else every core); the results do not depend on the cut.

use super::config::ForwardConfig;
use super::host_buf::{HostElement, HostIn, HostOut};
use super::io::{CacheSpec, CpuLayer, KvCacheWrite, Layer, NewKv};
use super::layers::{AttentionType, LayerSpec};
use super::step::StepMetadata;
use super::timing::Timer;
use super::validate::Parts;
use crate::batch::DecodeBatch;
use crate::cpu::{self, DecodeRef, DecodeResult, HostScales, KvRef, PrefillRef, WriteReport};
use crate::dtype::{DType, Element, Fp8E4m3, Fp8E5m2};
use crate::error::{AttnError, Result};
use crate::layout::{MlaCacheSpec, RowsDesc};
use crate::options::AttnOptions;
use half::{bf16, f16};

/// Runs a validated layer (whose attention is `ls`) on the CPU.
pub(crate) fn forward_cpu(
    config: &ForwardConfig,
    ls: &LayerSpec,
    spec: &CacheSpec,
    step: &StepMetadata,
    layer: CpuLayer<'_>,
    timer: &mut Timer,
) -> Result<()> {
    // The cache is validated: the queries' type or FP8.
    match (config.model.q_dtype, config.model.cache_dtype) {
        (DType::F16, DType::Fp8E4m3) => run::<f16, Fp8E4m3>(ls, spec, step, layer, timer),
        (DType::BF16, DType::Fp8E4m3) => run::<bf16, Fp8E4m3>(ls, spec, step, layer, timer),
        (DType::F32, DType::Fp8E4m3) => run::<f32, Fp8E4m3>(ls, spec, step, layer, timer),
        (DType::F16, DType::Fp8E5m2) => run::<f16, Fp8E5m2>(ls, spec, step, layer, timer),
        (DType::BF16, DType::Fp8E5m2) => run::<bf16, Fp8E5m2>(ls, spec, step, layer, timer),
        (DType::F32, DType::Fp8E5m2) => run::<f32, Fp8E5m2>(ls, spec, step, layer, timer),
        (DType::F16, _) => run::<f16, f16>(ls, spec, step, layer, timer),
        (DType::BF16, _) => run::<bf16, bf16>(ls, spec, step, layer, timer),
        (DType::F32, _) => run::<f32, f32>(ls, spec, step, layer, timer),
        (other, _) => Err(AttnError::UnsupportedDType { arg: "q", dtype: other, reason: "queries are f16, bf16 or f32" }),
    }
}

/// A validated [`Attention::write_kv`](super::Attention::write_kv) on the CPU.
pub(crate) fn write_cpu(
    config: &ForwardConfig,
    spec: &CacheSpec,
    step: &StepMetadata,
    w: KvCacheWrite<HostIn<'_>, HostOut<'_>>,
) -> Result<()> {
    match (config.model.q_dtype, config.model.cache_dtype) {
        (DType::F16, DType::Fp8E4m3) => write::<f16, Fp8E4m3>(spec, step, w),
        (DType::BF16, DType::Fp8E4m3) => write::<bf16, Fp8E4m3>(spec, step, w),
        (DType::F32, DType::Fp8E4m3) => write::<f32, Fp8E4m3>(spec, step, w),
        (DType::F16, DType::Fp8E5m2) => write::<f16, Fp8E5m2>(spec, step, w),
        (DType::BF16, DType::Fp8E5m2) => write::<bf16, Fp8E5m2>(spec, step, w),
        (DType::F32, DType::Fp8E5m2) => write::<f32, Fp8E5m2>(spec, step, w),
        (DType::F16, _) => write::<f16, f16>(spec, step, w),
        (DType::BF16, _) => write::<bf16, bf16>(spec, step, w),
        (DType::F32, _) => write::<f32, f32>(spec, step, w),
        (other, _) => Err(AttnError::UnsupportedDType { arg: "new_kv", dtype: other, reason: "keys are f16, bf16 or f32" }),
    }
}

fn write<T: HostElement, C: HostElement>(spec: &CacheSpec, step: &StepMetadata, w: KvCacheWrite<HostIn<'_>, HostOut<'_>>) -> Result<()> {
    let KvCacheWrite { new_kv, mut cache, kv_scales } = w;
    let (NewKv::Standard { k, k_rows, v, v_rows }, CacheSpec::Paged(s)) = (&new_kv, spec) else {
        return Err(AttnError::invalid("new_kv", "write_kv takes standard K/V (NewKv::Standard) for a paged cache"));
    };
    let nt = step.num_actual_tokens();
    let (k_rows, v_rows) = (RowsDesc { num_tokens: nt, ..*k_rows }, RowsDesc { num_tokens: nt, ..*v_rows });
    let (k, v) = (typed_in::<T>(k, "k")?, typed_in::<T>(v, "v")?);
    let scales = scale_values(kv_scales.as_ref())?;
    check_report(cpu::reshape_and_cache(k, k_rows, v, v_rows, step.host_slot_mapping(), typed_out::<C>(&mut cache, "cache")?, s, scales)?)
}

/// The layer's (k, v) scales: one f32 each, or one per kv head each (the lengths were checked).
fn scale_values<'a>(scales: Option<&(HostIn<'a>, HostIn<'a>)>) -> Result<Option<HostScales<'a>>> {
    let Some((k, v)) = scales else { return Ok(None) };
    let values = |b: &HostIn<'a>, arg| -> Result<&'a [f32]> {
        f32_in(Some(b), arg)?.filter(|s| !s.is_empty()).ok_or_else(|| AttnError::invalid(arg, "must hold f32 scales"))
    };
    let (k, v) = (values(k, "kv_scales.0")?, values(v, "kv_scales.1")?);
    Ok(Some(if k.len() == 1 && v.len() == 1 { HostScales::Tensor(k[0], v[0]) } else { HostScales::PerHead(k, v) }))
}

fn typed_in<'a, T: HostElement>(b: &HostIn<'a>, arg: &'static str) -> Result<&'a [T]> {
    T::from_in(b).ok_or(AttnError::UnsupportedDType { arg, dtype: b.dtype(), reason: "must be the query dtype" })
}

fn typed_out<'s, T: HostElement>(b: &'s mut HostOut<'_>, arg: &'static str) -> Result<&'s mut [T]> {
    let dtype = b.dtype();
    T::from_out(b).ok_or(AttnError::UnsupportedDType { arg, dtype, reason: "must be the model's dtype for it" })
}

fn f32_in<'a>(b: Option<&HostIn<'a>>, arg: &'static str) -> Result<Option<&'a [f32]>> {
    b.map(|b| f32::from_in(b).ok_or(AttnError::UnsupportedDType { arg, dtype: b.dtype(), reason: "must be f32" })).transpose()
}

fn run<T: HostElement, C: HostElement>(
    ls: &LayerSpec,
    spec: &CacheSpec,
    step: &StepMetadata,
    layer: CpuLayer<'_>,
    timer: &mut Timer,
) -> Result<()> {
    let Layer { q, q_rows, new_kv, mut cache, mut out, out_rows, alibi_slopes, sinks, kv_scales } = layer;
    let q = typed_in::<T>(&q, "q")?;
    let cache = typed_out::<C>(&mut cache, "cache")?;
    let scales = scale_values(kv_scales.as_ref())?;
    let out = typed_out::<T>(&mut out, "out")?;
    let alibi = f32_in(alibi_slopes.as_ref(), "alibi_slopes")?;
    let sinks = f32_in(sinks.as_ref(), "sinks")?;
    let nt = step.num_actual_tokens();
    let slots = step.host_slot_mapping();

    let start = timer.mark(None)?;
    if ls.attn_type.attends_new_kv() {
        let NewKv::Standard { k, k_rows, v, v_rows } = &new_kv else {
            return Err(AttnError::invalid("new_kv", format!("an {} layer attends its new K/V (NewKv::Standard)", ls.attn_type)));
        };
        let (k, v) = (typed_in::<T>(k, "k")?, typed_in::<T>(v, "v")?);
        if let (true, CacheSpec::Paged(s)) = (ls.attn_type.writes_cache(), spec) {
            let (k_rows, v_rows) = (RowsDesc { num_tokens: nt, ..*k_rows }, RowsDesc { num_tokens: nt, ..*v_rows });
            check_report(cpu::reshape_and_cache(k, k_rows, v, v_rows, slots, cache, s, scales)?)?;
        }
        let written = timer.mark(None)?;
        let res = encoder_only(step, &ls.opts, (q, q_rows), (k, *k_rows), (v, *v_rows), (alibi, sinks))?;
        store(out, &out_rows, 0, q_rows.num_heads, spec.v_head_size(), &res)?;
        let end = timer.mark(None)?;
        timer.layer([start, written, end]);
        return Ok(());
    }
    let report = match (&new_kv, spec) {
        // A KV-sharing layer reads its target's cache and writes nothing.
        (NewKv::None, _) => WriteReport::default(),
        (NewKv::Standard { k, k_rows, v, v_rows }, CacheSpec::Paged(s)) => {
            let (k_rows, v_rows) = (RowsDesc { num_tokens: nt, ..*k_rows }, RowsDesc { num_tokens: nt, ..*v_rows });
            cpu::reshape_and_cache(typed_in::<T>(k, "k")?, k_rows, typed_in::<T>(v, "v")?, v_rows, slots, cache, s, scales)?
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
            scales.map(|s| s.at(0).0),
        )?,
        _ => return Err(AttnError::invalid("new_kv", "does not match the model's attention kind")),
    };
    check_report(report)?;
    let written = timer.mark(None)?;

    let parts = Parts::of(step);
    let (bt, stride) = step.host_block_table();
    let split = step.split();
    let cache: &[C] = cache;
    let opts = ls.opts;
    let (hq, dv, ts) = (q_rows.num_heads, spec.v_head_size(), q_rows.token_stride);
    if let (AttentionType::EncoderDecoder, CacheSpec::Paged(s)) = (ls.attn_type, spec) {
        // Cross-attention: every query token against its request's whole encoder sequence.
        let res = cpu::prefill(&PrefillRef {
            q,
            q_rows: RowsDesc { num_tokens: nt, ..q_rows },
            kv: KvRef::Paged { cache, spec: *s, block_table: bt, block_table_stride: stride },
            head_size_v: dv,
            query_start_loc: step.query_start_loc(),
            seq_lens: step.seq_lens(),
            causal: false,
            opts,
            alibi_slopes: alibi,
            sinks,
            scales,
        })?;
        store(out, &out_rows, 0, hq, dv, &res)?;
        let end = timer.mark(None)?;
        timer.layer([start, written, end]);
        return Ok(());
    }
    // The requests of a chunk: their queries from token `first_token`, blocks from row `first_req`.
    let attend = |c: &Chunk| -> Result<DecodeResult> {
        let q = &q[(c.first_token * ts).min(q.len())..];
        let q_rows = RowsDesc { num_tokens: c.num_tokens(), ..q_rows };
        let block_table = &c.block_table[..];
        match spec {
            CacheSpec::Paged(s) if c.decode => cpu::paged_decode(&DecodeRef {
                q,
                q_rows,
                cache,
                spec: *s,
                block_table,
                block_table_stride: stride,
                batch: DecodeBatch { seq_lens: &c.seq_lens, query_start_loc: &c.query_start_loc },
                opts,
                alibi_slopes: alibi,
                sinks,
                scales,
            }),
            CacheSpec::Paged(s) => cpu::prefill(&PrefillRef {
                q,
                q_rows,
                kv: KvRef::Paged { cache, spec: *s, block_table, block_table_stride: stride },
                head_size_v: dv,
                query_start_loc: &c.query_start_loc,
                seq_lens: &c.seq_lens,
                causal: true,
                opts,
                alibi_slopes: alibi,
                sinks,
                scales,
            }),
            CacheSpec::Mla(s) => {
                let (keys, key_start_loc) = gather_latents(cache, s, block_table, stride, &c.seq_lens);
                let total = *key_start_loc.last().unwrap_or(&0) as usize;
                let w = s.row_width();
                let k_rows = RowsDesc { num_tokens: total, num_heads: 1, head_size: w, token_stride: w, head_stride: w };
                let v_rows = RowsDesc { head_size: s.latent_dim, ..k_rows };
                cpu::prefill(&PrefillRef {
                    q,
                    q_rows,
                    kv: KvRef::Packed { k: &keys, k_rows, v: &keys, v_rows, key_start_loc: &key_start_loc },
                    head_size_v: dv,
                    query_start_loc: &c.query_start_loc,
                    seq_lens: &c.seq_lens,
                    causal: true,
                    opts,
                    alibi_slopes: alibi,
                    sinks,
                    scales,
                })
            }
        }
    };
    let decode_part =
        Part { query_start_loc: parts.decode.query_start_loc, seq_lens: parts.decode.seq_lens, first_req: 0, first_token: 0, decode: true };
    let prefill_part = Part {
        query_start_loc: parts.prefill.query_start_loc,
        seq_lens: parts.prefill.seq_lens,
        first_req: split.num_decodes,
        first_token: split.num_decode_tokens,
        decode: false,
    };
    for part in [decode_part, prefill_part] {
        for (chunk, res) in run_chunks(part.split(threads(), bt, stride), &attend)? {
            store(out, &out_rows, chunk.first_token, hq, dv, &res)?;
        }
    }
    let end = timer.mark(None)?;
    timer.layer([start, written, end]);
    Ok(())
}

/// A piece of a part: consecutive query tokens (whole requests, or a run of one request's
/// tokens), as a batch of its own.
struct Chunk {
    /// From 0.
    query_start_loc: Vec<i32>,
    /// A partial request's length ends at its last query token here (causal attention is
    /// aligned to the end of the sequence, so its queries see exactly the keys they would).
    seq_lens: Vec<i32>,
    /// The requests' block-table rows.
    block_table: Vec<i32>,
    /// The step's token index of the chunk's first query.
    first_token: usize,
    decode: bool,
}

impl Chunk {
    fn num_tokens(&self) -> usize {
        *self.query_start_loc.last().unwrap_or(&0) as usize
    }
}

/// A part of the step: requests `first_req..` (their `query_start_loc` from 0), tokens from
/// `first_token`.
struct Part<'p> {
    query_start_loc: &'p [i32],
    seq_lens: &'p [i32],
    first_req: usize,
    first_token: usize,
    decode: bool,
}

impl Part<'_> {
    /// At most `n` chunks of about equal work (each query token costs the keys it sees),
    /// splitting long requests between chunks.
    fn split(&self, n: usize, block_table: &[i32], stride: usize) -> Vec<Chunk> {
        let qsl = self.query_start_loc;
        let reqs = self.seq_lens.len();
        // Token i of request r (q_len Q, length S) sees S - Q + i + 1 keys.
        let keys = |r: usize, i: usize| (self.seq_lens[r] - (qsl[r + 1] - qsl[r]) + i as i32 + 1).max(1) as u64;
        let total: u64 = (0..reqs).map(|r| (0..(qsl[r + 1] - qsl[r]) as usize).map(|i| keys(r, i)).sum::<u64>()).sum();
        let mut chunks = Vec::new();
        let mut cur = self.new_chunk(self.first_token);
        let mut acc = 0;
        for r in 0..reqs {
            let q = (qsl[r + 1] - qsl[r]) as usize;
            let mut i0 = 0;
            for i in 0..q {
                acc += keys(r, i);
                let share = total * (chunks.len() as u64 + 1) / n.max(1) as u64;
                if acc >= share && chunks.len() + 1 < n {
                    self.push(&mut cur, r, i0, i + 1, block_table, stride);
                    let next = self.new_chunk(cur.first_token + cur.num_tokens());
                    chunks.push(std::mem::replace(&mut cur, next));
                    i0 = i + 1;
                }
            }
            if i0 < q || q == 0 {
                self.push(&mut cur, r, i0, q, block_table, stride);
            }
        }
        if !cur.seq_lens.is_empty() {
            chunks.push(cur);
        }
        chunks
    }

    /// An empty chunk whose first query is the step's token `first_token`.
    fn new_chunk(&self, first_token: usize) -> Chunk {
        Chunk { query_start_loc: vec![0], seq_lens: Vec::new(), block_table: Vec::new(), first_token, decode: self.decode }
    }

    /// Queries `i0..i1` of request `r` into `c`.
    fn push(&self, c: &mut Chunk, r: usize, i0: usize, i1: usize, block_table: &[i32], stride: usize) {
        let q = self.query_start_loc[r + 1] - self.query_start_loc[r];
        c.query_start_loc.push(c.num_tokens() as i32 + (i1 - i0) as i32);
        c.seq_lens.push(self.seq_lens[r] - (q - i1 as i32));
        c.block_table.extend_from_slice(&block_table[(self.first_req + r) * stride..][..stride]);
    }
}

/// Threads the CPU backend uses (`ATTN_CPU_THREADS`, else every core).
fn threads() -> usize {
    std::env::var("ATTN_CPU_THREADS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1)
}

/// `f` on every chunk, one thread each (requests are independent, so the results do not
/// depend on the split).
fn run_chunks<F>(chunks: Vec<Chunk>, f: &F) -> Result<Vec<(Chunk, DecodeResult)>>
where
    F: Fn(&Chunk) -> Result<DecodeResult> + Sync,
{
    if chunks.len() <= 1 {
        return chunks.into_iter().map(|c| f(&c).map(|r| (c, r))).collect();
    }
    std::thread::scope(|scope| {
        let handles: Vec<_> = chunks.into_iter().map(|c| scope.spawn(move || f(&c).map(|r| (c, r)))).collect();
        handles.into_iter().map(|h| h.join().expect("a CPU attention thread panicked")).collect()
    })
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
        return Err(AttnError::BlockOutOfRange { first: res.first_bad_block });
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

/// An encoder(-only) layer's attention: every request's queries against its own new K/V (the
/// step holds each request whole: `seq_len` = its query tokens), bidirectional.
fn encoder_only<T: HostElement>(
    step: &StepMetadata,
    opts: &AttnOptions,
    (q, q_rows): (&[T], RowsDesc),
    (k, k_rows): (&[T], RowsDesc),
    (v, v_rows): (&[T], RowsDesc),
    (alibi_slopes, sinks): (Option<&[f32]>, Option<&[f32]>),
) -> Result<DecodeResult> {
    let nt = step.num_actual_tokens();
    let qsl = step.query_start_loc();
    let (k_rows, v_rows) = (RowsDesc { num_tokens: nt, ..k_rows }, RowsDesc { num_tokens: nt, ..v_rows });
    cpu::prefill(&PrefillRef {
        q,
        q_rows: RowsDesc { num_tokens: nt, ..q_rows },
        kv: KvRef::Packed { k, k_rows, v, v_rows, key_start_loc: qsl },
        head_size_v: v_rows.head_size,
        query_start_loc: qsl,
        seq_lens: step.seq_lens(),
        causal: false,
        opts: *opts,
        alibi_slopes,
        sinks,
        scales: None,
    })
}

fn check_report(report: WriteReport) -> Result<()> {
    if report.out_of_range > 0 {
        Err(AttnError::SlotOutOfRange { first: report.first_out_of_range })
    } else {
        Ok(())
    }
}
