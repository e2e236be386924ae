//! Word buffers that one copy moves to the GPU (a step's metadata, split plans): each array at
//! a 16-byte-aligned offset ([`ALIGN_WORDS`]), where a [`Region`] records it.

use std::ops::Range;

/// Arrays start at multiples of this many words (16 bytes).
pub const ALIGN_WORDS: usize = 4;

/// Where one array lies in the words: `len` words from `offset`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Region {
    /// First word.
    pub offset: usize,
    /// Words.
    pub len: usize,
}

impl Region {
    /// `offset..offset + len`.
    pub fn range(&self) -> Range<usize> {
        self.offset..self.end()
    }

    /// `offset + len` (saturating: a region past a usize is in no buffer).
    pub fn end(&self) -> usize {
        self.offset.saturating_add(self.len)
    }

    /// `offset * 4` (saturating).
    pub fn byte_offset(&self) -> usize {
        self.offset.saturating_mul(4)
    }

    /// This array's words in `words`.
    pub fn of<'w>(&self, words: &'w [u32]) -> &'w [u32] {
        &words[self.range()]
    }
}

/// Appends `values` at the end of `words`, then pads to the next aligned offset.
pub(crate) fn append(words: &mut Vec<u32>, values: impl IntoIterator<Item = u32>) -> Region {
    let offset = words.len();
    words.extend(values);
    let r = Region { offset, len: words.len() - offset };
    words.resize(words.len().next_multiple_of(ALIGN_WORDS), 0);
    r
}
