//! A call's launch, planned ([`plan_launch`]): the kernel ([`super::kernel`]), the batch's
//! split plan ([`super::split`]) or a device plan made for the same kernel, the grid, where the
//! kernel finds the plan's arrays, and whether the merge kernel follows. Nothing here touches
//! the device but the occupancy queries of the kernel's choice.

use super::kernel::{decode_tc_kernel, max_len, LayerShape, TcKernel};
use super::split::DecodePlan;
use crate::batch::DecodeBatch;
use crate::device::AttnDevice;
use crate::dtype::DType;
use crate::error::{ensure, Result};
use crate::kernels::KernelId;
use crate::layout::KvLayout;
use crate::options::{PlanOptions, Tuning};

/// A split plan already on the device (a CUDA-graph step's, [`crate::forward`]): its arrays,
/// and the header `[num_items, chunk]` the kernel reads, so that its grid can cover
/// `capacity_items` whatever the step's plan.
#[derive(Clone, Debug)]
pub(crate) struct DevicePlan {
    /// The kernel it was planned for (`TcKernel::id`).
    pub kernel: KernelId,
    /// The layer shape its offsets were computed for (its kernel's).
    pub layer: LayerShape,
    pub items: u64,
    pub req_num_splits: u64,
    pub req_partial_base: u64,
    pub token_request: u64,
    pub header: u64,
    pub capacity_items: usize,
    /// The most query tokens a request of the plan has: the kernel was chosen for it.
    pub query_len: u32,
    /// Tokens the merge covers: the first ones, where the decodes are (a mixed graph step's
    /// other tokens are the prefill kernel's).
    pub merge_tokens: usize,
    /// Whether the merge is launched: a graph's always (a replay's plan may split where the
    /// capture's did not), an eager step's when a request has several splits.
    pub needs_merge: bool,
    /// [`DecodePlan::cluster`].
    pub cluster: u32,
}

impl DevicePlan {
    /// Refuses a call whose kernel (which names the dtypes, cache format and head size) or
    /// layer shape is not the one planned.
    pub(crate) fn check_layer(&self, tc: &TcKernel) -> Result<()> {
        ensure(self.kernel == tc.id, "plan", || format!("was made for kernel {}, the call runs {}", self.kernel, tc.id))?;
        ensure(self.layer == tc.layer, "plan", || format!("was made for {:?}, the call has {:?}", self.layer, tc.layer))
    }
}

/// Where a call's split plan comes from: planned here from the host metadata and uploaded
/// (eager calls), or already on the device (graph steps: nothing is copied, and the launches
/// are the same whatever the plan).
#[derive(Clone, Copy)]
pub(crate) enum PlanSource<'p> {
    Host(PlanOptions),
    Device(&'p DevicePlan),
}

/// Where the kernel of a planned launch finds the plan's arrays.
#[derive(Clone, Copy, Debug)]
pub(crate) enum PlanArrays<'p> {
    /// Nowhere: its CTAs derive their work items from their index
    /// ([`DecodePlan::needs_device_plan`] false).
    Derived,
    /// Derived from the CTA index too, with the workspace's partials: uniform splits that the
    /// kernel merges itself ([`TcKernel::fused_merge`]).
    Partials,
    /// In the workspace, where the call uploads the plan.
    Upload,
    /// A plan already on the device: the grid covers its capacity, and CTAs past the step's
    /// items exit.
    Device(&'p DevicePlan),
}

/// A call's launch, planned: the kernel, the plan the call returns, where the kernel finds the
/// plan's arrays, the grid, the kernel's parameters that come from the plan, and whether the
/// merge kernel follows.
#[derive(Clone, Debug)]
pub(crate) struct LaunchPlan<'p> {
    pub kernel: TcKernel,
    /// The host plan (a device plan's call returns an empty one of its kernel).
    pub plan: DecodePlan,
    pub arrays: PlanArrays<'p>,
    /// Work items the grid covers, [`TcShape::ctas_per_item`] CTAs each.
    pub items: usize,
    /// `Shape::chunk`: the host plan's (a device plan's kernel reads its header).
    pub chunk: u32,
    /// `Schedule::plan`: a device plan's header, else 0.
    pub header: u64,
    /// `Schedule::uniform_splits`: the splits of every request when the CTAs derive their
    /// work items from their index, else 0.
    pub uniform_splits: u32,
    /// [`DecodePlan::cluster`] (the device plan's for a device plan).
    pub cluster: u32,
    /// Whether the merge kernel follows: requests with several splits, on a kernel that does not
    /// merge them itself.
    pub merge: bool,
}

impl LaunchPlan<'_> {
    /// CTAs of the grid.
    pub fn ctas(&self) -> usize {
        self.items * self.kernel.shape.ctas_per_item as usize
    }
}

/// Plans a call of `kernel` on `batch`: from the host metadata with the source's options (and
/// `cluster`, the cluster size for the plan: MLA's [`DecodePlan::cluster`]), or from a device
/// plan made for the same kernel and layer (refused otherwise). `partial_capacity`: the
/// workspace's partial rows.
pub(crate) fn plan_launch<'p>(
    kernel: TcKernel,
    batch: &DecodeBatch<'_>,
    source: PlanSource<'p>,
    partial_capacity: usize,
    cluster: impl FnOnce(&DecodePlan, &Tuning) -> u32,
) -> Result<LaunchPlan<'p>> {
    let merges = !kernel.fused_merge;
    match source {
        PlanSource::Device(dp) => {
            dp.check_layer(&kernel)?;
            Ok(LaunchPlan {
                plan: DecodePlan { kernel: kernel.kernel, ..DecodePlan::default() },
                arrays: PlanArrays::Device(dp),
                items: dp.capacity_items,
                chunk: 0,
                header: dp.header,
                uniform_splits: 0,
                cluster: dp.cluster,
                merge: dp.needs_merge && merges,
                kernel,
            })
        }
        PlanSource::Host(options) => {
            let tc = &kernel;
            let hq = tc.layer.num_q_heads;
            let mut plan = DecodePlan { kernel: tc.kernel, ..tc.plan(batch, hq, options.split, partial_capacity) };
            plan.cluster = cluster(&plan, &options.tuning);
            let arrays = if !plan.needs_device_plan() {
                PlanArrays::Derived
            } else if tc.fused_merge && plan.uniform_splits().is_some() {
                // Derived from the CTA index and merged in pass 1: only the partials' room.
                PlanArrays::Partials
            } else {
                PlanArrays::Upload
            };
            let uniform_splits = match arrays {
                PlanArrays::Derived | PlanArrays::Partials => plan.uniform_splits().unwrap_or(0),
                _ => 0,
            };
            Ok(LaunchPlan {
                arrays,
                items: plan.items.len() / 2,
                chunk: plan.chunk,
                header: 0,
                uniform_splits,
                cluster: plan.cluster,
                merge: plan.needs_merge() && merges,
                plan,
                kernel,
            })
        }
    }
}

/// The most query tokens a request of `batch` has (1 for an empty batch): the decode kernel is
/// chosen for it.
pub(crate) fn max_query_len(batch: &DecodeBatch<'_>) -> u32 {
    batch.query_start_loc.windows(2).map(|w| (w[1] - w[0]) as u32).max().unwrap_or(1)
}

/// The tensor-core kernel a call on `batch` runs for a layer of `hq` query heads over
/// `num_kv_heads` kv heads of head size `d` in a cache of `layout`. With a device plan, the kernel variant that
/// depends on the lengths (FP8's deep pipeline) is the plan's (a graph's runs whatever lengths
/// its steps have), and the tuning, which changes only the CTA target and the even waves, is
/// not the plan's own and not used.
#[allow(clippy::too_many_arguments)]
pub(crate) fn call_kernel(
    dev: &AttnDevice,
    q_dtype: DType,
    cache: DType,
    layout: KvLayout,
    d: usize,
    hq: usize,
    num_kv_heads: usize,
    batch: &DecodeBatch<'_>,
    source: PlanSource<'_>,
) -> Result<TcKernel> {
    // A device plan's kernel was chosen for its decodes (a mixed graph step's batch has
    // prefills too, which the plan leaves to the prefill kernel).
    let max_q = match source {
        PlanSource::Device(dp) => dp.query_len,
        PlanSource::Host(_) => max_query_len(batch),
    };
    let planned_len = match source {
        PlanSource::Device(dp) if matches!(dp.kernel, KernelId::DecodeKr { long: true, .. }) => u32::MAX,
        PlanSource::Device(_) => 0,
        PlanSource::Host(_) => max_len(batch.seq_lens),
    };
    let tuning = match source {
        PlanSource::Host(p) => p.tuning,
        PlanSource::Device(_) => Tuning::DEFAULT,
    };
    decode_tc_kernel(dev, q_dtype, cache, layout, d, hq, num_kv_heads, max_q, planned_len, &tuning)
}

#[cfg(test)]
mod tests {
    use super::super::kernel::DecodeKernel;
    use super::*;
    use crate::options::SplitMode;

    fn kernel(fused_merge: bool) -> TcKernel {
        TcKernel::keys_rows_d128(fused_merge)
    }

    fn device_plan(kernel: &TcKernel, needs_merge: bool) -> DevicePlan {
        DevicePlan {
            kernel: kernel.id,
            layer: kernel.layer,
            items: 0x1000,
            req_num_splits: 0x2000,
            req_partial_base: 0x3000,
            token_request: 0x4000,
            header: 0x5000,
            capacity_items: 96,
            query_len: 1,
            merge_tokens: 6,
            needs_merge,
            cluster: 0,
        }
    }

    /// Where a launch finds its plan, its grid and its parameters, for each kind of plan.
    #[test]
    fn plan_launch_of_each_kind_of_plan() {
        let (lens, qsl) = ([3001; 6], [0, 1, 2, 3, 4, 5, 6]);
        let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
        let host = |split| PlanSource::Host(PlanOptions { split, tuning: Tuning::DEFAULT });
        let no_cluster = |_: &DecodePlan, _: &Tuning| 0;

        // Uniform splits on a kernel that merges them itself: derived from the CTA index, with
        // the partials; no merge kernel.
        let lp = plan_launch(kernel(true), &batch, host(SplitMode::Fixed(4)), 1 << 20, no_cluster).unwrap();
        assert!(matches!(lp.arrays, PlanArrays::Partials));
        assert_eq!((lp.uniform_splits, lp.items, lp.header, lp.cluster, lp.merge), (4, 24, 0, 0, false));
        assert_eq!((lp.chunk, lp.ctas()), (lp.plan.chunk, 24 * 8));
        assert_eq!(lp.plan.kernel, DecodeKernel::TensorCoreKeys);
        // The same on a kernel that does not: uploaded, merged by the merge kernel.
        let lp = plan_launch(kernel(false), &batch, host(SplitMode::Fixed(4)), 1 << 20, no_cluster).unwrap();
        assert!(matches!(lp.arrays, PlanArrays::Upload));
        assert_eq!((lp.uniform_splits, lp.items, lp.merge), (0, 24, true));
        // One split each: derived, nothing merged.
        let lp = plan_launch(kernel(true), &batch, host(SplitMode::Fixed(1)), 1 << 20, no_cluster).unwrap();
        assert!(matches!(lp.arrays, PlanArrays::Derived));
        assert_eq!((lp.uniform_splits, lp.items, lp.merge), (0, 6, false));
        // Uneven splits: uploaded.
        let (uneven, qsl2) = ([3001, 10], [0, 1, 2]);
        let b2 = DecodeBatch { seq_lens: &uneven, query_start_loc: &qsl2 };
        let lp = plan_launch(kernel(true), &b2, host(SplitMode::Fixed(4)), 1 << 20, no_cluster).unwrap();
        assert!(matches!(lp.arrays, PlanArrays::Upload));
        assert_eq!((lp.uniform_splits, lp.merge), (0, false));
        // A cluster for the plan (MLA's): the splits are one cluster a request, derived.
        let lp = plan_launch(kernel(false), &batch, host(SplitMode::Fixed(4)), 1 << 20, |p: &DecodePlan, _: &Tuning| p.req_num_splits[0])
            .unwrap();
        assert!(matches!(lp.arrays, PlanArrays::Derived));
        assert_eq!((lp.cluster, lp.plan.cluster, lp.uniform_splits, lp.merge), (4, 4, 0, false));
    }

    #[test]
    fn plan_launch_of_a_device_plan() {
        let (lens, qsl) = ([3001; 6], [0, 1, 2, 3, 4, 5, 6]);
        let batch = DecodeBatch { seq_lens: &lens, query_start_loc: &qsl };
        let no_cluster = |_: &DecodePlan, _: &Tuning| 0;
        for (fused, needs_merge) in [(false, true), (true, true), (false, false)] {
            let k = kernel(fused);
            let dp = device_plan(&k, needs_merge);
            let lp = plan_launch(k, &batch, PlanSource::Device(&dp), 1 << 20, no_cluster).unwrap();
            assert!(matches!(lp.arrays, PlanArrays::Device(_)));
            assert_eq!((lp.items, lp.chunk, lp.header, lp.uniform_splits, lp.cluster), (96, 0, 0x5000, 0, 0));
            assert_eq!(lp.merge, needs_merge && !fused);
            assert_eq!(lp.plan, DecodePlan { kernel: DecodeKernel::TensorCoreKeys, ..DecodePlan::default() });
            assert_eq!(lp.ctas(), 96 * 8);
        }
        // A plan made for another kernel or layer is refused.
        let k = kernel(true);
        let other = DevicePlan {
            kernel: KernelId::DecodeTc { q: DType::BF16, rows: crate::kernels::CacheRows::Bits16, head_size: 128 },
            ..device_plan(&k, true)
        };
        assert!(plan_launch(k, &batch, PlanSource::Device(&other), 1 << 20, no_cluster).is_err());
        let heads = DevicePlan { layer: LayerShape { num_q_heads: 64, ..k.layer }, ..device_plan(&k, true) };
        assert!(plan_launch(k, &batch, PlanSource::Device(&heads), 1 << 20, no_cluster).is_err());
    }
}
