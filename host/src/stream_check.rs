//! Memory the library owns (workspaces, plans, batch metadata) belongs to one stream: every
//! launch that uses it must be enqueued there. Stream order is then what keeps a launch from
//! overwriting what an earlier one still reads; the library takes these buffers' device
//! addresses without cudarc's per-use events, which would not cover a kernel on another stream.

use crate::error::{ensure, Result};
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// Refuses `used` unless it is the stream `arg` belongs to.
pub(crate) fn check_stream(arg: &'static str, owner: &Arc<CudaStream>, used: &Arc<CudaStream>) -> Result<()> {
    ensure(Arc::ptr_eq(owner, used) || owner.cu_stream() == used.cu_stream(), arg, || {
        format!("belongs to stream {:?}; the call runs on {:?} (use one per stream)", owner.cu_stream(), used.cu_stream())
    })
}
