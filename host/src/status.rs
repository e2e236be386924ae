//! The device status block: kernels that meet input they refuse to act on (a slot past the
//! cache, a block id outside it) skip that work, raise a bit here instead of writing or reading
//! out of bounds, and describe the first such offence (which token or request, which
//! block-table entry, which value). Reading it synchronises the stream, so the caller chooses
//! when. Layout: `attn_math::status`.

use crate::error::{AttnError, BadBlock, BadIndex, BadSlot, Result};
use attn_math::status::{
    BLOCK_OUT_OF_RANGE, INDEX_OUT_OF_RANGE, SLOT_OUT_OF_RANGE, STATUS_BITS, STATUS_CLAIMED, STATUS_ENTRY, STATUS_LIMIT, STATUS_VALUE,
    STATUS_WHERE, STATUS_WORDS,
};
use cudarc::driver::{CudaSlice, CudaStream};
use std::sync::Arc;

/// `STATUS_WORDS` device u32s that kernels OR error bits into and record the first offence
/// in. Allocate once; pass to every op.
pub struct DeviceStatus {
    pub(crate) word: CudaSlice<u32>,
}

/// The offence a status block describes: the first one a kernel recorded since the last read.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Offence {
    /// A slot past the cache (cache writes).
    Slot(BadSlot),
    /// A block-table entry outside the cache (attention).
    Block(BadBlock),
    /// A sparse MLA index outside its request.
    Index(BadIndex),
}

/// The bits raised since the last read, and the first offence recorded.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StatusFlags {
    /// The raised bits (`attn_math::status`: `SLOT_OUT_OF_RANGE`, `BLOCK_OUT_OF_RANGE`,
    /// `INDEX_OUT_OF_RANGE`); read them through [`slot_out_of_range`](Self::slot_out_of_range),
    /// [`block_out_of_range`](Self::block_out_of_range) and
    /// [`index_out_of_range`](Self::index_out_of_range).
    pub bits: u32,
    /// The first offence a kernel recorded, if any (the GPU attention kernels raise the block
    /// bit without a record).
    pub first: Option<Offence>,
}

impl StatusFlags {
    /// Decodes a status block as the kernels wrote it.
    pub(crate) fn from_words(w: &[u32; STATUS_WORDS]) -> Self {
        let wide = |i: usize| w[i] as u64 | (w[i + 1] as u64) << 32;
        let first = match w[STATUS_CLAIMED] {
            SLOT_OUT_OF_RANGE => {
                Some(Offence::Slot(BadSlot { token: w[STATUS_WHERE], slot: wide(STATUS_VALUE) as i64, num_slots: wide(STATUS_LIMIT) }))
            }
            BLOCK_OUT_OF_RANGE => Some(Offence::Block(BadBlock {
                request: w[STATUS_WHERE],
                entry: w[STATUS_ENTRY],
                block: wide(STATUS_VALUE) as i64,
                num_blocks: wide(STATUS_LIMIT),
            })),
            INDEX_OUT_OF_RANGE => Some(Offence::Index(BadIndex {
                token: w[STATUS_WHERE],
                entry: w[STATUS_ENTRY],
                index: wide(STATUS_VALUE) as i64,
                seq_len: wide(STATUS_LIMIT),
            })),
            _ => None,
        };
        StatusFlags { bits: w[STATUS_BITS], first }
    }

    /// Whether a cache write met a slot at or past the cache's `num_slots` (and skipped it).
    pub fn slot_out_of_range(self) -> bool {
        self.bits & SLOT_OUT_OF_RANGE != 0
    }
    /// Whether an attention kernel met a block id outside the cache (and read nothing from it).
    pub fn block_out_of_range(self) -> bool {
        self.bits & BLOCK_OUT_OF_RANGE != 0
    }
    /// Whether sparse MLA met an index outside its token's request (and read nothing for it).
    pub fn index_out_of_range(self) -> bool {
        self.bits & INDEX_OUT_OF_RANGE != 0
    }
    /// The first sparse index outside its request recorded, if the recorded offence is one.
    pub fn first_bad_index(self) -> Option<BadIndex> {
        match self.first {
            Some(Offence::Index(b)) => Some(b),
            _ => None,
        }
    }
    /// The first slot past the cache recorded, if the recorded offence is one.
    pub fn first_bad_slot(self) -> Option<BadSlot> {
        match self.first {
            Some(Offence::Slot(s)) => Some(s),
            _ => None,
        }
    }
    /// The first block id outside the cache recorded, if the recorded offence is one.
    pub fn first_bad_block(self) -> Option<BadBlock> {
        match self.first {
            Some(Offence::Block(b)) => Some(b),
            _ => None,
        }
    }
    /// `Ok` when nothing was raised, else an error: the recorded offence, or (none recorded) a
    /// slot error before a block error before an index error.
    pub fn into_result(self) -> Result<()> {
        match self.first {
            Some(Offence::Slot(s)) => Err(AttnError::SlotOutOfRange { first: Some(s) }),
            Some(Offence::Block(b)) => Err(AttnError::BlockOutOfRange { first: Some(b) }),
            Some(Offence::Index(b)) => Err(AttnError::IndexOutOfRange { first: Some(b) }),
            None if self.slot_out_of_range() => Err(AttnError::SlotOutOfRange { first: None }),
            None if self.block_out_of_range() => Err(AttnError::BlockOutOfRange { first: None }),
            None if self.index_out_of_range() => Err(AttnError::IndexOutOfRange { first: None }),
            None => Ok(()),
        }
    }
}

impl DeviceStatus {
    /// Allocates the block, zeroed, on `stream` (the ops take it by `&mut`, on their own stream;
    /// [`take`](Self::take) and [`check`](Self::check) read it on the stream they are given).
    ///
    /// Errors: `Driver` when the allocation fails.
    pub fn new(stream: &Arc<CudaStream>) -> Result<Self> {
        Ok(DeviceStatus { word: stream.alloc_zeros::<u32>(STATUS_WORDS)? })
    }

    /// Waits for `stream`, returns the raised bits and the recorded offence, and clears them.
    ///
    /// Errors: `Driver` if the copy or the wait failed.
    pub fn take(&mut self, stream: &Arc<CudaStream>) -> Result<StatusFlags> {
        let mut host = [0u32; STATUS_WORDS];
        stream.memcpy_dtoh(&self.word, &mut host)?;
        stream.synchronize()?;
        if host.iter().any(|&w| w != 0) {
            stream.memset_zeros(&mut self.word)?;
        }
        Ok(StatusFlags::from_words(&host))
    }

    /// [`take`](Self::take), as a `Result`: `SlotOutOfRange`, `BlockOutOfRange` or `IndexOutOfRange` (with the
    /// recorded offence when there is one) if a kernel raised a bit since the last read, `Driver`
    /// if the copy or the wait failed (a kernel fault surfaces here).
    pub fn check(&mut self, stream: &Arc<CudaStream>) -> Result<()> {
        self.take(stream)?.into_result()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(bits: u32, claimed: u32, at: u32, entry: u32, value: i64, limit: u64) -> [u32; STATUS_WORDS] {
        let mut w = [0u32; STATUS_WORDS];
        w[STATUS_BITS] = bits;
        w[STATUS_CLAIMED] = claimed;
        w[STATUS_WHERE] = at;
        w[STATUS_ENTRY] = entry;
        w[STATUS_VALUE] = value as u32;
        w[STATUS_VALUE + 1] = (value >> 32) as u32;
        w[STATUS_LIMIT] = limit as u32;
        w[STATUS_LIMIT + 1] = (limit >> 32) as u32;
        w
    }

    #[test]
    fn a_recorded_block_offence_names_request_entry_and_block() {
        let f = StatusFlags::from_words(&words(BLOCK_OUT_OF_RANGE, BLOCK_OUT_OF_RANGE, 3, 7, 9001, 512));
        let want = BadBlock { request: 3, entry: 7, block: 9001, num_blocks: 512 };
        assert_eq!(f.first_bad_block(), Some(want));
        let err = f.into_result().expect_err("a raised bit is an error");
        assert!(matches!(err, AttnError::BlockOutOfRange { first: Some(b) } if b == want));
        assert_eq!(
            err.to_string(),
            "block id 9001 at request 3, block-table entry 7 is outside the cache's 512 blocks; those blocks were not read"
        );
        let neg = StatusFlags::from_words(&words(BLOCK_OUT_OF_RANGE, BLOCK_OUT_OF_RANGE, 0, 1, -2, 8));
        assert_eq!(neg.first_bad_block().map(|b| b.block), Some(-2));
    }

    #[test]
    fn a_recorded_slot_offence_names_token_and_slot() {
        let slot = 5_000_000_000i64;
        let f = StatusFlags::from_words(&words(SLOT_OUT_OF_RANGE | BLOCK_OUT_OF_RANGE, SLOT_OUT_OF_RANGE, 41, 0, slot, 4096));
        assert!(f.slot_out_of_range() && f.block_out_of_range());
        assert_eq!(f.first_bad_slot(), Some(BadSlot { token: 41, slot, num_slots: 4096 }));
        assert_eq!(f.first_bad_block(), None);
        let err = f.into_result().expect_err("raised");
        assert_eq!(err.to_string(), "slot 5000000000 of token 41 is at or past the cache's 4096 slots; those tokens were not written");
    }

    #[test]
    fn a_recorded_index_offence_names_token_entry_and_index() {
        let f = StatusFlags::from_words(&words(INDEX_OUT_OF_RANGE | BLOCK_OUT_OF_RANGE, INDEX_OUT_OF_RANGE, 5, 1999, -7, 300));
        let want = BadIndex { token: 5, entry: 1999, index: -7, seq_len: 300 };
        assert!(f.index_out_of_range() && f.block_out_of_range() && !f.slot_out_of_range());
        assert_eq!(f.first_bad_index(), Some(want));
        assert_eq!(f.first_bad_block(), None);
        let err = f.into_result().expect_err("raised");
        assert!(matches!(err, AttnError::IndexOutOfRange { first: Some(b) } if b == want));
        assert_eq!(
            err.to_string(),
            "sparse index -7 at token 5, entry 1999 is outside its request's 300 positions; those entries were not read"
        );
        let bare = StatusFlags::from_words(&words(INDEX_OUT_OF_RANGE, 0, 0, 0, 0, 0));
        assert!(matches!(bare.into_result(), Err(AttnError::IndexOutOfRange { first: None })));
    }

    #[test]
    fn bits_without_a_record_are_still_errors() {
        assert!(StatusFlags::from_words(&[0; STATUS_WORDS]).into_result().is_ok());
        let block = StatusFlags::from_words(&words(BLOCK_OUT_OF_RANGE, 0, 0, 0, 0, 0));
        assert!(matches!(block.into_result(), Err(AttnError::BlockOutOfRange { first: None })));
        let both = StatusFlags::from_words(&words(SLOT_OUT_OF_RANGE | BLOCK_OUT_OF_RANGE, 0, 0, 0, 0, 0));
        assert!(matches!(both.into_result(), Err(AttnError::SlotOutOfRange { first: None })));
    }
}
