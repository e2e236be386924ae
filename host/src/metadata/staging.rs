//! [`pack`]: everything a step's kernels read, in one buffer of u32 words (one upload), each
//! array at a 16-byte-aligned offset that [`StagingLayout`] records.

use super::input::{blocks_for, StepInput};
use super::tensor_core::TensorCoreMetadata;
use crate::words::{Region, ALIGN_WORDS};

/// Where [`pack`] put each array (offsets and lengths in u32 words from the buffer's start;
/// every offset a multiple of [`ALIGN_WORDS`], the gaps zero).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingLayout {
    /// `[num_reqs + 1]` i32.
    pub query_start_loc: Region,
    /// `[num_reqs]` i32.
    pub seq_lens: Region,
    /// `[num_reqs, block_table_stride]` i32: each request's `ceil(seq_len / block_size)` block
    /// ids; rows as wide as the most blocks a request of the step uses
    /// (`ceil(max_seq_len / block_size)`), so a large engine-side stride costs no copying.
    /// Entries past a request's blocks are unspecified (zero from [`pack`]; what the buffer
    /// held from [`pack_into`]), as in vLLM's block table: kernels never read them.
    pub block_table: Region,
    /// Entries per row of the packed `block_table`.
    pub block_table_stride: usize,
    /// `[num_actual_tokens]` i64 as (low, high) word pairs, little-endian: 8-byte aligned.
    pub slot_mapping: Region,
    /// `[num_prefills + 1]` i32: the prefill part's start locations, from 0.
    pub prefill_query_start_loc: Region,
    /// The decode plan (`DecodePlan`'s arrays): `items`, `req_num_splits`,
    /// `req_partial_base` (`[num_decodes]` each for the last two), `token_request`
    /// (`[num_decode_tokens]`).
    pub work_items: Region,
    /// `[num_decodes]` splits per decode.
    pub req_num_splits: Region,
    /// `[num_decodes]` first partial row per decode.
    pub req_partial_base: Region,
    /// `[num_decode_tokens]` request of each decode token.
    pub token_request: Region,
    /// Requests `0..num_decodes` are the decode part (a prefix of `query_start_loc`,
    /// `seq_lens` and `block_table`).
    pub num_decodes: usize,
    /// Words in the buffer (a multiple of [`ALIGN_WORDS`]).
    pub total_words: usize,
}

/// Lengths in words of the packed arrays.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StagingSizes {
    /// Requests of the step.
    pub num_reqs: usize,
    /// Entries per packed block-table row.
    pub block_table_stride: usize,
    /// Tokens of the step (slot-mapping entries).
    pub num_actual_tokens: usize,
    /// Decode requests.
    pub num_decodes: usize,
    /// Prefill requests.
    pub num_prefills: usize,
    /// Words of the decode plan's work items.
    pub num_work_items: usize,
    /// Query tokens of the decodes.
    pub num_decode_tokens: usize,
}

fn align_up(words: usize) -> usize {
    words.checked_next_multiple_of(ALIGN_WORDS).unwrap_or(usize::MAX)
}

impl StagingLayout {
    /// The layout of arrays of these sizes (sizes past a usize saturate: such a layout fits in
    /// no buffer, and a step that validates never has one).
    pub fn new(s: &StagingSizes) -> Self {
        let mut at = 0;
        let mut next = |len: usize| {
            let r = Region { offset: at, len };
            at = align_up(r.end());
            r
        };
        let query_start_loc = next(s.num_reqs.saturating_add(1));
        let seq_lens = next(s.num_reqs);
        let block_table = next(s.num_reqs.saturating_mul(s.block_table_stride));
        let slot_mapping = next(s.num_actual_tokens.saturating_mul(2));
        let prefill_query_start_loc = next(s.num_prefills.saturating_add(1));
        let work_items = next(s.num_work_items);
        let req_num_splits = next(s.num_decodes);
        let req_partial_base = next(s.num_decodes);
        let token_request = next(s.num_decode_tokens);
        StagingLayout {
            query_start_loc,
            seq_lens,
            block_table,
            block_table_stride: s.block_table_stride,
            slot_mapping,
            prefill_query_start_loc,
            work_items,
            req_num_splits,
            req_partial_base,
            token_request,
            num_decodes: s.num_decodes,
            total_words: at,
        }
    }

    /// The layout [`pack`] gives `meta` of `input`.
    pub fn for_step(meta: &TensorCoreMetadata, input: &StepInput<'_>) -> Self {
        let plan = &meta.decode.plan;
        StagingLayout::new(&StagingSizes {
            num_reqs: meta.num_reqs(),
            block_table_stride: blocks_for(meta.max_seq_len().min(i32::MAX as usize) as i32, input.block_size),
            num_actual_tokens: meta.num_actual_tokens,
            num_decodes: meta.split.num_decodes,
            num_prefills: meta.split.num_prefills,
            num_work_items: plan.items.len(),
            num_decode_tokens: plan.token_request.len(),
        })
    }

    /// Bytes in the buffer (`total_words * 4`, saturating).
    pub fn total_bytes(&self) -> usize {
        self.total_words.saturating_mul(4)
    }

    /// Every array with its name, in buffer order.
    pub fn regions(&self) -> [(&'static str, Region); 9] {
        [
            ("query_start_loc", self.query_start_loc),
            ("seq_lens", self.seq_lens),
            ("block_table", self.block_table),
            ("slot_mapping", self.slot_mapping),
            ("prefill_query_start_loc", self.prefill_query_start_loc),
            ("work_items", self.work_items),
            ("req_num_splits", self.req_num_splits),
            ("req_partial_base", self.req_partial_base),
            ("token_request", self.token_request),
        ]
    }

    /// The prefill part's `seq_lens` (a suffix of `seq_lens`: 4-byte aligned only).
    pub fn prefill_seq_lens(&self) -> Region {
        let skip = self.num_decodes.min(self.seq_lens.len);
        Region { offset: self.seq_lens.offset.saturating_add(skip), len: self.seq_lens.len - skip }
    }

    /// The prefill part's block-table rows (a suffix of `block_table`: 4-byte aligned only).
    pub fn prefill_block_table(&self) -> Region {
        let skip = self.num_decodes.saturating_mul(self.block_table_stride).min(self.block_table.len);
        Region { offset: self.block_table.offset.saturating_add(skip), len: self.block_table.len - skip }
    }
}

/// Packs a step's arrays (`meta` must be what
/// [`build_tensor_core_metadata`](super::build_tensor_core_metadata) made of `input`) into one
/// buffer of u32 words for a single upload.
pub fn pack(meta: &TensorCoreMetadata, input: &StepInput<'_>) -> (Vec<u32>, StagingLayout) {
    let mut words = Vec::new();
    let layout = pack_into(meta, input, &mut words);
    (words, layout)
}

/// [`pack`] into `words` (resized to the layout; its memory is reused). Writes the arrays and
/// zeros in the gaps between them; block-table rows past a request's
/// `ceil(seq_len / block_size)` blocks keep what `words` held (no kernel reads them).
///
/// Panics if `meta` does not describe `input` (request or token counts differ).
pub fn pack_into(meta: &TensorCoreMetadata, input: &StepInput<'_>, words: &mut Vec<u32>) -> StagingLayout {
    pack_words::<false>(meta, input, words).expect("packing without checks cannot fail")
}

/// [`pack_into`], and with `CHECK` `None` as soon as a used block id is outside
/// `0..num_blocks` or a slot outside `-1..num_slots` (checked while copying, in the order
/// [`validate`](super::validate) checks them). `input`'s rows must hold their blocks.
pub(crate) fn pack_words<const CHECK: bool>(
    meta: &TensorCoreMetadata,
    input: &StepInput<'_>,
    words: &mut Vec<u32>,
) -> Option<StagingLayout> {
    let n = input.num_reqs();
    assert!(
        meta.num_reqs() == n && meta.num_actual_tokens == input.num_actual_tokens,
        "pack: the metadata ({} requests, {} tokens) is not the step's ({n}, {})",
        meta.num_reqs(),
        meta.num_actual_tokens,
        input.num_actual_tokens
    );
    let layout = StagingLayout::for_step(meta, input);
    words.resize(layout.total_words, 0);
    let mut w = Writer { words, at: 0 };
    w.put(layout.query_start_loc, |d| cast_into(d, input.query_start_loc));
    w.put(layout.seq_lens, |d| cast_into(d, input.seq_lens));
    let width = layout.block_table_stride;
    let mut outside = 0;
    w.put(layout.block_table, |d| outside = copy_block_rows(d, input, width));
    if CHECK && outside < 0 {
        return None;
    }
    let mut ok = true;
    let slot_limit = input.num_slots() as u64;
    w.put(layout.slot_mapping, |d| {
        let mut outside = false;
        for (pair, &s) in d.chunks_exact_mut(2).zip(&input.slot_mapping[..input.num_actual_tokens]) {
            pair[0] = s as u64 as u32;
            pair[1] = (s as u64 >> 32) as u32;
            // -1..num_slots maps to 0..=num_slots.
            outside |= s.wrapping_add(1) as u64 > slot_limit;
        }
        ok = !(CHECK && outside);
    });
    if !ok {
        return None;
    }
    w.put(layout.prefill_query_start_loc, |d| cast_into(d, &meta.prefill.query_start_loc));
    let plan = &meta.decode.plan;
    w.put(layout.work_items, |d| d.copy_from_slice(&plan.items));
    w.put(layout.req_num_splits, |d| d.copy_from_slice(&plan.req_num_splits));
    w.put(layout.req_partial_base, |d| d.copy_from_slice(&plan.req_partial_base));
    w.put(layout.token_request, |d| d.copy_from_slice(&plan.token_request));
    w.finish();
    Some(layout)
}

/// Copies each request's used block ids into its row of `dst` (rows of `width`) and checks
/// them in the same pass: negative unless every id is in `0..num_blocks`. One pass, since
/// reading the ids is most of a step's cost; with AVX2 when the CPU has it.
fn copy_block_rows(dst: &mut [u32], input: &StepInput<'_>, width: usize) -> i32 {
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2 (checked just above).
        return unsafe { copy_block_rows_avx2(dst, input, width) };
    }
    copy_block_rows_portable(dst, input, width)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn copy_block_rows_avx2(dst: &mut [u32], input: &StepInput<'_>, width: usize) -> i32 {
    copy_block_rows_portable(dst, input, width)
}

#[inline(always)]
fn copy_block_rows_portable(dst: &mut [u32], input: &StepInput<'_>, width: usize) -> i32 {
    // `b` is in 0..num_blocks iff neither `b` nor `num_blocks - 1 - b` is negative (no 32-bit
    // min/max needed: SSE2 has none).
    let last = (input.num_blocks.min(1 << 31) as i64 - 1) as i32;
    let stride = input.block_table_stride;
    let mut acc = 0;
    for (r, &len) in input.seq_lens.iter().enumerate() {
        let blocks = blocks_for(len, input.block_size);
        let (d, s) = (&mut dst[r * width..][..blocks], &input.block_table[r * stride..][..blocks]);
        for (d, &b) in d.iter_mut().zip(s) {
            *d = b as u32;
            acc |= b | last.wrapping_sub(b);
        }
    }
    acc
}

fn cast_into(dst: &mut [u32], src: &[i32]) {
    for (d, &s) in dst.iter_mut().zip(src) {
        *d = s as u32;
    }
}

/// Writes regions in order, zeroing the gaps between them.
struct Writer<'w> {
    words: &'w mut [u32],
    at: usize,
}

impl Writer<'_> {
    fn put(&mut self, r: Region, fill: impl FnOnce(&mut [u32])) {
        self.words[self.at..r.offset].fill(0);
        fill(&mut self.words[r.range()]);
        self.at = r.end();
    }

    fn finish(self) {
        self.words[self.at..].fill(0);
    }
}
