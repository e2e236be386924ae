//! The device status word: kernels that meet input they refuse to act on (a slot past the
//! cache, a block id outside it) skip that work and raise a bit here instead of writing or
//! reading out of bounds. Reading it synchronises the stream, so the caller chooses when.

use crate::error::{AttnError, Result};
use attn_math::status::{BLOCK_OUT_OF_RANGE, SLOT_OUT_OF_RANGE};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// One device u32 that kernels OR error bits into. Allocate once; pass to every op.
pub struct DeviceStatus {
    pub(crate) word: CudaSlice<u32>,
}

/// The bits raised since the last read.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusFlags(pub u32);

impl StatusFlags {
    pub fn slot_out_of_range(self) -> bool {
        self.0 & SLOT_OUT_OF_RANGE != 0
    }
    pub fn block_out_of_range(self) -> bool {
        self.0 & BLOCK_OUT_OF_RANGE != 0
    }
    /// `Ok` when nothing was raised, else the first error.
    pub fn into_result(self) -> Result<()> {
        if self.slot_out_of_range() {
            Err(AttnError::SlotOutOfRange)
        } else if self.block_out_of_range() {
            Err(AttnError::BlockOutOfRange)
        } else {
            Ok(())
        }
    }
}

impl DeviceStatus {
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(DeviceStatus { word: stream.alloc_zeros::<u32>(1)? })
    }

    /// Waits for `stream`, returns the raised bits and clears them.
    pub fn take(&mut self, stream: &Arc<CudaStream>) -> Result<StatusFlags> {
        let mut host = [0u32];
        stream.memcpy_dtoh(&self.word, &mut host)?;
        stream.synchronize()?;
        if host[0] != 0 {
            stream.memset_zeros(&mut self.word)?;
        }
        Ok(StatusFlags(host[0]))
    }

    /// [`take`](Self::take), as a `Result`.
    pub fn check(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.take(stream)?.into_result()
    }
}
