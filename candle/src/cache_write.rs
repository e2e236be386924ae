//! Cache writes: [`reshape_and_cache`] (standard K/V) and [`concat_and_cache_mla`] (MLA latents),
//! in place on the cache tensor (a candle in-place op: the cache's storage is locked for writing
//! for the call, the sources for reading).

use crate::cache::{host_scale, KvCache, MlaCache};
use crate::error::{ensure, invalid, AttnResult};
use crate::host::{typed, typed_mut, HostSlice};
use crate::layout::{latent_rows, rows};
use attn_rs::cpu::WriteReport;
use attn_rs::{AttnError, Fp8E4m3, KvCacheSpec, MlaCacheSpec, RowsDesc};
use candle_core::backend::BackendStorage;
use candle_core::{CpuStorage, DType, Device, InplaceOp3, Layout, Result, Tensor};
use half::{bf16, f16};

/// A CPU write, typed.
type WriteFn<S> = fn(&S, &mut CpuStorage, &Layout, &CpuStorage, &Layout, &CpuStorage, &Layout) -> Result<()>;

/// A cache write on the CPU for source elements `T` and cache elements `C`.
trait CpuWrite: Sized {
    fn write_cpu<T: HostSlice, C: HostSlice>(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<()>;
}

/// The typed write for `src` sources into a `cache`-dtype cache: the sources' dtype, or FP8
/// E4M3 from any float source. `what` names the sources in the refusal.
fn typed_write<O: CpuWrite>(src: DType, cache: DType, what: &str) -> Result<WriteFn<O>> {
    Ok(match (src, cache) {
        (DType::F16, DType::F16) => O::write_cpu::<f16, f16>,
        (DType::BF16, DType::BF16) => O::write_cpu::<bf16, bf16>,
        (DType::F32, DType::F32) => O::write_cpu::<f32, f32>,
        (DType::F16, DType::F8E4M3) => O::write_cpu::<f16, Fp8E4m3>,
        (DType::BF16, DType::F8E4M3) => O::write_cpu::<bf16, Fp8E4m3>,
        (DType::F32, DType::F8E4M3) => O::write_cpu::<f32, Fp8E4m3>,
        (s, c) => return Err(invalid("cache", format!("dtype {c:?} with {s:?} {what}: a cache is the {what}' dtype or f8e4m3"))),
    })
}

/// The host copy of `[num_tokens]` slots (any integer dtype).
fn host_slots(slot_mapping: &Tensor) -> Result<Vec<i64>> {
    ensure(slot_mapping.rank() == 1, "slot_mapping", || format!("shape {:?}: expected [num_tokens]", slot_mapping.dims()))?;
    ensure(slot_mapping.dtype().is_int(), "slot_mapping", || format!("dtype {:?}: expected integers", slot_mapping.dtype()))?;
    slot_mapping.to_dtype(DType::I64)?.to_vec1::<i64>()
}

/// Refuses a tensor that is not on `device`.
pub(crate) fn same_device(arg: &str, t: &Tensor, device: &Device) -> Result<()> {
    ensure(t.device().same_device(device), arg, || format!("is on {:?}, the cache on {:?}", t.device().location(), device.location()))
}

fn check_report(report: WriteReport) -> Result<()> {
    if report.out_of_range > 0 {
        return Err(crate::error::attn(AttnError::SlotOutOfRange { first: report.first_out_of_range }));
    }
    Ok(())
}

/// Writes this step's keys and values into the paged cache at their slots (vLLM's
/// `reshape_and_cache_flash`, on [`KvCache`]'s layouts).
///
/// - `key`, `value`: `[num_tokens, num_kv_heads, head_size]` or `[num_tokens, num_kv_heads *
///   head_size]`, f16/bf16/f32 (both the same), any token and head strides with a contiguous head
///   dimension: e.g. `narrow`s of a fused QKV projection, passed without a copy.
/// - `cache`: f16/bf16/f32 of the sources' dtype, or FP8 E4M3 with its scales (stored =
///   value / scale).
/// - `slot_mapping`: `[num_tokens]` integers (i64 on CUDA; other integer dtypes are converted):
///   `block * block_size + offset`; negative = padding, skipped.
///
/// On the CPU a slot past the cache is an error (`SlotOutOfRange`, naming the token); on the
/// GPU it is skipped and reported by [`check_device_status`](crate::check_device_status).
///
/// ```
/// use attn_candle::{reshape_and_cache, KvCache, KvCacheSpec, KvLayout};
/// use candle_core::{DType, Device, IndexOp, Tensor};
///
/// let dev = Device::Cpu;
/// let cache = KvCache::zeros(KvCacheSpec::new(KvLayout::FlashNhd, 4, 16, 2, 8)?, DType::F32, &dev)?;
/// // A fused QKV projection of 3 tokens: 4 query heads, then 2 key and 2 value heads.
/// let qkv = Tensor::randn(0f32, 1., (3, 8, 8), &dev)?;
/// let (k, v) = (qkv.narrow(1, 4, 2)?, qkv.narrow(1, 6, 2)?);
/// let slots = Tensor::new(&[16i64, 17, -1], &dev)?; // block 1, offsets 0 and 1; a padding token
/// reshape_and_cache(&k, &v, &cache, &slots)?;
/// let stored = cache.key_cache()?.i((1, 1))?; // block 1, offset 1
/// assert_eq!(stored.to_vec2::<f32>()?, k.i(1)?.to_vec2::<f32>()?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn reshape_and_cache(key: &Tensor, value: &Tensor, cache: &KvCache, slot_mapping: &Tensor) -> Result<()> {
    let spec = cache.spec();
    let device = cache.device();
    for (arg, t) in [("key", key), ("value", value), ("slot_mapping", slot_mapping)] {
        same_device(arg, t, device)?;
    }
    let key_rows = rows("key", key.layout(), spec.head_size)?;
    let value_rows = rows("value", value.layout(), spec.head_size)?;
    ensure(value.dtype() == key.dtype(), "value", || format!("dtype {:?} differs from key's {:?}", value.dtype(), key.dtype()))?;
    let scales = cache.needed_scales()?;
    let mut op = KvWriteOp { key_rows, value_rows, spec, slots: Vec::new(), host_scales: None, slot_mapping, scales };
    if device.is_cpu() {
        op.slots = host_slots(slot_mapping)?;
        op.host_scales = scales.map(|(k, v)| Ok::<_, candle_core::Error>((host_scale(k)?, host_scale(v)?))).transpose()?;
    } else {
        ensure(slot_mapping.rank() == 1 && slot_mapping.dtype() == DType::I64, "slot_mapping", || {
            format!("{:?} {:?}: expected [num_tokens] i64", slot_mapping.dtype(), slot_mapping.dims())
        })?;
    }
    cache.tensor().inplace_op3(key, value, &op)
}

struct KvWriteOp<'a> {
    key_rows: RowsDesc,
    value_rows: RowsDesc,
    spec: KvCacheSpec,
    /// CPU: the host copies of the slots and scales.
    slots: Vec<i64>,
    host_scales: Option<(f32, f32)>,
    /// CUDA: read on the device.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    slot_mapping: &'a Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scales: Option<(&'a Tensor, &'a Tensor)>,
}

impl CpuWrite for KvWriteOp<'_> {
    fn write_cpu<T: HostSlice, C: HostSlice>(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        k: &CpuStorage,
        kl: &Layout,
        v: &CpuStorage,
        vl: &Layout,
    ) -> Result<()> {
        let key = typed::<T>("key", k, kl.start_offset())?;
        let value = typed::<T>("value", v, vl.start_offset())?;
        let cache = typed_mut::<C>("cache", cache, cl.start_offset())?;
        let slots = self.slots.as_slice();
        ensure(slots.len() == self.key_rows.num_tokens, "slot_mapping", || {
            format!("has {} entries for {} tokens", slots.len(), self.key_rows.num_tokens)
        })?;
        let report = attn_rs::cpu::reshape_and_cache(
            key,
            self.key_rows,
            value,
            self.value_rows,
            slots,
            cache,
            &self.spec,
            self.host_scales.map(Into::into),
        )
        .c()?;
        check_report(report)
    }
}

impl InplaceOp3 for KvWriteOp<'_> {
    fn name(&self) -> &'static str {
        "attn-reshape-and-cache"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cl: &Layout, k: &CpuStorage, kl: &Layout, v: &CpuStorage, vl: &Layout) -> Result<()> {
        typed_write::<Self>(k.dtype(), cache.dtype(), "keys")?(self, cache, cl, k, kl, v, vl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        k: &candle_core::CudaStorage,
        kl: &Layout,
        v: &candle_core::CudaStorage,
        vl: &Layout,
    ) -> Result<()> {
        use crate::cuda::{cuda, device_state, CudaIn, CudaOut};
        use attn_rs::cache_write::{KvScales, KvWrite};
        let state = device_state(&cache.device)?;
        let stream = state.stream.clone();
        let (slot_guard, slot_layout) = self.slot_mapping.storage_and_layout();
        let slots = CudaIn::new("slot_mapping", cuda("slot_mapping", &slot_guard)?, slot_layout.start_offset())?;
        ensure(slot_layout.is_contiguous(), "slot_mapping", || "must be contiguous: call `.contiguous()` on it".into())?;
        let scale_guards = self.scales.map(|(k, v)| (k.storage_and_layout(), v.storage_and_layout()));
        let scales = match &scale_guards {
            Some(((kg, kl), (vg, vl))) => Some((
                CudaIn::new("k_scale", cuda("k_scale", kg)?, kl.start_offset())?,
                CudaIn::new("v_scale", cuda("v_scale", vg)?, vl.start_offset())?,
            )),
            None => None,
        };
        let key = CudaIn::new("key", k, kl.start_offset())?;
        let value = CudaIn::new("value", v, vl.start_offset())?;
        let mut out = CudaOut::new("cache", cache, cl.start_offset())?;
        let mut status = state.status.lock().expect("status poisoned");
        let w = KvWrite {
            key: key.dev_in(&stream),
            key_rows: self.key_rows,
            value: value.dev_in(&stream),
            value_rows: self.value_rows,
            slot_mapping: slots.dev_in(&stream),
            cache: out.dev_out(&stream),
            spec: self.spec,
            scales: scales.as_ref().map(|(k, v)| KvScales { k: k.dev_in(&stream), v: v.dev_in(&stream) }),
        };
        attn_rs::cache_write::reshape_and_cache(&state.dev, &stream, w, &mut status).c()
    }
}

/// Writes this step's MLA latents into the latent cache at their slots (vLLM's
/// `concat_and_cache_mla`): each token's row is `kv_c` then `k_pe`.
///
/// - `kv_c`: `[num_tokens, latent_dim]`, `k_pe`: `[num_tokens, rope_dim]` or `[num_tokens, 1,
///   rope_dim]`, f16/bf16/f32, any token stride with contiguous rows (e.g. `narrow`s of one
///   projection, without a copy).
/// - `cache`: the sources' dtype, or FP8 E4M3 with its scale.
/// - `slot_mapping`: as [`reshape_and_cache`]'s.
///
/// ```
/// use attn_candle::{concat_and_cache_mla, MlaCache, MlaCacheSpec};
/// use candle_core::{DType, Device, IndexOp, Tensor};
///
/// let dev = Device::Cpu;
/// let cache = MlaCache::zeros(MlaCacheSpec::new(4, 16, 32, 8)?, DType::F32, &dev)?;
/// let proj = Tensor::randn(0f32, 1., (2, 40), &dev)?; // kv_c then k_pe, per token
/// let (kv_c, k_pe) = (proj.narrow(1, 0, 32)?, proj.narrow(1, 32, 8)?);
/// concat_and_cache_mla(&kv_c, &k_pe, &cache, &Tensor::new(&[5i64, 33], &dev)?)?;
/// assert_eq!(cache.tensor().i((2, 1))?.to_vec1::<f32>()?, proj.i(1)?.to_vec1::<f32>()?);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
pub fn concat_and_cache_mla(kv_c: &Tensor, k_pe: &Tensor, cache: &MlaCache, slot_mapping: &Tensor) -> Result<()> {
    let spec = cache.spec();
    let device = cache.device();
    for (arg, t) in [("kv_c", kv_c), ("k_pe", k_pe), ("slot_mapping", slot_mapping)] {
        same_device(arg, t, device)?;
    }
    let (nt, kv_c_stride) = latent_rows("kv_c", kv_c.layout(), spec.latent_dim)?;
    let (nt_pe, k_pe_stride) = latent_rows("k_pe", k_pe.layout(), spec.rope_dim)?;
    ensure(nt_pe == nt, "k_pe", || format!("has {nt_pe} tokens, kv_c {nt}"))?;
    ensure(k_pe.dtype() == kv_c.dtype(), "k_pe", || format!("dtype {:?} differs from kv_c's {:?}", k_pe.dtype(), kv_c.dtype()))?;
    let scale = cache.needed_scale()?;
    let mut op = MlaWriteOp { num_tokens: nt, kv_c_stride, k_pe_stride, spec, slots: Vec::new(), host_scale: None, slot_mapping, scale };
    if device.is_cpu() {
        op.slots = host_slots(slot_mapping)?;
        op.host_scale = scale.map(host_scale).transpose()?;
    } else {
        ensure(slot_mapping.rank() == 1 && slot_mapping.dtype() == DType::I64, "slot_mapping", || {
            format!("{:?} {:?}: expected [num_tokens] i64", slot_mapping.dtype(), slot_mapping.dims())
        })?;
    }
    cache.tensor().inplace_op3(kv_c, k_pe, &op)
}

struct MlaWriteOp<'a> {
    num_tokens: usize,
    kv_c_stride: usize,
    k_pe_stride: usize,
    spec: MlaCacheSpec,
    slots: Vec<i64>,
    host_scale: Option<f32>,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    slot_mapping: &'a Tensor,
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    scale: Option<&'a Tensor>,
}

impl CpuWrite for MlaWriteOp<'_> {
    fn write_cpu<T: HostSlice, C: HostSlice>(
        &self,
        cache: &mut CpuStorage,
        cl: &Layout,
        a: &CpuStorage,
        al: &Layout,
        b: &CpuStorage,
        bl: &Layout,
    ) -> Result<()> {
        let kv_c = typed::<T>("kv_c", a, al.start_offset())?;
        let k_pe = typed::<T>("k_pe", b, bl.start_offset())?;
        let cache = typed_mut::<C>("cache", cache, cl.start_offset())?;
        let slots = self.slots.as_slice();
        ensure(slots.len() == self.num_tokens, "slot_mapping", || format!("has {} entries for {} tokens", slots.len(), self.num_tokens))?;
        let report = attn_rs::cpu::concat_and_cache_mla(
            kv_c,
            self.kv_c_stride,
            k_pe,
            self.k_pe_stride,
            self.num_tokens,
            slots,
            cache,
            &self.spec,
            self.host_scale,
        )
        .c()?;
        check_report(report)
    }
}

impl InplaceOp3 for MlaWriteOp<'_> {
    fn name(&self) -> &'static str {
        "attn-concat-and-cache-mla"
    }

    fn cpu_fwd(&self, cache: &mut CpuStorage, cl: &Layout, a: &CpuStorage, al: &Layout, b: &CpuStorage, bl: &Layout) -> Result<()> {
        typed_write::<Self>(a.dtype(), cache.dtype(), "latents")?(self, cache, cl, a, al, b, bl)
    }

    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        cache: &mut candle_core::CudaStorage,
        cl: &Layout,
        a: &candle_core::CudaStorage,
        al: &Layout,
        b: &candle_core::CudaStorage,
        bl: &Layout,
    ) -> Result<()> {
        use crate::cuda::{cuda, device_state, CudaIn, CudaOut};
        use attn_rs::cache_write::MlaWrite;
        let state = device_state(&cache.device)?;
        let stream = state.stream.clone();
        let (slot_guard, slot_layout) = self.slot_mapping.storage_and_layout();
        ensure(slot_layout.is_contiguous(), "slot_mapping", || "must be contiguous: call `.contiguous()` on it".into())?;
        let slots = CudaIn::new("slot_mapping", cuda("slot_mapping", &slot_guard)?, slot_layout.start_offset())?;
        let scale_guard = self.scale.map(|s| s.storage_and_layout());
        let scale = match &scale_guard {
            Some((g, l)) => Some(CudaIn::new("scale", cuda("scale", g)?, l.start_offset())?),
            None => None,
        };
        let kv_c = CudaIn::new("kv_c", a, al.start_offset())?;
        let k_pe = CudaIn::new("k_pe", b, bl.start_offset())?;
        let mut out = CudaOut::new("cache", cache, cl.start_offset())?;
        let mut status = state.status.lock().expect("status poisoned");
        let w = MlaWrite {
            kv_c: kv_c.dev_in(&stream),
            kv_c_token_stride: self.kv_c_stride,
            k_pe: k_pe.dev_in(&stream),
            k_pe_token_stride: self.k_pe_stride,
            num_tokens: self.num_tokens,
            slot_mapping: slots.dev_in(&stream),
            cache: out.dev_out(&stream),
            spec: self.spec,
            scale: scale.as_ref().map(|s| s.dev_in(&stream)),
        };
        attn_rs::cache_write::concat_and_cache_mla(&state.dev, &stream, w, &mut status).c()
    }
}
