//! CUDA tensors (the `cuda` feature): views of candle's device slices at a layout's start
//! offset as attn-rs buffers, candle's stream, and one [`AttnDevice`] per candle device.
//!
//! Everything is enqueued on the candle device's own stream (`CudaDevice::cuda_stream`), so the
//! ops are ordered with candle's kernels as candle's own ops are, and nothing synchronises.

use crate::error::{invalid, AttnResult};
use attn_rs::{AttnDevice, DevIn, DevOut, DeviceStatus, Element, Fp8E4m3};
use candle_core::backend::BackendStorage;
use candle_core::cuda_backend::cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use candle_core::cuda_backend::{CudaStorageSlice, DeviceId};
use candle_core::{CudaDevice, CudaStorage, Layout, Result, Storage, StorageRef};
use half::{bf16, f16};
use std::collections::HashMap;
use std::marker::PhantomData;
use std::sync::{Arc, Mutex, OnceLock};

/// Elements `offset..offset + len` of a device slice of `S`, read as `T` (of the same size).
pub(crate) struct In<'a, S, T> {
    slice: &'a CudaSlice<S>,
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

/// Elements `offset..offset + len` of a device slice of `S`, written as `T` (of the same size).
pub(crate) struct Out<'a, S, T> {
    slice: &'a mut CudaSlice<S>,
    offset: usize,
    len: usize,
    _t: PhantomData<T>,
}

fn range_of<S>(arg: &str, slice: &CudaSlice<S>, offset: usize) -> Result<usize> {
    slice.len().checked_sub(offset).ok_or_else(|| invalid(arg, format!("start offset {offset} past its storage of {}", slice.len())))
}

impl<'a, S, T> In<'a, S, T> {
    fn new(arg: &str, slice: &'a CudaSlice<S>, offset: usize) -> Result<Self> {
        const { assert!(std::mem::size_of::<S>() == std::mem::size_of::<T>()) };
        let len = range_of(arg, slice, offset)?;
        Ok(In { slice, offset, len, _t: PhantomData })
    }
}

impl<'a, S, T> Out<'a, S, T> {
    fn new(arg: &str, slice: &'a mut CudaSlice<S>, offset: usize) -> Result<Self> {
        const { assert!(std::mem::size_of::<S>() == std::mem::size_of::<T>()) };
        let len = range_of(arg, slice, offset)?;
        Ok(Out { slice, offset, len, _t: PhantomData })
    }
}

impl<S, T> DeviceSlice<T> for In<'_, S, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<S, T> DevicePtr<T> for In<'_, S, T> {
    fn device_ptr<'b>(&'b self, stream: &'b CudaStream) -> (u64, SyncOnDrop<'b>) {
        let (ptr, order) = self.slice.device_ptr(stream);
        (ptr + (self.offset * std::mem::size_of::<S>()) as u64, order)
    }
}

impl<S, T> DeviceSlice<T> for Out<'_, S, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.slice.stream()
    }
}

impl<S, T> DevicePtrMut<T> for Out<'_, S, T> {
    fn device_ptr_mut<'b>(&'b mut self, stream: &'b CudaStream) -> (u64, SyncOnDrop<'b>) {
        let (ptr, order) = self.slice.device_ptr_mut(stream);
        (ptr + (self.offset * std::mem::size_of::<S>()) as u64, order)
    }
}

/// A candle CUDA storage from an element offset, typed for attn-rs (FP8 as [`Fp8E4m3`], u32
/// block tables as i32).
pub(crate) enum CudaIn<'a> {
    F16(In<'a, f16, f16>),
    BF16(In<'a, bf16, bf16>),
    F32(In<'a, f32, f32>),
    Fp8(In<'a, float8::F8E4M3, Fp8E4m3>),
    I64(In<'a, i64, i64>),
    I32(In<'a, i32, i32>),
    U32AsI32(In<'a, u32, i32>),
}

impl<'a> CudaIn<'a> {
    pub(crate) fn new(arg: &str, s: &'a CudaStorage, offset: usize) -> Result<Self> {
        Ok(match &s.slice {
            CudaStorageSlice::F16(v) => CudaIn::F16(In::new(arg, v, offset)?),
            CudaStorageSlice::BF16(v) => CudaIn::BF16(In::new(arg, v, offset)?),
            CudaStorageSlice::F32(v) => CudaIn::F32(In::new(arg, v, offset)?),
            CudaStorageSlice::F8E4M3(v) => CudaIn::Fp8(In::new(arg, v, offset)?),
            CudaStorageSlice::I64(v) => CudaIn::I64(In::new(arg, v, offset)?),
            CudaStorageSlice::I32(v) => CudaIn::I32(In::new(arg, v, offset)?),
            CudaStorageSlice::U32(v) => CudaIn::U32AsI32(In::new(arg, v, offset)?),
            _ => return Err(invalid(arg, format!("dtype {:?} is not one the ops take", s.dtype()))),
        })
    }

    /// The attn-rs input, ordered on `stream`.
    pub(crate) fn dev_in<'b>(&'b self, stream: &'b Arc<CudaStream>) -> DevIn<'b> {
        fn make<'b, T: Element>(v: &'b impl DevicePtr<T>, stream: &'b Arc<CudaStream>) -> DevIn<'b> {
            DevIn::new(v, stream)
        }
        match self {
            CudaIn::F16(v) => make(v, stream),
            CudaIn::BF16(v) => make(v, stream),
            CudaIn::F32(v) => make(v, stream),
            CudaIn::Fp8(v) => make(v, stream),
            CudaIn::I64(v) => make(v, stream),
            CudaIn::I32(v) => make(v, stream),
            CudaIn::U32AsI32(v) => make(v, stream),
        }
    }
}

/// A candle CUDA float storage from an element offset, to write.
pub(crate) enum CudaOut<'a> {
    F16(Out<'a, f16, f16>),
    BF16(Out<'a, bf16, bf16>),
    F32(Out<'a, f32, f32>),
    Fp8(Out<'a, float8::F8E4M3, Fp8E4m3>),
}

impl<'a> CudaOut<'a> {
    pub(crate) fn new(arg: &str, s: &'a mut CudaStorage, offset: usize) -> Result<Self> {
        let dtype = s.dtype();
        Ok(match &mut s.slice {
            CudaStorageSlice::F16(v) => CudaOut::F16(Out::new(arg, v, offset)?),
            CudaStorageSlice::BF16(v) => CudaOut::BF16(Out::new(arg, v, offset)?),
            CudaStorageSlice::F32(v) => CudaOut::F32(Out::new(arg, v, offset)?),
            CudaStorageSlice::F8E4M3(v) => CudaOut::Fp8(Out::new(arg, v, offset)?),
            _ => return Err(invalid(arg, format!("dtype {dtype:?}: expected f16, bf16, f32 or f8e4m3"))),
        })
    }

    /// The attn-rs output, ordered on `stream`.
    pub(crate) fn dev_out<'b>(&'b mut self, stream: &'b Arc<CudaStream>) -> DevOut<'b> {
        fn make<'b, T: Element>(v: &'b mut impl DevicePtrMut<T>, stream: &'b Arc<CudaStream>) -> DevOut<'b> {
            DevOut::new(v, stream)
        }
        match self {
            CudaOut::F16(v) => make(v, stream),
            CudaOut::BF16(v) => make(v, stream),
            CudaOut::F32(v) => make(v, stream),
            CudaOut::Fp8(v) => make(v, stream),
        }
    }
}

/// A tensor's CUDA storage.
pub(crate) fn cuda<'a>(arg: &str, s: &'a Storage) -> Result<&'a CudaStorage> {
    match s {
        Storage::Cuda(s) => Ok(s),
        _ => Err(invalid(arg, "is not a CUDA tensor (the other tensors are)")),
    }
}

/// The view of a tensor whose storage guard and layout the caller holds.
pub(crate) fn guarded<'a>(arg: &str, g: &'a (StorageRef<'_>, &Layout)) -> Result<CudaIn<'a>> {
    CudaIn::new(arg, cuda(arg, &g.0)?, g.1.start_offset())
}

/// What attn-rs keeps per candle CUDA device: the kernels loaded for its GPU (from candle's own
/// context), the status block the standalone cache writes report into, and the decode
/// workspace of [`paged_attention`](crate::paged_attention).
pub(crate) struct DeviceState {
    pub dev: Arc<AttnDevice>,
    pub stream: Arc<CudaStream>,
    pub status: Mutex<DeviceStatus>,
    pub decode: Mutex<Option<crate::decode::GpuDecode>>,
}

/// The state of candle device `d`, made on its first use.
pub(crate) fn device_state(d: &CudaDevice) -> Result<Arc<DeviceState>> {
    static DEVICES: OnceLock<Mutex<HashMap<DeviceId, Arc<DeviceState>>>> = OnceLock::new();
    let mut devices = DEVICES.get_or_init(Default::default).lock().expect("device registry poisoned");
    if let Some(s) = devices.get(&d.id()) {
        return Ok(s.clone());
    }
    let stream = d.cuda_stream();
    let dev = Arc::new(AttnDevice::from_context(stream.context().clone()).c()?);
    let status = Mutex::new(DeviceStatus::new(&stream).c()?);
    let state = Arc::new(DeviceState { dev, stream, status, decode: Mutex::new(None) });
    devices.insert(d.id(), state.clone());
    Ok(state)
}
