//! The wide shape's seesaw order (sm_90a; FlashMLA's schedule): the two warpgroups take
//! alternate 64-key tiles, so that one's softmax runs under the other's MMAs.
//!
//! Warpgroup 0 holds O's columns 0-255, warpgroup 1 columns 256-511, both for all 64 query
//! rows; each scores whole tiles of its own (even tiles: 0, odd: 1) into its own half of the ring
//! (`attn_math::mla::seesaw_layout`). Per pair of tiles a (warpgroup 0's) and b (warpgroup 1's),
//! with m the rows' running max:
//! 1. 0: S_a (issued at the end of the last pair); m_a = max(m, rowmax S_a); P_a = exp2(S_a - m_a)
//!    into a's rope columns, m_a published (`SCORED_0`); O_L rescaled, O_L += P_a V_a[L] issued.
//! 2. 1: S_b; after `SCORED_0`: O_R rescaled to m_a, O_R += P_a V_a[R] issued; then, under it,
//!    m_b = max(m_a, rowmax S_b), P_b into b's rope columns, m_b published (`SCORED_1`).
//! 3. 0: after `SCORED_1`, once P_a V_a[L] has retired: O_L rescaled to m_b, O_L += P_b V_b[L].
//!    1: once P_a V_a[R] has retired (`FREED_0`: a's buffer may take tile a + 2): O_R rescaled
//!    to m_b, O_R += P_b V_b[R].
//! 4. Each warpgroup copies its next tile into its buffer once the other is done reading it
//!    (`FREED_0`, `FREED_1`), one `cp.async` group a 64-column atom, and issues its S at once:
//!    each three atoms' k-steps wait for those atoms (`MmaHalf::wgmma_64x64_k576_landing_async`).
//!    Warpgroup 0 copies a 16-bit tile's atoms 0-3 (its own V columns) earlier, in step 1, as
//!    soon as its own P V on the tile before has retired.
//!
//! Both warpgroups end with the same running max (each takes the other's published one), so
//! their denominators, each over its own tiles' keys, add up at the end.
//!
//! Shared memory holds Q and two tiles (72 KB each): a tile's copy can start only once the P V
//! that read each of its atoms on the tile before it in that buffer has retired.

use super::keys::KeySource;
use super::slots::{copy_queries, copy_tile_warpgroup};
use crate::attention::lazy_rescale::must_rescale;
use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{
    dynamic_shared, fma, named_barrier, pdl_prologue, shfl_idx, shfl_xor, static_for, sync_threads, thread_idx_x, vote_any,
};
use crate::blocks::mbarrier;
use crate::blocks::mma::{
    cp_async_commit, cp_async_wait, fence_proxy_async_shared, ld_shared_f32, ld_shared_u32, ld_shared_u64, shared_addr, st_shared_f32,
    st_shared_u32, wgmma_desc, MmaHalf,
};
use crate::blocks::wgmma::{wait_acc256, wait_scores64, Acc};
use attn_math::mla::{self, seesaw_layout, swizzled, GROUP_BYTES, SLOT_KEYS};
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// The `mbarrier`s between the warpgroups (128 arrivals, every thread of the signalling
/// warpgroup; a phase a pair of tiles): warpgroup k's tile scored, its P and row maxima published
/// (`SCORED_k`); warpgroup k's buffer freed by the other (`FREED_k`). (Named barriers, arrived at
/// by one side and waited at by the other, order the same; racecheck reported every exchange
/// through them as a race.)
const SCORED_0: u32 = 0;
const SCORED_1: u32 = 1;
const FREED_0: u32 = 2;
const FREED_1: u32 = 3;
/// At the end: warpgroup k's row sums published (one phase).
const SUMMED_0: u32 = 4;
const SUMMED_1: u32 = 5;
/// Named barriers of one warpgroup (128 threads): its tables are filled, an atom of its next
/// tile has landed, a step of an FP8 tile's conversion is done.
const LANDED_0: u32 = 1;
const LANDED_1: u32 = 2;

/// Where the work item's keys run: `[begin, end)` in `n_tiles` tiles of 64; the causal mask and
/// the first query row's position.
#[derive(Clone, Copy)]
pub(super) struct Span {
    pub begin: u32,
    pub end: u32,
    pub n_tiles: u32,
    pub causal: bool,
    pub min_pos: u32,
}

/// O scaled row by row (`f[h]`: the factor of this thread's row h), unless every row of the
/// warp keeps its max (a warp-uniform branch: 128 multiplies a thread skipped).
#[inline(always)]
fn rescale(o: &mut Acc, f: [f32; 2]) {
    if vote_any(f[0] != 1.0 || f[1] != 1.0) {
        static_for::<2>(|h| {
            static_for::<32>(|n| {
                o[n][2 * h] *= f[h];
                o[n][2 * h + 1] *= f[h];
            });
        });
    }
}

/// The running max of this thread's rows for a tile whose raw row maxima are `m`: raised (and
/// the factors for O returned) only when some row of the warp passes its max by more than the
/// slack ([`must_rescale`]); otherwise every row keeps its max and O stays as it is. The other
/// warpgroup takes the published max as it is, so both keep the same.
#[inline(always)]
fn raise_lazily(state: &mut [OnlineSoftmax; 2], m: [f32; 2], mult: f32) -> [f32; 2] {
    if must_rescale(state, m, mult) {
        [state[0].rescale_to(m[0] * mult), state[1].rescale_to(m[1] * mult)]
    } else {
        [1.0; 2]
    }
}

/// The seesaw kernel body: `early`, `locate`, `fill` and `table` are the kernel's address-table
/// steps (`super::kernel`), `q_row(r)` the address of query row r; `mult` the scores' factor
/// (base 2). The cache's rows are of Q's type (an FP8 cache takes `super::wide_e4m3`).
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(super) unsafe fn seesaw<Q: MmaHalf, S: KeySource>(
    p: &AttnParams,
    w: &Work,
    span: Span,
    mult: f32,
    early: impl Fn(u32) -> S::Early,
    locate: impl Fn(u32, S::Early) -> S::Loc,
    fill: impl Fn(u32, S::Loc),
    table: impl Fn(u32) -> u32,
    q_row: impl Fn(u32) -> u64,
) {
    let (base, lay) = (mla::shared_layout(mla::WIDE, false), seesaw_layout());
    let tid = thread_idx_x();
    // Broadcast so that `ptxas` knows it warp-uniform (the descriptors below stay uniform).
    let warp = shfl_idx(tid / 32, 0);
    let (wg, wl) = (warp / 4, warp % 4);
    let (g, t4) = ((tid % 32) / 4, tid % 4);
    let smem = shared_addr(dynamic_shared::<u8>());
    let buffer = |k: u32| smem + base.k + k * lay.tile;
    let (mine, theirs) = (buffer(wg), buffer(1 - wg));
    let n_tiles = span.n_tiles;
    let maxima = |k: u32, r: u32| smem + lay.maxima + (k * mla::WIDE.block_m + r) * 4;
    let rows_h = |h: usize| 16 * wl + g + 8 * h as u32;
    // The rows' positions (the causal mask); the rest of a row is looked up again at the end
    // (held across the key loop, it spilled).
    let pos = unsafe { [w.row(p, rows_h(0)).pos, w.row(p, rows_h(1)).pos] };

    // Prologue: the first tile's tables (two warps a warpgroup, a slot each), the queries, the
    // first tile of each warpgroup.
    if wl < 2 {
        let j = 2 * wg + wl;
        fill(j, locate(j, early(j)));
    }
    let mut early_next = if wl < 2 { early(2 * (wg + 2) + wl) } else { S::NO_EARLY };
    let bar = |k: u32| smem + lay.bars + 8 * k;
    if tid == 0 {
        static_for::<6>(|k| unsafe { mbarrier::init(bar(k as u32), 128) });
    }
    sync_threads();
    unsafe { copy_queries(smem + base.q, mla::WIDE.block_m, q_row) };
    cp_async_commit();
    // Programmatic dependent launch: the cache rows wait for the kernel ahead (module docs of
    // `super::kernel`).
    pdl_prologue();
    // A tile's two address tables (its two 32-row slots).
    let tables = |tile: u32| [table(2 * tile), table(2 * tile + 1)];
    let copy = |tile: u32| unsafe { copy_tile_warpgroup::<0, 9>(mine, tables(tile), p.qkv.q) };
    // A 16-bit tile of warpgroup 0 in two parts: atoms 0-3 (V columns 0-255, which only this
    // warpgroup's P V reads) once its own P V on the tile before has retired, atoms 4-8 once
    // warpgroup 1's has too (`FREED_0`).
    let copy_own_atoms = |tile: u32| unsafe { copy_tile_warpgroup::<0, 4>(mine, tables(tile), p.qkv.q) };
    let copy_other_atoms = |tile: u32| unsafe { copy_tile_warpgroup::<4, 9>(mine, tables(tile), p.qkv.q) };
    // The warpgroup's own barrier (128 threads).
    let warpgroup_sync = || {
        if wg == 0 {
            named_barrier::<LANDED_0, 128>();
        } else {
            named_barrier::<LANDED_1, 128>();
        }
    };
    if wg < n_tiles {
        copy(wg);
    }
    cp_async_wait::<0>();
    fence_proxy_async_shared();
    sync_threads();
    let (q_desc, k_desc) = (wgmma_desc(smem + base.q, 16, GROUP_BYTES, true), wgmma_desc(mine, 16, GROUP_BYTES, true));
    let mut s = [[0.0f32; 4]; 8];
    if wg < n_tiles {
        s = unsafe { Q::wgmma_64x64_k576_async(q_desc, k_desc) };
    }
    // S over a tile whose copies are still landing (an atom at a time).
    let issue_scores = || unsafe {
        if wg == 0 {
            Q::wgmma_64x64_k576_landing_async::<LANDED_0>(q_desc, k_desc)
        } else {
            Q::wgmma_64x64_k576_landing_async::<LANDED_1>(q_desc, k_desc)
        }
    };

    // O += P V of the tile in buffer `at` (its P in its rope columns), this warpgroup's columns.
    let pv = |o: &mut Acc, at: u32| {
        let atom = wg * (MLA_V / 2 / 64) * 1024;
        let a = wgmma_desc(at + lay.p, 16, GROUP_BYTES, true);
        let b0 = wgmma_desc(at + atom, 1024, GROUP_BYTES, true);
        let b1 = wgmma_desc(at + base.k_slot + atom, 1024, GROUP_BYTES, true);
        unsafe { Q::wgmma_pv_64x256_k64_async(o, a, b0, b1) };
    };
    // Keys outside the span, the causal mask, and keys whose block was not read (-inf).
    let mask = |s: &mut [[f32; 4]; 8], tile: u32| {
        let first = span.begin + tile * 64;
        let flag = |j: u32| unsafe { ld_shared_u32(table(j) + SLOT_KEYS * 8) } != 0;
        let has_bad = flag(2 * tile) || flag(2 * tile + 1);
        if first + 64 > span.end || (span.causal && first + 63 > span.min_pos) || has_bad {
            static_for::<8>(|n| {
                static_for::<4>(|e| {
                    let k = n as u32 * 8 + 2 * t4 + (e % 2) as u32;
                    let key = first + k;
                    let entry = table(2 * tile + k / SLOT_KEYS) + (k % SLOT_KEYS) * 8;
                    let visible =
                        key < span.end && (!span.causal || key <= pos[e / 2]) && (!has_bad || unsafe { ld_shared_u64(entry) } != 0);
                    if !visible {
                        s[n][e] = f32::NEG_INFINITY;
                    }
                });
            });
        }
    };
    // The rows' maxima of raw scores (over the warp's 4 lanes of a row).
    let row_max = |s: &[[f32; 4]; 8]| {
        let mut m = [f32::NEG_INFINITY; 2];
        static_for::<2>(|h| {
            static_for::<8>(|n| m[h] = m[h].max(s[n][2 * h]).max(s[n][2 * h + 1]));
            m[h] = m[h].max(shfl_xor(m[h], 1));
            m[h] = m[h].max(shfl_xor(m[h], 2));
        });
        m
    };
    // Weights under the rows' current max into P (this warpgroup's tile's rope columns), their
    // sum into the denominators, and the max published for the other warpgroup.
    let publish = |s: &[[f32; 4]; 8], state: &mut [OnlineSoftmax; 2]| {
        static_for::<2>(|h| {
            let r = rows_h(h);
            let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
            static_for::<8>(|n| {
                let w0 = exp2(fma(s[n][2 * h], mult, neg_max));
                let w1 = exp2(fma(s[n][2 * h + 1], mult, neg_max));
                state[h].sum += w0 + w1;
                unsafe { st_shared_u32(mine + swizzled(r, MLA_V / 8 + n as u32) + 4 * t4, Q::pack2(w0, w1)) };
            });
            if t4 == 0 {
                unsafe { st_shared_f32(maxima(wg, r), state[h].max) };
            }
        });
        // P is read by `wgmma` (the async proxy), the other warpgroup's too.
        fence_proxy_async_shared();
        unsafe { mbarrier::arrive(bar(if wg == 0 { SCORED_0 } else { SCORED_1 })) };
    };
    // Waits for phase `pair` of barrier k.
    let wait = |k: u32, pair: u32| unsafe { mbarrier::wait(bar(k), pair % 2) };
    // Raises the rows' max to the other warpgroup's published one; the factors for O.
    let take_max = |state: &mut [OnlineSoftmax; 2]| {
        let mut f = [1.0f32; 2];
        static_for::<2>(|h| f[h] = state[h].rescale_to(unsafe { ld_shared_f32(maxima(1 - wg, rows_h(h))) }));
        f
    };

    // The key loop, one copy a warpgroup (`$wg`): a `wgmma` chain in flight where the two
    // warpgroups' paths joined would be copied, which `ptxas` answers by serialising every chain.
    macro_rules! key_loop {
        ($wg:literal) => {{
            let mut o: Acc = [[0.0f32; 4]; 32];
            let mut state = [OnlineSoftmax::EMPTY; 2];
            let mut pair = 0;
            while pair < n_tiles.div_ceil(2) {
                let t = 2 * pair + $wg;
                // Whether the tile after a (after b) exists: buffer 0 (1) takes it.
                let refill = [2 * pair + 2 < n_tiles, 2 * pair + 3 < n_tiles];
                let has_b = 2 * pair + 1 < n_tiles;
                let ahead = if wl < 2 { locate(2 * (t + 2) + wl, early_next) } else { S::NO_LOC };
                early_next = if wl < 2 { early(2 * (t + 4) + wl) } else { S::NO_EARLY };
                // Retired on every path (nothing else is in flight here): a chain that `ptxas`
                // cannot rule out is still running when issued again is serialised.
                s = unsafe { wait_scores64::<0>(s) };
                let mut m = [f32::NEG_INFINITY; 2];
                if t < n_tiles {
                    mask(&mut s, t);
                    m = row_max(&s);
                }
                if $wg == 0 {
                    let f = raise_lazily(&mut state, m, mult);
                    publish(&s, &mut state);
                    rescale(&mut o, f);
                    pv(&mut o, mine);
                    if wl < 2 {
                        fill(2 * (t + 2) + wl, ahead);
                    }
                    // P_a V_a[L] retired: O is rescaled below, and a 16-bit tile a + 2's first
                    // four atoms may land over the columns it read while warpgroup 1 takes its
                    // softmax.
                    unsafe { wait_acc256::<0>(&mut o) };
                    if refill[0] {
                        // The tables just filled, to the copying threads.
                        warpgroup_sync();
                        copy_own_atoms(t + 2);
                    }
                    if has_b {
                        wait(SCORED_1, pair);
                        let f = take_max(&mut state);
                        rescale(&mut o, f);
                        pv(&mut o, theirs);
                    }
                } else {
                    wait(SCORED_0, pair);
                    let f = take_max(&mut state);
                    rescale(&mut o, f);
                    pv(&mut o, theirs);
                    let mut f = [1.0f32; 2];
                    if has_b {
                        f = raise_lazily(&mut state, m, mult);
                        publish(&s, &mut state);
                    }
                    if wl < 2 {
                        fill(2 * (t + 2) + wl, ahead);
                    }
                    unsafe { wait_acc256::<0>(&mut o) };
                    if refill[0] {
                        unsafe { mbarrier::arrive(bar(FREED_0)) };
                    }
                    if has_b {
                        rescale(&mut o, f);
                        pv(&mut o, mine);
                        // Retired before the next tile's copy (it reads the buffer that takes it).
                        unsafe { wait_acc256::<0>(&mut o) };
                    }
                }
                // This warpgroup's next tile into its buffer once the other is done reading it,
                // then its S.
                let next = refill[$wg];
                if next {
                    wait(if $wg == 0 { FREED_0 } else { FREED_1 }, pair);
                    if $wg == 0 {
                        copy_other_atoms(t + 2);
                    } else {
                        // The tables just filled, to the copying threads.
                        warpgroup_sync();
                        copy(t + 2);
                    }
                }
                // Warpgroup 0: P_b V_b[L] retired, so buffer 1 is free (1 retired its own above).
                unsafe { wait_acc256::<0>(&mut o) };
                if $wg == 0 && refill[1] {
                    unsafe { mbarrier::arrive(bar(FREED_1)) };
                }
                if next {
                    s = issue_scores();
                }
                pair += 1;
            }
            unsafe { wait_acc256::<0>(&mut o) };
            (o, state)
        }};
    }
    let (o, state) = if wg == 0 { key_loop!(0) } else { key_loop!(1) };

    // The denominators: this thread's share summed over its row's lanes, then the two
    // warpgroups' (both under the same max), exchanged through their own barriers.
    let mut sum = [state[0].sum, state[1].sum];
    static_for::<2>(|h| {
        sum[h] += shfl_xor(sum[h], 1);
        sum[h] += shfl_xor(sum[h], 2);
    });
    let sums = |k: u32, r: u32| smem + lay.sums + (k * mla::WIDE.block_m + r) * 4;
    if t4 == 0 {
        static_for::<2>(|h| unsafe { st_shared_f32(sums(wg, rows_h(h)), sum[h]) });
    }
    unsafe { mbarrier::arrive(bar(if wg == 0 { SUMMED_0 } else { SUMMED_1 })) };
    wait(if wg == 0 { SUMMED_1 } else { SUMMED_0 }, 0);
    let num_splits = unsafe { w.num_splits(p) };
    static_for::<2>(|h| {
        let r = rows_h(h);
        if r >= w.live {
            return;
        }
        let row_state = OnlineSoftmax { max: state[h].max, sum: sum[h] + unsafe { ld_shared_f32(sums(1 - wg, r)) } };
        let row = unsafe { w.row(p, r) };
        let out = unsafe { RowOut::new(p, w, &row, row_state, num_splits, t4 == 0 && wg == 0, 1.0, MLA_V) };
        static_for::<32>(|n| unsafe { out.store_pair::<Q>(wg * (MLA_V / 2) + n as u32 * 8 + 2 * t4, o[n][2 * h], o[n][2 * h + 1]) });
    });
}
