//! Decode context parallelism (vLLM's DCP): a request's KV cache dealt across the ranks of a
//! group, each rank attending over its share, the partial results exchanged and merged by
//! their LSEs on every rank. Queries are replicated: every rank decodes the same queries, over
//! a different part of each context.
//!
//! Use, on each rank (one GPU, one thread or process each):
//!
//! 1. Once: a [`CpShard`] (rank, group size, interleave), a [`CpDecode`] for the largest step,
//!    and (feature `nccl`) the group's communicator, [`new_comm`].
//! 2. Every step: [`CpShard::shard_step`] of the step's metadata gives the rank's slot mapping
//!    (the cache write of the tokens it holds; the others' slots are -1, skipped) and its local
//!    context lengths, the decode's `seq_lens`. The block table is the step's own: an entry
//!    covers `block_size * world_size` positions of the request, the same block id on every
//!    rank.
//! 3. Every layer: the cache write with the rank's slot mapping, then [`CpDecode::decode`]
//!    (the rank's decode, the all-gather, the merge), or [`CpDecode::decode_mla`] for MLA's
//!    latent cache (DeepSeek's models, whose one latent head cannot be split by heads).
//!
//! Speculative tokens (several new tokens a request) are decoded as a request a token over the
//! keys each may see ([`ShardedStep::token_seq_lens`], [`ShardedStep::expand_block_table`]);
//! `forward` does it by itself.
//!
//! Without NCCL (ranks on one device, as the tests run them), the steps of `decode` are
//! public: [`CpDecode::partial_out`] is where a rank's
//! [`paged_decode`](crate::decode::paged_decode) writes, [`CpDecode::exchange_on_one_device`]
//! moves the parts, [`CpDecode::merge`] merges them.
//!
//! Source layout: `shard` (who holds which position, a rank's view of a step), `partials`
//! (the parts, the one-device exchange, the merge), `nccl` (the all-gather and the whole step).

mod decode;
mod exchange;
#[cfg(feature = "nccl")]
mod nccl;
mod partials;
mod shard;

pub use exchange::{CpExchange, LocalGroup};
#[cfg(feature = "nccl")]
pub use nccl::{nccl_available, new_comm, NcclExchange};
pub use partials::CpDecode;
pub use shard::{CpShard, ShardedStep};
