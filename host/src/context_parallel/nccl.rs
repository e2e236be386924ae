//! The exchange of the ranks' parts through NCCL (feature `nccl`, [`NcclExchange`]): one
//! all-gather a layer on the rank's stream.

use super::exchange::CpExchange;
use super::shard::CpShard;
use crate::error::{ensure, AttnError, Result};
use cudarc::driver::{CudaStream, CudaView, CudaViewMut};
use cudarc::nccl::safe::{Comm, Id};
use std::sync::Arc;

/// Checks that the NCCL library loads under one of the names cudarc looks for, so that a
/// missing library is an error rather than cudarc's panic at the first call. NCCL's wheels
/// ship `libnccl.so.2` only: a directory with a link `libnccl.so` to it, on `LD_LIBRARY_PATH`,
/// makes it found.
pub fn nccl_available() -> Result<()> {
    let names = cudarc::get_lib_name_candidates("nccl");
    // SAFETY: loading NCCL runs its initialisers, which have no preconditions.
    if names.iter().any(|n| unsafe { libloading::Library::new(n) }.is_ok()) {
        return Ok(());
    }
    Err(AttnError::Nccl(format!(
        "the NCCL library is not found under any of {names:?}: put a directory with `libnccl.so` (a link to libnccl.so.2) on LD_LIBRARY_PATH"
    )))
}

/// This rank's communicator for `shard`'s group, on `stream` (the stream its decode runs on):
/// every rank calls it with the same `id` (made once with `Id::new` and handed to the others),
/// each from its own thread or process; it returns when all have joined.
///
/// Errors: the library missing ([`nccl_available`]), or NCCL's own.
pub fn new_comm(stream: &Arc<CudaStream>, shard: CpShard, id: Id) -> Result<Comm> {
    shard.validate()?;
    nccl_available()?;
    Comm::from_rank(stream.clone(), shard.rank, shard.world_size, id).map_err(|e| AttnError::Nccl(format!("{e:?}")))
}

/// A communicator as a [`CpExchange`]: its all-gather on its own stream.
pub struct NcclExchange(pub Comm);

// SAFETY: an NCCL communicator may be used from any thread, one at a time (NCCL forbids
// concurrent calls on one communicator, not moving it); `&mut self` gives one at a time.
unsafe impl Send for NcclExchange {}

impl CpExchange for NcclExchange {
    fn rank(&self) -> usize {
        self.0.rank()
    }

    fn world_size(&self) -> usize {
        self.0.world_size()
    }

    fn all_gather(&mut self, stream: &Arc<CudaStream>, send: &CudaView<'_, u8>, recv: &mut CudaViewMut<'_, u8>) -> Result<()> {
        ensure(stream.cu_stream() == self.0.stream().cu_stream(), "stream", || "differs from the communicator's stream".into())?;
        ensure(recv.len() >= send.len() * self.0.world_size(), "recv", || {
            format!("{} bytes for {} parts of {}", recv.len(), self.0.world_size(), send.len())
        })?;
        self.0.all_gather(send, recv).map(|_| ()).map_err(|e| AttnError::Nccl(format!("all-gather of {} bytes: {e:?}", send.len())))
    }
}
