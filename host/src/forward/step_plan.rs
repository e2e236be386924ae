//! A step's split plans, made once in [`StepMetadata::build`](super::StepMetadata::build) and
//! uploaded with one copy, so that every layer's `forward` launches decode from the device copy
//! (no planning and no copies per layer); and a cascade step's arrays.
//!
//! Words of the step-plan buffer (i32/u32, each array at a 16-byte-aligned offset):
//! - the shared prefix as one request of all the step's tokens: `query_start_loc` `[0, tokens]`,
//!   `seq_lens` `[prefix tokens]` (cascade steps);
//! - every request's suffix length, `seq_len - prefix` (cascade steps);
//! - the decode part's plan (items, splits, partial bases, token requests, header);
//! - the prefix's plan (cascade steps).

use crate::batch::DecodeBatch;
use crate::decode::{append_plan, decode_tc_kernel, max_len, DevicePlan, PlanRegions, TcKernel};
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::Result;
use crate::layout::KvLayout;
use crate::metadata::{upload, BatchSplit, CommonPrefix, StepInput};
use crate::mla::mla_tc_kernel;
use crate::options::PlanOptions;
use crate::words::{append, Region, ALIGN_WORDS};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, PinnedHostSlice};
use std::sync::Arc;

/// Which decode kernels the model runs.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PlanKind {
    Standard { head_size: usize, num_kv_heads: usize, layout: KvLayout },
    Mla,
}

/// The device arrays of a built step's plans.
#[derive(Clone, Debug, Default)]
pub(crate) struct StepPlans {
    pub decode: Option<DevicePlan>,
    pub prefix: Option<DevicePlan>,
    /// Device addresses of the cascade arrays (0 when the step has none).
    pub prefix_query_start_loc: u64,
    pub prefix_seq_len: u64,
    pub suffix_seq_lens: u64,
}

/// Plans each step's decodes (and a cascade step's prefix) for the tensor-core kernels.
pub(crate) struct StepPlanner {
    dev: Arc<AttnDevice>,
    stream: Arc<CudaStream>,
    kind: PlanKind,
    q_dtype: DType,
    cache_dtype: DType,
    num_q_heads: usize,
    plan: PlanOptions,
    partial_capacity: usize,
    words: Vec<u32>,
    staging: PinnedHostSlice<u32>,
    device: CudaSlice<u32>,
    plans: StepPlans,
}

impl StepPlanner {
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn new(
        dev: Arc<AttnDevice>,
        stream: Arc<CudaStream>,
        kind: PlanKind,
        q_dtype: DType,
        cache_dtype: DType,
        num_q_heads: usize,
        plan: PlanOptions,
        partial_capacity: usize,
        initial_words: usize,
    ) -> Result<Self> {
        let n = initial_words.max(ALIGN_WORDS);
        // SAFETY: the staging buffer is written before each copy out of it (`upload`).
        let staging = unsafe { stream.context().alloc_pinned::<u32>(n)? };
        let device = stream.alloc_zeros::<u32>(n)?;
        Ok(StepPlanner {
            dev,
            stream,
            kind,
            q_dtype,
            cache_dtype,
            num_q_heads,
            plan,
            partial_capacity,
            words: Vec::with_capacity(n),
            staging,
            device,
            plans: StepPlans::default(),
        })
    }

    fn kernel(&self, max_q: u32, lens: &[i32]) -> Result<TcKernel> {
        let tuning = &self.plan.tuning;
        match self.kind {
            PlanKind::Standard { head_size, num_kv_heads, layout } => decode_tc_kernel(
                &self.dev,
                self.q_dtype,
                self.cache_dtype,
                layout,
                head_size,
                self.num_q_heads,
                num_kv_heads,
                max_q,
                max_len(lens),
                tuning,
            ),
            PlanKind::Mla => mla_tc_kernel(&self.dev, self.q_dtype, self.cache_dtype.fp8_format(), self.num_q_heads, max_q, tuning),
        }
    }

    /// Plans a validated step (decodes first) and uploads the plans: the decode part's (over
    /// the suffix lengths when `cascade` has a prefix) and the prefix's.
    pub(crate) fn build(&mut self, input: &StepInput<'_>, split: BatchSplit, cascade: Option<CommonPrefix>) -> Result<&StepPlans> {
        let (nd, nt) = (split.num_decodes, input.num_actual_tokens);
        let mut words = std::mem::take(&mut self.words);
        words.clear();
        let mut suffix_lens = Vec::new();
        let cascade_regions = cascade.map(|p| {
            let qsl = append(&mut words, [0, nt as u32]);
            let len = append(&mut words, [p.tokens as u32]);
            suffix_lens.extend(input.seq_lens.iter().map(|&l| l - p.tokens as i32));
            let suffix = append(&mut words, suffix_lens.iter().map(|&l| l as u32));
            (qsl, len, suffix)
        });
        let qsl = &input.query_start_loc[..=nd];
        let mut decode = None;
        if nd > 0 {
            let max_q = qsl.windows(2).map(|w| (w[1] - w[0]) as u32).max().unwrap_or(1);
            let lens = if cascade.is_some() { &suffix_lens[..nd] } else { &input.seq_lens[..nd] };
            let tc = self.kernel(max_q, lens)?;
            let batch = DecodeBatch { seq_lens: lens, query_start_loc: qsl };
            let plan = tc.plan(&batch, self.num_q_heads, self.plan.split, self.partial_capacity);
            decode = Some((append_plan(&mut words, &plan), tc, plan.items.len() / 2, plan.needs_merge(), max_q));
        }
        let mut prefix = None;
        if let Some(p) = cascade {
            let (lens, qsl) = ([p.tokens as i32], [0, nt as i32]);
            let tc = self.kernel(nt as u32, &lens)?;
            let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
            let plan = tc.plan(&batch, self.num_q_heads, self.plan.split, self.partial_capacity);
            prefix = Some((append_plan(&mut words, &plan), tc, plan.items.len() / 2, plan.needs_merge(), nt as u32));
        }
        if self.staging.len() < words.len() {
            // A step larger than any before: grow both buffers (eager steps only; the copy out
            // of the old staging buffer is waited for when it is dropped).
            let n = words.len().next_power_of_two();
            // SAFETY: as in `new`.
            self.staging = unsafe { self.stream.context().alloc_pinned::<u32>(n)? };
            self.device = self.stream.alloc_zeros::<u32>(n)?;
        }
        let uploaded = upload(&self.stream, &mut self.staging, &mut self.device, &words);
        self.words = words;
        uploaded?;
        let base = self.device.device_ptr(&self.stream).0;
        let at = |r: Region| base + r.byte_offset() as u64;
        let device_plan = |(r, tc, items, needs_merge, query_len): (PlanRegions, TcKernel, usize, bool, u32)| DevicePlan {
            kernel: tc.id,
            layer: tc.layer,
            items: at(r.items),
            req_num_splits: at(r.req_num_splits),
            req_partial_base: at(r.req_partial_base),
            token_request: at(r.token_request),
            header: at(r.header),
            capacity_items: items,
            query_len,
            merge_tokens: usize::MAX,
            needs_merge,
            cluster: 0,
        };
        let (pq, pl, sl) = cascade_regions.map_or((0, 0, 0), |(q, l, s)| (at(q), at(l), at(s)));
        self.plans = StepPlans {
            decode: decode.map(device_plan),
            prefix: prefix.map(device_plan),
            prefix_query_start_loc: pq,
            prefix_seq_len: pl,
            suffix_seq_lens: sl,
        };
        Ok(&self.plans)
    }

    pub(crate) fn plans(&self) -> &StepPlans {
        &self.plans
    }
}
