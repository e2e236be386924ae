//! A context-parallel rank's decode inside `forward`: the rank's decode into its part, the
//! exchange, the merge into the layer's output (`crate::context_parallel` has the pieces).

use crate::batch::{DecodeBatch, DeviceBatch};
use crate::context_parallel::{CpDecode, CpExchange, CpShard};
use crate::decode::{paged_decode_from, DecodeArgs, DecodeWorkspace, PlanSource};
use crate::device::AttnDevice;
use crate::error::{AttnError, Result};
use crate::layout::RowsDesc;
use crate::options::AttnOptions;
use crate::status::DeviceStatus;
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

    /// The decode part of a layer (`args`, planned by `source`) as the group's: this rank's
    /// decode into its part (the sinks on rank 0 only, so that the merge counts them once),
    /// the exchange, the merge of every rank's part into `args.out`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn decode(
        &mut self,
        dev: &AttnDevice,
        stream: &Arc<CudaStream>,
        args: DecodeArgs<'_>,
        batch: &DecodeBatch<'_>,
        meta: DeviceBatch<'_>,
        opts: &AttnOptions,
        source: PlanSource,
        ws: &mut DecodeWorkspace,
        status: &mut DeviceStatus,
    ) -> Result<()> {
        let ex = self
            .exchange
            .as_deref_mut()
            .ok_or_else(|| AttnError::invalid("exchange", "a context-parallel rank needs Attention::set_cp_exchange before forward"))?;
        let rows: RowsDesc = args.out_rows;
        let dtype = args.out.dtype();
        let fits = |p: &CpDecode| p.dtype() == dtype && p.layout(&rows).is_ok();
        if !self.part.as_ref().is_some_and(fits) {
            let lse = rows.num_tokens.saturating_mul(rows.num_heads);
            self.part = Some(CpDecode::new(stream, self.shard, dtype, rows.required_len(), lse)?);
        }
        let part = self.part.as_mut().expect("made above");
        let (out, lse) = (args.out, args.lse);
        let sinks = if self.shard.rank == 0 { args.sinks } else { None };
        part.attend_exchange_merge(dev, stream, (out, rows, lse), ex, |part_out, part_lse| {
            let mine = DecodeArgs { out: part_out, lse: Some(part_lse), sinks, ..args };
            paged_decode_from(dev, stream, mine, batch, meta, opts, source, true, ws, status).map(|_| ())
        })
    }
}
