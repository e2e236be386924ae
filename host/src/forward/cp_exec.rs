//! A context-parallel rank's decode inside `forward`: the rank's decode into its part, the
//! exchange, the merge into the layer's output (`crate::context_parallel` has the pieces).

use crate::buffer::DevOut;
use crate::context_parallel::{CpDecode, CpExchange, CpShard};
use crate::error::{AttnError, Result};
use crate::layout::RowsDesc;
use cudarc::driver::CudaStream;
use std::sync::Arc;

/// A rank of a group of two or more: its parts (made at the first layer, remade for larger
/// rows) and the exchange the engine gave.
pub(super) struct CpRank {
    shard: CpShard,
    part: Option<CpDecode>,
    exchange: Option<Box<dyn CpExchange>>,
}

impl CpRank {
    /// A rank of `shard`'s group; `None` for a group of one (nothing to exchange).
    pub(super) fn new(shard: Option<CpShard>) -> Option<Self> {
        shard.filter(|s| s.world_size > 1).map(|shard| CpRank { shard, part: None, exchange: None })
    }

    pub(super) fn set_exchange(&mut self, exchange: Box<dyn CpExchange>) {
        self.exchange = Some(exchange);
    }

    /// Whether this rank's softmax takes the attention sinks: rank 0's alone, so that the
    /// merge counts them once.
    pub(super) fn takes_sinks(&self) -> bool {
        self.shard.rank == 0
    }

    /// A layer's decode part as the group's: `attend` (the rank's decode or MLA attention over
    /// its share) writes this rank's part, laid out as `out_rows`, and its LSEs; then the
    /// exchange, and the merge of every rank's part into `out`.
    pub(super) fn decode(
        &mut self,
        dev: &crate::device::AttnDevice,
        stream: &Arc<CudaStream>,
        (out, out_rows): (DevOut<'_>, RowsDesc),
        attend: impl FnOnce(DevOut<'static>, DevOut<'static>) -> Result<()>,
    ) -> Result<()> {
        let ex = self
            .exchange
            .as_deref_mut()
            .ok_or_else(|| AttnError::invalid("exchange", "a context-parallel rank needs Attention::set_cp_exchange before forward"))?;
        let dtype = out.dtype();
        let fits = |p: &CpDecode| p.dtype() == dtype && p.layout(&out_rows).is_ok();
        if !self.part.as_ref().is_some_and(fits) {
            let lse = out_rows.num_tokens.saturating_mul(out_rows.num_heads);
            self.part = Some(CpDecode::new(stream, self.shard, dtype, out_rows.required_len(), lse)?);
        }
        let part = self.part.as_mut().expect("made above");
        part.attend_exchange_merge(dev, stream, (out, out_rows, None), ex, attend)
    }
}
