//! CUDA-graph steps, their planning side: the [`GraphBucket`] a graph is captured for, and the
//! [`GraphPlanner`] that pads each step to it and packs its arrays and split plan at fixed
//! offsets of one device buffer (what makes a step replayable: [`super::graph`]).

use crate::batch::DecodeBatch;
use crate::decode::{plan_decode_tc, DevicePlan, TcKernel};
use crate::error::{ensure, AttnError, Result};
use crate::metadata::{validate, BatchSplit, StagingLayout, StagingSizes, StepInput};
use crate::options::SplitMode;
use crate::words::{Region, ALIGN_WORDS};
use attn_math::params::NO_WORK;

/// The batch a graph is captured for: up to `num_reqs` decode requests of exactly `query_len`
/// query tokens each (1, or 1 + speculative tokens); smaller batches are padded to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct GraphBucket {
    /// Requests the captured step has (a smaller batch is padded with empty requests).
    pub num_reqs: usize,
    /// Query tokens of every request (1, or 1 + speculative tokens).
    pub query_len: usize,
}

impl GraphBucket {
    /// One-token decodes of up to `num_reqs` requests.
    pub fn decode(num_reqs: usize) -> Self {
        GraphBucket { num_reqs, query_len: 1 }
    }

    /// Query tokens of a padded step: the rows the layer tensors (q, k, v, out) must have.
    pub fn num_tokens(&self) -> usize {
        self.num_reqs * self.query_len
    }
}

/// A graph step's fixed part (the bucket, the kernel, the layout of its device words) and the
/// host buffers it packs each step into.
pub(crate) struct GraphPlanner {
    bucket: GraphBucket,
    tc: TcKernel,
    mode: SplitMode,
    num_q_heads: usize,
    partial_capacity: usize,
    capacity_items: usize,
    layout: StagingLayout,
    /// `[num_items, chunk, 0, 0]` after the layout's arrays.
    header: Region,
    query_start_loc: Vec<i32>,
    seq_lens: Vec<i32>,
    words: Vec<u32>,
}

impl GraphPlanner {
    /// `block_width`: block-table entries per request (`max_model_len / block_size`, rounded up).
    pub(crate) fn new(
        bucket: GraphBucket,
        tc: TcKernel,
        mode: SplitMode,
        num_q_heads: usize,
        block_width: usize,
        partial_capacity: usize,
    ) -> Result<Self> {
        let (n, nt) = (bucket.num_reqs, bucket.num_tokens());
        ensure(n > 0 && bucket.query_len > 0, "bucket", || format!("{bucket:?} is empty"))?;
        let capacity_items = tc.max_items(n, bucket.query_len as u32, mode);
        let layout = StagingLayout::new(&StagingSizes {
            num_reqs: n,
            block_table_stride: block_width,
            num_actual_tokens: nt,
            num_decodes: n,
            num_prefills: 0,
            num_work_items: 2 * capacity_items,
            num_decode_tokens: nt,
        });
        let header = Region { offset: layout.total_words, len: ALIGN_WORDS };
        Ok(GraphPlanner {
            bucket,
            tc,
            mode,
            num_q_heads,
            partial_capacity,
            capacity_items,
            layout,
            header,
            query_start_loc: Vec::with_capacity(n + 1),
            seq_lens: Vec::with_capacity(n),
            words: vec![0; header.end()],
        })
    }

    pub(crate) fn bucket(&self) -> GraphBucket {
        self.bucket
    }

    /// Words of the device buffer.
    pub(crate) fn total_words(&self) -> usize {
        self.header.end()
    }

    pub(crate) fn layout(&self) -> &StagingLayout {
        &self.layout
    }

    /// The padded step's start locations and lengths, as built.
    pub(crate) fn padded(&self) -> (&[i32], &[i32]) {
        (&self.query_start_loc, &self.seq_lens)
    }

    /// Checks `input` (a full [`validate`], then: decodes of the bucket's query length, no more
    /// requests than the bucket, rows within the block-table width), pads it to the bucket,
    /// plans its splits and packs the words. The split of the padded step.
    pub(crate) fn build(&mut self, input: &StepInput<'_>) -> Result<BatchSplit> {
        validate(input)?;
        let GraphBucket { num_reqs: bn, query_len: q } = self.bucket;
        let n = input.num_reqs();
        ensure(n <= bn, "seq_lens", || format!("{n} requests exceed the graph bucket's {bn}"))?;
        if let Some(r) = (0..n).find(|&r| input.query_len(r) != q as i64) {
            return Err(AttnError::invalid(
                "query_start_loc",
                format!("request {r} has {} query tokens; the graph bucket takes exactly {q} each", input.query_len(r)),
            ));
        }
        let width = self.layout.block_table_stride;
        if let Some(r) = (0..n).find(|&r| input.blocks_needed(r) > width) {
            return Err(AttnError::invalid(
                "seq_lens",
                format!("request {r} has length {}: past the {width} blocks of max_model_len", input.seq_lens[r]),
            ));
        }

        self.query_start_loc.clear();
        self.query_start_loc.extend((0..=bn).map(|r| (r * q) as i32));
        self.seq_lens.clear();
        self.seq_lens.extend_from_slice(input.seq_lens);
        self.seq_lens.resize(bn, 0);
        let batch = DecodeBatch { seq_lens: &self.seq_lens, query_start_loc: &self.query_start_loc };
        let tc = &self.tc;
        let plan = plan_decode_tc(&batch, self.num_q_heads, tc.group, tc.shape, tc.target, tc.slots, self.mode, self.partial_capacity);
        let items = plan.items.len() / 2;
        ensure(items <= self.capacity_items, "step", || {
            format!("its plan has {items} work items, the graph's grid {}: a planner bug", self.capacity_items)
        })?;

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
            let s = if t < input.num_actual_tokens { input.slot_mapping[t] } else { -1 };
            pair[0] = s as u64 as u32;
            pair[1] = (s as u64 >> 32) as u32;
        }
        words[l.prefill_query_start_loc.offset] = 0;
        // Items past the step's do nothing (their CTAs exit at once): the grid is fixed.
        let items_words = &mut words[l.work_items.range()];
        items_words[..plan.items.len()].copy_from_slice(&plan.items);
        for pad in items_words[plan.items.len()..].chunks_exact_mut(2) {
            pad.copy_from_slice(&[0, NO_WORK]);
        }
        words[l.req_num_splits.range()].copy_from_slice(&plan.req_num_splits);
        words[l.req_partial_base.range()].copy_from_slice(&plan.req_partial_base);
        words[l.token_request.range()].copy_from_slice(&plan.token_request);
        words[self.header.range()].copy_from_slice(&[items as u32, plan.chunk, 0, 0]);
        let nt = self.bucket.num_tokens();
        Ok(BatchSplit { num_decodes: bn, num_decode_tokens: nt, num_prefills: 0, num_prefill_tokens: 0 })
    }

    /// The words [`build`](Self::build) packed.
    pub(crate) fn words(&self) -> &[u32] {
        &self.words
    }

    /// The plan's arrays in the device buffer at `base` (its address).
    pub(crate) fn device_plan(&self, base: u64) -> DevicePlan {
        let at = |r: Region| base + r.byte_offset() as u64;
        let l = &self.layout;
        DevicePlan {
            kernel: self.tc.id,
            layer: self.tc.layer,
            items: at(l.work_items),
            req_num_splits: at(l.req_num_splits),
            req_partial_base: at(l.req_partial_base),
            token_request: at(l.token_request),
            header: at(self.header),
            capacity_items: self.capacity_items,
            // Launched at capture whatever that step's plan (requests with one split are
            // skipped by the merge kernel).
            needs_merge: true,
            cluster: 0,
        }
    }
}
