//! The cache buffer each layer was last given, so that a layer that reads another layer's cache
//! ([`LayerSpec::kv_sharing_target`](super::LayerSpec::kv_sharing_target)) is checked to read
//! that very buffer, not another of the same size.

use crate::error::{AttnError, Result};

/// The address of the cache each layer that writes one was given last.
#[derive(Default)]
pub(crate) struct CacheOwners {
    addrs: Vec<Option<u64>>,
}

impl CacheOwners {
    /// Layer `layer` writes the cache at `addr`.
    pub(crate) fn record(&mut self, layer: usize, addr: u64) {
        if self.addrs.len() <= layer {
            self.addrs.resize(layer + 1, None);
        }
        self.addrs[layer] = Some(addr);
    }

    /// Cross-attention layer `layer`, which reads its own cache, was given the buffer at
    /// `addr`.
    ///
    /// Errors (`cache`): nothing was written to its cache yet, or into another buffer.
    pub(crate) fn check_own(&self, layer: usize, addr: u64) -> Result<()> {
        match self.addrs.get(layer).copied().flatten() {
            None => Err(AttnError::invalid(
                "cache",
                format!("layer {layer} reads its own cache, which write_kv has not filled yet (write the encoder's K/V first)"),
            )),
            Some(owned) if owned != addr => Err(AttnError::invalid(
                "cache",
                format!("layer {layer}'s cache was written at {owned:#x}, but it was given the buffer at {addr:#x}"),
            )),
            Some(_) => Ok(()),
        }
    }

    /// Layer `layer`, which reads layer `target`'s cache, was given the buffer at `addr`.
    ///
    /// Errors (`cache`): the target has not run yet, or was given another buffer.
    pub(crate) fn check(&self, layer: usize, target: usize, addr: u64) -> Result<()> {
        match self.addrs.get(target).copied().flatten() {
            None => Err(AttnError::invalid(
                "cache",
                format!("layer {layer} reads layer {target}'s cache, but layer {target} has not run (run the layers in order)"),
            )),
            Some(owned) if owned != addr => Err(AttnError::invalid(
                "cache",
                format!("layer {layer} reads layer {target}'s cache at {owned:#x}, but was given the buffer at {addr:#x}"),
            )),
            Some(_) => Ok(()),
        }
    }
}
