//! Bits of the device status word that kernels raise when they meet bad input they refused to
//! act on (instead of writing out of bounds). The host reads and clears the word on request.

/// A slot mapping entry was at or past the cache's capacity; that token was not written.
pub const SLOT_OUT_OF_RANGE: u32 = 1 << 0;
/// A block table entry was negative or past the cache's block count; that block was not read.
pub const BLOCK_OUT_OF_RANGE: u32 = 1 << 1;
