//! The device status block that kernels raise bits in when they meet bad input they refused to
//! act on (instead of writing out of bounds), and where the first such offence is described.
//! The host reads and clears the block on request.
//!
//! Layout: `STATUS_WORDS` u32 words. Word [`STATUS_BITS`] collects every raised bit. The first
//! kernel thread that wins a compare-and-swap of [`STATUS_CLAIMED`] from 0 to its bit writes the
//! record after it; the others only raise their bit. The record is complete once the writing
//! grid has finished, which is when the host reads it (after synchronising the stream). The
//! cache writes record their slot offences and sparse MLA its index offences; the attention
//! kernels raise `BLOCK_OUT_OF_RANGE` without a record.

/// A slot mapping entry was at or past the cache's capacity; that token was not written.
pub const SLOT_OUT_OF_RANGE: u32 = 1 << 0;
/// A block table entry was negative or past the cache's block count; that block was not read.
pub const BLOCK_OUT_OF_RANGE: u32 = 1 << 1;

/// A sparse attention index (a listed position) was negative but not the -1 padding, or at or
/// past its request's length; that entry was not read. Recorded with the token, the entry and
/// the value.
pub const INDEX_OUT_OF_RANGE: u32 = 1 << 2;

/// Word index: the OR of every bit raised since the last read.
pub const STATUS_BITS: usize = 0;
/// Word index: 0 while nothing is recorded, else the bit of the offence the record describes.
pub const STATUS_CLAIMED: usize = 1;
/// Word index: a block offence's request (block-table row); a slot or index offence's token.
pub const STATUS_WHERE: usize = 2;
/// Word index: a block offence's block-table entry (column in the request's row); an index
/// offence's entry (column of the token's index row); 0 for a slot.
pub const STATUS_ENTRY: usize = 3;
/// Word index: the offending value (block id, slot or index) as an i64, low word first.
pub const STATUS_VALUE: usize = 4;
/// Word index: the capacity it broke (the cache's blocks or slots, the request's length) as a
/// u64, low word first.
pub const STATUS_LIMIT: usize = 6;
/// Words in the status block.
pub const STATUS_WORDS: usize = 8;
