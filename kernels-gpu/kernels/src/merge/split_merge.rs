//! Split-K's merge inside pass 1, for the keys-split decode kernels: the CTA of a work item
//! that finishes last combines the item's partials, so a split batch is one launch, not two
//! (`attn_math::params::Schedule::merge_counters`). The merge kernel
//! (`crate::merge::lse_merge`'s `decode_merge`) stays for the other kernels; both weigh partials
//! by their LSEs the same way. Built into the attention family, whose kernels call it.

use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{atomic_add_acq_rel_gpu, static_for, sync_threads, thread_idx_x};
use crate::blocks::mma::{ld_shared_u32, st_shared_u32, MmaHalf};
use crate::blocks::vec_io::{load16_cg, load_f32_cg, store4};
use attn_math::params::{merge_counter_index, AttnParams};
use attn_math::prefill::THREADS;
use attn_math::softmax::{OnlineSoftmax, LOG2_E};

/// Split-K's merge inside pass 1 (`Schedule::merge_counters`): called by every thread of
/// a work item's CTA once its partial rows are stored, it counts the CTA in; the CTA that
/// arrives last combines the item's `num_splits` partials (its own among them) into the output
/// and zeroes the counter for the next launch, the others return. `R` rows of `THREADS / R`
/// threads each, 16-byte column chunks; `flag`: a free word of shared memory.
///
/// Ordering: the CTA barrier puts every thread's partial stores before thread 0's acq_rel
/// add, which releases them and acquires the stores of the CTAs that added before; the loads
/// that follow (after a second barrier) go to L2 (`.cg`), never to a stale L1 line.
#[inline(always)]
pub(crate) unsafe fn merge_item_splits<Q: MmaHalf, const DV: usize, const R: u32>(p: &AttnParams, w: &Work, num_splits: u32, flag: u32) {
    let tid = thread_idx_x();
    let base = unsafe { w.partial_base(p) };
    sync_threads();
    if tid == 0 {
        let counter = p.schedule.merge_counters + merge_counter_index(base, p.shape.num_q_heads, p.shape.group, w.kv_head) * 4;
        let last = unsafe { atomic_add_acq_rel_gpu(counter, 1) } + 1 == num_splits;
        if last {
            unsafe { store4(counter, 0) };
        }
        unsafe { st_shared_u32(flag, last as u32) };
    }
    sync_threads();
    let per_row = THREADS / R;
    let (r, t) = (tid / per_row, tid % per_row);
    if unsafe { ld_shared_u32(flag) } == 0 || r >= w.live {
        return;
    }
    let row = unsafe { w.row(p, r) };
    let first = base + (row.token - w.q_start) as u64 * p.shape.num_q_heads as u64 + row.head as u64;
    let split_stride = w.q_len as u64 * p.shape.num_q_heads as u64;
    // Four splits at a time: their LSEs and this thread's chunks load together (one round trip),
    // then fold into a softmax state of denominator 1 each (partials are normalised).
    // The launch's row width (its head size, at most the kernel's `DV`).
    let dv = p.dims.v_or(DV as u32);
    let chunks = dv / 4;
    let mut state = OnlineSoftmax::EMPTY;
    let mut acc = [[0.0f32; 4]; 4];
    let mut s0 = 0;
    while s0 < num_splits {
        let mut lse = [f32::NEG_INFINITY; 4];
        let mut v = [[[0u32; 4]; 4]; 4];
        static_for::<4>(|j| {
            if s0 + (j as u32) < num_splits {
                let index = first + (s0 as u64 + j as u64) * split_stride;
                lse[j] = unsafe { load_f32_cg(p.split.partial_lse + index * 4) };
                static_for::<4>(|i| {
                    let c = t + per_row * i as u32;
                    if i as u32 * per_row < chunks && c < chunks {
                        v[j][i] = unsafe { load16_cg(p.split.partial_out + (index * dv as u64 + 4 * c as u64) * 4) };
                    }
                });
            }
        });
        static_for::<4>(|j| {
            let (a, b) = state.merge(OnlineSoftmax { max: lse[j] * LOG2_E, sum: 1.0 });
            static_for::<4>(|i| {
                static_for::<4>(|e| {
                    // An empty split (weight 0) adds nothing, whatever its row holds.
                    acc[i][e] = acc[i][e] * a + if b != 0.0 { f32::from_bits(v[j][i][e]) * b } else { 0.0 };
                });
            });
        });
        s0 += 4;
    }
    let out = unsafe { RowOut::new(p, w, &row, state, 1, t == 0, 1.0, dv) };
    static_for::<4>(|i| {
        let c = t + per_row * i as u32;
        if i as u32 * per_row < chunks && c < chunks {
            unsafe {
                out.store_pair::<Q>(4 * c, acc[i][0], acc[i][1]);
                out.store_pair::<Q>(4 * c + 2, acc[i][2], acc[i][3]);
            }
        }
    });
}
