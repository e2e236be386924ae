//! The caller's device memory as the ops take it: any cudarc slice or view (what candle's CUDA
//! tensors hold too) with its dtype and length, and cudarc's stream-ordering guard kept alive
//! until the op has been enqueued.
//!
//! A borrow ends with the call, but a CUDA graph keeps the addresses it captured and uses them
//! at every replay. So buffers a graph captures are [`SharedBuf`]s: their
//! [`DevIn::shared`]/[`DevOut::shared`] views carry a keep-alive that the graph takes, and the
//! memory is freed only when the last handle, the graph's included, is dropped.

use crate::dtype::{DType, Element};
use crate::error::{ensure, AttnError, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceSlice, SyncOnDrop};
use std::any::Any;
use std::ops::{Bound, Range, RangeBounds};
use std::sync::Arc;

/// Something that keeps device memory allocated for as long as it is held.
pub(crate) type KeepAlive = Arc<dyn Any + Send + Sync>;

/// A device buffer the op reads.
pub struct DevIn<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _order: SyncOnDrop<'a>,
    /// Set when the memory is a [`SharedBuf`]'s: what a graph capturing this call holds.
    keep: Option<KeepAlive>,
}

/// A device buffer the op writes.
pub struct DevOut<'a> {
    pub(crate) ptr: u64,
    pub(crate) len: usize,
    pub(crate) dtype: DType,
    _order: SyncOnDrop<'a>,
    /// Set when the memory is a [`SharedBuf`]'s: what a graph capturing this call holds.
    keep: Option<KeepAlive>,
}

/// A device buffer with shared ownership (a cudarc slice behind an [`Arc`]): cloning it clones
/// the handle, and the memory is freed when the last handle is dropped. It is what a buffer
/// captured into a CUDA graph ([`Attention::capture`](crate::forward::Attention::capture))
/// must be, since the graph keeps a handle to every buffer it uses.
///
/// Device memory is written through shared handles ([`DevOut::shared`],
/// [`write_from_host`](Self::write_from_host)): no Rust reference points into it, and the
/// writes are ordered by the stream they are enqueued on. cudarc's cross-stream event tracking
/// sees those writes as reads, so a reader on another stream must be ordered after them by the
/// caller (an event, or one stream for everything, as an engine's step usually is).
pub struct SharedBuf<T> {
    buf: Arc<CudaSlice<T>>,
}

impl<T> Clone for SharedBuf<T> {
    fn clone(&self) -> Self {
        SharedBuf { buf: self.buf.clone() }
    }
}

impl<T: Element> SharedBuf<T> {
    /// Takes ownership of `buf` (its stream stays the one it was allocated on).
    pub fn new(buf: CudaSlice<T>) -> Self {
        SharedBuf { buf: Arc::new(buf) }
    }

    /// Elements in the buffer.
    pub fn len(&self) -> usize {
        self.buf.len()
    }

    /// Whether the buffer holds no elements.
    pub fn is_empty(&self) -> bool {
        self.buf.len() == 0
    }

    /// The slice, for reading (downloads, views); `SharedBuf` also implements `DevicePtr`.
    pub fn as_cuda_slice(&self) -> &CudaSlice<T> {
        &self.buf
    }

    /// The handle a graph holds: this buffer's memory, type-erased.
    pub(crate) fn keep_alive(&self) -> KeepAlive {
        self.buf.clone()
    }

    /// Copies `src` into elements `0..src.len()`, enqueued on `stream` (the source may be
    /// reused when this returns, as with cudarc's copies from host slices).
    ///
    /// Errors: `InvalidArgument` (`src`) when it is longer than the buffer.
    pub fn write_from_host(&self, stream: &Arc<CudaStream>, src: &[T]) -> Result<()> {
        self.write_from_host_at(stream, 0, src)
    }

    /// Copies `src` into elements `offset..offset + src.len()`, enqueued on `stream`.
    ///
    /// Errors: `InvalidArgument` (`src`) when that range leaves the buffer.
    pub fn write_from_host_at(&self, stream: &Arc<CudaStream>, offset: usize, src: &[T]) -> Result<()> {
        let fits = offset.checked_add(src.len()).is_some_and(|end| end <= self.len());
        if !fits {
            return Err(AttnError::invalid("src", format!("{} elements at offset {offset} leave a buffer of {}", src.len(), self.len())));
        }
        let mut dst = SharedWrite { buf: &self.buf, offset, len: src.len() };
        Ok(stream.memcpy_htod(src, &mut dst)?)
    }

    /// Copies device memory `src` into elements `offset..offset + src.len()`, enqueued on
    /// `stream` (an engine filling a captured step's inputs from its own buffers; kernels that
    /// write through [`DevOut::shared`] need no copy).
    ///
    /// Errors: `InvalidArgument` (`src`) when that range leaves the buffer.
    pub fn write_from_device_at(&self, stream: &Arc<CudaStream>, offset: usize, src: &impl DevicePtr<T>) -> Result<()> {
        let fits = offset.checked_add(src.len()).is_some_and(|end| end <= self.len());
        if !fits {
            return Err(AttnError::invalid("src", format!("{} elements at offset {offset} leave a buffer of {}", src.len(), self.len())));
        }
        let mut dst = SharedWrite { buf: &self.buf, offset, len: src.len() };
        Ok(stream.memcpy_dtod(src, &mut dst)?)
    }

    /// Elements `range` of this buffer, as a checked element range.
    fn range(&self, arg: &'static str, range: impl RangeBounds<usize>) -> Result<Range<usize>> {
        element_range(arg, self.len(), range)
    }
}

/// `range` as elements of a buffer of `len`, refused (naming `arg`) unless it lies within it.
fn element_range(arg: &'static str, len: usize, range: impl RangeBounds<usize>) -> Result<Range<usize>> {
    let start = match range.start_bound() {
        Bound::Included(&s) => Some(s),
        Bound::Excluded(&s) => s.checked_add(1),
        Bound::Unbounded => Some(0),
    };
    let end = match range.end_bound() {
        Bound::Included(&e) => e.checked_add(1),
        Bound::Excluded(&e) => Some(e),
        Bound::Unbounded => Some(len),
    };
    match (start, end) {
        (Some(s), Some(e)) if s <= e && e <= len => Ok(s..e),
        _ => Err(AttnError::invalid(
            arg,
            format!("range ({:?}, {:?}) is not within a buffer of {len} elements", range.start_bound(), range.end_bound()),
        )),
    }
}

impl<T> DeviceSlice<T> for SharedBuf<T> {
    fn len(&self) -> usize {
        self.buf.len()
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.buf.stream()
    }
}

impl<T> DevicePtr<T> for SharedBuf<T> {
    fn device_ptr<'a>(&'a self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        self.buf.device_ptr(stream)
    }
}

/// Elements `offset..offset + len` of a shared buffer as the destination of a cudarc copy: a
/// write through a shared handle, ordered by the stream (see [`SharedBuf`]).
struct SharedWrite<'a, T> {
    buf: &'a CudaSlice<T>,
    offset: usize,
    len: usize,
}

impl<T> DeviceSlice<T> for SharedWrite<'_, T> {
    fn len(&self) -> usize {
        self.len
    }
    fn stream(&self) -> &Arc<CudaStream> {
        self.buf.stream()
    }
}

impl<T> DevicePtrMut<T> for SharedWrite<'_, T> {
    fn device_ptr_mut<'a>(&'a mut self, stream: &'a CudaStream) -> (u64, SyncOnDrop<'a>) {
        let (ptr, order) = self.buf.device_ptr(stream);
        (ptr + (self.offset * std::mem::size_of::<T>()) as u64, order)
    }
}

impl<'a> DevIn<'a> {
    /// Borrows `buf` for reading on `stream` (cudarc makes `stream` wait for pending writers).
    pub fn new<T: Element>(buf: &'a impl DevicePtr<T>, stream: &'a CudaStream) -> Self {
        let len = buf.len();
        let (ptr, order) = buf.device_ptr(stream);
        DevIn { ptr, len, dtype: T::DTYPE, _order: order, keep: None }
    }

    /// All of `buf` for reading on `stream`, holding a handle to it: what a call captured into
    /// a CUDA graph takes (the graph keeps the handle).
    pub fn shared<T: Element>(buf: &'a SharedBuf<T>, stream: &'a CudaStream) -> Self {
        let (ptr, order) = buf.device_ptr(stream);
        DevIn { ptr, len: buf.len(), dtype: T::DTYPE, _order: order, keep: Some(buf.keep_alive()) }
    }

    /// Elements `range` of `buf` (e.g. one tensor of a fused QKV buffer), as [`shared`](Self::shared).
    ///
    /// Errors: `InvalidArgument` (`range`) when the range leaves the buffer.
    pub fn shared_range<T: Element>(buf: &'a SharedBuf<T>, range: impl RangeBounds<usize>, stream: &'a CudaStream) -> Result<Self> {
        let r = buf.range("range", range)?;
        let (ptr, order) = buf.device_ptr(stream);
        let ptr = ptr + (r.start * std::mem::size_of::<T>()) as u64;
        Ok(DevIn { ptr, len: r.len(), dtype: T::DTYPE, _order: order, keep: Some(buf.keep_alive()) })
    }

    /// The handle keeping this memory alive (a [`SharedBuf`]'s), if any.
    pub(crate) fn keep_alive(&self) -> Option<&KeepAlive> {
        self.keep.as_ref()
    }

    /// Elements in the view (of [`dtype`](Self::dtype)).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type, from the slice's Rust type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// `len` elements of `dtype` from `byte_offset` of this buffer, borrowed from it (its
    /// stream-ordering guard covers the view). Panics if the view leaves the buffer.
    pub(crate) fn view(&self, byte_offset: usize, len: usize, dtype: DType) -> DevIn<'_> {
        let end = byte_offset + len * dtype.size_bytes();
        assert!(end <= self.len * self.dtype.size_bytes(), "view of {end} bytes past a buffer of {} x {:?}", self.len, self.dtype);
        DevIn { ptr: self.ptr + byte_offset as u64, len, dtype, _order: SyncOnDrop::Sync(None), keep: None }
    }

    /// `len` elements of `dtype` at `ptr`: memory the library owns and keeps alive past the
    /// launches that read it (workspaces).
    pub(crate) fn owned(ptr: u64, len: usize, dtype: DType) -> DevIn<'static> {
        DevIn { ptr, len, dtype, _order: SyncOnDrop::Sync(None), keep: None }
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
        DevOut { ptr, len, dtype: T::DTYPE, _order: order, keep: None }
    }

    /// All of `buf` for writing on `stream`, holding a handle to it: what a call captured into
    /// a CUDA graph takes (the graph keeps the handle). The write is ordered by `stream` (see
    /// [`SharedBuf`]).
    pub fn shared<T: Element>(buf: &'a SharedBuf<T>, stream: &'a CudaStream) -> Self {
        let (ptr, order) = buf.device_ptr(stream);
        DevOut { ptr, len: buf.len(), dtype: T::DTYPE, _order: order, keep: Some(buf.keep_alive()) }
    }

    /// Elements `range` of `buf`, as [`shared`](Self::shared).
    ///
    /// Errors: `InvalidArgument` (`range`) when the range leaves the buffer.
    pub fn shared_range<T: Element>(buf: &'a SharedBuf<T>, range: impl RangeBounds<usize>, stream: &'a CudaStream) -> Result<Self> {
        let r = buf.range("range", range)?;
        let (ptr, order) = buf.device_ptr(stream);
        let ptr = ptr + (r.start * std::mem::size_of::<T>()) as u64;
        Ok(DevOut { ptr, len: r.len(), dtype: T::DTYPE, _order: order, keep: Some(buf.keep_alive()) })
    }

    /// The handle keeping this memory alive (a [`SharedBuf`]'s), if any.
    pub(crate) fn keep_alive(&self) -> Option<&KeepAlive> {
        self.keep.as_ref()
    }

    /// Elements in the view (of [`dtype`](Self::dtype)).
    pub fn len(&self) -> usize {
        self.len
    }
    /// Whether the view holds no elements.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    /// The element type, from the slice's Rust type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }
}

impl DevOut<'_> {
    /// `len` elements of `dtype` at `ptr`: memory the library owns and keeps alive past the
    /// launches that write it (workspaces).
    pub(crate) fn owned(ptr: u64, len: usize, dtype: DType) -> DevOut<'static> {
        DevOut { ptr, len, dtype, _order: SyncOnDrop::Sync(None), keep: None }
    }

    /// Elements `offset..` of this buffer, written through a borrow of it.
    pub(crate) fn tail_mut(&mut self, offset: usize) -> DevOut<'_> {
        let offset = offset.min(self.len);
        let ptr = self.ptr + (offset * self.dtype.size_bytes()) as u64;
        DevOut { ptr, len: self.len - offset, dtype: self.dtype, _order: SyncOnDrop::Sync(None), keep: None }
    }

    /// The same memory for reading (after a write on the same stream), borrowed from this.
    pub(crate) fn as_input(&self) -> DevIn<'_> {
        DevIn { ptr: self.ptr, len: self.len, dtype: self.dtype, _order: SyncOnDrop::Sync(None), keep: None }
    }
}

/// The address of `len` f32 values in `b` (refused, naming `arg`, if it holds fewer or another
/// dtype).
pub(crate) fn f32_values(b: &DevIn<'_>, arg: &'static str, len: usize) -> Result<u64> {
    ensure(b.dtype == DType::F32 && b.len >= len, arg, || format!("must be {len} f32 values, got {} x {:?}", b.len, b.dtype))?;
    Ok(b.ptr)
}

/// [`f32_values`] of an optional buffer; 0 for none.
pub(crate) fn optional_f32(buf: &Option<DevIn<'_>>, arg: &'static str, len: usize) -> Result<u64> {
    buf.as_ref().map_or(Ok(0), |b| f32_values(b, arg, len))
}

#[cfg(test)]
mod tests {
    use super::element_range;

    #[test]
    fn element_ranges() {
        assert_eq!(element_range("r", 10, ..).unwrap(), 0..10);
        assert_eq!(element_range("r", 10, 3..).unwrap(), 3..10);
        assert_eq!(element_range("r", 10, 3..=9).unwrap(), 3..10);
        assert_eq!(element_range("r", 10, 10..).unwrap(), 10..10);
        for bad in [element_range("r", 10, ..11), element_range("r", 10, 11..), element_range("r", 10, 0..=usize::MAX)] {
            assert!(matches!(bad, Err(crate::AttnError::InvalidArgument { arg: "r", .. })));
        }
        #[allow(clippy::reversed_empty_ranges)]
        let reversed = element_range("r", 10, 5..4);
        assert!(reversed.is_err());
    }
}
