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

    /// `len` elements of `dtype` from `byte_offset` of this buffer, borrowed from it (its
    /// stream-ordering guard covers the view). Panics if the view leaves the buffer.
    pub(crate) fn view(&self, byte_offset: usize, len: usize, dtype: DType) -> DevIn<'_> {
        let end = byte_offset + len * dtype.size_bytes();
        assert!(end <= self.len * self.dtype.size_bytes(), "view of {end} bytes past a buffer of {} x {:?}", self.len, self.dtype);
        DevIn { ptr: self.ptr + byte_offset as u64, len, dtype, _order: SyncOnDrop::Sync(None) }
    }

    /// `len` elements of `dtype` at `ptr`: memory the library owns and keeps alive past the
    /// launches that read it (workspaces).
    pub(crate) fn owned(ptr: u64, len: usize, dtype: DType) -> DevIn<'static> {
        DevIn { ptr, len, dtype, _order: SyncOnDrop::Sync(None) }
    }

    /// Elements `offset..` of this buffer, borrowed from it.
    pub(crate) fn tail(&self, offset: usize) -> DevIn<'_> {
        let offset = offset.min(self.len);
        self.view(offset * self.dtype.size_bytes(), self.len - offset, self.dtype)
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

impl DevOut<'_> {
    /// `len` elements of `dtype` at `ptr`: memory the library owns and keeps alive past the
    /// launches that write it (workspaces).
    pub(crate) fn owned(ptr: u64, len: usize, dtype: DType) -> DevOut<'static> {
        DevOut { ptr, len, dtype, _order: SyncOnDrop::Sync(None) }
    }

    /// Elements `offset..` of this buffer, written through a borrow of it.
    pub(crate) fn tail_mut(&mut self, offset: usize) -> DevOut<'_> {
        let offset = offset.min(self.len);
        let ptr = self.ptr + (offset * self.dtype.size_bytes()) as u64;
        DevOut { ptr, len: self.len - offset, dtype: self.dtype, _order: SyncOnDrop::Sync(None) }
    }

    /// The same memory for reading (after a write on the same stream), borrowed from this.
    pub(crate) fn as_input(&self) -> DevIn<'_> {
        DevIn { ptr: self.ptr, len: self.len, dtype: self.dtype, _order: SyncOnDrop::Sync(None) }
    }
}
