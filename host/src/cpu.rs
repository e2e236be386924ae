//! The CPU implementation of every op: the reference the GPU tests compare with (written for
//! clarity, element by element) and the path the library runs on when there is no GPU.

use crate::cache_write::{check_kv_shapes, check_mla_shapes, check_write_dtypes};
use crate::dtype::Element;
use crate::error::{ensure, BadBlock, BadIndex, BadSlot, Result};
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};
use attn_math::paging::{resolve_slot, SlotTarget};

/// What a CPU cache write did.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct WriteReport {
    /// Tokens written into the cache.
    pub written: usize,
    /// Tokens skipped because their slot was negative (padding).
    pub padding: usize,
    /// Tokens whose slot was past the cache (not written; the GPU raises `SLOT_OUT_OF_RANGE`).
    pub out_of_range: usize,
    /// The first of them (the lowest token).
    pub first_out_of_range: Option<BadSlot>,
}

impl WriteReport {
    /// Counts token `token`'s slot and returns where it goes, if anywhere.
    fn count(&mut self, token: usize, slot: i64, block_size: usize, num_slots: usize) -> Option<(usize, usize)> {
        match resolve_slot(slot, block_size as u32, num_slots as u64) {
            SlotTarget::Padding => self.padding += 1,
            SlotTarget::OutOfRange => {
                self.out_of_range += 1;
                self.first_out_of_range.get_or_insert(BadSlot { token: token as u32, slot, num_slots: num_slots as u64 });
            }
            SlotTarget::At { block, offset } => {
                self.written += 1;
                return Some((block as usize, offset as usize));
            }
        }
        None
    }
}

/// Cache-element value of `x`: a plain conversion, or `x / scale` quantised for an FP8 cache
/// (one f32 division, then E4M3 or E5M2 rounding: `attn_math::fp8::quantize_e4m3`,
/// `quantize_e5m2`, as vLLM and the kernels).
fn store<C: Element>(x: f32, scale: f32) -> C {
    if C::DTYPE.is_fp8() {
        C::from_f32(x / scale)
    } else {
        C::from_f32(x)
    }
}

/// FP8 scales on the host: one K and one V scale for the cache, or one per kv head (the
/// layouts [`KvScales`](crate::cache_write::KvScales) takes on the device).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum HostScales<'a> {
    /// (k_scale, v_scale) for every head.
    Tensor(f32, f32),
    /// `[num_kv_heads]` K scales and as many V scales.
    PerHead(&'a [f32], &'a [f32]),
}

impl From<(f32, f32)> for HostScales<'_> {
    fn from((k, v): (f32, f32)) -> Self {
        HostScales::Tensor(k, v)
    }
}

impl HostScales<'_> {
    /// Kv head `head`'s (k, v) scales.
    pub fn at(&self, head: usize) -> (f32, f32) {
        match *self {
            HostScales::Tensor(k, v) => (k, v),
            HostScales::PerHead(k, v) => (k[head], v[head]),
        }
    }

    /// Per-head scales hold one per kv head of the cache (`arg`: the argument to name).
    fn check(&self, num_kv_heads: usize, arg: &'static str) -> Result<()> {
        match self {
            HostScales::Tensor(..) => Ok(()),
            HostScales::PerHead(k, v) => crate::error::ensure(k.len() == num_kv_heads && v.len() == num_kv_heads, arg, || {
                format!("per-head scales: {} K and {} V values for {num_kv_heads} kv heads", k.len(), v.len())
            }),
        }
    }
}

/// CPU `reshape_and_cache`: the same checks and the same bytes as
/// [`cache_write::reshape_and_cache`](crate::cache_write::reshape_and_cache) over host slices.
/// `scales`, needed for an FP8 cache (it stores `x / scale`): per tensor or per kv head.
///
/// Errors: as the GPU op's refusals (`InvalidArgument`, `UnsupportedDType`). Slots past the
/// cache are not an error here: they are counted in the report.
#[allow(clippy::too_many_arguments)]
pub fn reshape_and_cache<T: Element, C: Element>(
    key: &[T],
    key_rows: RowsDesc,
    value: &[T],
    value_rows: RowsDesc,
    slot_mapping: &[i64],
    cache: &mut [C],
    spec: &KvCacheSpec,
    scales: Option<HostScales<'_>>,
) -> Result<WriteReport> {
    check_write_dtypes(T::DTYPE, T::DTYPE, C::DTYPE, scales.is_some())?;
    check_kv_shapes(key.len(), &key_rows, value.len(), &value_rows, slot_mapping.len(), cache.len(), spec)?;
    if let Some(s) = &scales {
        s.check(spec.num_kv_heads, "scales")?;
    }
    let mut report = WriteReport::default();
    for (token, &slot) in slot_mapping.iter().take(key_rows.num_tokens).enumerate() {
        let Some((block, offset)) = report.count(token, slot, spec.block_size, spec.num_slots()) else { continue };
        for head in 0..spec.num_kv_heads {
            let (k_scale, v_scale) = scales.map_or((1.0, 1.0), |s| s.at(head));
            for dim in 0..spec.head_size {
                cache[spec.offset(0, block, offset, head, dim)] = store(key[key_rows.offset(token, head, dim)].to_f32(), k_scale);
                cache[spec.offset(1, block, offset, head, dim)] = store(value[value_rows.offset(token, head, dim)].to_f32(), v_scale);
            }
        }
    }
    Ok(report)
}

/// CPU `concat_and_cache_mla`: the same checks and the same bytes as
/// [`cache_write::concat_and_cache_mla`](crate::cache_write::concat_and_cache_mla) over host
/// slices; `scale`, needed for an FP8 cache, divides both parts. Slots past the cache are
/// counted in the report.
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
        let Some((block, offset)) = report.count(token, slot, spec.block_size, spec.num_slots()) else { continue };
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
    /// Queries, laid out as `q_rows` (`[num_tokens, num_q_heads, head_size]`).
    pub q: &'a [Q],
    /// Shape and strides of `q`.
    pub q_rows: RowsDesc,
    /// The paged cache, laid out as `spec`.
    pub cache: &'a [C],
    /// The cache's layout and sizes.
    pub spec: KvCacheSpec,
    /// `[num_reqs, block_table_stride]` block ids.
    pub block_table: &'a [i32],
    /// Entries per row of `block_table`.
    pub block_table_stride: usize,
    /// The batch's lengths and query start locations (up to 8 query tokens a request).
    pub batch: crate::batch::DecodeBatch<'a>,
    /// Scale, sliding window and soft-cap.
    pub opts: crate::options::AttnOptions,
    /// `[num_q_heads]` ALiBi slopes, if the model uses ALiBi.
    pub alibi_slopes: Option<&'a [f32]>,
    /// `[num_q_heads]` sink logits, if the model uses sinks.
    pub sinks: Option<&'a [f32]>,
    /// The scales of an FP8 cache, per tensor or per kv head.
    pub scales: Option<HostScales<'a>>,
}

/// Result of the CPU decode, in f64: `out[token][head][dim]` flattened, and `lse[token][head]`
/// (natural log, the sink included; -inf when nothing is attended).
pub struct DecodeResult {
    /// `[num_tokens, num_q_heads, head_size_v]` attention outputs.
    pub out: Vec<f64>,
    /// `[num_tokens, num_q_heads]` natural-log LSEs.
    pub lse: Vec<f64>,
    /// Keys skipped because their block id was outside the cache.
    pub bad_blocks: usize,
    /// The first such block-table entry met (requests in order, then keys).
    pub first_bad_block: Option<BadBlock>,
}

/// CPU paged decode: every query token of every request against its visible keys (causal among
/// the request's query tokens, the sliding window, chunks, soft-cap, ALiBi, sinks), in f64.
///
/// Errors: `InvalidArgument` for a batch that [`decode::paged_decode`](crate::decode::paged_decode)
/// would refuse or buffers too small for their shapes. Block ids outside the cache are skipped
/// and counted in the result.
pub fn paged_decode<Q: Element, C: Element>(a: &DecodeRef<'_, Q, C>) -> Result<DecodeResult> {
    crate::batch::validate_batch(&a.batch, a.q_rows.num_tokens, a.spec.block_size, a.block_table_stride)?;
    a.opts.validate_masks("opts", true)?;
    let kv = KvRef::Paged { cache: a.cache, spec: a.spec, block_table: a.block_table, block_table_stride: a.block_table_stride };
    let (q_rows, d) = (a.q_rows, a.q_rows.head_size);
    check_inputs(a.q, &q_rows, &kv, a.batch.seq_lens, d, [("alibi_slopes", a.alibi_slopes), ("sinks", a.sinks)])?;
    attention(
        |t, h, dim| a.q[q_rows.offset(t, h, dim)].to_f32() as f64,
        &kv,
        a.batch.query_start_loc,
        a.batch.seq_lens,
        (q_rows.num_tokens, q_rows.num_heads, d, d),
        true,
        &a.opts,
        a.alibi_slopes,
        a.sinks,
        a.scales,
    )
}

/// Where the CPU reference reads keys and values.
pub enum KvRef<'a, C> {
    /// A paged cache through a block table.
    Paged {
        /// The cache, laid out as `spec`.
        cache: &'a [C],
        /// Its layout and sizes.
        spec: KvCacheSpec,
        /// `[num_reqs, block_table_stride]` block ids.
        block_table: &'a [i32],
        /// Entries per row of `block_table`.
        block_table_stride: usize,
    },
    /// Packed K and V rows; request r's keys start at row `key_start_loc[r]`.
    Packed {
        /// Keys, laid out as `k_rows`.
        k: &'a [C],
        /// Shape and strides of `k`.
        k_rows: RowsDesc,
        /// Values, laid out as `v_rows`.
        v: &'a [C],
        /// Shape and strides of `v`.
        v_rows: RowsDesc,
        /// `[num_reqs + 1]` first key row of each request.
        key_start_loc: &'a [i32],
    },
    /// MLA's latent cache: one kv head whose K is the whole row and V its first columns.
    Mla {
        /// The latent cache, laid out as `spec`.
        cache: &'a [C],
        /// Its sizes.
        spec: MlaCacheSpec,
        /// `[num_reqs, block_table_stride]` block ids.
        block_table: &'a [i32],
        /// Entries per row of `block_table`.
        block_table_stride: usize,
    },
}

impl<C: Element> KvRef<'_, C> {
    fn num_kv_heads(&self) -> usize {
        match self {
            KvRef::Paged { spec, .. } => spec.num_kv_heads,
            KvRef::Packed { k_rows, .. } => k_rows.num_heads,
            KvRef::Mla { .. } => 1,
        }
    }

    /// Key `t` of request `r`'s block-table entry, if its block id is outside the cache.
    fn bad_block(&self, r: usize, t: usize) -> Option<BadBlock> {
        let (block_table, stride, block_size, num_blocks) = match *self {
            KvRef::Paged { spec, block_table, block_table_stride, .. } => {
                (block_table, block_table_stride, spec.block_size, spec.num_blocks)
            }
            KvRef::Mla { spec, block_table, block_table_stride, .. } => (block_table, block_table_stride, spec.block_size, spec.num_blocks),
            KvRef::Packed { .. } => return None,
        };
        let entry = t / block_size;
        let block = block_table[r * stride + entry];
        (block < 0 || block as usize >= num_blocks).then_some(BadBlock {
            request: r as u32,
            entry: entry as u32,
            block: block as i64,
            num_blocks: num_blocks as u64,
        })
    }

    /// Key `t` of request `r`, head `kvh`: (k element at dim, v element at dim), or `None` when
    /// its block id is outside the cache.
    #[allow(clippy::type_complexity)]
    fn key(&self, r: usize, t: usize, kvh: usize) -> Option<(Box<dyn Fn(usize) -> f64 + '_>, Box<dyn Fn(usize) -> f64 + '_>)> {
        match *self {
            KvRef::Paged { cache, spec, block_table, block_table_stride } => {
                let block = block_table[r * block_table_stride + t / spec.block_size];
                if block < 0 || block as usize >= spec.num_blocks {
                    return None;
                }
                let at = move |plane: usize, dim: usize| spec.offset(plane, block as usize, t % spec.block_size, kvh, dim);
                Some((Box::new(move |d| cache[at(0, d)].to_f32() as f64), Box::new(move |d| cache[at(1, d)].to_f32() as f64)))
            }
            KvRef::Packed { k, k_rows, v, v_rows, key_start_loc } => {
                let row = key_start_loc[r] as usize + t;
                Some((
                    Box::new(move |d| k[k_rows.offset(row, kvh, d)].to_f32() as f64),
                    Box::new(move |d| v[v_rows.offset(row, kvh, d)].to_f32() as f64),
                ))
            }
            KvRef::Mla { cache, spec, block_table, block_table_stride } => {
                let block = block_table[r * block_table_stride + t / spec.block_size];
                if block < 0 || block as usize >= spec.num_blocks {
                    return None;
                }
                let row = (block as usize * spec.block_size + t % spec.block_size) * spec.row_width();
                Some((Box::new(move |d| cache[row + d].to_f32() as f64), Box::new(move |d| cache[row + d].to_f32() as f64)))
            }
        }
    }
}

/// Inputs of the CPU [`prefill`].
pub struct PrefillRef<'a, Q, C> {
    /// Queries, laid out as `q_rows` (`[num_tokens, num_q_heads, head_size_qk]`).
    pub q: &'a [Q],
    /// Shape and strides of `q`.
    pub q_rows: RowsDesc,
    /// Where keys and values are read.
    pub kv: KvRef<'a, C>,
    /// Head size of V and the output.
    pub head_size_v: usize,
    /// `[num_reqs + 1]` query-token start of each request, from 0.
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]` keys per request.
    pub seq_lens: &'a [i32],
    /// Causal aligned to the end of each sequence, or every query sees every key.
    pub causal: bool,
    /// Scale, sliding window and soft-cap.
    pub opts: crate::options::AttnOptions,
    /// `[num_q_heads]` ALiBi slopes, if the model uses ALiBi.
    pub alibi_slopes: Option<&'a [f32]>,
    /// `[num_q_heads]` sink logits, if the model uses sinks.
    pub sinks: Option<&'a [f32]>,
    /// (k_scale, v_scale) for an FP8 cache (MLA: its one scale as both).
    pub scales: Option<HostScales<'a>>,
}

/// CPU varlen prefill (paged or packed K/V, causal aligned to the end or not), in f64; with
/// [`KvRef::Mla`] it is MLA attention (decodes included).
///
/// Errors: `InvalidArgument` for start locations or lengths that do not describe the queries,
/// or buffers too small for their shapes. Block ids outside the cache are skipped and counted.
pub fn prefill<Q: Element, C: Element>(a: &PrefillRef<'_, Q, C>) -> Result<DecodeResult> {
    let q_rows = a.q_rows;
    let batch = crate::batch::PrefillBatch { query_start_loc: a.query_start_loc, seq_lens: a.seq_lens, key_start_loc: None };
    crate::batch::validate_prefill_batch(&batch, q_rows.num_tokens, a.causal, None)?;
    a.opts.validate_masks("opts", a.causal)?;
    check_inputs(a.q, &q_rows, &a.kv, a.seq_lens, a.head_size_v, [("alibi_slopes", a.alibi_slopes), ("sinks", a.sinks)])?;
    attention(
        |t, h, dim| a.q[q_rows.offset(t, h, dim)].to_f32() as f64,
        &a.kv,
        a.query_start_loc,
        a.seq_lens,
        (q_rows.num_tokens, q_rows.num_heads, q_rows.head_size, a.head_size_v),
        a.causal,
        &a.opts,
        a.alibi_slopes,
        a.sinks,
        a.scales,
    )
}

/// What the CPU attention reads, checked before it reads anything (for start locations and
/// lengths already validated): the queries' rows inside their buffer; a valid cache spec, a
/// cache that holds it and block-table rows that hold each request's blocks, or packed K/V
/// rows that hold each request's keys; key and value rows at least as wide as the head sizes
/// read; the per-head inputs; an output whose size fits a usize.
fn check_inputs<Q, C>(
    q: &[Q],
    q_rows: &RowsDesc,
    kv: &KvRef<'_, C>,
    seq_lens: &[i32],
    dv: usize,
    per_head: [(&'static str, Option<&[f32]>); 2],
) -> Result<()> {
    q_rows.validate("q")?;
    ensure(q.len() >= q_rows.required_len(), "q", || format!("buffer of {} elements is too small for {q_rows:?}", q.len()))?;
    let (nt, hq, dk) = (q_rows.num_tokens, q_rows.num_heads, q_rows.head_size);
    // A positive head size bounds the tokens x heads (the LSE's size) by the queries' buffer.
    ensure(dk > 0, "q", || "head size 0".into())?;
    let table = |table: &[i32], stride: usize, block_size: usize| {
        let need = crate::batch::block_table_reach(seq_lens, block_size, stride);
        ensure(table.len() >= need, "block_table", || format!("has {} entries, the requests' blocks reach {need}", table.len()))
    };
    match *kv {
        KvRef::Paged { cache, spec, block_table, block_table_stride } => {
            spec.validate("spec")?;
            ensure(dk <= spec.head_size && dv <= spec.head_size, "q", || {
                format!("head sizes {dk} / {dv} past the cache's {}", spec.head_size)
            })?;
            ensure(cache.len() >= spec.num_elements(), "cache", || {
                format!("buffer of {} elements is smaller than the layout's", cache.len())
            })?;
            table(block_table, block_table_stride, spec.block_size)?;
        }
        KvRef::Mla { cache, spec, block_table, block_table_stride } => {
            spec.validate("spec")?;
            ensure(dk <= spec.row_width() && dv <= spec.row_width(), "q", || {
                format!("head sizes {dk} / {dv} past the latent rows of {}", spec.row_width())
            })?;
            ensure(cache.len() >= spec.num_elements(), "cache", || {
                format!("buffer of {} elements is smaller than the layout's", cache.len())
            })?;
            table(block_table, block_table_stride, spec.block_size)?;
        }
        KvRef::Packed { k, k_rows, v, v_rows, key_start_loc } => {
            for (arg, buf, rows, d) in [("k", k, k_rows, dk), ("v", v, v_rows, dv)] {
                rows.validate(arg)?;
                ensure(buf.len() >= rows.required_len(), arg, || format!("buffer of {} elements is too small for {rows:?}", buf.len()))?;
                ensure(rows.head_size >= d && rows.num_heads == k_rows.num_heads && rows.num_tokens == k_rows.num_tokens, arg, || {
                    format!("rows {rows:?} do not hold head size {d} or differ from k's {k_rows:?}")
                })?;
            }
            ensure(key_start_loc.len() > seq_lens.len(), "key_start_loc", || format!("has {} entries", key_start_loc.len()))?;
            for (r, &len) in seq_lens.iter().enumerate() {
                let start = key_start_loc[r];
                ensure(start >= 0 && start as u64 + len.max(0) as u64 <= k_rows.num_tokens as u64, "key_start_loc", || {
                    format!("request {r}'s {len} keys from row {start} are past k's {} rows", k_rows.num_tokens)
                })?;
            }
        }
    }
    for (arg, values) in per_head {
        if let Some(values) = values {
            ensure(values.len() >= hq, arg, || format!("{} values for {hq} heads", values.len()))?;
        }
    }
    ensure(nt.checked_mul(hq).and_then(|x| x.checked_mul(dv)).is_some(), "head_size_v", || format!("{nt} x {hq} x {dv} outputs"))
}

/// The attention every CPU op is made of: each query token of each request against its
/// visible keys. `dims` = (num_tokens, num_q_heads, head_size_qk, head_size_v).
#[allow(clippy::too_many_arguments)]
fn attention<C: Element>(
    q: impl Fn(usize, usize, usize) -> f64,
    kv: &KvRef<'_, C>,
    query_start_loc: &[i32],
    seq_lens: &[i32],
    dims: (usize, usize, usize, usize),
    causal: bool,
    opts: &crate::options::AttnOptions,
    alibi_slopes: Option<&[f32]>,
    sinks: Option<&[f32]>,
    scales: Option<HostScales<'_>>,
) -> Result<DecodeResult> {
    let (nt, hq, dk, dv) = dims;
    let hkv = kv.num_kv_heads();
    crate::error::ensure(hkv > 0 && hq % hkv == 0, "num_q_heads", || format!("{hq} is not a multiple of num_kv_heads {hkv}"))?;
    let group = hq / hkv;
    if let Some(s) = &scales {
        s.check(hkv, "scales")?;
    }
    let scale = opts.softmax_scale as f64;
    let mut res =
        DecodeResult { out: vec![0.0; nt * hq * dv], lse: vec![f64::NEG_INFINITY; nt * hq], bad_blocks: 0, first_bad_block: None };
    for r in 0..seq_lens.len() {
        let (q0, q1) = (query_start_loc[r] as usize, query_start_loc[r + 1] as usize);
        let len = seq_lens[r].max(0) as usize;
        for token in q0..q1 {
            let pos = (len + token - q0).saturating_sub(q1 - q0);
            let mut first = opts.window.map_or(0, |w| (pos + 1).saturating_sub(w as usize));
            let mut last = if causal { len.min(pos + 1) } else { len };
            if let Some(c) = opts.chunk_size {
                // Chunked local attention: the query's own chunk only.
                let c = c.max(1) as usize;
                first = first.max(pos - pos % c);
                last = last.min((pos / c + 1) * c);
            }
            if let Some(w) = opts.symmetric_window {
                first = first.max(pos.saturating_sub(w as usize));
                last = last.min(pos.saturating_add(w as usize).saturating_add(1));
            }
            for h in 0..hq {
                let kvh = h / group;
                let (ks, vs) = scales.map_or((1.0, 1.0), |s| s.at(kvh));
                let (ks, vs) = (ks as f64, vs as f64);
                let mut logits = Vec::new();
                let mut values: Vec<Vec<f64>> = Vec::new();
                for t in first..last {
                    let Some((k, v)) = kv.key(r, t, kvh) else {
                        res.bad_blocks += 1;
                        if res.first_bad_block.is_none() {
                            res.first_bad_block = kv.bad_block(r, t);
                        }
                        continue;
                    };
                    let dot: f64 = (0..dk).map(|dim| q(token, h, dim) * k(dim) * ks).sum();
                    let mut logit = dot * scale;
                    if let Some(cap) = opts.softcap {
                        logit = cap as f64 * (logit / cap as f64).tanh();
                    }
                    if let Some(slopes) = alibi_slopes {
                        logit += slopes[h] as f64 * (t as f64 - pos as f64);
                    }
                    logits.push(logit);
                    values.push((0..dv).map(|dim| v(dim) * vs).collect());
                }
                let sink = sinks.map_or(f64::NEG_INFINITY, |s| s[h] as f64);
                let max = logits.iter().copied().fold(sink, f64::max);
                if max == f64::NEG_INFINITY {
                    continue; // nothing attended: output 0, LSE -inf
                }
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let denom = weights.iter().sum::<f64>() + (sink - max).exp();
                let out = &mut res.out[(token * hq + h) * dv..(token * hq + h + 1) * dv];
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

/// Inputs of the CPU [`mla_sparse_attention`].
pub struct SparseMlaRef<'a, Q, C> {
    /// Queries `[num_tokens, num_heads, 576]`, laid out as `q_rows`.
    pub q: &'a [Q],
    /// Shape and strides of `q`.
    pub q_rows: RowsDesc,
    /// The latent cache, laid out as `spec`.
    pub cache: &'a [C],
    /// Its sizes.
    pub spec: MlaCacheSpec,
    /// `[num_reqs, block_table_stride]` block ids.
    pub block_table: &'a [i32],
    /// Entries per row of `block_table`.
    pub block_table_stride: usize,
    /// `[num_reqs + 1]` query-token start of each request, from 0.
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]` keys per request.
    pub seq_lens: &'a [i32],
    /// `[num_tokens, row_stride]` positions within each token's request; -1 is padding.
    pub indices: &'a [i32],
    /// Entries per token.
    pub topk: usize,
    /// Elements between consecutive tokens' rows of `indices`.
    pub row_stride: usize,
    /// The softmax scale (natural units).
    pub softmax_scale: f32,
    /// An FP8 cache's one scale (K and V).
    pub scale: Option<f32>,
}

/// What the CPU [`mla_sparse_attention`] computed and skipped.
#[derive(Clone, Debug, PartialEq)]
pub struct SparseResult {
    /// `[num_tokens, num_heads, latent_dim]`.
    pub out: Vec<f64>,
    /// `[num_tokens, num_heads]` natural-log LSE; -inf where nothing was attended.
    pub lse: Vec<f64>,
    /// Entries skipped because they were neither -1 nor a position of their request.
    pub bad_indices: usize,
    /// The first of them (tokens in order, then entries).
    pub first_bad_index: Option<BadIndex>,
    /// Entries skipped because their position's block id was outside the cache.
    pub bad_blocks: usize,
    /// The first such block-table entry met.
    pub first_bad_block: Option<BadBlock>,
}

/// CPU sparse MLA attention, in f64: each query token against the cache rows its index row
/// lists (no causal mask), a plain softmax over the gathered rows; the value is each row's first
/// `latent_dim` columns. Entries of -1 are skipped; entries outside `0..seq_len` of the token's
/// request and positions whose block is outside the cache are skipped and counted. A token with
/// nothing attended gets zeros and an LSE of -inf.
///
/// Errors: `InvalidArgument` for a batch that does not describe the queries, buffers too small
/// for their shapes, or an index tensor that [`crate::mla::mla_sparse_attention`] refuses.
pub fn mla_sparse_attention<Q: Element, C: Element>(a: &SparseMlaRef<'_, Q, C>) -> Result<SparseResult> {
    let q_rows = a.q_rows;
    let batch = crate::batch::PrefillBatch { query_start_loc: a.query_start_loc, seq_lens: a.seq_lens, key_start_loc: None };
    crate::batch::validate_prefill_batch(&batch, q_rows.num_tokens, true, None)?;
    let kv = KvRef::Mla { cache: a.cache, spec: a.spec, block_table: a.block_table, block_table_stride: a.block_table_stride };
    let dv = a.spec.latent_dim;
    check_inputs(a.q, &q_rows, &kv, a.seq_lens, dv, [("alibi_slopes", None), ("sinks", None)])?;
    crate::mla::check_indices(a.indices.len(), q_rows.num_tokens, a.topk, a.row_stride)?;
    let (nt, hq, dk) = (q_rows.num_tokens, q_rows.num_heads, q_rows.head_size);
    let s = a.scale.map_or(1.0, |s| s as f64);
    let mut res = SparseResult {
        out: vec![0.0; nt * hq * dv],
        lse: vec![f64::NEG_INFINITY; nt * hq],
        bad_indices: 0,
        first_bad_index: None,
        bad_blocks: 0,
        first_bad_block: None,
    };
    for r in 0..a.seq_lens.len() {
        let len = a.seq_lens[r].max(0) as i64;
        for token in a.query_start_loc[r] as usize..a.query_start_loc[r + 1] as usize {
            // The rows this token attends, in list order.
            let mut rows = Vec::new();
            for entry in 0..a.topk {
                let index = a.indices[token * a.row_stride + entry];
                if index == -1 {
                    continue;
                }
                if index < 0 || index as i64 >= len {
                    res.bad_indices += 1;
                    res.first_bad_index.get_or_insert(BadIndex {
                        token: token as u32,
                        entry: entry as u32,
                        index: index as i64,
                        seq_len: len as u64,
                    });
                    continue;
                }
                match kv.key(r, index as usize, 0) {
                    // The whole row: its first `dk` columns are the key, its first `dv` the value.
                    Some((k, _)) => rows.push((0..a.spec.row_width()).map(|d| k(d) * s).collect::<Vec<f64>>()),
                    None => {
                        res.bad_blocks += 1;
                        if res.first_bad_block.is_none() {
                            res.first_bad_block = kv.bad_block(r, index as usize);
                        }
                    }
                }
            }
            if rows.is_empty() {
                continue; // nothing attended: output 0, LSE -inf
            }
            for h in 0..hq {
                let logits: Vec<f64> = rows
                    .iter()
                    .map(|k| (0..dk).map(|d| a.q[q_rows.offset(token, h, d)].to_f32() as f64 * k[d]).sum::<f64>() * a.softmax_scale as f64)
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let weights: Vec<f64> = logits.iter().map(|l| (l - max).exp()).collect();
                let denom: f64 = weights.iter().sum();
                let out = &mut res.out[(token * hq + h) * dv..(token * hq + h + 1) * dv];
                for (w, k) in weights.iter().zip(&rows) {
                    for (o, x) in out.iter_mut().zip(&k[..dv]) {
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
