//! Chunked local attention as a batch of its own (vLLM's local "virtual batches"): each request's
//! query tokens are cut where a chunk starts, and each piece becomes a request whose context
//! begins at its chunk's first position. A piece's tokens see exactly the keys of their chunk
//! up to themselves, so the decode and prefill kernels run a chunked local layer unmasked,
//! split-K included, over any cache format.
//!
//! A piece's keys are its request's block-table row from the chunk's first block on, so the
//! chunk must be a whole number of blocks. The tokens keep their places (the pieces of a request
//! are consecutive, in order), so query, output and slot rows are the step's own.

use super::input::{blocks_for, StepInput};
use super::split::BatchSplit;
use crate::error::{ensure, Result};

/// A step's requests cut at chunk starts: the arrays of the batch the kernels take for a
/// chunked local layer, rebuilt each step into buffers it keeps.
#[derive(Clone, Debug)]
pub struct LocalBatch {
    chunk: usize,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    block_table: Vec<i32>,
    /// Entries per row of `block_table`: the longest piece's blocks (a chunk's at most).
    stride: usize,
    split: BatchSplit,
}

impl LocalBatch {
    /// Batches for chunks of `chunk` positions over blocks of `block_size` tokens.
    pub fn new(chunk: usize, block_size: usize) -> Result<Self> {
        ensure(chunk > 0 && block_size > 0 && chunk.is_multiple_of(block_size), "chunk_size", || {
            format!("{chunk}: local batches need a whole number of blocks of {block_size} a chunk")
        })?;
        Ok(LocalBatch {
            chunk,
            query_start_loc: Vec::new(),
            seq_lens: Vec::new(),
            block_table: Vec::new(),
            stride: 0,
            split: BatchSplit::default(),
        })
    }

    /// Requests of the local batch of a step of `max_reqs` requests and `max_tokens` tokens at
    /// most: a request of `q` tokens falls into at most `1 + ceil((q - 1) / chunk)` pieces, so
    /// the pieces past one a request are fewer than `max_reqs + max_tokens / chunk`.
    pub fn max_reqs(max_reqs: usize, max_tokens: usize, chunk: usize) -> usize {
        max_reqs.saturating_mul(2).saturating_add(max_tokens / chunk.max(1))
    }

    /// Cuts a validated step whose first `split.num_decodes` requests are decodes. A decode's
    /// pieces are decodes, a prefill's prefills (a prefill's last piece may be one token: the
    /// split is the step's, not a query-length rule). A request without query tokens stays
    /// one, with no context.
    pub fn build(&mut self, input: &StepInput<'_>, split: BatchSplit) {
        let (c, bs) = (self.chunk, input.block_size);
        // Rows as wide as the longest piece: a whole chunk where a request's tokens cross a
        // chunk start, else its keys from its last chunk's start.
        let longest_piece = |r: usize| {
            let (q, len) = (input.query_len(r).max(0) as usize, input.seq_lens[r].max(0) as usize);
            match q == 0 || len == 0 {
                true => 0,
                false if len.saturating_sub(q) / c < (len - 1) / c => c,
                false => (len - 1) % c + 1,
            }
        };
        self.stride = (0..input.num_reqs()).map(|r| longest_piece(r).div_ceil(bs)).max().unwrap_or(0).max(1);
        self.query_start_loc.clear();
        self.seq_lens.clear();
        self.block_table.clear();
        self.query_start_loc.push(0);
        let mut decodes = 0;
        for r in 0..input.num_reqs() {
            let (first, end) = (input.query_start_loc[r] as usize, input.query_start_loc[r + 1] as usize);
            let len = input.seq_lens[r].max(0) as usize;
            let row = &input.block_table[r * input.block_table_stride..][..blocks_for(input.seq_lens[r], bs)];
            let pieces_before = self.seq_lens.len();
            if end == first {
                self.push(end, 0, &[]);
            }
            // Positions `first_pos..len` hold the tokens `first..end` (`validate`: q <= len).
            let first_pos = len.saturating_sub(end - first);
            let mut pos = first_pos;
            while pos < len {
                let start = pos - pos % c;
                let last = (start + c).min(len);
                let token_end = first + (last - first_pos);
                self.push(token_end, last - start, &row[start / bs..last.div_ceil(bs)]);
                pos = last;
            }
            if r < split.num_decodes {
                decodes += self.seq_lens.len() - pieces_before;
            }
        }
        let qsl = &self.query_start_loc;
        let decode_tokens = qsl[decodes] as usize;
        self.split = BatchSplit {
            num_decodes: decodes,
            num_decode_tokens: decode_tokens,
            num_prefills: self.seq_lens.len() - decodes,
            num_prefill_tokens: input.num_actual_tokens - decode_tokens,
        };
    }

    /// One piece: its tokens up to `token_end`, its `len` keys and their blocks.
    fn push(&mut self, token_end: usize, len: usize, blocks: &[i32]) {
        debug_assert!(blocks.len() <= self.stride, "a piece of {} blocks in rows of {}", blocks.len(), self.stride);
        self.query_start_loc.push(token_end as i32);
        self.seq_lens.push(len as i32);
        let at = self.block_table.len();
        self.block_table.extend_from_slice(blocks);
        self.block_table.resize(at + self.stride, 0);
    }

    /// The local batch as a step: its own requests and block table, the step's slots.
    pub fn input<'a>(&'a self, step: &StepInput<'a>) -> StepInput<'a> {
        StepInput {
            query_start_loc: &self.query_start_loc,
            seq_lens: &self.seq_lens,
            block_table: &self.block_table,
            block_table_stride: self.stride,
            ..*step
        }
    }

    /// The decode and prefill parts: the pieces of the step's decodes, then of its prefills.
    pub fn split(&self) -> BatchSplit {
        self.split
    }

    /// Positions of a chunk.
    pub fn chunk(&self) -> usize {
        self.chunk
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metadata::{validate, MetadataBuilder, PlanConfig};

    /// A small deterministic generator for the batches below.
    struct Lcg(u64);
    impl Lcg {
        fn below(&mut self, n: usize) -> usize {
            self.0 = self.0.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
            ((self.0 >> 33) as usize) % n.max(1)
        }
    }

    /// For every query token, the cache slots it sees: through the local batch (its piece's
    /// blocks, causal within the piece) and directly (its request's blocks, keys of its chunk
    /// up to itself). Both must be the same sets, in the same order.
    fn seen_both_ways(input: &StepInput<'_>, lb: &LocalBatch) -> (Vec<Vec<usize>>, Vec<Vec<usize>>) {
        let bs = input.block_size;
        let slots =
            |row: &[i32], keys: std::ops::Range<usize>| -> Vec<usize> { keys.map(|k| row[k / bs] as usize * bs + k % bs).collect() };
        let mut direct = Vec::new();
        for r in 0..input.num_reqs() {
            let row = &input.block_table[r * input.block_table_stride..];
            let (q, len) = (input.query_len(r) as usize, input.seq_lens[r] as usize);
            for pos in len - q..len {
                direct.push(slots(row, pos - pos % lb.chunk..pos + 1));
            }
        }
        let local = lb.input(input);
        let mut through = Vec::new();
        for v in 0..local.num_reqs() {
            let row = &local.block_table[v * local.block_table_stride..][..local.block_table_stride];
            let (q, len) = (local.query_len(v) as usize, local.seq_lens[v] as usize);
            for pos in len - q..len {
                through.push(slots(row, 0..pos + 1));
            }
        }
        (through, direct)
    }

    #[test]
    fn every_token_sees_its_chunk_up_to_itself_through_the_local_batch() {
        let mut rng = Lcg(11);
        for case in 0..400 {
            let bs = [1, 2, 4, 16][rng.below(4)];
            let chunk = bs * (1 + rng.below(5));
            let n = 1 + rng.below(6);
            let nd = rng.below(n + 1);
            let (mut qsl, mut seq_lens) = (vec![0i32], Vec::new());
            for r in 0..n {
                let q = if r < nd { rng.below(3) } else { 2 + rng.below(3 * chunk + 2) };
                let len = q + rng.below(4 * chunk);
                qsl.push(qsl[r] + q as i32);
                seq_lens.push(len as i32);
            }
            let stride = seq_lens.iter().map(|&l| blocks_for(l, bs)).max().unwrap_or(0) + rng.below(3);
            let num_blocks = 4 * stride * n + 1;
            let mut table = vec![0i32; n * stride];
            for (i, b) in table.iter_mut().enumerate() {
                *b = ((i * 7 + case) % num_blocks) as i32;
            }
            let nt = *qsl.last().unwrap() as usize;
            let slots = vec![-1i64; nt];
            let input = StepInput {
                query_start_loc: &qsl,
                seq_lens: &seq_lens,
                block_table: &table,
                block_table_stride: stride,
                slot_mapping: &slots,
                num_actual_tokens: nt,
                num_blocks,
                block_size: bs,
            };
            validate(&input).unwrap();
            let split = BatchSplit {
                num_decodes: nd,
                num_decode_tokens: qsl[nd] as usize,
                num_prefills: n - nd,
                num_prefill_tokens: nt - qsl[nd] as usize,
            };
            let mut lb = LocalBatch::new(chunk, bs).unwrap();
            lb.build(&input, split);
            let local = lb.input(&input);
            validate(&local).unwrap_or_else(|e| panic!("case {case}: {e}"));
            let (through, direct) = seen_both_ways(&input, &lb);
            assert_eq!(through, direct, "case {case}: chunk {chunk}, block size {bs}, {qsl:?} {seq_lens:?}");
            // Every piece lies in one chunk; the split counts the decodes' pieces.
            assert!(local.seq_lens.iter().all(|&l| l as usize <= chunk), "case {case}");
            let s = lb.split();
            assert_eq!(s.num_decode_tokens, split.num_decode_tokens, "case {case}");
            assert!((0..s.num_decodes).all(|v| local.query_len(v) <= 2), "case {case}");
            assert!(local.num_reqs() <= LocalBatch::max_reqs(n, nt, chunk), "case {case}");
        }
    }

    /// The CPU backend's paged prefill (f64): with the chunks over the step, and without them
    /// over its local batch, the outputs agree, also under a window, ALiBi and sinks (whose
    /// terms read a key's distance to its query, which the cut keeps) and GQA.
    #[test]
    fn attention_over_the_local_batch_is_the_steps_chunked_attention() {
        use crate::cpu::{prefill, KvRef, PrefillRef};
        use crate::layout::{KvCacheSpec, KvLayout, RowsDesc};
        use crate::options::AttnOptions;
        let (hq, hkv, d, bs, chunk) = (4, 2, 8, 4, 8);
        let mut rng = Lcg(5);
        let mut unit = || rng.below(2001) as f32 / 1000.0 - 1.0;
        // Two decodes (one at a chunk's first position), a prefill of 10 across a chunk start
        // and one of 3 from position 0.
        let (qsl, seq_lens) = ([0, 1, 2, 12, 15], [20, 9, 30, 3]);
        let stride = 8;
        let num_blocks = 40;
        let table: Vec<i32> = (0..4 * stride).map(|i| ((i * 11 + 3) % num_blocks) as i32).collect();
        let spec = KvCacheSpec::new(KvLayout::FlashNhd, num_blocks, bs, hkv, d).unwrap();
        let cache: Vec<f32> = (0..spec.num_elements()).map(|_| unit()).collect();
        let q: Vec<f32> = (0..15 * hq * d).map(|_| unit()).collect();
        let slopes = [0.5f32, 0.25, 0.125, 0.0625];
        let sinks = [0.3f32, -0.2, 0.1, 0.0];
        let slots = [-1i64; 15];
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &table,
            block_table_stride: stride,
            slot_mapping: &slots,
            num_actual_tokens: 15,
            num_blocks,
            block_size: bs,
        };
        let split = BatchSplit { num_decodes: 2, num_decode_tokens: 2, num_prefills: 2, num_prefill_tokens: 13 };
        let mut lb = LocalBatch::new(chunk, bs).unwrap();
        lb.build(&input, split);
        let local = lb.input(&input);
        for (window, alibi, with_sinks) in [(None, false, false), (Some(5), false, false), (None, true, true), (Some(3), true, false)] {
            let run = |s: &StepInput<'_>, chunk_size: Option<u32>| {
                prefill(&PrefillRef {
                    q: &q,
                    q_rows: RowsDesc::contiguous(15, hq, d),
                    kv: KvRef::Paged { cache: &cache, spec, block_table: s.block_table, block_table_stride: s.block_table_stride },
                    head_size_v: d,
                    query_start_loc: s.query_start_loc,
                    seq_lens: s.seq_lens,
                    causal: true,
                    opts: AttnOptions { chunk_size, window, softmax_scale: 0.4, ..AttnOptions::new(d) },
                    alibi_slopes: alibi.then_some(&slopes[..]),
                    sinks: with_sinks.then_some(&sinks[..]),
                    scales: None,
                })
                .unwrap()
                .out
            };
            let (chunked, cut) = (run(&input, Some(chunk as u32)), run(&local, None));
            let worst = chunked.iter().zip(&cut).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
            assert!(worst < 1e-12, "window {window:?}, ALiBi {alibi}, sinks {with_sinks}: max difference {worst:e}");
            // Not vacuous: without the chunks the step's outputs differ.
            let plain = run(&input, None);
            assert!(plain.iter().zip(&cut).any(|(a, b)| (a - b).abs() > 1e-6));
        }
    }

    #[test]
    fn a_prefill_across_two_chunk_starts_becomes_three_pieces() {
        // Chunks of 4, blocks of 2. Request 0: a decode at position 9 (chunk 8..12). Request 1:
        // 7 new tokens at positions 3..10 of 10: pieces 3 (chunk 0..4), 4..8 and 8..10.
        let (qsl, seq_lens) = ([0, 1, 8], [10, 10]);
        let table = [10, 11, 12, 13, 14, 20, 21, 22, 23, 24];
        let slots = [-1i64; 8];
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &seq_lens,
            block_table: &table,
            block_table_stride: 5,
            slot_mapping: &slots,
            num_actual_tokens: 8,
            num_blocks: 25,
            block_size: 2,
        };
        let mut lb = LocalBatch::new(4, 2).unwrap();
        lb.build(&input, BatchSplit { num_decodes: 1, num_decode_tokens: 1, num_prefills: 1, num_prefill_tokens: 7 });
        let local = lb.input(&input);
        assert_eq!(local.query_start_loc, [0, 1, 2, 6, 8]);
        assert_eq!(local.seq_lens, [2, 4, 4, 2]);
        assert_eq!(local.block_table_stride, 2);
        assert_eq!(local.block_table, [14, 0, 20, 21, 22, 23, 24, 0]);
        assert_eq!(lb.split(), BatchSplit { num_decodes: 1, num_decode_tokens: 1, num_prefills: 3, num_prefill_tokens: 7 });
        assert!(LocalBatch::new(6, 4).is_err(), "a chunk must be a whole number of blocks");

        // The builder takes the local batch with its split, though the prefill's last piece (2
        // tokens) is as short as a decode under a threshold of 2; found from the query lengths,
        // that order is refused.
        let config = PlanConfig { decode_threshold: 2, num_q_heads: 8, num_kv_heads: 2, head_size: 128 };
        let mut builder = MetadataBuilder::new(config).unwrap();
        assert!(builder.build(&local).is_err());
        let built = builder.build_split(&local, lb.split()).unwrap();
        assert_eq!(built.metadata.split, lb.split());
        assert_eq!(built.metadata.prefill.query_start_loc, [0, 1, 5, 7]);
        // A split that is not the batch's, or whose decodes pass the threshold, is refused.
        let wrong = BatchSplit { num_decodes: 2, ..lb.split() };
        assert!(builder.build_split(&local, wrong).is_err());
        let past = BatchSplit { num_decodes: 3, num_decode_tokens: 6, num_prefills: 1, num_prefill_tokens: 2 };
        assert!(builder.build_split(&local, past).is_err());
    }
}
