//! [`DecodeWorkspace`]: the device memory of split-K (partials, the merge counters of kernels
//! that merge their splits themselves) and of a call's uploaded plan.

use super::plan::{LaunchPlan, PlanArrays};
use super::plan_words::{append_plan, plan_words};
use super::split::DecodePlan;
use crate::error::{ensure, Result};
use crate::stream_check::check_stream;
use crate::words::{Region, ALIGN_WORDS};
use attn_math::params::SplitK;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use std::sync::Arc;

/// Device memory for split-K partials and the plan. Allocate once for the largest batch.
pub struct DecodeWorkspace {
    partial_out: CudaSlice<f32>,
    partial_lse: CudaSlice<f32>,
    /// A call's plan, its arrays packed into one buffer (`plan_words`) that one
    /// copy fills (one copy instead of four saved about 3 us a call on the H100, docs/decode.md).
    plan_device: CudaSlice<u32>,
    plan_words: Vec<u32>,
    /// Split-K merged in pass 1: an arrival counter per split work item (zero between launches;
    /// `attn_math::params::merge_counter_index`, below `partial_rows / 2`).
    merge_counters: CudaSlice<u32>,
    max_items: usize,
    max_reqs: usize,
    max_tokens: usize,
    head_size: usize,
    /// The stream every call that uses this workspace runs on (`crate::stream_check`).
    stream: Arc<CudaStream>,
}

impl DecodeWorkspace {
    /// Device bytes [`new`](Self::new) allocates (saturating: sizes that overflow are ones
    /// `new` refuses).
    pub fn bytes(partial_rows: usize, head_size: usize, max_items: usize, max_reqs: usize, max_tokens: usize) -> usize {
        let padded = |n: usize| (n as u128).next_multiple_of(ALIGN_WORDS as u128);
        let plan = padded(max_items) + 2 * padded(max_reqs) + padded(max_tokens) + padded(4);
        let rows = partial_rows as u128;
        let total = rows * (head_size as u128 + 1) + plan + rows / 2 + 1;
        usize::try_from(4 * total).unwrap_or(usize::MAX)
    }

    /// A workspace for up to `max_reqs` requests and `max_tokens` query tokens; `partial_rows`
    /// bounds the split-K partials (a good size: `4 * sm_count * 8 * num_q_heads / num_kv_heads`).
    /// Every call that uses it must run on `stream`: one workspace per stream. `head_size` is the
    /// layer's (512 for MLA). Allocates [`bytes`](Self::bytes) of device memory.
    ///
    /// Errors: `InvalidArgument` for sizes past what a launch indexes (`i32::MAX`, or
    /// `partial_rows * head_size` past `u32::MAX`); `Driver` when an allocation fails.
    pub fn new(stream: &Arc<CudaStream>, partial_rows: usize, head_size: usize, max_reqs: usize, max_tokens: usize) -> Result<Self> {
        // The kernels index partial rows, items and tokens with 32-bit words.
        for (arg, n) in [("partial_rows", partial_rows), ("head_size", head_size), ("max_reqs", max_reqs), ("max_tokens", max_tokens)] {
            ensure(n <= i32::MAX as usize, arg, || format!("{n} is past what a launch indexes ({})", i32::MAX))?;
        }
        ensure(partial_rows.max(1).checked_mul(head_size).is_some_and(|n| n <= u32::MAX as usize), "partial_rows", || {
            format!("{partial_rows} rows of {head_size} floats are past what a launch indexes")
        })?;
        // Tensor-core items are two words, and MQA rows can take several row tiles.
        let max_items = 4 * (max_reqs + partial_rows);
        let words = plan_words(max_items, max_reqs, max_tokens);
        Ok(DecodeWorkspace {
            partial_out: stream.alloc_zeros(partial_rows.max(1) * head_size)?,
            partial_lse: stream.alloc_zeros(partial_rows.max(1))?,
            plan_device: stream.alloc_zeros(words)?,
            plan_words: Vec::with_capacity(words),
            merge_counters: stream.alloc_zeros(merge_counters(partial_rows))?,
            max_items,
            max_reqs,
            max_tokens,
            head_size,
            stream: stream.clone(),
        })
    }

    /// Refuses a call on another stream than the workspace's.
    pub(crate) fn check_stream(&self, stream: &Arc<CudaStream>) -> Result<()> {
        check_stream("workspace", &self.stream, stream)
    }

    /// Partial rows (`head_size` f32 each) the workspace holds for split-K.
    pub fn partial_rows(&self) -> usize {
        self.partial_lse.len()
    }

    /// The partial buffers alone: a plan the kernel derives from its CTA index (uniform splits).
    fn partials_ptrs(&mut self, stream: &Arc<CudaStream>) -> WorkspacePtrs {
        WorkspacePtrs {
            partial_out: self.partial_out.device_ptr_mut(stream).0,
            partial_lse: self.partial_lse.device_ptr_mut(stream).0,
            ..WorkspacePtrs::default()
        }
    }

    /// The counters of split-K merged in pass 1.
    pub(crate) fn merge_counters_ptr(&mut self, stream: &Arc<CudaStream>) -> u64 {
        self.merge_counters.device_ptr_mut(stream).0
    }

    /// Whether a plan for a batch of `num_reqs` requests and `num_tokens` query tokens fits.
    pub(crate) fn check_plan(&self, plan: &DecodePlan, num_reqs: usize, num_tokens: usize) -> Result<()> {
        ensure(plan.items.len() <= self.max_items && plan.items.len() < i32::MAX as usize, "workspace", || {
            format!("the plan has {} work items, the workspace holds {}", plan.items.len(), self.max_items)
        })?;
        ensure(plan.partial_rows <= self.partial_rows(), "workspace", || {
            format!("the plan needs {} partial rows, the workspace holds {}", plan.partial_rows, self.partial_rows())
        })?;
        self.check_batch(num_reqs, num_tokens)?;
        ensure(plan.req_num_splits.len() == num_reqs && plan.token_request.len() == num_tokens, "workspace", || {
            format!(
                "a plan of {} requests / {} tokens for a batch of {num_reqs} / {num_tokens}",
                plan.req_num_splits.len(),
                plan.token_request.len()
            )
        })
    }

    /// Whether a batch of `num_reqs` requests and `num_tokens` query tokens fits.
    pub(crate) fn check_batch(&self, num_reqs: usize, num_tokens: usize) -> Result<()> {
        ensure(num_reqs <= self.max_reqs && num_tokens <= self.max_tokens, "workspace", || {
            format!("holds {} requests / {} tokens, the batch has {num_reqs} / {num_tokens}", self.max_reqs, self.max_tokens)
        })
    }
}

/// Counters a workspace of `partial_rows` rows needs for split-K merged in pass 1.
fn merge_counters(partial_rows: usize) -> usize {
    partial_rows / 2 + 1
}

/// Device addresses of an uploaded plan in a [`DecodeWorkspace`]; all 0 for a launch that
/// needs no plan on the device (its CTAs derive their items from their index).
#[derive(Default)]
pub(crate) struct WorkspacePtrs {
    pub items: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    pub token_request: u64,
    pub partial_out: u64,
    pub partial_lse: u64,
}

impl WorkspacePtrs {
    /// The split-K group of the attention parameter block: these partials and plan arrays.
    pub(crate) fn split_k(&self) -> SplitK {
        SplitK {
            partial_out: self.partial_out,
            partial_lse: self.partial_lse,
            req_num_splits: self.req_num_splits,
            req_partial_base: self.req_partial_base,
            work_items: self.items,
        }
    }
}

impl DecodeWorkspace {
    /// Uploads a plan's arrays (one copy enqueued on `stream`) after checking they fit.
    pub(crate) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        plan: &DecodePlan,
        num_reqs: usize,
        num_tokens: usize,
    ) -> Result<WorkspacePtrs> {
        self.check_plan(plan, num_reqs, num_tokens)?;
        let mut words = std::mem::take(&mut self.plan_words);
        words.clear();
        let r = append_plan(&mut words, plan);
        // One pageable copy: the driver sends a small one with the stream's commands, which
        // measured 8 us a call cheaper than a copy-engine transfer from pinned memory.
        let uploaded = stream.memcpy_htod(&words[..], &mut self.plan_device.slice_mut(..words.len()));
        self.plan_words = words;
        uploaded?;
        // The buffers live as long as the workspace, which the caller keeps past the launches.
        let base = self.plan_device.device_ptr(stream).0;
        let at = |r: Region| base + r.byte_offset() as u64;
        Ok(WorkspacePtrs {
            items: at(r.items),
            req_num_splits: at(r.req_num_splits),
            req_partial_base: at(r.req_partial_base),
            token_request: at(r.token_request),
            partial_out: self.partial_out.device_ptr_mut(stream).0,
            partial_lse: self.partial_lse.device_ptr_mut(stream).0,
        })
    }

    pub(crate) fn head_size(&self) -> usize {
        self.head_size
    }

    /// Where a planned launch's kernel finds the plan's arrays and the partials: nowhere, the
    /// partials alone (after checking that the plan fits), the plan uploaded here, or a device
    /// plan's arrays with this workspace's partials.
    pub(crate) fn arrays(
        &mut self,
        stream: &Arc<CudaStream>,
        launch: &LaunchPlan<'_>,
        num_reqs: usize,
        num_tokens: usize,
    ) -> Result<WorkspacePtrs> {
        match launch.arrays {
            PlanArrays::Derived => Ok(WorkspacePtrs::default()),
            PlanArrays::Partials => {
                self.check_plan(&launch.plan, num_reqs, num_tokens)?;
                Ok(self.partials_ptrs(stream))
            }
            PlanArrays::Upload => self.upload(stream, &launch.plan, num_reqs, num_tokens),
            PlanArrays::Device(dp) => Ok(WorkspacePtrs {
                items: dp.items,
                req_num_splits: dp.req_num_splits,
                req_partial_base: dp.req_partial_base,
                token_request: dp.token_request,
                partial_out: self.partial_out.device_ptr_mut(stream).0,
                partial_lse: self.partial_lse.device_ptr_mut(stream).0,
            }),
        }
    }
}
