//! The KV-cache block allocator of the simulated engine: a free list of block ids shared by all
//! layers (a block id addresses the same block in every layer's cache), and per-request block
//! tables that grow as their requests do and are given back when they finish.

use super::rng::SplitMix;

/// What the allocator refuses.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AllocError {
    #[error("out of KV-cache blocks: {needed} needed, {free} free of {total}")]
    OutOfBlocks { needed: usize, free: usize, total: usize },
    #[error("block {0} freed twice")]
    DoubleFree(i32),
    #[error("block {block} is not a block of this cache ({total} blocks)")]
    NotABlock { block: i32, total: usize },
}

/// A free list of the cache's block ids.
#[derive(Clone, Debug)]
pub struct BlockAllocator {
    free: Vec<i32>,
    in_use: Vec<bool>,
    block_size: usize,
}

impl BlockAllocator {
    /// Blocks `0..num_blocks`, handed out in increasing order.
    pub fn new(num_blocks: usize, block_size: usize) -> Self {
        assert!(num_blocks <= i32::MAX as usize && block_size > 0, "num_blocks {num_blocks}, block_size {block_size}");
        BlockAllocator { free: (0..num_blocks as i32).rev().collect(), in_use: vec![false; num_blocks], block_size }
    }

    /// Blocks handed out in a shuffled order (as after a while of serving), so request tables
    /// are scattered over the cache.
    pub fn shuffled(num_blocks: usize, block_size: usize, rng: &mut SplitMix) -> Self {
        let mut a = Self::new(num_blocks, block_size);
        rng.shuffle(&mut a.free);
        a
    }

    pub fn num_blocks(&self) -> usize {
        self.in_use.len()
    }

    pub fn num_free(&self) -> usize {
        self.free.len()
    }

    pub fn num_used(&self) -> usize {
        self.num_blocks() - self.num_free()
    }

    pub fn block_size(&self) -> usize {
        self.block_size
    }

    /// One free block (the most recently freed first).
    pub fn allocate(&mut self) -> Result<i32, AllocError> {
        let b = self.free.pop().ok_or(AllocError::OutOfBlocks { needed: 1, free: 0, total: self.num_blocks() })?;
        self.in_use[b as usize] = true;
        Ok(b)
    }

    /// Gives `block` back.
    pub fn free(&mut self, block: i32) -> Result<(), AllocError> {
        let total = self.num_blocks();
        let used = usize::try_from(block).ok().and_then(|b| self.in_use.get_mut(b)).ok_or(AllocError::NotABlock { block, total })?;
        if !*used {
            return Err(AllocError::DoubleFree(block));
        }
        *used = false;
        self.free.push(block);
        Ok(())
    }
}

/// One request's blocks, in order: token `pos` lives in block `blocks[pos / block_size]`.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct BlockTable {
    blocks: Vec<i32>,
}

impl BlockTable {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn blocks(&self) -> &[i32] {
        &self.blocks
    }

    /// Blocks needed for `tokens` tokens.
    pub fn blocks_for(tokens: usize, block_size: usize) -> usize {
        tokens.div_ceil(block_size)
    }

    /// Grows the table to hold `tokens` tokens: all the blocks it needs, or none (and an error).
    pub fn grow_to(&mut self, tokens: usize, alloc: &mut BlockAllocator) -> Result<(), AllocError> {
        let needed = Self::blocks_for(tokens, alloc.block_size()).saturating_sub(self.blocks.len());
        if needed > alloc.num_free() {
            return Err(AllocError::OutOfBlocks { needed, free: alloc.num_free(), total: alloc.num_blocks() });
        }
        for _ in 0..needed {
            self.blocks.push(alloc.allocate()?);
        }
        Ok(())
    }

    /// The cache slot of token `pos`: `block * block_size + pos % block_size`.
    pub fn slot(&self, pos: usize, block_size: usize) -> i64 {
        self.blocks[pos / block_size] as i64 * block_size as i64 + (pos % block_size) as i64
    }

    /// Gives every block back (the request finished).
    pub fn release(&mut self, alloc: &mut BlockAllocator) -> Result<(), AllocError> {
        for b in self.blocks.drain(..) {
            alloc.free(b)?;
        }
        Ok(())
    }
}
