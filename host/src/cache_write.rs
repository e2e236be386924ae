//! Paged KV-cache writes on the GPU: `reshape_and_cache` (vLLM's `reshape_and_cache_flash`) and
//! `concat_and_cache_mla`. Everything is validated before launch; slots are checked by the
//! kernel, which skips (and reports through [`DeviceStatus`]) any slot past the cache.

use crate::buffer::{DevIn, DevOut};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, AttnError, Result};
use crate::kernels::KernelId;
use crate::layout::{KvCacheSpec, MlaCacheSpec, RowsDesc};
use crate::status::DeviceStatus;
use crate::stream_check::refuse_foreign_capture;
use attn_math::params::{CacheWriteParams, MlaCacheWriteParams};
use cudarc::driver::{CudaStream, DevicePtrMut};
use std::sync::Arc;

const THREADS: u32 = 256;

/// FP8 scales as device f32s (so the call can be captured in a CUDA graph): one per tensor, or
/// one per kv head (vLLM's per-head `k_scale`/`v_scale` of shape `[num_kv_heads]`), told apart by
/// their length. The cache holds `value / scale`; reads multiply by the scale.
pub struct KvScales<'a> {
    /// The keys' scales: 1 f32, or `num_kv_heads`.
    pub k: DevIn<'a>,
    /// The values' scales, as many as the keys'.
    pub v: DevIn<'a>,
}

impl KvScales<'_> {
    /// The kernels' view for a cache of `num_kv_heads` heads: the K and V scale addresses and
    /// the stride between heads' scales (0 for one per tensor, 1 for one per head).
    ///
    /// Errors (`scales.k` / `scales.v`): not f32, a length other than 1 or `num_kv_heads`, or
    /// the two of different lengths.
    pub(crate) fn layout(&self, num_kv_heads: usize) -> Result<(u64, u64, u32)> {
        let check = |b: &DevIn<'_>, arg: &'static str| {
            ensure(b.dtype == DType::F32 && (b.len == 1 || b.len == num_kv_heads), arg, || {
                format!("must be 1 f32 (per tensor) or {num_kv_heads} (one per kv head), got {} x {:?}", b.len, b.dtype)
            })
        };
        check(&self.k, "scales.k")?;
        check(&self.v, "scales.v")?;
        ensure(self.k.len == self.v.len, "scales.v", || {
            format!("has {} values, scales.k {}: give both per tensor or both per head", self.v.len, self.k.len)
        })?;
        Ok((self.k.ptr, self.v.ptr, u32::from(self.k.len > 1)))
    }
}

/// Inputs of [`reshape_and_cache`].
pub struct KvWrite<'a> {
    /// This step's keys, `[num_tokens, num_kv_heads, head_size]` as `key_rows` lays them out
    /// (f16, bf16 or f32; 16-byte aligned with 16-byte-multiple strides).
    pub key: DevIn<'a>,
    /// Shape and strides of `key` (heads and head size must be the cache's).
    pub key_rows: RowsDesc,
    /// This step's values, as `key` (the same dtype and token count).
    pub value: DevIn<'a>,
    /// Shape and strides of `value`.
    pub value_rows: RowsDesc,
    /// `[num_tokens]` i64: `block * block_size + offset`; negative = padding (skipped).
    pub slot_mapping: DevIn<'a>,
    /// The paged cache: `spec.num_elements()` elements of the source dtype, or FP8 E4M3.
    pub cache: DevOut<'a>,
    /// The cache's layout and sizes.
    pub spec: KvCacheSpec,
    /// Required for an FP8 cache, ignored otherwise.
    pub scales: Option<KvScales<'a>>,
}

/// Inputs of [`concat_and_cache_mla`].
pub struct MlaWrite<'a> {
    /// `[num_tokens, latent_dim]`, rows `kv_c_token_stride` apart.
    pub kv_c: DevIn<'a>,
    /// Elements between consecutive tokens of `kv_c`.
    pub kv_c_token_stride: usize,
    /// `[num_tokens, rope_dim]`, rows `k_pe_token_stride` apart.
    pub k_pe: DevIn<'a>,
    /// Elements between consecutive tokens of `k_pe`.
    pub k_pe_token_stride: usize,
    /// Tokens to write (rows of `kv_c`, `k_pe` and `slot_mapping`).
    pub num_tokens: usize,
    /// `[num_tokens]` i64: `block * block_size + offset`; negative = padding (skipped).
    pub slot_mapping: DevIn<'a>,
    /// The latent cache: `spec.num_elements()` elements of the source dtype, or FP8 E4M3.
    pub cache: DevOut<'a>,
    /// The cache's sizes (`[num_blocks, block_size, latent_dim + rope_dim]`).
    pub spec: MlaCacheSpec,
    /// Required for an FP8 cache, ignored otherwise.
    pub scale: Option<DevIn<'a>>,
}

/// Source/cache dtype pairs the kernels take: same dtype, or quantise to FP8.
pub(crate) fn check_write_dtypes(src: DType, value: DType, cache: DType, scaled: bool) -> Result<()> {
    if !matches!(src, DType::F16 | DType::BF16 | DType::F32) {
        return Err(AttnError::UnsupportedDType { arg: "key", dtype: src, reason: "sources must be f16, bf16 or f32" });
    }
    if value != src {
        return Err(AttnError::UnsupportedDType { arg: "value", dtype: value, reason: "must match the key's dtype" });
    }
    if cache != src && !cache.is_fp8() {
        return Err(AttnError::UnsupportedDType { arg: "cache", dtype: cache, reason: "must be the source dtype, fp8 e4m3 or e5m2" });
    }
    ensure(!cache.is_fp8() || scaled, "scales", || "an fp8 cache needs k/v scales".into())
}

/// Shape checks shared by the GPU and CPU paths.
pub(crate) fn check_kv_shapes(
    key_len: usize,
    key_rows: &RowsDesc,
    value_len: usize,
    value_rows: &RowsDesc,
    slots_len: usize,
    cache_len: usize,
    spec: &KvCacheSpec,
) -> Result<()> {
    spec.validate("spec")?;
    for (arg, rows, len) in [("key", key_rows, key_len), ("value", value_rows, value_len)] {
        rows.validate(arg)?;
        ensure(rows.num_heads == spec.num_kv_heads, arg, || format!("has {} heads, the cache {}", rows.num_heads, spec.num_kv_heads))?;
        ensure(rows.head_size == spec.head_size, arg, || {
            format!("head_size {} differs from the cache's {}", rows.head_size, spec.head_size)
        })?;
        ensure(len >= rows.required_len(), arg, || {
            format!("buffer of {len} elements is too small for {rows:?} ({} needed)", rows.required_len())
        })?;
    }
    ensure(value_rows.num_tokens == key_rows.num_tokens, "value", || {
        format!("has {} tokens, key has {}", value_rows.num_tokens, key_rows.num_tokens)
    })?;
    ensure(slots_len >= key_rows.num_tokens, "slot_mapping", || format!("has {slots_len} entries for {} tokens", key_rows.num_tokens))?;
    ensure(cache_len >= spec.num_elements(), "cache", || {
        format!("buffer of {cache_len} elements is smaller than the layout's {}", spec.num_elements())
    })
}

/// The vector path's alignment needs: 16-byte source vectors, and the matching cache vectors.
fn check_vector_alignment(arg: &'static str, ptr: u64, strides: &[usize], elem_bytes: usize, vec_bytes: usize) -> Result<()> {
    ensure(ptr.is_multiple_of(vec_bytes as u64), arg, || format!("address {ptr:#x} is not {vec_bytes}-byte aligned"))?;
    for &s in strides {
        ensure((s * elem_bytes).is_multiple_of(vec_bytes), arg, || {
            format!("stride of {s} elements is not a multiple of {vec_bytes} bytes")
        })?;
    }
    Ok(())
}

/// One warp per token, `THREADS / 32` tokens per block. Many short blocks rather than a
/// persistent grid: measured on the H100, a warp per token with its slot loaded alongside its
/// data beat a flat grid-stride loop over vectors (see docs/cache-writes.md).
fn grid_for(num_tokens: usize) -> Result<(u32, u32, u32)> {
    let blocks = num_tokens.div_ceil((THREADS / 32) as usize);
    // The kernels take the token count as a u32.
    ensure(blocks <= i32::MAX as usize && num_tokens <= u32::MAX as usize, "num_tokens", || {
        format!("{num_tokens} tokens exceed one launch")
    })?;
    Ok((blocks as u32, 1, 1))
}

fn scale_ptr(s: Option<&DevIn<'_>>, arg: &'static str) -> Result<u64> {
    match s {
        None => Ok(0),
        Some(s) => {
            ensure(s.dtype == DType::F32 && !s.is_empty(), arg, || {
                format!("must be one f32 on the device, got {} x {:?}", s.len, s.dtype)
            })?;
            Ok(s.ptr)
        }
    }
}

/// Writes K and V rows into the paged cache at their slots (vLLM's `reshape_and_cache_flash`):
/// token t's heads go to slot `slot_mapping[t]` of `w.cache`, converted to the cache dtype (FP8:
/// `x / scale`, E4M3-rounded). Enqueued on `stream`; nothing synchronises.
///
/// Errors, all before anything is enqueued: `UnsupportedDType` for sources other than
/// f16/bf16/f32, a value dtype other than the key's, or a cache that is neither the source dtype
/// nor FP8; `InvalidArgument` for a missing FP8 scale, a spec that does not validate, rows whose
/// heads or head size differ from the cache's, buffers shorter than their rows, fewer
/// `slot_mapping` entries than tokens, a head size that is not whole 16-byte vectors, or
/// misaligned buffers or strides (16 bytes); `Driver` when the launch fails. Slots at or past
/// the cache's `num_slots` are skipped and raise the slot bit in `status`
/// ([`DeviceStatus::check`] reports them as `SlotOutOfRange`).
pub fn reshape_and_cache(dev: &AttnDevice, stream: &Arc<CudaStream>, w: KvWrite<'_>, status: &mut DeviceStatus) -> Result<()> {
    refuse_foreign_capture(stream, "stream", "reshape_and_cache")?;
    reshape_and_cache_from(dev, stream, w, status)
}

/// [`reshape_and_cache`] for `forward`, which may be recording its own graph.
pub(crate) fn reshape_and_cache_from(dev: &AttnDevice, stream: &CudaStream, w: KvWrite<'_>, status: &mut DeviceStatus) -> Result<()> {
    let (src, cache) = (w.key.dtype, w.cache.dtype);
    check_write_dtypes(src, w.value.dtype, cache, w.scales.is_some())?;
    ensure(w.slot_mapping.dtype == DType::I64, "slot_mapping", || format!("must be i64, got {:?}", w.slot_mapping.dtype))?;
    check_kv_shapes(w.key.len, &w.key_rows, w.value.len, &w.value_rows, w.slot_mapping.len, w.cache.len, &w.spec)?;
    let elems_per_vec = 16 / src.size_bytes();
    ensure(w.spec.head_size.is_multiple_of(elems_per_vec), "head_size", || {
        format!("{} is not a multiple of {elems_per_vec} (16-byte vectors)", w.spec.head_size)
    })?;
    check_vector_alignment("key", w.key.ptr, &[w.key_rows.token_stride, w.key_rows.head_stride], src.size_bytes(), 16)?;
    check_vector_alignment("value", w.value.ptr, &[w.value_rows.token_stride, w.value_rows.head_stride], src.size_bytes(), 16)?;
    check_vector_alignment("cache", w.cache.ptr, &[], cache.size_bytes(), elems_per_vec * cache.size_bytes())?;
    let num_tokens = w.key_rows.num_tokens;
    if num_tokens == 0 {
        return Ok(());
    }
    let kernel = KernelId::ReshapeAndCache { src, fp8: cache.fp8_format() };
    let grid = grid_for(num_tokens)?;
    let (k_origin, v_origin) = w.spec.kv_origins();
    let strides = w.spec.strides();
    let (k_scale, v_scale, scale_head_stride) = match &w.scales {
        Some(s) if cache.is_fp8() => s.layout(w.spec.num_kv_heads)?,
        _ => (0, 0, 0),
    };
    let (status_ptr, _status_order) = status.word.device_ptr_mut(stream);
    let p = CacheWriteParams {
        key: w.key.ptr,
        value: w.value.ptr,
        key_token_stride: w.key_rows.token_stride as u64,
        key_head_stride: w.key_rows.head_stride as u64,
        value_token_stride: w.value_rows.token_stride as u64,
        value_head_stride: w.value_rows.head_stride as u64,
        k_cache: w.cache.ptr + (k_origin * cache.size_bytes()) as u64,
        v_cache: w.cache.ptr + (v_origin * cache.size_bytes()) as u64,
        k_strides: strides,
        v_strides: strides,
        slot_mapping: w.slot_mapping.ptr,
        k_scale,
        v_scale,
        status: status_ptr,
        num_slots: w.spec.num_slots() as u64,
        num_tokens: num_tokens as u32,
        num_heads: w.spec.num_kv_heads as u32,
        head_size: w.spec.head_size as u32,
        block_size: w.spec.block_size as u32,
        scale_head_stride,
        reserved: 0,
    };
    dev.launch_pdl(stream, kernel, grid, THREADS, 0, p)
}

/// Writes MLA latent rows into the latent cache (vLLM's `concat_and_cache_mla`): token t's row
/// is `kv_c[t]` (`latent_dim` wide) then `k_pe[t]` (`rope_dim` wide), at slot
/// `slot_mapping[t]`; FP8 caches store `x / scale`. Enqueued on `stream`; nothing synchronises.
///
/// Errors: as [`reshape_and_cache`]'s (`kv_c` and `k_pe` in place of key and value, `scale` in
/// place of `scales`); slots past the cache raise the slot bit in `status`.
pub fn concat_and_cache_mla(dev: &AttnDevice, stream: &Arc<CudaStream>, w: MlaWrite<'_>, status: &mut DeviceStatus) -> Result<()> {
    refuse_foreign_capture(stream, "stream", "concat_and_cache_mla")?;
    concat_and_cache_mla_from(dev, stream, w, status)
}

/// [`concat_and_cache_mla`] for `forward`, which may be recording its own graph.
pub(crate) fn concat_and_cache_mla_from(dev: &AttnDevice, stream: &CudaStream, w: MlaWrite<'_>, status: &mut DeviceStatus) -> Result<()> {
    let (src, cache) = (w.kv_c.dtype, w.cache.dtype);
    check_write_dtypes(src, w.k_pe.dtype, cache, w.scale.is_some())?;
    ensure(w.slot_mapping.dtype == DType::I64, "slot_mapping", || format!("must be i64, got {:?}", w.slot_mapping.dtype))?;
    check_mla_shapes(
        w.kv_c.len,
        w.kv_c_token_stride,
        w.k_pe.len,
        w.k_pe_token_stride,
        w.num_tokens,
        w.slot_mapping.len,
        w.cache.len,
        &w.spec,
    )?;
    let elems_per_vec = 16 / src.size_bytes();
    for (arg, dim) in [("latent_dim", w.spec.latent_dim), ("rope_dim", w.spec.rope_dim)] {
        ensure(dim % elems_per_vec == 0, arg, || format!("{dim} is not a multiple of {elems_per_vec} (16-byte vectors)"))?;
    }
    check_vector_alignment("kv_c", w.kv_c.ptr, &[w.kv_c_token_stride], src.size_bytes(), 16)?;
    check_vector_alignment("k_pe", w.k_pe.ptr, &[w.k_pe_token_stride], src.size_bytes(), 16)?;
    check_vector_alignment("cache", w.cache.ptr, &[], cache.size_bytes(), elems_per_vec * cache.size_bytes())?;
    if w.num_tokens == 0 {
        return Ok(());
    }
    let kernel = KernelId::ConcatAndCacheMla { src, fp8: cache.fp8_format() };
    let grid = grid_for(w.num_tokens)?;
    let scale = if cache.is_fp8() { scale_ptr(w.scale.as_ref(), "scale")? } else { 0 };
    let (status_ptr, _status_order) = status.word.device_ptr_mut(stream);
    let p = MlaCacheWriteParams {
        kv_c: w.kv_c.ptr,
        k_pe: w.k_pe.ptr,
        kv_c_token_stride: w.kv_c_token_stride as u64,
        k_pe_token_stride: w.k_pe_token_stride as u64,
        cache: w.cache.ptr,
        cache_strides: w.spec.strides(),
        slot_mapping: w.slot_mapping.ptr,
        scale,
        status: status_ptr,
        num_slots: w.spec.num_slots() as u64,
        num_tokens: w.num_tokens as u32,
        latent_dim: w.spec.latent_dim as u32,
        rope_dim: w.spec.rope_dim as u32,
        block_size: w.spec.block_size as u32,
    };
    dev.launch_pdl(stream, kernel, grid, THREADS, 0, p)
}

/// Elements `num_tokens` rows of `dim`, `stride` apart, span (`None` when that overflows).
pub(crate) fn latent_rows_len(num_tokens: usize, stride: usize, dim: usize) -> Option<usize> {
    if num_tokens == 0 {
        return Some(0);
    }
    (num_tokens - 1).checked_mul(stride)?.checked_add(dim)
}

/// Shape checks of the MLA write shared by the GPU and CPU paths.
#[allow(clippy::too_many_arguments)]
pub(crate) fn check_mla_shapes(
    kv_c_len: usize,
    kv_c_stride: usize,
    k_pe_len: usize,
    k_pe_stride: usize,
    num_tokens: usize,
    slots_len: usize,
    cache_len: usize,
    spec: &MlaCacheSpec,
) -> Result<()> {
    spec.validate("spec")?;
    for (arg, len, stride, dim) in [("kv_c", kv_c_len, kv_c_stride, spec.latent_dim), ("k_pe", k_pe_len, k_pe_stride, spec.rope_dim)] {
        ensure(stride >= dim || num_tokens <= 1, arg, || format!("token stride {stride} is smaller than its row of {dim}"))?;
        let needed = latent_rows_len(num_tokens, stride, dim).ok_or_else(|| {
            AttnError::invalid(arg, format!("{num_tokens} rows of {dim}, {stride} apart, span more elements than a usize holds"))
        })?;
        ensure(len >= needed, arg, || format!("buffer of {len} elements is too small for {num_tokens} rows ({needed} needed)"))?;
    }
    ensure(slots_len >= num_tokens, "slot_mapping", || format!("has {slots_len} entries for {num_tokens} tokens"))?;
    ensure(cache_len >= spec.num_elements(), "cache", || {
        format!("buffer of {cache_len} elements is smaller than the layout's {}", spec.num_elements())
    })
}
