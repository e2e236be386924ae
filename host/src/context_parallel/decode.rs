//! [`CpDecode::decode`] and [`CpDecode::decode_mla`]: a rank's decode of one layer (its
//! decode over its share, the exchange, the merge), and what context-parallel decode takes of
//! a step.

use super::exchange::CpExchange;
use super::partials::CpDecode;
use crate::batch::BatchMetadata;
use crate::buffer::DevOut;
use crate::decode::{paged_decode, DecodeArgs, DecodeWorkspace};
use crate::device::AttnDevice;
use crate::error::{ensure, AttnError, Result};
use crate::layout::RowsDesc;
use crate::mla::{mla_attention, MlaArgs};
use crate::options::{AttnOptions, PlanOptions};
use crate::status::DeviceStatus;
use cudarc::driver::CudaStream;
use std::sync::Arc;

impl CpDecode {
    /// A rank's decode step: [`paged_decode`](crate::decode::paged_decode) of `args` over this
    /// rank's share (the metadata's `seq_lens` are the local lengths,
    /// [`CpShard::shard_step`]), into this rank's part instead of `args.out`; the exchange
    /// through `ex` (`NcclExchange` across GPUs, feature `nccl`); the merge of every rank's part
    /// into `args.out` (and `args.lse`). The
    /// attention sinks join rank 0's softmax only, so the merged one counts them once.
    ///
    /// Context-parallel decode takes one query token a request, and no sliding window or
    /// ALiBi (they need each key's position in the whole context, which a rank's share does
    /// not keep).
    ///
    /// Errors: those of `paged_decode`, [`exchange_with`](Self::exchange_with) and
    /// [`merge`](Self::merge), and a batch or options outside what is above.
    #[allow(clippy::too_many_arguments)]
    pub fn decode(
        &mut self,
        dev: &AttnDevice,
        stream: &Arc<CudaStream>,
        args: DecodeArgs<'_>,
        local: &BatchMetadata,
        opts: &AttnOptions,
        plan: impl Into<PlanOptions>,
        ws: &mut DecodeWorkspace,
        status: &mut DeviceStatus,
        ex: &mut dyn CpExchange,
    ) -> Result<()> {
        check_decode(local, opts, args.alibi_slopes.is_some())?;
        let (out, out_rows, lse) = (args.out, args.out_rows, args.lse);
        let sinks = if self.shard.rank == 0 { args.sinks } else { None };
        self.attend_exchange_merge(dev, stream, (out, out_rows, lse), ex, |part_out, part_lse| {
            let mine = DecodeArgs { out: part_out, lse: Some(part_lse), sinks, ..args };
            paged_decode(dev, stream, mine, local, opts, plan, ws, status).map(|_| ())
        })
    }

    /// [`decode`](Self::decode) for MLA: a rank's [`mla_attention`] over its share of the
    /// latent cache (one query token a request), the exchange, the merge into `args.out` (and
    /// `args.lse`). DeepSeek's models are the ones vLLM's decode context parallelism is for:
    /// their one latent head cannot be split across GPUs by heads.
    ///
    /// Errors: those of `mla_attention`, [`exchange_with`](Self::exchange_with) and
    /// [`merge`](Self::merge), and a request of more than one query token.
    #[allow(clippy::too_many_arguments)]
    pub fn decode_mla(
        &mut self,
        dev: &AttnDevice,
        stream: &Arc<CudaStream>,
        args: MlaArgs<'_>,
        local: &BatchMetadata,
        softmax_scale: f32,
        plan: impl Into<PlanOptions>,
        ws: &mut DecodeWorkspace,
        status: &mut DeviceStatus,
        ex: &mut dyn CpExchange,
    ) -> Result<()> {
        check_decode(local, &AttnOptions::new(args.q_rows.head_size), false)?;
        let (out, out_rows, lse) = (args.out, args.out_rows, args.lse);
        self.attend_exchange_merge(dev, stream, (out, out_rows, lse), ex, |part_out, part_lse| {
            let mine = MlaArgs { out: part_out, lse: Some(part_lse), ..args };
            mla_attention(dev, stream, mine, local, softmax_scale, plan, ws, status).map(|_| ())
        })
    }

    /// The three steps of a rank's layer: `attend` writes this rank's part (the output rows of
    /// `out`'s layout, their LSEs), the exchange, the merge into `out`.
    pub(crate) fn attend_exchange_merge(
        &mut self,
        dev: &AttnDevice,
        stream: &Arc<CudaStream>,
        (out, out_rows, lse): (DevOut<'_>, RowsDesc, Option<DevOut<'_>>),
        ex: &mut dyn CpExchange,
        attend: impl FnOnce(DevOut<'static>, DevOut<'static>) -> Result<()>,
    ) -> Result<()> {
        self.check_stream(stream)?;
        let p = self.layout(&out_rows)?;
        let (part_out, part_lse) = self.partial_views(&p);
        attend(part_out, part_lse)?;
        self.exchange_with(ex, &out_rows)?;
        self.merge(dev, stream, out, &out_rows, lse)
    }
}

/// What context-parallel decode takes of a step and its options.
pub(crate) fn check_decode(local: &BatchMetadata, opts: &AttnOptions, alibi: bool) -> Result<()> {
    let qsl = local.query_start_loc();
    if let Some(r) = qsl.windows(2).position(|w| w[1] - w[0] != 1) {
        return Err(AttnError::invalid(
            "query_start_loc",
            format!(
                "request {r} has {} query tokens: context-parallel decode takes one (speculative tokens: a request a token, \
                 ShardedStep::token_seq_lens)",
                qsl[r + 1] - qsl[r]
            ),
        ));
    }
    ensure(opts.window.is_none() && !alibi, "opts", || {
        "a sliding window or ALiBi: they need each key's position in the whole context, which a rank's share does not keep".into()
    })
}
