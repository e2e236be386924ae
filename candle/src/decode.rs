//! [`paged_attention`]: decode over the paged cache, one query token per sequence, with the
//! block tables and context lengths as tensors (the shape of vLLM's and mistral.rs's
//! `paged_attention`).

use crate::attention::{host_block_table, host_i32, shares_storage};
use crate::cache::{host_scale, KvCache};
use crate::cache_write::same_device;
use crate::error::{ensure, invalid, AttnResult};
use crate::host::{cpu, typed, HostSlice};
use crate::layout::rows;
use attn_rs::cpu::DecodeRef;
use attn_rs::decode::DecodeBatch;
use attn_rs::{AttnError, AttnOptions, Fp8E4m3, RowsDesc};
use candle_core::{DType, Result, Tensor};
use half::{bf16, f16};

/// Attention of one new token per sequence over its context in the paged cache (its own key
/// included: write it first with [`reshape_and_cache`](crate::reshape_and_cache)).
///
/// - `q`: `[num_seqs, num_q_heads, head_size]` (or `[num_seqs, num_q_heads * head_size]`), any
///   token and head strides with a contiguous head dimension; f16/bf16 (and f32 on the CPU).
/// - `block_tables`: `[num_seqs, max_blocks]` integers (i32 or u32 on the GPU are read in place,
///   other dtypes converted); `context_lens`: `[num_seqs]` integers.
/// - `alibi_slopes`: `[num_q_heads]` f32; `softcapping`: logits become `cap * tanh(logit / cap)`.
///
/// Returns `[num_seqs, num_q_heads, head_size]` (2-D for a 2-D `q`) in the query dtype.
///
/// The context lengths are read on the host (the split plan is made there): on the GPU that
/// copies them back and waits for candle's stream. [`PagedAttention`](crate::PagedAttention)
/// takes its batch from the host once per step instead, and mixes prefills in.
///
/// ```
/// use attn_candle::{paged_attention, reshape_and_cache, KvCache, KvCacheSpec, KvLayout};
/// use candle_core::{DType, Device, Tensor};
///
/// let dev = Device::Cpu;
/// let cache = KvCache::zeros(KvCacheSpec::new(KvLayout::FlashNhd, 4, 16, 1, 32)?, DType::F32, &dev)?;
/// // One sequence whose first key is in block 2; all its values are 1.
/// let (k, v) = (Tensor::randn(0f32, 1., (1, 1, 32), &dev)?, Tensor::ones((1, 1, 32), DType::F32, &dev)?);
/// reshape_and_cache(&k, &v, &cache, &Tensor::new(&[32i64], &dev)?)?;
/// let q = Tensor::randn(0f32, 1., (1, 4, 32), &dev)?;
/// let block_tables = Tensor::new(&[[2u32]], &dev)?;
/// let out = paged_attention(&q, &cache, &block_tables, &Tensor::new(&[1u32], &dev)?, None, 32f32.powf(-0.5), None)?;
/// assert!(out.flatten_all()?.to_vec1::<f32>()?.iter().all(|&x| (x - 1.0).abs() < 1e-6));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn paged_attention(
    q: &Tensor,
    cache: &KvCache,
    block_tables: &Tensor,
    context_lens: &Tensor,
    alibi_slopes: Option<&Tensor>,
    softmax_scale: f32,
    softcapping: Option<f32>,
) -> Result<Tensor> {
    let spec = cache.spec();
    let device = cache.device();
    for (arg, t) in [("q", q), ("block_tables", block_tables), ("context_lens", context_lens)] {
        same_device(arg, t, device)?;
    }
    if let Some(a) = alibi_slopes {
        same_device("alibi_slopes", a, device)?;
        ensure(a.dtype() == DType::F32 && a.rank() == 1 && a.is_contiguous(), "alibi_slopes", || {
            format!("{:?} {:?}: expected [num_q_heads] f32, contiguous", a.dtype(), a.dims())
        })?;
    }
    ensure(!shares_storage(q, cache.tensor()), "q", || "shares its storage with the cache".into())?;
    let q_rows = rows("q", q.layout(), spec.head_size)?;
    let seq_lens = host_i32("context_lens", context_lens, 1)?;
    let n = q_rows.num_tokens;
    ensure(seq_lens.len() == n, "context_lens", || format!("has {} entries for {n} sequences", seq_lens.len()))?;
    ensure(block_tables.rank() == 2 && block_tables.dims()[0] == n, "block_tables", || {
        format!("shape {:?}: expected [{n}, max_blocks]", block_tables.dims())
    })?;
    let query_start_loc: Vec<i32> = (0..=n as i32).collect();
    let opts = AttnOptions { softmax_scale, softcap: softcapping, ..AttnOptions::new(1) };
    let out_shape: Vec<usize> =
        if q.rank() == 3 { vec![n, q_rows.num_heads, spec.head_size] } else { vec![n, q_rows.num_heads * spec.head_size] };
    let scales = cache.needed_scales()?;
    let args = Args { q, q_rows, cache, block_tables, alibi_slopes, seq_lens: &seq_lens, query_start_loc: &query_start_loc, opts, scales };
    if device.is_cpu() {
        return decode_cpu(&args)?.reshape(out_shape);
    }
    #[cfg(feature = "cuda")]
    if let candle_core::Device::Cuda(d) = device {
        return decode_gpu(d, &args)?.reshape(out_shape);
    }
    Err(invalid("cache", format!("is on {:?}: the ops run on CPU and CUDA tensors", device.location())))
}

struct Args<'a> {
    q: &'a Tensor,
    q_rows: RowsDesc,
    cache: &'a KvCache,
    block_tables: &'a Tensor,
    alibi_slopes: Option<&'a Tensor>,
    seq_lens: &'a [i32],
    query_start_loc: &'a [i32],
    opts: AttnOptions,
    scales: Option<(&'a Tensor, &'a Tensor)>,
}

/// `[num_seqs, num_q_heads * head_size]` on the CPU.
fn decode_cpu(a: &Args<'_>) -> Result<Tensor> {
    let block_table = host_block_table("block_tables", a.block_tables)?;
    let stride = a.block_tables.dims()[1];
    let alibi = a.alibi_slopes.map(|t| t.to_vec1::<f32>()).transpose()?;
    let scales = match a.scales {
        Some((k, v)) => Some((host_scale(k)?, host_scale(v)?)),
        None => None,
    };
    let (q_guard, ql) = a.q.storage_and_layout();
    let (c_guard, cl) = a.cache.tensor().storage_and_layout();
    let h = HostDecode {
        q: cpu("q", &q_guard)?,
        q_offset: ql.start_offset(),
        cache: cpu("cache", &c_guard)?,
        cache_offset: cl.start_offset(),
        block_table: &block_table,
        stride,
        alibi: alibi.as_deref(),
        scales,
    };
    let f: fn(&Args<'_>, &HostDecode<'_>) -> Result<Vec<f64>> = match (a.q.dtype(), a.cache.dtype()) {
        (DType::F16, DType::F16) => cpu_typed::<f16, f16>,
        (DType::BF16, DType::BF16) => cpu_typed::<bf16, bf16>,
        (DType::F32, DType::F32) => cpu_typed::<f32, f32>,
        (DType::F16, DType::F8E4M3) => cpu_typed::<f16, Fp8E4m3>,
        (DType::BF16, DType::F8E4M3) => cpu_typed::<bf16, Fp8E4m3>,
        (DType::F32, DType::F8E4M3) => cpu_typed::<f32, Fp8E4m3>,
        (qd, cd) => return Err(invalid("cache", format!("dtype {cd:?} with {qd:?} queries: a cache is the queries' dtype or f8e4m3"))),
    };
    let out = f(a, &h)?;
    let n = out.len();
    Tensor::from_vec(out, n, &candle_core::Device::Cpu)?.to_dtype(a.q.dtype())
}

/// The CPU decode's host inputs.
struct HostDecode<'a> {
    q: &'a candle_core::CpuStorage,
    q_offset: usize,
    cache: &'a candle_core::CpuStorage,
    cache_offset: usize,
    block_table: &'a [i32],
    stride: usize,
    alibi: Option<&'a [f32]>,
    scales: Option<(f32, f32)>,
}

fn cpu_typed<Q: HostSlice, C: HostSlice>(a: &Args<'_>, h: &HostDecode<'_>) -> Result<Vec<f64>> {
    let r = attn_rs::cpu::paged_decode(&DecodeRef {
        q: typed::<Q>("q", h.q, h.q_offset)?,
        q_rows: a.q_rows,
        cache: typed::<C>("cache", h.cache, h.cache_offset)?,
        spec: a.cache.spec(),
        block_table: h.block_table,
        block_table_stride: h.stride,
        batch: DecodeBatch { seq_lens: a.seq_lens, query_start_loc: a.query_start_loc },
        opts: a.opts,
        alibi_slopes: h.alibi,
        sinks: None,
        scales: h.scales.map(Into::into),
    })
    .c()?;
    if r.bad_blocks > 0 {
        return Err(crate::error::attn(AttnError::BlockOutOfRange { first: r.first_bad_block }));
    }
    Ok(r.out)
}

/// The decode workspace and batch kept per CUDA device, grown as batches need.
#[cfg(feature = "cuda")]
pub(crate) struct GpuDecode {
    ws: attn_rs::decode::DecodeWorkspace,
    batch: attn_rs::BatchMetadata,
    /// (head size, q heads per kv head, requests, tokens) the workspace was made for.
    made_for: (usize, usize, usize, usize),
}

#[cfg(feature = "cuda")]
fn decode_gpu(d: &candle_core::CudaDevice, a: &Args<'_>) -> Result<Tensor> {
    use crate::cuda::{cuda, device_state, CudaIn, CudaOut};
    use attn_rs::cache_write::KvScales;
    use attn_rs::decode::{paged_decode, DecodeArgs, DecodeWorkspace};
    use candle_core::backend::BackendDevice;
    let state = device_state(d)?;
    let stream = state.stream.clone();
    let spec = a.cache.spec();
    let (n, hq, dh) = (a.q_rows.num_tokens, a.q_rows.num_heads, spec.head_size);
    ensure(hq % spec.num_kv_heads == 0, "q", || format!("{hq} heads are not a multiple of the cache's {} kv heads", spec.num_kv_heads))?;
    let group = hq / spec.num_kv_heads;
    // Block tables as i32 in place (u32 ids read as i32), else converted.
    let block_tables = match a.block_tables.dtype() {
        DType::I32 | DType::U32 => a.block_tables.contiguous()?,
        _ => a.block_tables.to_dtype(DType::U32)?.contiguous()?,
    };
    let stride = block_tables.dims()[1];
    let mut guard = state.decode.lock().expect("decode state poisoned");
    let fits = |g: &GpuDecode| g.made_for.0 == dh && g.made_for.1 == group && g.made_for.2 >= n && g.made_for.3 >= n;
    if !guard.as_ref().is_some_and(fits) {
        let cap = n.next_power_of_two().max(16);
        let partial_rows = 4 * state.dev.sm_count() as usize * 8 * group;
        let ws = DecodeWorkspace::new(&stream, partial_rows, dh, cap, cap).c()?;
        let batch = attn_rs::BatchMetadata::new(&stream, a.seq_lens, a.query_start_loc).c()?;
        *guard = Some(GpuDecode { ws, batch, made_for: (dh, group, cap, cap) });
    }
    let g = guard.as_mut().expect("made above");
    g.batch.update(a.seq_lens, a.query_start_loc, None).c()?;
    let (q_guard, ql) = a.q.storage_and_layout();
    let (c_guard, cl) = a.cache.tensor().storage_and_layout();
    let (bt_guard, btl) = block_tables.storage_and_layout();
    let q = CudaIn::new("q", cuda("q", &q_guard)?, ql.start_offset())?;
    let cache = CudaIn::new("cache", cuda("cache", &c_guard)?, cl.start_offset())?;
    let bt = CudaIn::new("block_tables", cuda("block_tables", &bt_guard)?, btl.start_offset())?;
    let alibi_g = a.alibi_slopes.map(|t| t.storage_and_layout());
    let alibi = match &alibi_g {
        Some((s, l)) => Some(CudaIn::new("alibi_slopes", cuda("alibi_slopes", s)?, l.start_offset())?),
        None => None,
    };
    let scale_g = a.scales.map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()));
    let scales = match &scale_g {
        Some(((ks, kl), (vs, vl))) => Some((
            CudaIn::new("k_scale", cuda("k_scale", ks)?, kl.start_offset())?,
            CudaIn::new("v_scale", cuda("v_scale", vs)?, vl.start_offset())?,
        )),
        None => None,
    };
    let shape = candle_core::Shape::from((n, hq * dh));
    let mut out = d.zeros_impl(&shape, a.q.dtype())?;
    {
        let mut out_view = CudaOut::new("out", &mut out, 0)?;
        let mut status = state.status.lock().expect("status poisoned");
        let args = DecodeArgs {
            q: q.dev_in(&stream),
            q_rows: a.q_rows,
            cache: cache.dev_in(&stream),
            spec,
            block_table: bt.dev_in(&stream),
            block_table_stride: stride,
            out: out_view.dev_out(&stream),
            out_rows: RowsDesc::contiguous(n, hq, dh),
            lse: None,
            alibi_slopes: alibi.as_ref().map(|x| x.dev_in(&stream)),
            sinks: None,
            scales: scales.as_ref().map(|(k, v)| KvScales { k: k.dev_in(&stream), v: v.dev_in(&stream) }),
        };
        paged_decode(&state.dev, &stream, args, &g.batch, &a.opts, attn_rs::SplitMode::Auto, &mut g.ws, &mut status).c()?;
    }
    Ok(Tensor::from_storage(candle_core::Storage::Cuda(out), shape, candle_core::op::BackpropOp::none(), false))
}
