//! CUDA-graph steps, their planning side: the [`GraphBucket`] a graph is captured for, and the
//! [`GraphPlanner`] that pads each step to it and packs its arrays and plans at fixed offsets of
//! one device buffer (what makes a step replayable: [`super::graph`]).

use crate::batch::DecodeBatch;
use crate::decode::{DevicePlan, TcKernel};
use crate::error::{ensure, AttnError, Result};
use crate::kernels::KernelId;
use crate::metadata::{given_split, split_decodes, validate, BatchSplit, StagingLayout, StagingSizes, StepInput};
use crate::options::SplitMode;
use crate::prefill::{plan_prefill, DevicePrefillPlan, PrefillBatch};
use crate::words::{Region, ALIGN_WORDS};
use attn_math::params::NO_WORK;

/// The batches a graph is captured for: a step's batch is padded to its bucket, and the layer
/// tensors hold [`num_tokens`](Self::num_tokens) rows.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GraphBucket {
    /// Up to `num_reqs` decode requests of exactly `query_len` query tokens each (1, or 1 +
    /// speculative tokens): the decode kernels alone. Padding requests have `query_len` tokens
    /// and length 0 (their rows come out zero).
    Uniform {
        /// Requests of the padded step.
        num_reqs: usize,
        /// Query tokens of every request.
        query_len: usize,
    },
    /// Up to `num_reqs` requests with up to `num_tokens` query tokens in all, decodes (at most
    /// `decode_threshold` tokens) and prefills (new prompts, chunks of prompts) in any mix,
    /// decodes first: FlashAttention-3's full-graph batches in vLLM. The decode kernel and the
    /// prefill kernel both run, each on its own requests. The padded step has `num_reqs + 1`
    /// requests: the requests past the step's have no tokens, and the last one holds the
    /// padding tokens with length 0. Their output rows are not written (as vLLM leaves padded
    /// tokens' outputs), and their slots are -1.
    Mixed {
        /// Requests of the step at most.
        num_reqs: usize,
        /// Query tokens of the padded step.
        num_tokens: usize,
    },
}

impl GraphBucket {
    /// One-token decodes of up to `num_reqs` requests.
    pub fn decode(num_reqs: usize) -> Self {
        GraphBucket::Uniform { num_reqs, query_len: 1 }
    }

    /// Decodes of exactly `query_len` tokens (speculative decoding) of up to `num_reqs` requests.
    pub fn uniform(num_reqs: usize, query_len: usize) -> Self {
        GraphBucket::Uniform { num_reqs, query_len }
    }

    /// Any mix of decodes and prefills of up to `num_reqs` requests and `num_tokens` tokens.
    pub fn mixed(num_reqs: usize, num_tokens: usize) -> Self {
        GraphBucket::Mixed { num_reqs, num_tokens }
    }

    /// Requests a step of the bucket may have.
    pub fn num_reqs(&self) -> usize {
        match *self {
            GraphBucket::Uniform { num_reqs, .. } | GraphBucket::Mixed { num_reqs, .. } => num_reqs,
        }
    }

    /// Query tokens of a padded step: the rows the layer tensors (q, k, v, out) must have.
    pub fn num_tokens(&self) -> usize {
        match *self {
            GraphBucket::Uniform { num_reqs, query_len } => num_reqs.saturating_mul(query_len),
            GraphBucket::Mixed { num_tokens, .. } => num_tokens,
        }
    }

    /// Requests of the padded step: a mixed bucket's last one holds the padding tokens.
    pub(crate) fn padded_reqs(&self) -> usize {
        match *self {
            GraphBucket::Uniform { num_reqs, .. } => num_reqs,
            GraphBucket::Mixed { num_reqs, .. } => num_reqs.saturating_add(1),
        }
    }
}

/// A prefill kernel a graph runs: tiles are cut for it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GraphPrefillKernel {
    pub kernel: KernelId,
    pub block_m: u32,
    /// Query heads per kv head.
    pub group: usize,
}

/// Tiles of one prefill kernel in the step's words: the kernel, and where its tiles and their
/// count go.
struct PrefillPart {
    kernel: GraphPrefillKernel,
    capacity_tiles: usize,
    /// `[request, row_tile << 16]` per tile, `NO_WORK` past the step's.
    items: Region,
    /// `[num_tiles, 0, 0, 0]`: the `Schedule::plan` header the prefill kernels read.
    header: Region,
}

impl PrefillPart {
    /// Room from word `offset` on for the tiles of `num_tokens` query tokens in `num_reqs`
    /// requests (each request's last tile partial).
    fn at(offset: usize, kernel: GraphPrefillKernel, num_tokens: usize, num_reqs: usize) -> Self {
        let capacity_tiles = num_tokens.saturating_mul(kernel.group).div_ceil(kernel.block_m as usize).saturating_add(num_reqs);
        let items = Region { offset, len: 2 * capacity_tiles };
        let header = Region { offset: items.end().next_multiple_of(ALIGN_WORDS), len: ALIGN_WORDS };
        PrefillPart { kernel, capacity_tiles, items, header }
    }

    /// Cuts the requests of `batch` into tiles, ordered as a causal layer's (the order only
    /// balances the SMs), their request indices plus `first_req`.
    fn tiles(&self, batch: &PrefillBatch<'_>, first_req: usize) -> Result<Vec<[u32; 2]>> {
        let k = &self.kernel;
        let mut tiles = plan_prefill(batch, k.group, true, None, k.block_m).items;
        ensure(tiles.len() <= self.capacity_tiles, "step", || {
            format!("its prefill has {} tiles, the graph's grid for {} {}: a planner bug", tiles.len(), k.kernel, self.capacity_tiles)
        })?;
        for t in &mut tiles {
            t[0] += first_req as u32;
        }
        Ok(tiles)
    }

    /// Packs `tiles` and their count into `words`.
    fn pack(&self, words: &mut [u32], tiles: &[[u32; 2]]) {
        let flat: Vec<u32> = tiles.iter().flatten().copied().collect();
        fill_items(&mut words[self.items.range()], &flat);
        words[self.header.range()].copy_from_slice(&[tiles.len() as u32, 0, 0, 0]);
    }

    /// Its tiles in the device buffer at `base`.
    fn device(&self, base: u64) -> DevicePrefillPlan {
        let at = |r: Region| base + r.byte_offset() as u64;
        DevicePrefillPlan {
            kernel: self.kernel.kernel,
            items: at(self.items),
            header: at(self.header),
            capacity_tiles: self.capacity_tiles,
        }
    }
}

/// A graph step's fixed part (the bucket, the kernels, the layout of its device words) and the
/// host buffers it packs each step into.
pub(crate) struct GraphPlanner {
    bucket: GraphBucket,
    /// Requests with at most this many query tokens are decodes.
    decode_threshold: usize,
    tc: TcKernel,
    mode: SplitMode,
    num_q_heads: usize,
    partial_capacity: usize,
    capacity_items: usize,
    layout: StagingLayout,
    /// `[num_items, chunk, 0, 0]` after the layout's arrays.
    header: Region,
    /// A mixed bucket's prefill part: tiles of the step's prefills only.
    prefill: Option<PrefillPart>,
    /// Tiles of the whole step, decodes included, for each kernel that runs a layer as one
    /// prefill over the step (`GpuExec::whole_step_kernel`: chunked local attention, encoder
    /// layers, cross-attention of several-token decodes).
    whole_step: Vec<PrefillPart>,
    /// Requests of the step as given (the padded step has more).
    step_reqs: usize,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    words: Vec<u32>,
}

impl GraphPlanner {
    /// `block_width`: block-table entries per request (`max_model_len / block_size`, rounded
    /// up). `prefill`: a mixed bucket's prefill kernel (`None` for a uniform one). `whole_step`:
    /// the kernels that run layers of the model as one prefill over the whole step.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        bucket: GraphBucket,
        decode_threshold: usize,
        tc: TcKernel,
        mode: SplitMode,
        num_q_heads: usize,
        block_width: usize,
        partial_capacity: usize,
        prefill: Option<GraphPrefillKernel>,
        whole_step: &[GraphPrefillKernel],
    ) -> Result<Self> {
        let (n, nt, padded) = (bucket.num_reqs(), bucket.num_tokens(), bucket.padded_reqs());
        ensure(n > 0 && nt > 0, "bucket", || format!("{bucket:?} is empty"))?;
        let decode_len = match bucket {
            GraphBucket::Uniform { query_len, .. } => query_len,
            GraphBucket::Mixed { .. } => decode_threshold,
        };
        ensure(matches!(bucket, GraphBucket::Mixed { .. }) == prefill.is_some(), "bucket", || {
            format!("{bucket:?}: a prefill kernel goes with mixed buckets only")
        })?;
        // Decodes are the first requests, so the merge (one CTA per token and head) covers the
        // most tokens they can have, not the bucket's.
        let capacity_items = tc.max_items(n, decode_len as u32, mode);
        let layout = StagingLayout::new(&StagingSizes {
            num_reqs: padded,
            block_table_stride: block_width,
            num_actual_tokens: nt,
            num_decodes: padded,
            num_prefills: 0,
            num_work_items: 2 * capacity_items,
            num_decode_tokens: nt,
        });
        let header = Region { offset: layout.total_words, len: ALIGN_WORDS };
        let prefill = prefill.map(|kernel| PrefillPart::at(header.end(), kernel, nt, padded));
        let mut end = prefill.as_ref().map_or(header.end(), |p| p.header.end());
        let whole_step: Vec<PrefillPart> = whole_step
            .iter()
            .map(|&kernel| {
                let part = PrefillPart::at(end, kernel, nt, padded);
                end = part.header.end();
                part
            })
            .collect();
        Ok(GraphPlanner {
            bucket,
            decode_threshold,
            tc,
            mode,
            num_q_heads,
            partial_capacity,
            capacity_items,
            layout,
            header,
            prefill,
            whole_step,
            step_reqs: 0,
            query_start_loc: Vec::with_capacity(padded + 1),
            seq_lens: Vec::with_capacity(padded),
            words: vec![0; end],
        })
    }

    pub(crate) fn bucket(&self) -> GraphBucket {
        self.bucket
    }

    /// Words of the device buffer.
    pub(crate) fn total_words(&self) -> usize {
        self.words.len()
    }

    pub(crate) fn layout(&self) -> &StagingLayout {
        &self.layout
    }

    /// The padded step's start locations and lengths, as built.
    pub(crate) fn padded(&self) -> (&[i32], &[i32]) {
        (&self.query_start_loc, &self.seq_lens)
    }

    /// Requests of the step as built, before the padding.
    pub(crate) fn step_reqs(&self) -> usize {
        self.step_reqs
    }

    /// Checks `input` (a full [`validate`], then what the bucket takes: no more requests or
    /// tokens, decodes of the bucket's query length for a uniform bucket, decodes first for a
    /// mixed one, rows within the block-table width), pads it to the bucket, plans it and packs
    /// the words. The split of the padded step: a mixed step's padding requests count as
    /// prefills. A mixed step's decodes are `given`'s (a local batch's, checked) or found from
    /// the query lengths.
    pub(crate) fn build(&mut self, input: &StepInput<'_>, given: Option<BatchSplit>) -> Result<BatchSplit> {
        validate(input)?;
        let (bn, bt, padded) = (self.bucket.num_reqs(), self.bucket.num_tokens(), self.bucket.padded_reqs());
        let (n, nt) = (input.num_reqs(), input.num_actual_tokens);
        ensure(n <= bn, "seq_lens", || format!("{n} requests exceed the graph bucket's {bn}"))?;
        let split = match self.bucket {
            GraphBucket::Uniform { query_len: q, .. } => {
                if let Some(r) = (0..n).find(|&r| input.query_len(r) != q as i64) {
                    return Err(AttnError::invalid(
                        "query_start_loc",
                        format!("request {r} has {} query tokens; the graph bucket takes exactly {q} each", input.query_len(r)),
                    ));
                }
                BatchSplit { num_decodes: bn, num_decode_tokens: bt, num_prefills: 0, num_prefill_tokens: 0 }
            }
            GraphBucket::Mixed { .. } => {
                ensure(nt <= bt, "num_actual_tokens", || format!("{nt} tokens exceed the graph bucket's {bt}"))?;
                let s = match given {
                    Some(split) => given_split(input, self.decode_threshold, split)?,
                    None => split_decodes(input, self.decode_threshold)?,
                };
                BatchSplit { num_prefills: padded - s.num_decodes, num_prefill_tokens: bt - s.num_decode_tokens, ..s }
            }
        };
        let width = self.layout.block_table_stride;
        if let Some(r) = (0..n).find(|&r| input.blocks_needed(r) > width) {
            return Err(AttnError::invalid(
                "seq_lens",
                format!("request {r} has length {}: past the {width} blocks of max_model_len", input.seq_lens[r]),
            ));
        }

        // Padding: a uniform bucket's requests keep the query length; a mixed bucket's have no
        // tokens, but the last, which has every padding token.
        self.query_start_loc.clear();
        self.query_start_loc.extend_from_slice(&input.query_start_loc[..=n]);
        match self.bucket {
            GraphBucket::Uniform { query_len: q, .. } => self.query_start_loc.extend((n + 1..=bn).map(|r| (r * q) as i32)),
            GraphBucket::Mixed { .. } => {
                self.query_start_loc.resize(padded, nt as i32);
                self.query_start_loc.push(bt as i32);
            }
        }
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(input.seq_lens);
        self.seq_lens.resize(padded, 0);
        let nd = split.num_decodes.min(padded);
        let decodes = DecodeBatch { seq_lens: &self.seq_lens[..nd], query_start_loc: &self.query_start_loc[..=nd] };
        let tc = &self.tc;
        let plan = tc.plan(&decodes, self.num_q_heads, self.mode, self.partial_capacity);
        let items = plan.items.len() / 2;
        ensure(items <= self.capacity_items, "step", || {
            format!("its plan has {items} work items, the graph's grid {}: a planner bug", self.capacity_items)
        })?;
        let prefill_tiles = match &self.prefill {
            // The step's prefills, naming requests of the whole padded batch. The padding
            // request has none: its rows are left as they are (zeros would cost a write of them
            // all).
            Some(part) => {
                let rest =
                    PrefillBatch { query_start_loc: &self.query_start_loc[nd..=n], seq_lens: &self.seq_lens[nd..n], key_start_loc: None };
                part.tiles(&rest, nd)?
            }
            None => Vec::new(),
        };
        // The whole step: a mixed bucket's requests but the padding one (left as it is, as
        // above); every request of a uniform bucket, whose padding requests come out zero as
        // the decode kernels leave them.
        let whole_reqs = match self.bucket {
            GraphBucket::Uniform { .. } => padded,
            GraphBucket::Mixed { .. } => n,
        };
        let whole = PrefillBatch {
            query_start_loc: &self.query_start_loc[..=whole_reqs],
            seq_lens: &self.seq_lens[..whole_reqs],
            key_start_loc: None,
        };
        let whole_tiles = self.whole_step.iter().map(|part| part.tiles(&whole, 0)).collect::<Result<Vec<_>>>()?;

        let (l, words) = (&self.layout, &mut self.words);
        let put_i32 = |words: &mut [u32], r: Region, v: &[i32]| {
            for (w, &x) in words[r.range()].iter_mut().zip(v) {
                *w = x as u32;
            }
        };
        put_i32(words, l.query_start_loc, &self.query_start_loc);
        put_i32(words, l.seq_lens, &self.seq_lens);
        for r in 0..n {
            let used = input.blocks_needed(r);
            let src = &input.block_table[r * input.block_table_stride..][..used];
            put_i32(words, Region { offset: l.block_table.offset + r * width, len: used }, src);
        }
        let slots = &mut words[l.slot_mapping.range()];
        for (t, pair) in slots.chunks_exact_mut(2).enumerate() {
            let s = if t < nt { input.slot_mapping[t] } else { -1 };
            pair[0] = s as u64 as u32;
            pair[1] = (s as u64 >> 32) as u32;
        }
        words[l.prefill_query_start_loc.offset] = 0;
        // Items past the step's do nothing (their CTAs exit at once): the grids are fixed.
        fill_items(&mut words[l.work_items.range()], &plan.items);
        // The decode plan covers the decodes; every other request has one split (the merge
        // skips it), and the tokens past the decodes' are the last request's.
        let fill = |words: &mut [u32], r: Region, v: &[u32], rest: u32| {
            let w = &mut words[r.range()];
            w[..v.len()].copy_from_slice(v);
            w[v.len()..].fill(rest);
        };
        fill(words, l.req_num_splits, &plan.req_num_splits, 1);
        fill(words, l.req_partial_base, &plan.req_partial_base, 0);
        fill(words, l.token_request, &plan.token_request, padded as u32 - 1);
        words[self.header.range()].copy_from_slice(&[items as u32, plan.chunk, 0, 0]);
        if let Some(part) = &self.prefill {
            part.pack(words, &prefill_tiles);
        }
        for (part, tiles) in self.whole_step.iter().zip(&whole_tiles) {
            part.pack(words, tiles);
        }
        self.step_reqs = n;
        Ok(split)
    }

    /// The words [`build`](Self::build) packed.
    pub(crate) fn words(&self) -> &[u32] {
        &self.words
    }

    /// The decode plan's arrays in the device buffer at `base` (its address).
    pub(crate) fn device_plan(&self, base: u64) -> DevicePlan {
        let at = |r: Region| base + r.byte_offset() as u64;
        let l = &self.layout;
        let decode_len = match self.bucket {
            GraphBucket::Uniform { query_len, .. } => query_len,
            GraphBucket::Mixed { .. } => self.decode_threshold,
        };
        DevicePlan {
            kernel: self.tc.id,
            layer: self.tc.layer,
            items: at(l.work_items),
            req_num_splits: at(l.req_num_splits),
            req_partial_base: at(l.req_partial_base),
            token_request: at(l.token_request),
            header: at(self.header),
            capacity_items: self.capacity_items,
            query_len: decode_len as u32,
            // The decodes come first: their tokens are the first ones, at most this many.
            merge_tokens: self.bucket.num_tokens().min(self.bucket.num_reqs().saturating_mul(decode_len)),
            // Launched at capture whatever that step's plan (requests with one split are
            // skipped by the merge kernel).
            needs_merge: true,
            cluster: 0,
        }
    }

    /// A mixed bucket's prefill tiles in the device buffer at `base`.
    pub(crate) fn device_prefill_plan(&self, base: u64) -> Option<DevicePrefillPlan> {
        self.prefill.as_ref().map(|p| p.device(base))
    }

    /// The whole step's tiles for `kernel` in the device buffer at `base`, if the planner was
    /// made with that kernel.
    pub(crate) fn device_whole_step_plan(&self, base: u64, kernel: KernelId) -> Option<DevicePrefillPlan> {
        self.whole_step.iter().find(|p| p.kernel.kernel == kernel).map(|p| p.device(base))
    }
}

/// `items` (word pairs) at the start of `words`, and `[0, NO_WORK]` in every pair after them.
fn fill_items(words: &mut [u32], items: &[u32]) {
    words[..items.len()].copy_from_slice(items);
    for pad in words[items.len()..].chunks_exact_mut(2) {
        pad.copy_from_slice(&[0, NO_WORK]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::DType;

    fn decode_kernel() -> TcKernel {
        TcKernel::keys_rows_d128(true)
    }

    /// A mixed step: padded to one request more, which holds the padding tokens; the decode
    /// plan over the decodes, every other token mapped to the padding request (one split); the
    /// prefill tiles over the step's prefills only, `NO_WORK` past them, counted in the header.
    #[test]
    fn a_mixed_step_is_padded_and_planned_for_both_kernels() {
        let prefill = GraphPrefillKernel {
            kernel: KernelId::PrefillWgs { q: DType::BF16, rows: crate::kernels::CacheRows::Bits16, head_size: 128, head_size_v: 128 },
            block_m: 128,
            group: 4,
        };
        let bucket = GraphBucket::mixed(3, 40);
        let mut g = GraphPlanner::new(bucket, 1, decode_kernel(), SplitMode::Auto, 32, 4, 1 << 20, Some(prefill), &[]).unwrap();
        // Two decodes, then a 30-token chunk after 10 cached tokens.
        let (qsl, lens, table) = ([0, 1, 2, 32], [50, 7, 40], [3, 4, 5, 6, 7, 0, 0, 0, 8, 9, 10, 0]);
        let slots: Vec<i64> = [3 * 16 + 1, 7 * 16 + 6].into_iter().chain((10..40).map(|p| (8 + p / 16) * 16 + p % 16)).collect();
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_table: &table,
            block_table_stride: 4,
            slot_mapping: &slots,
            num_actual_tokens: 32,
            num_blocks: 64,
            block_size: 16,
        };
        let split = g.build(&input, None).unwrap();
        assert_eq!(split, BatchSplit { num_decodes: 2, num_decode_tokens: 2, num_prefills: 2, num_prefill_tokens: 38 });
        assert_eq!(g.padded(), (&[0, 1, 2, 32, 40][..], &[50, 7, 40, 0][..]));
        let (w, l) = (g.words(), g.layout());
        let slot_words = &w[l.slot_mapping.range()];
        assert!(slot_words[64..].iter().all(|&x| x == u32::MAX), "padding slots are -1");
        assert_eq!(&w[l.token_request.range()][..2], &[0, 1]);
        assert!(w[l.token_request.range()][2..].iter().all(|&r| r == 3));
        assert_eq!(&w[l.req_num_splits.range()][2..], &[1, 1]);
        let part = g.prefill.as_ref().unwrap();
        assert_eq!(part.capacity_tiles, 2 + 4);
        let items = &w[part.items.range()];
        // 30 tokens x 4 heads = 120 rows: one tile, of request 2.
        assert_eq!(&items[..2], &[2, 0]);
        assert!(items[2..].chunks(2).all(|p| p == [0, NO_WORK]));
        assert_eq!(&w[part.header.range()], &[1, 0, 0, 0]);
        let dp = g.device_plan(0);
        assert_eq!((dp.query_len, dp.merge_tokens), (1, 3));

        // Past the bucket, or not decodes first: refused, naming the argument.
        let arg = |e: AttnError| match e {
            AttnError::InvalidArgument { arg, .. } => arg,
            other => panic!("{other:?}"),
        };
        let long_slots: Vec<i64> = (48..89).collect();
        let long = StepInput { query_start_loc: &[0, 41], seq_lens: &[41], slot_mapping: &long_slots, num_actual_tokens: 41, ..input };
        assert_eq!(arg(g.build(&long, None).unwrap_err()), "num_actual_tokens");
        let order_slots: Vec<i64> = (58..88).chain([7 * 16 + 6]).collect();
        let order =
            StepInput { query_start_loc: &[0, 30, 31], seq_lens: &[40, 7], slot_mapping: &order_slots, num_actual_tokens: 31, ..input };
        assert_eq!(arg(g.build(&order, None).unwrap_err()), "query_start_loc");
        // A local batch's order: a prefill piece as short as a decode after a longer one. With
        // the split given, it is one decode and two prefills; a split whose decodes pass the
        // threshold is refused.
        let piece_slots: Vec<i64> = [3 * 16 + 1].into_iter().chain((58..88).map(|s| s as i64)).chain([100]).collect();
        let pieces = StepInput {
            query_start_loc: &[0, 1, 31, 32],
            seq_lens: &[50, 40, 1],
            slot_mapping: &piece_slots,
            num_actual_tokens: 32,
            ..input
        };
        assert_eq!(arg(g.build(&pieces, None).unwrap_err()), "query_start_loc");
        let given = BatchSplit { num_decodes: 1, num_decode_tokens: 1, num_prefills: 2, num_prefill_tokens: 31 };
        let split = g.build(&pieces, Some(given)).unwrap();
        assert_eq!(split, BatchSplit { num_prefills: 3, num_prefill_tokens: 39, ..given });
        let past = BatchSplit { num_decodes: 2, num_decode_tokens: 31, num_prefills: 1, num_prefill_tokens: 1 };
        assert_eq!(arg(g.build(&pieces, Some(past)).unwrap_err()), "split");
        // A uniform bucket's planner takes no prefill kernel.
        assert!(GraphPlanner::new(GraphBucket::decode(3), 1, decode_kernel(), SplitMode::Auto, 32, 4, 1 << 20, Some(prefill), &[]).is_err());
    }

    /// The whole step's tiles, for a kernel that runs a layer over every request: a mixed
    /// bucket's decodes and prefills but not its padding request (left as it is), a uniform
    /// bucket's padding requests too (their rows come out zero, as the decode kernels leave
    /// them). Each kernel has its own list, found by its id.
    #[test]
    fn whole_step_tiles_cover_every_request() {
        let local = GraphPrefillKernel { kernel: KernelId::PrefillLocal { q: DType::BF16, head_size: 128 }, block_m: 64, group: 4 };
        let wgs = GraphPrefillKernel {
            kernel: KernelId::PrefillWgs { q: DType::BF16, rows: crate::kernels::CacheRows::Bits16, head_size: 128, head_size_v: 128 },
            block_m: 128,
            group: 4,
        };
        let mut g =
            GraphPlanner::new(GraphBucket::mixed(3, 40), 1, decode_kernel(), SplitMode::Auto, 32, 4, 1 << 20, Some(wgs), &[local]).unwrap();
        // Two decodes, then a 30-token chunk after 10 cached tokens.
        let (qsl, lens, table) = ([0, 1, 2, 32], [50, 7, 40], [3, 4, 5, 6, 7, 0, 0, 0, 8, 9, 10, 0]);
        let slots: Vec<i64> = [3 * 16 + 1, 7 * 16 + 6].into_iter().chain((10..40).map(|p| (8 + p / 16) * 16 + p % 16)).collect();
        let input = StepInput {
            query_start_loc: &qsl,
            seq_lens: &lens,
            block_table: &table,
            block_table_stride: 4,
            slot_mapping: &slots,
            num_actual_tokens: 32,
            num_blocks: 64,
            block_size: 16,
        };
        g.build(&input, None).unwrap();
        assert_eq!(g.step_reqs(), 3);
        let part = &g.whole_step[0];
        // 40 tokens x 4 heads in tiles of 64 rows, and a partial tile a request.
        assert_eq!(part.capacity_tiles, 3 + 4);
        let w = g.words();
        let items = &w[part.items.range()];
        // One tile for each decode (4 rows), two for the chunk's 120 rows; none for request 3.
        let mut reqs: Vec<u32> = items[..8].chunks(2).map(|p| p[0]).collect();
        reqs.sort_unstable();
        assert_eq!(reqs, [0, 1, 2, 2]);
        assert!(items[8..].chunks(2).all(|p| p == [0, NO_WORK]));
        assert_eq!(&w[part.header.range()], &[4, 0, 0, 0]);
        // The mixed prefill part still holds the chunk's tile alone.
        assert_eq!(&w[g.prefill.as_ref().unwrap().header.range()], &[1, 0, 0, 0]);
        assert_eq!(g.device_whole_step_plan(0, local.kernel).map(|p| p.capacity_tiles), Some(7));
        assert!(g.device_whole_step_plan(0, wgs.kernel).is_none());

        // A uniform bucket of 4 with 2 requests: tiles for its padding requests too.
        let mut u = GraphPlanner::new(GraphBucket::decode(4), 1, decode_kernel(), SplitMode::Auto, 32, 4, 1 << 20, None, &[local]).unwrap();
        let input =
            StepInput { query_start_loc: &qsl[..3], seq_lens: &lens[..2], slot_mapping: &slots[..2], num_actual_tokens: 2, ..input };
        u.build(&input, None).unwrap();
        let part = &u.whole_step[0];
        let mut reqs: Vec<u32> = u.words()[part.items.range()][..8].chunks(2).map(|p| p[0]).collect();
        reqs.sort_unstable();
        assert_eq!(reqs, [0, 1, 2, 3]);
        assert_eq!(&u.words()[part.header.range()], &[4, 0, 0, 0]);
    }
}
