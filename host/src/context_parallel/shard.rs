//! Which rank holds which token of a request's context, and a rank's view of one step: its
//! slots (the tokens it writes) and its requests' local lengths (the keys it attends over).
//!
//! The layout is vLLM's decode context parallelism: the tokens of a request are dealt to the
//! `world_size` ranks in groups of `interleave` consecutive positions (group `g = pos /
//! interleave` goes to rank `g % world_size`), and every rank keeps its share contiguous in its
//! own cache, in the blocks the request's one block table names. A table entry so covers
//! `block_size * world_size` positions of the request (a "virtual" block): the same block id on
//! every rank, each holding that rank's `block_size` of them. A rank's share of a request is then
//! an ordinary paged context of [`local_len`](CpShard::local_len) keys over the same table, which
//! the decode kernels read unchanged.

use crate::error::{ensure, AttnError, Result};

/// One rank's place in a context-parallel group.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CpShard {
    /// Ranks in the group (1: no sharding).
    pub world_size: usize,
    /// This rank, `0..world_size`.
    pub rank: usize,
    /// Consecutive positions a rank takes before the next rank's turn (vLLM's
    /// `cp_kv_cache_interleave_size`; 1 deals the tokens one by one).
    pub interleave: usize,
}

impl CpShard {
    /// Rank `rank` of `world_size`, dealt in groups of `interleave` positions.
    ///
    /// Errors: a zero `world_size` or `interleave`, or `rank` not below `world_size`.
    pub fn new(world_size: usize, rank: usize, interleave: usize) -> Result<Self> {
        let s = CpShard { world_size, rank, interleave };
        s.validate()?;
        Ok(s)
    }

    /// Checks the fields (they are public), naming the one refused.
    pub fn validate(&self) -> Result<()> {
        ensure(self.world_size >= 1, "world_size", || "0: a group has at least one rank".into())?;
        ensure(self.rank < self.world_size, "rank", || format!("{} is not below world_size {}", self.rank, self.world_size))?;
        ensure(self.interleave >= 1, "interleave", || "0: ranks take at least one position at a time".into())?;
        // Positions are i32 in the kernels: a dealing period that fits one keeps the arithmetic
        // below in range for every position.
        ensure(self.world_size.checked_mul(self.interleave).is_some_and(|p| p <= i32::MAX as usize), "interleave", || {
            format!("{} x world_size {} overflows an i32 position", self.interleave, self.world_size)
        })
    }

    /// Positions of one dealing round (`world_size * interleave`).
    fn period(&self) -> usize {
        self.world_size * self.interleave
    }

    /// The rank that holds position `pos` of a request.
    pub fn owner(&self, pos: usize) -> usize {
        (pos / self.interleave) % self.world_size
    }

    /// The index of position `pos` in its owner's share of the request.
    pub fn local_index(&self, pos: usize) -> usize {
        (pos / self.period()) * self.interleave + pos % self.interleave
    }

    /// Keys of a request of `seq_len` tokens that this rank holds.
    pub fn local_len(&self, seq_len: usize) -> usize {
        let full = seq_len / self.period();
        let rest = seq_len - full * self.period();
        full * self.interleave + rest.saturating_sub(self.rank * self.interleave).min(self.interleave)
    }

    /// Positions a table entry covers: `block_size * world_size`.
    pub fn virtual_block_size(&self, block_size: usize) -> Result<usize> {
        block_size
            .checked_mul(self.world_size)
            .ok_or_else(|| AttnError::invalid("block_size", format!("{block_size} x world_size {} overflows", self.world_size)))
    }

    /// This rank's view of a step: the slot each new token is written to on this rank (-1 for
    /// the tokens other ranks hold, which the cache write skips) and each request's local
    /// length.
    ///
    /// The step is given as vLLM gives it: `query_start_loc` (`[num_reqs + 1]`), `seq_lens`
    /// (each request's length, its new tokens the last `query_len` positions) and the block
    /// table (`[num_reqs, block_table_stride]`, an entry per `block_size * world_size`
    /// positions), for a cache of `num_blocks` blocks of `block_size` tokens.
    ///
    /// Errors, naming the argument and the request: `block_size` not a multiple of
    /// `interleave` (a group would straddle two blocks), inconsistent lengths, a table row too
    /// short for its request, or a block id outside the cache for one of this rank's tokens.
    pub fn shard_step(
        &self,
        query_start_loc: &[i32],
        seq_lens: &[i32],
        block_table: &[i32],
        block_table_stride: usize,
        block_size: usize,
        num_blocks: usize,
    ) -> Result<ShardedStep> {
        self.validate()?;
        ensure(block_size > 0 && block_size.is_multiple_of(self.interleave), "block_size", || {
            format!("{block_size} is not a positive multiple of interleave {}", self.interleave)
        })?;
        let vblock = self.virtual_block_size(block_size)?;
        let n = seq_lens.len();
        ensure(query_start_loc.len() == n + 1, "query_start_loc", || {
            format!("has {} entries for {n} requests (needs {})", query_start_loc.len(), n + 1)
        })?;
        let mut slots = Vec::with_capacity(query_start_loc.last().map_or(0, |&t| t.max(0) as usize));
        let mut local = Vec::with_capacity(n);
        let mut tokens = Vec::with_capacity(slots.capacity());
        for r in 0..n {
            let (start, end, len) = (query_start_loc[r], query_start_loc[r + 1], seq_lens[r]);
            ensure(start >= 0 && end >= start && start as usize == slots.len(), "query_start_loc", || {
                format!("request {r} spans {start}..{end} after {} tokens", slots.len())
            })?;
            let q = (end - start) as usize;
            ensure(len == 0 || (len > 0 && len as usize >= q), "seq_lens", || {
                format!("request {r} has length {len} < its {q} new tokens")
            })?;
            let len = len as usize;
            if len == 0 {
                // An empty request (padding): nothing to write, nothing to attend.
                slots.extend(std::iter::repeat_n(-1, q));
                tokens.extend(std::iter::repeat_n(0, q));
                local.push(0);
                continue;
            }
            let entries = len.div_ceil(vblock);
            ensure(entries <= block_table_stride, "block_table_stride", || {
                format!("{block_table_stride} entries a row; request {r} of {len} tokens needs {entries}")
            })?;
            let row_end = r.checked_mul(block_table_stride).and_then(|o| o.checked_add(entries));
            ensure(row_end.is_some_and(|e| e <= block_table.len()), "block_table", || {
                format!("{} entries; request {r} needs {entries} from entry {}", block_table.len(), r.saturating_mul(block_table_stride))
            })?;
            let row = &block_table[r * block_table_stride..];
            for pos in len - q..len {
                tokens.push(self.local_len(pos + 1) as i32);
                if self.owner(pos) != self.rank {
                    slots.push(-1);
                    continue;
                }
                let (entry, li) = (pos / vblock, self.local_index(pos));
                let block = row[entry];
                ensure(block >= 0 && (block as usize) < num_blocks, "block_table", || {
                    format!("request {r} entry {entry} is block {block}, outside the {num_blocks}-block cache (position {pos})")
                })?;
                slots.push(block as i64 * block_size as i64 + (li % block_size) as i64);
            }
            local.push(self.local_len(len) as i32);
        }
        Ok(ShardedStep { slot_mapping: slots, local_seq_lens: local, token_seq_lens: tokens })
    }
}

/// One rank's view of a step ([`CpShard::shard_step`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ShardedStep {
    /// `[num_tokens]`: the slot each new token is written to on this rank, -1 where another
    /// rank holds it (the cache write's `slot_mapping`).
    pub slot_mapping: Vec<i64>,
    /// `[num_reqs]`: the keys of each request this rank holds (the decode's `seq_lens`; 0 where
    /// it holds none, which the decode takes as an empty context).
    pub local_seq_lens: Vec<i32>,
    /// `[num_tokens]`: the keys of its request this rank holds that each new token may see
    /// (those at or before its position). A request of several new tokens (speculative
    /// decoding) is decoded as a request a token, each over this many keys of its request's
    /// row: a rank's share has lost the positions the causal mask among them needs
    /// ([`expand_block_table`](Self::expand_block_table)).
    pub token_seq_lens: Vec<i32>,
}

impl ShardedStep {
    /// The block table of the step decoded as a request a token: each request's row repeated
    /// for each of its new tokens (`query_start_loc` as given to `shard_step`).
    pub fn expand_block_table(&self, query_start_loc: &[i32], block_table: &[i32], block_table_stride: usize) -> Vec<i32> {
        let mut rows = Vec::with_capacity(self.token_seq_lens.len() * block_table_stride);
        for (r, w) in query_start_loc.windows(2).enumerate() {
            // A table may end inside its last row (past what that request uses): pad with -1.
            let start = r.saturating_mul(block_table_stride).min(block_table.len());
            let row = &block_table[start..start.saturating_add(block_table_stride).min(block_table.len())];
            for _ in w[0]..w[1] {
                rows.extend_from_slice(row);
                rows.resize(rows.len() + block_table_stride - row.len(), -1);
            }
        }
        rows
    }
}
