//! The splits of one MLA request run by the CTAs of a cluster and combined through distributed
//! shared memory (sm_90a).

use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{fma, static_for, thread_idx_x};
use crate::blocks::mma::{st_shared_u64, st_shared_v4, MmaHalf};
use attn_math::mla::{self, THREADS};
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::softmax::OnlineSoftmax;

/// Output columns of a narrow warp: 8 accumulator tiles of 8 columns.
#[cfg(wgmma)]
const NARROW_TILES: usize = (mla::NARROW.cols_per_warp() / 8) as usize;

/// The splits of one request, run by the CTAs of a cluster (rank = split), combined through
/// distributed shared memory (narrow shape: every warp holds all 16 rows, `NARROW_TILES` pairs
/// of columns per row in the `mma` C layout, pair `n` at columns `pair_column(n)` and `+ 1`; the
/// thread whose first pair is column 0 writes the row's LSE). Each CTA publishes its unnormalised accumulators (`[tile][thread]`
/// 16-byte entries: conflict-free, and every CTA's thread finds its own fragment at the same
/// offset) and its rows' states at `publish`; after a cluster barrier, rank k combines the
/// column tiles `n` with `n % ranks == k` from every rank under the merged row states and
/// stores the output as a one-split request would (LSE from rank 0); a second barrier keeps
/// every CTA's shared memory alive until all reads are done.
#[cfg(wgmma)]
#[inline(always)]
pub(super) unsafe fn cluster_combine<Q: MmaHalf>(
    p: &AttnParams,
    w: &Work,
    publish: u32,
    o: &[[f32; 4]; 32],
    states: [OnlineSoftmax; 2],
    pair_column: impl Fn(u32) -> u32,
    v_scale: f32,
) {
    use crate::blocks::cluster::{cluster_rank, cluster_sync, ld_cluster_v2, ld_cluster_v4, map_rank};
    const THREAD_BYTES: u32 = 16;
    let tid = thread_idx_x();
    let (lane, warp) = (tid % 32, tid / 32);
    let (g, t4) = (lane / 4, lane % 4);
    let entry = |n: u32| publish + (n * THREADS + tid) * THREAD_BYTES;
    let state_at = |r: u32| publish + NARROW_TILES as u32 * THREADS * THREAD_BYTES + r * 8;
    static_for::<NARROW_TILES>(|n| unsafe { st_shared_v4(entry(n as u32), o[n].map(f32::to_bits)) });
    if warp == 0 && t4 == 0 {
        static_for::<2>(|h| unsafe {
            st_shared_u64(state_at(g + 8 * h as u32), (states[h].sum.to_bits() as u64) << 32 | states[h].max.to_bits() as u64)
        });
    }
    cluster_sync();
    let (ranks, me) = (p.mla.cluster, cluster_rank());
    // Every rank's rows under the merged maxima: factor[rank][h].
    let mut merged = [OnlineSoftmax::EMPTY; 2];
    let mut factor = [[0.0f32; 2]; 8];
    static_for::<8>(|j| {
        if (j as u32) < ranks {
            static_for::<2>(|h| {
                let [max, sum] = unsafe { ld_cluster_v2(map_rank(state_at(g + 8 * h as u32), j as u32)) };
                let other = OnlineSoftmax { max: f32::from_bits(max), sum: f32::from_bits(sum) };
                let (a, b) = merged[h].merge(other);
                // Earlier ranks' factors follow the merged max down.
                static_for::<8>(|i| {
                    if i < j {
                        factor[i][h] *= a;
                    }
                });
                factor[j][h] = b;
            });
        }
    });
    static_for::<2>(|h| {
        let r = g + 8 * h as u32;
        if r >= w.live {
            return;
        }
        let row = unsafe { w.row(p, r) };
        let out = unsafe { RowOut::new(p, w, &row, merged[h], 1, me == 0 && pair_column(0) == 0, v_scale, MLA_V) };
        static_for::<NARROW_TILES>(|n| {
            if n as u32 % ranks != me {
                return;
            }
            let (mut a, mut b) = (0.0f32, 0.0f32);
            static_for::<8>(|j| {
                if (j as u32) < ranks {
                    let v = unsafe { ld_cluster_v4(map_rank(entry(n as u32), j as u32)) };
                    a = fma(factor[j][h], f32::from_bits(v[2 * h]), a);
                    b = fma(factor[j][h], f32::from_bits(v[2 * h + 1]), b);
                }
            });
            unsafe { out.store_pair::<Q>(pair_column(n as u32), a, b) };
        });
    });
    cluster_sync();
}
