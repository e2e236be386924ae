//! [`upload`]: a packed step to the GPU with one copy from pinned host memory.

use crate::error::{ensure, Result};
use cudarc::driver::{CudaSlice, CudaStream, HostSlice, PinnedHostSlice, SyncOnDrop};
use std::sync::Arc;

/// Copies `words` into the pinned `staging` buffer (waiting first for the previous upload
/// from it to finish reading) and enqueues one host-to-device copy of those words into the
/// front of `device` on `stream`. Allocate both once for the largest step
/// (`CudaContext::alloc_pinned`, `CudaStream::alloc_zeros`); refuses (`staging`, `device`) a
/// buffer smaller than `words`. Nothing synchronises the stream.
pub fn upload(stream: &Arc<CudaStream>, staging: &mut PinnedHostSlice<u32>, device: &mut CudaSlice<u32>, words: &[u32]) -> Result<()> {
    let n = words.len();
    ensure(staging.len() >= n, "staging", || format!("pinned buffer of {} words is smaller than the step's {n}", staging.len()))?;
    ensure(device.len() >= n, "device", || format!("buffer of {} words is smaller than the step's {n}", device.len()))?;
    if n == 0 {
        return Ok(());
    }
    // `as_mut_slice` waits on the buffer's event (recorded after the last copy out of it).
    staging.as_mut_slice()?[..n].copy_from_slice(words);
    stream.memcpy_htod(&PinnedPrefix { pinned: staging, len: n }, device)?;
    Ok(())
}

/// The first `len` elements of a pinned buffer, so a copy moves only those and still records
/// the buffer's event (cudarc copies a whole `PinnedHostSlice`).
struct PinnedPrefix<'p> {
    pinned: &'p PinnedHostSlice<u32>,
    len: usize,
}

impl HostSlice<u32> for PinnedPrefix<'_> {
    fn len(&self) -> usize {
        self.len
    }

    unsafe fn stream_synced_slice<'a>(&'a self, stream: &'a CudaStream) -> (&'a [u32], SyncOnDrop<'a>) {
        let (all, record) = self.pinned.stream_synced_slice(stream);
        (&all[..self.len], record)
    }

    unsafe fn stream_synced_mut_slice<'a>(&'a mut self, _stream: &'a CudaStream) -> (&'a mut [u32], SyncOnDrop<'a>) {
        unreachable!("a host-to-device copy only reads its source")
    }
}
