//! Split-K's merge inside pass 1, for the keys-split decode kernels: the CTA of a work item
//! that finishes last combines the item's partials, so a split batch is one launch, not two
//! (`attn_math::params::Schedule::merge_counters`). The merge kernel
//! (`crate::merge::lse_merge`'s `decode_merge`) stays for the other kernels; both weigh partials
//! by their LSEs the same way. Many splits merge in two levels, so that no one CTA folds them all. Built into the attention family, whose kernels call it.

use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{atomic_add_acq_rel_gpu, static_for, sync_threads, thread_idx_x};
use crate::blocks::mma::{ld_shared_u32, st_shared_u32, MmaHalf};
use crate::blocks::vec_io::{load16_cg, load_f32_cg, store4};
use attn_math::params::{merge_counter_index, merge_group_counter_index, merge_group_splits, AttnParams};
use attn_math::prefill::THREADS;
use attn_math::softmax::{OnlineSoftmax, LOG2_E};

/// Split-K's merge inside pass 1 (`Schedule::merge_counters`): called by every thread of
/// a work item's CTA once its partial rows are stored, it counts the CTA in; the CTA that
/// arrives last combines the item's `num_splits` partials (its own among them) into the output
/// and zeroes the counter for the next launch, the others return. From
/// `TWO_LEVEL_MERGE_SPLITS` splits on, in two levels (`attn_math::params::merge_group_splits`):
/// the last CTA of each group of splits folds the group into the partial rows of its first
/// split, then counts in at the item's counter, and the last of the groups folds the groups.
/// `R` rows of `THREADS / R` threads each, 16-byte column chunks; `flag`: a free word of shared
/// memory.
///
/// Ordering: the CTA barrier puts every thread's partial stores before thread 0's acq_rel
/// add, which releases them and acquires the stores of the CTAs that added before; the loads
/// that follow (after a second barrier) go to L2 (`.cg`), never to a stale L1 line.
#[inline(always)]
pub(crate) unsafe fn merge_item_splits<Q: MmaHalf, const DV: usize, const R: u32>(p: &AttnParams, w: &Work, num_splits: u32, flag: u32) {
    let base = unsafe { w.partial_base(p) };
    let (hq, group) = (p.shape.num_q_heads, p.shape.group);
    let group_splits = merge_group_splits(num_splits);
    let mut folded = Folded { first: 0, step: 1, count: num_splits };
    if group_splits < num_splits {
        let g = w.split / group_splits;
        let first = g * group_splits;
        let count = group_splits.min(num_splits - first);
        let counter = p.schedule.merge_counters + merge_group_counter_index(base, hq, group, w.kv_head, g) * 4;
        if !unsafe { arrive_last(counter, count, flag) } {
            return;
        }
        if count > 1 {
            let fold = Folded { first, step: 1, count };
            let (state, acc) = unsafe { fold_splits::<DV, R>(p, w, base, fold) };
            // Every thread has read the group's rows before the first's are overwritten.
            sync_threads();
            let mut at_first = *w;
            at_first.split = first;
            unsafe { store_rows::<Q, DV, R>(p, &at_first, state, &acc, num_splits) };
        }
        folded = Folded { first: 0, step: group_splits, count: num_splits.div_ceil(group_splits) };
    }
    let counter = p.schedule.merge_counters + merge_counter_index(base, hq, group, w.kv_head) * 4;
    if !unsafe { arrive_last(counter, folded.count, flag) } {
        return;
    }
    let (state, acc) = unsafe { fold_splits::<DV, R>(p, w, base, folded) };
    unsafe { store_rows::<Q, DV, R>(p, w, state, &acc, 1) };
}

/// 16-byte column chunks a thread of the merge takes of a row: `DV / 4` chunks over `THREADS / R`
/// threads a row (4 for the keys-as-rows kernels' rows, 8 for 16 rows of width 256).
const fn chunk_slots<const DV: usize, const R: u32>() -> u32 {
    let slots = (DV as u32 / 4).div_ceil(THREADS / R);
    assert!(slots <= 8);
    slots
}

/// The splits a fold reads: `count` of them, `step` apart from `first`.
#[derive(Clone, Copy)]
struct Folded {
    first: u32,
    step: u32,
    count: u32,
}

/// Counts the CTA in at `counter` (after a CTA barrier: every thread's stores before it) and
/// says, the same to every thread, whether it arrived last of `arrivals`; the last zeroes the
/// counter for the next launch.
#[inline(always)]
unsafe fn arrive_last(counter: u64, arrivals: u32, flag: u32) -> bool {
    sync_threads();
    if thread_idx_x() == 0 {
        let last = unsafe { atomic_add_acq_rel_gpu(counter, 1) } + 1 == arrivals;
        if last {
            unsafe { store4(counter, 0) };
        }
        unsafe { st_shared_u32(flag, last as u32) };
    }
    sync_threads();
    (unsafe { ld_shared_u32(flag) }) != 0
}

/// This thread's row and columns of the folded splits' partials: their softmax state
/// (denominator 1 each: partials are normalised) and the weighted sum of its 16-byte chunks.
/// Four splits at a time: their LSEs and chunks load together (one round trip).
#[inline(always)]
unsafe fn fold_splits<const DV: usize, const R: u32>(p: &AttnParams, w: &Work, base: u64, fold: Folded) -> (OnlineSoftmax, [[f32; 4]; 8]) {
    let tid = thread_idx_x();
    let per_row = THREADS / R;
    let (r, t) = (tid / per_row, tid % per_row);
    let slots = const { chunk_slots::<DV, R>() };
    let mut state = OnlineSoftmax::EMPTY;
    let mut acc = [[0.0f32; 4]; 8];
    // Threads past the live rows fold the last live row again (`store_rows` stores nothing of
    // theirs). Returning early here let the compiler copy the CTA barrier that follows a fold
    // into both paths: warps then reached `bar.sync` at two addresses (synccheck's "divergent
    // threads"), and where a warp holds a live row and a dead one that is undefined.
    let row = unsafe { w.row(p, r.min(w.live.saturating_sub(1))) };
    let first = base + (row.token - w.q_start) as u64 * p.shape.num_q_heads as u64 + row.head as u64;
    let split_stride = w.q_len as u64 * p.shape.num_q_heads as u64;
    // The launch's row width (its head size, at most the kernel's `DV`).
    let dv = p.dims.v_or(DV as u32);
    let chunks = dv / 4;
    let mut k0 = 0;
    while k0 < fold.count {
        let mut lse = [f32::NEG_INFINITY; 4];
        let mut v = [[[0u32; 4]; 8]; 4];
        static_for::<4>(|j| {
            if k0 + (j as u32) < fold.count {
                let split = fold.first + (k0 + j as u32) * fold.step;
                let index = first + split as u64 * split_stride;
                lse[j] = unsafe { load_f32_cg(p.split.partial_lse + index * 4) };
                static_for::<8>(|i| {
                    let c = t + per_row * i as u32;
                    if (i as u32) < slots && i as u32 * per_row < chunks && c < chunks {
                        v[j][i] = unsafe { load16_cg(p.split.partial_out + (index * dv as u64 + 4 * c as u64) * 4) };
                    }
                });
            }
        });
        static_for::<4>(|j| {
            let (a, b) = state.merge(OnlineSoftmax { max: lse[j] * LOG2_E, sum: 1.0 });
            static_for::<8>(|i| {
                if (i as u32) >= slots {
                    return;
                }
                static_for::<4>(|e| {
                    // An empty split (weight 0) adds nothing, whatever its row holds.
                    acc[i][e] = acc[i][e] * a + if b != 0.0 { f32::from_bits(v[j][i][e]) * b } else { 0.0 };
                });
            });
        });
        k0 += 4;
    }
    (state, acc)
}

/// Stores this thread's folded row and columns: into the output (`num_splits` 1), or as the
/// partial rows of `w.split` (a group's fold, with its LSE).
#[inline(always)]
unsafe fn store_rows<Q: MmaHalf, const DV: usize, const R: u32>(
    p: &AttnParams,
    w: &Work,
    state: OnlineSoftmax,
    acc: &[[f32; 4]; 8],
    num_splits: u32,
) {
    let tid = thread_idx_x();
    let per_row = THREADS / R;
    let (r, t) = (tid / per_row, tid % per_row);
    if r >= w.live {
        return;
    }
    let row = unsafe { w.row(p, r) };
    let dv = p.dims.v_or(DV as u32);
    let chunks = dv / 4;
    let slots = const { chunk_slots::<DV, R>() };
    let out = unsafe { RowOut::new(p, w, &row, state, num_splits, t == 0, 1.0, dv) };
    static_for::<8>(|i| {
        let c = t + per_row * i as u32;
        if (i as u32) < slots && i as u32 * per_row < chunks && c < chunks {
            unsafe {
                out.store_pair::<Q>(4 * c, acc[i][0], acc[i][1]);
                out.store_pair::<Q>(4 * c + 2, acc[i][2], acc[i][3]);
            }
        }
    });
}
