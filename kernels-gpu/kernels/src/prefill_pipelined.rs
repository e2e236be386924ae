//! Hopper prefill with each warpgroup's matrix products under its own softmax
//! (`prefill_wgp_<q>_d64`, sm_90a; geometry in `attn_math::hopper_prefill`).
//!
//! The CTA (two warpgroups, 128 query rows), the 128-key tiles, the copies and the address
//! tables are those of [`crate::prefill_hopper`]; what differs is the schedule. There a
//! warpgroup waits for each `wgmma` chain, and only the other warpgroup's work fills the tensor
//! cores' idle time. Here a warpgroup works in half tiles of 64 keys (S of a half is 32
//! registers a thread, so two fit beside O), and per key tile j it
//! 1. passes the tile's barrier (K and V of j + 1 have landed),
//! 2. issues S of j's second half, then the copies of K and V of j + 2,
//! 3. retires P V of j - 1's second half, takes the softmax of j's first half, issues its P V,
//! 4. retires S of j's second half and issues S of j + 1's first,
//! 5. retires P V of j's first half, takes the softmax of j's second half, issues its P V,
//! 6. retires S of j + 1's first half (P V of j runs on through the next barrier).
//!
//! So the tensor cores always hold a chain of this warpgroup's while it takes a softmax. Nothing
//! reads an in-flight chain's registers: the waits name them as operands ([`wait_scores64`]
//! copies S out after the wait, [`wait_pv64`]), and in-flight chains meet only straight-line
//! code and branches that do not touch them (the last tile, which has no next S, is a separate
//! copy of the step). `cargo xtask ptx-report` fails if `ptxas` serialises the chains.
//!
//! Head size 128 measured slower this way (two V stages and a second barrier to fit 227 KB,
//! and spills: 282 against 327 TFLOP/s at 4 x 4096); it keeps [`crate::prefill_hopper`].

use crate::device::{dynamic_shared, fma, pdl_prologue, shfl_xor, static_for, sync_threads, thread_idx_x};
use crate::mma::{cp_async_16, cp_async_commit, cp_async_wait, fence_proxy_async_shared, ld_shared_u64x2, shared_addr, wgmma_desc};
use crate::prefill::{work_item, KeyTables, KvSource, Logits, RowInfo, RowOut};
use crate::vec_io::load_u32_nc;
use crate::wgmma::{wait_pv64, wait_scores64, WgmmaTiles};
use attn_math::hopper_prefill::{
    group_bytes, pipelined_layout, swizzled, BLOCK_M, BLOCK_N, PIPE_K_STAGES, PIPE_TABLE_SLOTS, PIPE_V_STAGES, THREADS,
};
use attn_math::params::PrefillParams;
use attn_math::prefill::TABLE_ENTRY;
use attn_math::softmax::{exp2, OnlineSoftmax};

const BN: usize = BLOCK_N as usize;

/// Copies `ROWS` rows of `D` 16-bit columns into the [`swizzled`] layout at `dst` by `NT`
/// threads (`t`: this one's index among them); `src(r)`: row r's address, 0 to zero-fill
/// (`fallback` named then, not read). Thread t always takes chunk `t % (D / 8)` of rows
/// `t / (D / 8) + i * NT / (D / 8)`: the rows a thread copies are a whole number of 8-row
/// groups apart, so their shared-memory addresses and table entries differ by constants.
#[inline(always)]
pub(crate) unsafe fn copy_rows<const D: usize, const ROWS: u32, const NT: u32>(dst: u32, t: u32, fallback: u64, src: impl Fn(u32) -> u64) {
    unsafe { copy_row_pairs::<D, ROWS, NT>([dst, dst], t, fallback, |r| (src(r), 0), false) }
}

/// [`copy_rows`] of two tiles at once (`dst[0]`, `dst[1]`; K and V) whose rows `src(r)` gives
/// together, zero-filled together when the first is 0; only the first when `!both`.
#[inline(always)]
pub(crate) unsafe fn copy_row_pairs<const D: usize, const ROWS: u32, const NT: u32>(
    dst: [u32; 2],
    t: u32,
    fallback: u64,
    src: impl Fn(u32) -> (u64, u64),
    both: bool,
) {
    let chunks = D as u32 / 8;
    const { assert!(NT.is_multiple_of(D as u32 / 8) && (NT / (D as u32 / 8)).is_multiple_of(8) && ROWS.is_multiple_of(NT / (D as u32 / 8))) };
    let (c, r0) = (t % chunks, t / chunks);
    let step = NT / chunks;
    let off0 = swizzled(D as u32, r0, c);
    static_for::<16>(|i| {
        if (i as u32) < ROWS / step {
            let (a, b) = src(r0 + i as u32 * step);
            let valid = a != 0;
            let bytes = if valid { 16 } else { 0 };
            // Rows `step` apart are `step / 8` groups apart.
            let off = off0 + i as u32 * (step / 8) * group_bytes(D as u32);
            unsafe { cp_async_16(dst[0] + off, if valid { a + c as u64 * 16 } else { fallback }, bytes) };
            if both {
                unsafe { cp_async_16(dst[1] + off, if valid { b + c as u64 * 16 } else { fallback }, bytes) };
            }
        }
    });
}

/// The max of each of a thread's two rows over a 64-row S block of `NB` column blocks (its
/// values of each, then the quad's 4 lanes), as four independent chains so that the
/// comparisons overlap.
#[inline(always)]
pub(crate) fn row_max<const NB: usize>(s: &[[f32; 4]; NB]) -> [f32; 2] {
    core::array::from_fn(|h| {
        let mut m = [f32::NEG_INFINITY; 4];
        static_for::<NB>(|n| {
            m[n % 4] = m[n % 4].max(s[n][2 * h]).max(s[n][2 * h + 1]);
        });
        let mut m = m[0].max(m[1]).max(m[2].max(m[3]));
        m = m.max(shfl_xor(m, 1));
        m.max(shfl_xor(m, 2))
    })
}

/// Raises the row's running max to cover the block's `block_max` (base-2 units); returns the
/// accumulator's rescale factor. Selects, no branches (an S chain is in flight).
#[inline(always)]
pub(crate) fn raise_max(st: &mut OnlineSoftmax, block_max: f32) -> f32 {
    let new_max = st.max.max(block_max);
    // exp2(-inf) = 0 for a row that had seen nothing; a row that still sees nothing keeps 1.
    let factor = if new_max == f32::NEG_INFINITY { 1.0 } else { exp2(st.max - new_max) };
    st.sum *= factor;
    st.max = new_max;
    factor
}

/// The block's weights `2^(s * mult - max)` in place, added to the rows' denominators (four
/// partial sums a row).
#[inline(always)]
pub(crate) fn weights<const NB: usize>(s: &mut [[f32; 4]; NB], state: &mut [OnlineSoftmax; 2], mult: f32) {
    static_for::<2>(|h| {
        // A row that has seen nothing yet keeps max -inf: its weights are all 0.
        let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
        let mut sum = [0.0f32; 4];
        static_for::<NB>(|n| {
            static_for::<2>(|e| {
                let w = exp2(fma(s[n][2 * h + e], mult, neg_max));
                s[n][2 * h + e] = w;
                sum[n % 4] += w;
            });
        });
        state[h].sum += (sum[0] + sum[1]) + (sum[2] + sum[3]);
    });
}

/// The kernel for head size `D` (QK = V) and 16-bit Q, K, V of type `Q`.
#[inline(always)]
pub unsafe fn prefill_pipelined<Q: WgmmaTiles, const D: usize>(p: &PrefillParams) {
    // Programmatic dependent launch: wait for the cache write before reading anything.
    pdl_prologue();
    const { assert!(D == 64 || D == 128) };
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let wg = warp / 4;
    let Some(w) = (unsafe { work_item(p, BLOCK_M, D as u32) }) else { return };
    let src = unsafe { KvSource::of(p, &w) };
    let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };
    let (begin, end) = unsafe { w.key_range(p, min_pos, max_pos) };
    let n_tiles = if end > begin { (end - begin).div_ceil(BLOCK_N) } else { 0 };

    let layout = pipelined_layout(D as u32);
    let gb = group_bytes(D as u32);
    let smem = shared_addr(dynamic_shared::<u8>());
    let tables = KeyTables::<BN> { base: smem + layout.table, slots: PIPE_TABLE_SLOTS, begin, end, n_tiles, src, elem_bytes: 2 };
    // Tile x sits in K stage x % 3 and V stage x % 4; a step takes its K stages' indices from
    // one remainder (`k_stages`), not a division each.
    const { assert!(PIPE_K_STAGES == 3 && PIPE_V_STAGES == 4) };
    let k_stage = |slot: u32| smem + layout.k + slot * layout.stage;
    let v_stage = |tile: u32| smem + layout.v + (tile % PIPE_V_STAGES) * layout.stage;
    let k_stages = |tile: u32| {
        let next = |x: u32| if x == 2 { 0 } else { x + 1 };
        let a = tile % 3;
        (a, next(a), next(next(a)))
    };
    // K and V of `tile` (K into stage `k_slot`), copied by the whole CTA.
    let copy_kv = |tile: u32, k_slot: u32| {
        let t = tables.table(tile);
        unsafe {
            copy_row_pairs::<D, BLOCK_N, THREADS>(
                [k_stage(k_slot), v_stage(tile)],
                tid,
                p.q,
                |r| ld_shared_u64x2(t + r * TABLE_ENTRY),
                true,
            )
        };
    };

    // Prologue: the address tables of tiles 0..3; the queries, K and V of tiles 0 and 1 in one
    // commit group.
    // The three lookups first: a fill may raise the status word (a global atomic), which the
    // next lookup's load could not pass, so interleaved they would take three load latencies.
    let locs: [i64; 3] = core::array::from_fn(|j| unsafe { tables.locate(p, j as u32) });
    static_for::<3>(|j| unsafe { tables.fill(p, j as u32, locs[j]) });
    sync_threads();
    let q_row = |r: u32| {
        let row = unsafe { w.row(p, r) };
        p.q + (row.token as u64 * p.q_token_stride + row.head as u64 * p.q_head_stride) * 2
    };
    unsafe { copy_rows::<D, BLOCK_M, THREADS>(smem + layout.q, tid, p.q, q_row) };
    if n_tiles > 0 {
        copy_kv(0, 0);
    }
    if n_tiles > 1 {
        copy_kv(1, 1);
    }
    cp_async_commit();

    // This thread's two rows (g and g + 8 of its warp's 16; a warpgroup's 64 rows are its
    // warps' in order), and the span of positions its warp sees.
    let warp_row0 = 16 * warp;
    let rows: [[RowInfo; 2]; 1] = [unsafe { [w.row(p, warp_row0 + g), w.row(p, warp_row0 + g + 8)] }];
    let warp_pos = unsafe { (w.row(p, warp_row0).pos, w.row(p, warp_row0 + 15).pos) };
    let logits = Logits::new(p, p.scale_log2, end);
    let mult = logits.mult();
    let q_desc = wgmma_desc(smem + layout.q + 64 * wg * 2 * D as u32, 16, gb, true);
    let k_desc = |addr: u32| wgmma_desc(addr, 16, gb, true);
    let v_desc = |addr: u32| wgmma_desc(addr, 1024, gb, true);

    let mut state = [OnlineSoftmax::EMPTY; 2];
    let mut o = [[0.0f32; 4]; 16];
    // The weights of the previous half tile, read by its in-flight P V.
    let mut pf = [[0u32; 4]; 4];
    // Half tile `h` (keys 64h..64h+63) of a K or V stage.
    let half = |stage: u32, h: u32| stage + h * 64 * D as u32 * 2;
    if n_tiles > 0 {
        cp_async_wait::<0>();
        fence_proxy_async_shared();
        sync_threads();
        // S of the current half tile, retired.
        let mut s = unsafe { wait_scores64::<0>(Q::scores_64x64_async::<D>(q_desc, k_desc(half(k_stage(0), 0)))) };
        // The softmax of half `h` of tile `j` (S in `s`, every chain before it retired but P V of
        // the previous half, and `$next` in flight), then its P V issued.
        macro_rules! softmax_pv {
            ($j:expr, $h:literal, $wait_pv:literal) => {{
                let (j, h): (u32, u32) = ($j, $h);
                let mut st = [s];
                let kt = begin + j * BLOCK_N + 64 * h;
                let (flags, table) = (tables.flags(j) + 8 * h, tables.table(j) + 64 * h * TABLE_ENTRY);
                unsafe { logits.apply::<1, 8, 64>(&mut st, &rows, kt, warp_pos, flags, table) };
                let [mut s_cur] = st;
                let m = row_max(&s_cur);
                // Retire P V of the previous half (O and its weights) before rescaling O.
                unsafe { wait_pv64::<$wait_pv, D>(&mut o, &pf) };
                static_for::<2>(|r| {
                    let factor = raise_max(&mut state[r], m[r] * mult);
                    static_for::<16>(|n| {
                        if n < D / 8 {
                            o[n][2 * r] *= factor;
                            o[n][2 * r + 1] *= factor;
                        }
                    });
                });
                weights(&mut s_cur, &mut state, mult);
                pf = core::array::from_fn(|kk| {
                    [
                        Q::pack2(s_cur[2 * kk][0], s_cur[2 * kk][1]),
                        Q::pack2(s_cur[2 * kk][2], s_cur[2 * kk][3]),
                        Q::pack2(s_cur[2 * kk + 1][0], s_cur[2 * kk + 1][1]),
                        Q::pack2(s_cur[2 * kk + 1][2], s_cur[2 * kk + 1][3]),
                    ]
                });
                unsafe { Q::pv_64xd_k64_async::<D>(&mut o, &pf, v_desc(half(v_stage(j), h))) };
            }};
        }
        // One tile `j` (`$last`: no next tile, so no S of its first half to run ahead).
        macro_rules! step {
            ($j:expr, $last:literal) => {{
                let j: u32 = $j;
                let (s0, s1, s2) = k_stages(j);
                // K and V of j + 1 have landed; every warp has retired S of j - 1 and P V of
                // j - 2, whose stages the copies below overwrite.
                cp_async_wait::<0>();
                fence_proxy_async_shared();
                sync_threads();
                let s_next = unsafe { Q::scores_64x64_async::<D>(q_desc, k_desc(half(k_stage(s0), 1))) };
                let ahead = unsafe { tables.locate(p, j + 3) };
                if j + 2 < n_tiles {
                    copy_kv(j + 2, s2);
                }
                cp_async_commit();
                // In flight: P V of j - 1's second half, S of j's second half.
                softmax_pv!(j, 0, 1);
                // In flight: S of j's second half, P V of its first.
                s = unsafe { wait_scores64::<1>(s_next) };
                if $last {
                    softmax_pv!(j, 1, 0);
                } else {
                    let s_next = unsafe { Q::scores_64x64_async::<D>(q_desc, k_desc(half(k_stage(s1), 0))) };
                    // In flight: P V of j's first half, S of j + 1's first half.
                    softmax_pv!(j, 1, 1);
                    // In flight: S of j + 1's first half, P V of j's second.
                    s = unsafe { wait_scores64::<1>(s_next) };
                }
                unsafe { tables.fill(p, j + 3, ahead) };
            }};
        }
        let mut j = 0;
        while j + 1 < n_tiles {
            step!(j, false);
            j += 1;
        }
        step!(n_tiles - 1, true);
        let _ = s;
        unsafe { wait_pv64::<0, D>(&mut o, &pf) };
    }
    cp_async_wait::<0>();

    let num_splits = if p.req_num_splits != 0 { unsafe { load_u32_nc(p.req_num_splits + w.req as u64 * 4) } } else { 1 };
    // The quad's partial sums, then the output (or the split's partial) per row.
    static_for::<2>(|h| {
        let mut st = state[h];
        st.sum += shfl_xor(st.sum, 1);
        st.sum += shfl_xor(st.sum, 2);
        if warp_row0 + g + 8 * h as u32 >= w.live {
            return;
        }
        let out = unsafe { RowOut::new::<D>(p, &w, &rows[0][h], st, num_splits, t4 == 0, 1.0) };
        static_for::<16>(|n| {
            if n < D / 8 {
                unsafe { out.store_pair::<Q>(n as u32 * 8 + 2 * t4, o[n][2 * h], o[n][2 * h + 1]) };
            }
        });
    });
}
