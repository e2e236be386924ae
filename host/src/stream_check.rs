//! Memory the library owns (workspaces, plans, batch metadata) belongs to one stream: every
//! launch that uses it must be enqueued there. Stream order is then what keeps a launch from
//! overwriting what an earlier one still reads; the library takes these buffers' device
//! addresses without cudarc's per-use events, which would not cover a kernel on another stream.
//!
//! And a stream being captured into a CUDA graph ([`crate::forward`]'s captures) takes only the
//! capturing `Attention`'s work: [`refuse_foreign_capture`].

use crate::error::{ensure, Result};
use cudarc::driver::sys::CUstreamCaptureStatus;
use cudarc::driver::CudaStream;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// Refuses `used` unless it is the stream `arg` belongs to.
pub(crate) fn check_stream(arg: &'static str, owner: &Arc<CudaStream>, used: &Arc<CudaStream>) -> Result<()> {
    ensure(Arc::ptr_eq(owner, used) || owner.cu_stream() == used.cu_stream(), arg, || {
        format!("belongs to stream {:?}; the call runs on {:?} (use one per stream)", owner.cu_stream(), used.cu_stream())
    })
}

/// Captures in progress ([`Attention::capture`](crate::forward::Attention::capture)) in this process.
/// While there are none, the library's calls need not ask the driver whether their stream is
/// being captured.
static CAPTURES: AtomicUsize = AtomicUsize::new(0);

/// Counts one capture in progress while alive.
pub(crate) struct CaptureInProgress(());

impl CaptureInProgress {
    pub(crate) fn begin() -> Self {
        CAPTURES.fetch_add(1, Ordering::SeqCst);
        CaptureInProgress(())
    }
}

impl Drop for CaptureInProgress {
    fn drop(&mut self) {
        CAPTURES.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Refuses (naming `arg`) work for `stream` while it is being captured by a capture that would
/// not hold that work's memory: another `Attention`'s, on a shared stream. One atomic load when
/// no capture is in progress.
pub(crate) fn refuse_foreign_capture(stream: &CudaStream, arg: &'static str, what: &str) -> Result<()> {
    if CAPTURES.load(Ordering::SeqCst) == 0 {
        return Ok(());
    }
    let status = stream.capture_status()?;
    ensure(status == CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE, arg, || {
        format!(
            "{what} cannot run while its stream is being captured into a graph that would not keep its memory \
             alive (record only the capturing Attention's forward calls, with its graph step)"
        )
    })
}
