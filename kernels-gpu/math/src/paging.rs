//! Index math of the paged KV cache.
//!
//! A cache holds `num_blocks` blocks of `block_size` token slots; a *slot* is
//! `block * block_size + offset`. Every layout (vLLM's FlashAttention `[2, blocks, tokens, heads,
//! dim]`, FlashInfer's `[blocks, 2, tokens, heads, dim]`, their heads-before-tokens variants, the
//! MLA `[blocks, tokens, 576]` layout) is described by one base pointer per tensor (K, V) and the
//! element strides of block, token-in-block and head, with the head dimension contiguous.

/// Element strides of one paged tensor (K or V). The head dimension has stride 1.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct CacheStrides {
    pub block: u64,
    pub token: u64,
    pub head: u64,
}

impl CacheStrides {
    /// Element offset of (block, token-in-block, head, dim).
    #[inline(always)]
    pub fn offset(&self, block: u64, token: u64, head: u64, dim: u64) -> u64 {
        block * self.block + token * self.token + head * self.head + dim
    }
}

/// Where a slot lives, or why it is not written.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SlotTarget {
    /// A negative slot: padding, skipped by design.
    Padding,
    /// At or past `num_blocks * block_size`: never written, reported as an error.
    OutOfRange,
    /// (block, offset inside the block).
    At { block: u64, offset: u64 },
}

/// Decode a slot against a cache of `num_slots = num_blocks * block_size` slots.
#[inline(always)]
pub fn resolve_slot(slot: i64, block_size: u32, num_slots: u64) -> SlotTarget {
    if slot < 0 {
        SlotTarget::Padding
    } else if slot as u64 >= num_slots {
        SlotTarget::OutOfRange
    } else {
        let slot = slot as u64;
        SlotTarget::At { block: slot / block_size as u64, offset: slot % block_size as u64 }
    }
}
