//! The caller's device memory as the ops take it: any cudarc slice or view (what candle's CUDA
//! tensors hold too) with its dtype and length, and cudarc's stream-ordering guard kept alive
//! until the op has been enqueued.

use crate::dtype::{DType, Element};
use cudarc::driver::{CudaStream, DevicePtr, DevicePtrMut, SyncOnDrop};

/// A device buffer the op reads.
pub struct DevIn<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _order: SyncOnDrop<'a>,
}

/// A device buffer the op writes.
pub struct DevOut<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _order: SyncOnDrop<'a>,
}

impl<'a> DevIn<'a> {
    /// Borrows `buf` for reading on `stream` (cudarc makes `stream` wait for pending writers).
    pub fn new<T: Element>(buf: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, order) = buf.device_ptr(stream);
        DevIn { ptr, len, dtype: T::DTYPE, _order: order }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl<'a> DevOut<'a> {
    /// Borrows `buf` for writing on `stream`.
    pub fn new<T: Element>(buf: &'a mut impl DevicePtrMut<T>, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, order) = buf.device_ptr_mut(stream);
        DevOut { ptr, len, dtype: T::DTYPE, _order: order }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}
