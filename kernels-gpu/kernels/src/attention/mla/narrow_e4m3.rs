//! The narrow shape (up to 16 query rows) over an FP8 cache on sm_90a: e4m3 `wgmma` with the
//! operands swapped (layout and shapes in `attn_math::mla::narrow_e4m3_layout`).
//!
//! With 16 query rows, `mma.sync` tiles (16 rows on M) leave each warp a chain of 36 dependent
//! MMAs for its share of S and a conversion per pair of cache bytes, and the kernel was bound
//! by those chains at two warps a scheduler, not by its bytes (docs/mla.md, "FP8"). Here the
//! keys are M:
//! - S^T = K Q^T: 18 k-steps of m64n16k32, K straight from its rows in shared memory, the
//!   queries quantised to e4m3 once per CTA (one scale a row, its largest magnitude to 448,
//!   folded into the row's score factor);
//! - O^T += V^T P^T: 8 M blocks of 64 columns x 2 k-steps; V^T's A fragments (4 keys of a
//!   column a register) come from the rows by `ldmatrix.trans` and one `prmt` a register, and
//!   P^T is stored as e4m3 bytes (the weights times 2^7 under a max that may lag the row's by
//!   up to 2^1.5, so that small weights keep e4m3's precision).
//!
//! Each warpgroup takes alternate tiles with its own softmax state and O^T (64 registers); the
//! tiles come through one ring of five buffers, so that three are in flight while each
//! warpgroup works on one. A warpgroup done with tile t copies tile t + 5 into its buffer (the
//! other warpgroup's), looking its rows up itself, and the copies complete the buffer's
//! `mbarrier` phase; inside the key loop the only other barriers are the warpgroup's own (named
//! barriers of 128 threads). At the end the two states are merged through shared memory, each
//! warpgroup storing half of the columns; when a request's splits run as a cluster, every
//! warpgroup of the cluster's CTAs is merged at once instead ([`cluster_merge`]).
//!
//! Keys are permuted between S and P V, which the sum over keys does not see: S^T's M row m of a
//! tile is the tile's key m; P^T column (and V^T's A column) k is key
//! `attn_math::mla::e4m3_rho(k)`, the order in which `ldmatrix.trans` hands a lane its keys.

use super::e4m3_operands::{copy_tile_rows, mask_scores, quantise_query_row, v_fragments, v_lanes, with_fp8_chains, Lookups};
use super::e4m3_softmax::{final_state, lazy_factors, publish_row_maxima, publish_row_sums, tile_maxima, weights_into_p};
use super::keys::KeySource;
use crate::attention::config::CacheFormat;
use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{self, dynamic_shared, fma, shfl_idx, static_for, sync_threads, thread_idx_x, PdlGate};
use crate::blocks::mbarrier;
use crate::blocks::mma::{
    cp_async_wait, fence_proxy_async_shared, ld_shared_f32, ld_shared_u32, ld_shared_u64, ld_shared_v4, shared_addr, st_shared_u64,
    st_shared_v4, wgmma_desc, MmaHalf,
};
use crate::blocks::vec_io::load_f32_nc;
use crate::blocks::wgmma::{wait_pv_t, wait_scores_t, NarrowFp8Chains};
use attn_math::mla::{narrow_e4m3_layout, E4M3_CLUSTER_RANKS, E4M3_RING, E4M3_TABLES, E4M3_TABLE_BYTES, E4M3_TILE_BYTES};
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// P is stored as `2^P_SHIFT` times the weights, so that small ones keep e4m3's precision; the
/// state's max carries the shift back out.
pub(super) const P_SHIFT: f32 = 7.0;
/// How far (base 2) a row's max may rise past the one its weights are taken under before O is
/// rescaled: weights stay under `2^(P_SHIFT + SLACK)` = 362, below e4m3's 448. Rescaling at
/// every rise cost 64 multiplies a tile nearly every tile (some row of 16 rises).
pub(super) const SLACK: f32 = 1.5;
/// Keys of a tile (M of every `wgmma`).
pub(super) const TILE: u32 = 64;

/// Named barrier of warpgroup `wg` (1 or 2; 0 is the CTA's).
#[inline(always)]
pub(super) fn warpgroup_barrier(wg: u32) {
    device::warpgroup_barrier::<1, 2>(wg)
}

/// The kernel body for `mla_<q>_<fp8>_narrow` on sm_90a (`super::kernel::mla_attention` calls
/// it for an FP8 cache's narrow shape): work item `w`, its keys `begin..end` from `src`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn narrow_e4m3<Q: MmaHalf, K: CacheFormat, S: KeySource>(
    p: &AttnParams,
    w: &Work,
    src: S,
    gate: &PdlGate,
    begin: u32,
    end: u32,
    causal: bool,
    min_pos: u32,
    q_row: impl Fn(u32) -> u64,
) {
    let l = narrow_e4m3_layout();
    let smem = shared_addr(dynamic_shared::<u8>());
    let tid = thread_idx_x();
    // Broadcast from lane 0: the same value, but `ptxas` then knows it is warp-uniform, so the
    // descriptors derived from it live in uniform registers (moved across for each `wgmma`
    // otherwise).
    let (wg, t) = (shfl_idx(tid / 128, 0), tid % 128);
    let (warp, lane) = (t / 32, t % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let n_tiles = if end > begin { (end - begin).div_ceil(TILE) } else { 0 };
    // This warpgroup's tiles: 2i + wg. The tiles it copies: 2m + 1 - wg (tile t + 5 once done
    // with tile t; before the loop, those under 5).
    let n_local = if wg == 0 { n_tiles.div_ceil(2) } else { n_tiles / 2 };
    let n_issue = if wg == 0 { n_tiles / 2 } else { n_tiles.div_ceil(2) };
    let issued = |m: u32| 2 * m + 1 - wg;
    // The index m of the tile it copies in its loop's first step.
    let m_first = 2 + wg;
    let buf = |tile: u32| smem + l.tiles + (tile % E4M3_RING) * E4M3_TILE_BYTES;
    let filled = |tile: u32| smem + l.bars + 8 * (tile % E4M3_RING);
    let handed = |w2: u32| smem + l.bars + 8 * (E4M3_RING + w2);
    let table = |tile: u32| smem + l.tables + (tile % E4M3_TABLES) * E4M3_TABLE_BYTES;
    let flag = |tile: u32, half: u32| table(tile) + TILE * 8 + 4 * half;
    let p_buf = smem + l.p + wg * 16 * 128;
    let maxima = smem + l.maxima + wg * 16 * 4 * 4;

    // Address lookups of the tiles this warpgroup copies (index m), two warps, a key a lane:
    // `early` two copies ahead, `locate` one ahead, the entry (`fill`) before the copy.
    let key_of = |m: u32| begin + issued(m) * TILE + 32 * warp + lane;
    let looks_up = |m: u32| warp < 2 && m < n_issue;
    let lookups = Lookups { p, src, end };
    let early = |m: u32| lookups.early(key_of(m), looks_up(m));
    let locate = |m: u32, e: S::Early| lookups.locate(key_of(m), looks_up(m), e);
    let fill = |m: u32, loc: S::Loc| {
        if looks_up(m) {
            let entry = table(issued(m)) + (32 * warp + lane) * 8;
            lookups.fill(key_of(m), loc, entry, flag(issued(m), warp), lane)
        }
    };
    // Copy m's 64 rows into its buffer (a barrier must separate the table's writes from this).
    let copy = |m: u32| {
        if m < n_issue {
            let tile = issued(m);
            // Rows of the new tokens wait for the kernel ahead (the cache write).
            gate.before_keys(begin + (tile + 1) * TILE);
            unsafe { copy_tile_rows::<4>(p, table(tile), buf(tile), 0, t, filled(tile)) };
        }
    };

    // The queries, quantised to e4m3 (16 threads a row), and each row's score factor.
    {
        let (n, sub) = (tid / 16, tid % 16);
        let live = n < w.live;
        let row = if live { q_row(n) } else { 0 };
        unsafe { quantise_query_row::<Q>(p, n, sub, live, row, smem + l.q, 16, smem + l.mult) };
    }
    if tid == 0 {
        static_for::<{ E4M3_RING as usize }>(|b| unsafe { mbarrier::init(filled(b as u32), 128 + 1) });
        static_for::<2>(|w2| unsafe { mbarrier::init(handed(w2 as u32), 128) });
    }
    // The tables of the tiles under 5 (copies 0 and 1, and 2 of warpgroup 1), and the lookups
    // of the next two copies.
    static_for::<3>(|m| {
        if (m as u32) < m_first {
            fill(m as u32, locate(m as u32, early(m as u32)));
        }
    });
    let mut loc_next = locate(m_first, early(m_first));
    let mut early_next = early(m_first + 1);
    fence_proxy_async_shared();
    sync_threads();
    gate.prologue();
    static_for::<3>(|m| {
        if (m as u32) < m_first {
            copy(m as u32);
        }
    });

    // This thread's query rows: N columns 2t4 + (r & 1) + 8 (r >> 1) of the accumulators.
    let rows_n = |r: usize| 2 * t4 + (r as u32 & 1) + 8 * (r as u32 >> 1);
    let mult: [f32; 4] = core::array::from_fn(|r| unsafe { ld_shared_f32(smem + l.mult + 4 * rows_n(r)) });
    let pos: [u32; 4] = core::array::from_fn(|r| if causal { unsafe { w.row(p, rows_n(r)).pos } } else { u32::MAX });
    let mut state = [OnlineSoftmax::EMPTY; 4];
    let mut o = [[0.0f32; 4]; 16];
    let mut v = [[0u32; 4]; 16];
    let desc_q = wgmma_desc(smem + l.q, 16, 1024, true);
    let desc_p = wgmma_desc(p_buf, 16, 1024, true);
    let v_lane = v_lanes(warp, lane);
    // This thread's output columns: `v_out + 16 b + h` for M block b, row g + 8 h.
    let v_out = 128 * warp + 2 * g;

    let mut i = 0;
    while i < n_local {
        let this = 2 * i + wg;
        unsafe {
            mbarrier::wait(filled(this), (this / E4M3_RING) & 1);
            fence_proxy_async_shared();
        }
        let tile = buf(this);
        let s = unsafe { with_fp8_chains!(K, F => F::scores_t(wgmma_desc(tile, 16, 1024, true), desc_q)) };
        // The table of the copy this step issues (tile this + 5, into this tile's buffer once
        // it is read); the lookups of the two after it.
        let mi = i + m_first;
        fill(mi, loc_next);
        loc_next = locate(mi + 1, early_next);
        early_next = early(mi + 2);
        let mut s = unsafe { wait_scores_t(s) };

        // V^T's A fragments of this tile.
        static_for::<2>(|ks| unsafe { v_fragments(tile, ks as u32, &v_lane, &mut v, 8 * ks) });

        // Masks where the tile crosses a boundary: key m = 16 warp + g + 8 (e >> 1).
        let first = begin + this * TILE;
        let has_bad = unsafe { ld_shared_u32(flag(this, 0)) | ld_shared_u32(flag(this, 1)) } != 0;
        let masked = first + TILE > end || (causal && first + TILE - 1 > min_pos) || has_bad;
        if masked {
            mask_scores(&mut s, first, end, has_bad, table(this), warp, g, |r| pos[r]);
        }
        // Each row's max over the warp's 16 keys, then the warpgroup's through shared memory.
        publish_row_maxima::<2, 4>(&s, |r| maxima + 4 * rows_n(r) * 4, warp, g);
        warpgroup_barrier(wg);
        let tile_max = tile_maxima(|r| maxima + 4 * rows_n(r) * 4, &mult);
        if let Some(factor) = lazy_factors(&mut state, &tile_max) {
            static_for::<16>(|b| static_for::<4>(|e| o[b][e] *= factor[2 * (b % 2) + (e & 1)]));
        }
        weights_into_p(&mut s, &mut state, &mult, masked, p_buf, 16, warp, lane);
        fence_proxy_async_shared();
        warpgroup_barrier(wg);
        unsafe { with_fp8_chains!(K, F => F::pv_t(&mut o, &v, desc_p)) };
        // This tile's buffer is free (S retired, V in registers, every warp past the barrier).
        copy(mi);
        // Retired before the loop's back edge: with a chain in flight across it, `ptxas`
        // serialised every chain (C7514), as in the prefill kernels.
        unsafe { wait_pv_t(&mut o, &v) };
        i += 1;
    }
    cp_async_wait::<0>();
    gate.before_writes();

    // Each row's sum over the warpgroup (every warp holds the same max).
    publish_row_sums(&state, |r| maxima + 4 * rows_n(r) * 4, warp, g, wg);
    static_for::<4>(|r| state[r] = final_state(&state[r], maxima + 4 * rows_n(r) * 4));
    let v_scale = unsafe { load_f32_nc(p.fp8.v_scale) };
    if p.mla.cluster > 1 {
        unsafe { cluster_merge::<Q>(p, w, smem + l.tiles, &o, &state, (wg, t), v_out, v_scale) };
        return;
    }
    // Merge: warpgroup `wg` stores M blocks 4 wg..4 wg + 3 (columns v_out + 64 wg ..) and hands
    // the other four, with its rows' states, to the other warpgroup through the buffer of its
    // last tile (no copy goes there any more: the next one would be its tile + 5, past the
    // end; with no tile, buffer wg + 1, which no tile of so short a work item uses), published
    // by an `mbarrier` arrival of each thread (release) and read after the other's wait
    // (acquire).
    warpgroup_barrier(wg);
    let other = 1 - wg;
    let last_buf = |w2: u32| {
        let n = if w2 == 0 { n_tiles.div_ceil(2) } else { n_tiles / 2 };
        if n > 0 {
            buf(2 * (n - 1) + w2)
        } else {
            buf(w2 + 1)
        }
    };
    let give = |w2: u32, k: u32| last_buf(w2) + (k * 128 + t) * 16;
    let states_at = |w2: u32, n: u32| last_buf(w2) + 8 * 128 * 16 + n * 8;
    // Constant indices only (each warpgroup's half a branch of its own): indexed by the
    // warpgroup, `o` would live in local memory.
    static_for::<2>(|h| {
        if h as u32 == other {
            static_for::<8>(|k| unsafe { st_shared_v4(give(wg, k as u32), o[8 * h + k].map(f32::to_bits)) });
        }
    });
    if warp == 0 && g == 0 {
        static_for::<4>(|r| unsafe {
            st_shared_u64(states_at(wg, rows_n(r)), (state[r].sum.to_bits() as u64) << 32 | state[r].max.to_bits() as u64)
        });
    }
    unsafe {
        mbarrier::arrive(handed(wg));
        mbarrier::wait(handed(other), 0);
    }
    let mut half = [[0.0f32; 4]; 8];
    let mut merged = [OnlineSoftmax::EMPTY; 4];
    let mut f = [[0.0f32; 2]; 4];
    static_for::<4>(|r| {
        let bits = unsafe { ld_shared_u64(states_at(other, rows_n(r))) };
        let theirs = OnlineSoftmax { max: f32::from_bits(bits as u32), sum: f32::from_bits((bits >> 32) as u32) };
        // The merged state and both sides' factors.
        merged[r] = state[r];
        let (a, b) = merged[r].merge(theirs);
        f[r] = [a, b];
    });
    static_for::<2>(|h| {
        if h as u32 == wg {
            static_for::<8>(|k| {
                let theirs = unsafe { ld_shared_v4(give(other, k as u32)) };
                static_for::<4>(|e| {
                    let r = 2 * (k % 2) + (e & 1);
                    half[k][e] = f[r][0] * o[8 * h + k][e] + f[r][1] * f32::from_bits(theirs[e]);
                });
            });
        }
    });
    let num_splits = unsafe { w.num_splits(p) };
    static_for::<4>(|r| {
        let n = rows_n(r);
        if n >= w.live {
            return;
        }
        let row = unsafe { w.row(p, n) };
        let out = unsafe { RowOut::new(p, w, &row, merged[r], num_splits, wg == 0 && warp == 0 && g == 0, v_scale, MLA_V) };
        let (j, e1) = (r / 2, r % 2);
        // Block 4 wg + kb of this row: columns v_out + 16 (4 wg + kb) and + 1 (M rows g, g + 8).
        static_for::<4>(|kb| {
            let acc = half[2 * kb + j];
            unsafe { out.store_pair::<Q>(v_out + 16 * (4 * wg + kb as u32), acc[e1], acc[2 + e1]) };
        });
    });
}

/// The splits of one request as the CTAs of a cluster (rank = split), combined through
/// distributed shared memory instead of the intra-CTA merge and the partials: once every
/// warpgroup of the cluster is done with its ring (a cluster barrier), each publishes its O^T
/// (`[16][128]` 16-byte entries, every thread's at the same place) and its rows' states in
/// buffer `wg` of its ring; after a second barrier, warpgroup `wg` of rank k combines entries
/// `8 wg + kk` with `kk % ranks == k` from both warpgroups of every rank under the merged row
/// states, and stores them as a one-split request would (LSE from rank 0); a third barrier keeps
/// each CTA's shared memory alive until all reads are done. At most `E4M3_CLUSTER_RANKS` (4)
/// ranks, the host's limit for this kernel: 8 states a row.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn cluster_merge<Q: MmaHalf>(
    p: &AttnParams,
    w: &Work,
    ring: u32,
    o: &[[f32; 4]; 16],
    state: &[OnlineSoftmax; 4],
    (wg, t): (u32, u32),
    v_out: u32,
    v_scale: f32,
) {
    use crate::blocks::cluster::{cluster_rank, cluster_sync, ld_cluster_v2, ld_cluster_v4, map_rank};
    let (warp, lane) = (t / 32, t % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let rows_n = |r: usize| 2 * t4 + (r as u32 & 1) + 8 * (r as u32 >> 1);
    let region = |s: u32| ring + s * E4M3_TILE_BYTES;
    let entry = |s: u32, k: u32| region(s) + (k * 128 + t) * 16;
    let state_at = |s: u32, n: u32| region(s) + 16 * 128 * 16 + n * 8;
    cluster_sync();
    static_for::<16>(|k| unsafe { st_shared_v4(entry(wg, k as u32), o[k].map(f32::to_bits)) });
    if warp == 0 && g == 0 {
        static_for::<4>(|r| unsafe {
            st_shared_u64(state_at(wg, rows_n(r)), (state[r].sum.to_bits() as u64) << 32 | state[r].max.to_bits() as u64)
        });
    }
    cluster_sync();
    // The host's plan launches at most `E4M3_CLUSTER_RANKS` ranks (`mla_cluster`); the bound
    // keeps the combine within the ranks whose states it holds whatever the launch says.
    let (ranks, me) = (p.mla.cluster.min(E4M3_CLUSTER_RANKS), cluster_rank());
    // Every source's (rank j, warpgroup s) state of this thread's rows, then their max, each
    // source's factor under it and the merged sum.
    let mut st = [[[OnlineSoftmax::EMPTY; 4]; 2]; 4];
    let mut merged = [OnlineSoftmax::EMPTY; 4];
    static_for::<4>(|j| {
        if (j as u32) < ranks {
            static_for::<2>(|s| {
                static_for::<4>(|r| {
                    let [max, sum] = unsafe { ld_cluster_v2(map_rank(state_at(s as u32, rows_n(r)), j as u32)) };
                    st[j][s][r] = OnlineSoftmax { max: f32::from_bits(max), sum: f32::from_bits(sum) };
                    merged[r].max = merged[r].max.max(st[j][s][r].max);
                });
            });
        }
    });
    let mut factor = [[[0.0f32; 4]; 2]; 4];
    static_for::<4>(|j| {
        if (j as u32) < ranks {
            static_for::<2>(|s| {
                static_for::<4>(|r| {
                    let src = st[j][s][r];
                    let f = if src.max == f32::NEG_INFINITY { 0.0 } else { exp2(src.max - merged[r].max) };
                    factor[j][s][r] = f;
                    merged[r].sum += f * src.sum;
                });
            });
        }
    });
    static_for::<4>(|r| {
        let n = rows_n(r);
        if n >= w.live {
            return;
        }
        let row = unsafe { w.row(p, n) };
        let first = me == 0 && wg == 0 && warp == 0 && g == 0;
        let out = unsafe { RowOut::new(p, w, &row, merged[r], 1, first, v_scale, MLA_V) };
        let (jn, e1) = (r / 2, r % 2);
        // Entries 8 wg + kk of this row (kk % 2 == jn): block 4 wg + kk / 2.
        static_for::<4>(|kb| {
            let kk = 2 * kb as u32 + jn as u32;
            if kk % ranks != me {
                return;
            }
            let (mut a, mut b) = (0.0f32, 0.0f32);
            static_for::<4>(|j| {
                if (j as u32) < ranks {
                    static_for::<2>(|s| {
                        let v = unsafe { ld_cluster_v4(map_rank(entry(s as u32, 8 * wg + kk), j as u32)) };
                        a = fma(factor[j][s][r], f32::from_bits(v[e1]), a);
                        b = fma(factor[j][s][r], f32::from_bits(v[2 + e1]), b);
                    });
                }
            });
            unsafe { out.store_pair::<Q>(v_out + 16 * (4 * wg + kb as u32), a, b) };
        });
    });
    cluster_sync();
}
