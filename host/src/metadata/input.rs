//! [`StepInput`]: the per-step metadata the engine fills in host memory.

use crate::layout::KvCacheSpec;

/// One step's batch as the engine's scheduler left it, in host memory (vLLM's
/// `CommonAttentionMetadata`, CPU side). Nothing here is trusted: [`validate`](super::validate)
/// checks it, naming the field it refuses.
#[derive(Clone, Copy, Debug)]
pub struct StepInput<'a> {
    /// `[num_reqs + 1]`: request `r`'s query tokens are `query_start_loc[r]..query_start_loc[r + 1]`.
    pub query_start_loc: &'a [i32],
    /// `[num_reqs]`: context lengths, this step's new tokens included. `num_reqs` is its length.
    pub seq_lens: &'a [i32],
    /// `[>= num_reqs, block_table_stride]`: physical block ids of each request's context.
    pub block_table: &'a [i32],
    /// Entries per row of `block_table`.
    pub block_table_stride: usize,
    /// `[>= num_actual_tokens]`: the cache slot of each new token (`block * block_size + offset`);
    /// -1 is padding (written nowhere). Entries past `num_actual_tokens` are ignored.
    pub slot_mapping: &'a [i64],
    /// Tokens of the step without padding.
    pub num_actual_tokens: usize,
    /// Blocks in the KV cache (block ids must be below it).
    pub num_blocks: usize,
    /// Tokens per cache block.
    pub block_size: usize,
}

impl<'a> StepInput<'a> {
    /// A step over the cache `spec` (its `num_blocks` and `block_size`).
    pub fn new(
        query_start_loc: &'a [i32],
        seq_lens: &'a [i32],
        block_table: &'a [i32],
        block_table_stride: usize,
        slot_mapping: &'a [i64],
        num_actual_tokens: usize,
        spec: &KvCacheSpec,
    ) -> Self {
        StepInput {
            query_start_loc,
            seq_lens,
            block_table,
            block_table_stride,
            slot_mapping,
            num_actual_tokens,
            num_blocks: spec.num_blocks,
            block_size: spec.block_size,
        }
    }

    /// Requests of the step (`seq_lens.len()`).
    pub fn num_reqs(&self) -> usize {
        self.seq_lens.len()
    }

    /// Query tokens of request `r` (negative if `query_start_loc` decreases there).
    pub fn query_len(&self, r: usize) -> i64 {
        self.query_start_loc[r + 1] as i64 - self.query_start_loc[r] as i64
    }

    /// Block-table entries request `r` uses: `ceil(seq_len / block_size)`.
    pub fn blocks_needed(&self, r: usize) -> usize {
        blocks_for(self.seq_lens[r], self.block_size)
    }

    /// Slots in the cache (`num_blocks * block_size`).
    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }
}

/// `ceil(len / block_size)` for a length that may be negative (then 0).
pub(crate) fn blocks_for(len: i32, block_size: usize) -> usize {
    (len.max(0) as usize).div_ceil(block_size.max(1))
}
