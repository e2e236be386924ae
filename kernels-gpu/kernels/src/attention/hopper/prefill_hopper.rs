//! Prefill on Hopper's warpgroup MMA (sm_90a): FlashAttention's tiled online softmax with
//! `wgmma` for both products (`attn_math::hopper_prefill` has the geometry).
//!
//! A CTA of two warpgroups takes 128 query rows (row = token * group + head-in-group, as on the
//! `mma.sync` path) of one request and kv head. K/V tiles of 128 keys stream through a two-stage
//! `cp.async` pipeline into shared memory in the 128-byte-swizzled layout, their row addresses
//! looked up a tile ahead ([`KeyTables`]). Per tile a warpgroup computes S = Q K^T (64 x 128,
//! `wgmma` from shared memory), turns it into logits (masks only on tiles that cross a
//! boundary), updates its rows' online softmax in registers, packs P into `wgmma` A fragments
//! and adds P V (V read N-major from the tile). A warpgroup whose rows see none of a tile's keys
//! skips it (under causality the first warpgroup's rows end earlier).
//!
//! The warpgroups run half a tile apart so that one's softmax overlaps the other's matrix
//! products: per tile the first computes S, softmax and P V; the second first adds P V of the
//! previous tile, then computes S and softmax of this one. One barrier per tile: after it the
//! tile is visible to both warpgroups and both are done with what the next copies overwrite.
//! The first warpgroup copies the next tile's K (the stage of the previous tile's K, read by
//! both before the barrier), the second the next V (the stage of the previous V, which it has
//! just read), so two stages suffice.

use crate::attention::hopper::Wgmma;
use crate::attention::kv::{KeyTables, KvSource};
use crate::attention::logits::{softmax_step, Logits};
use crate::attention::output::RowOut;
use crate::attention::work::{work_item, RowInfo};
use crate::blocks::device::{dynamic_shared, pdl_prologue, shfl_xor, static_for, sync_threads, thread_idx_x};
use crate::blocks::mma::{cp_async_16, cp_async_commit, cp_async_wait, fence_proxy_async_shared, ld_shared_u64, shared_addr, wgmma_desc};
use crate::blocks::wgmma::WgmmaTiles;
use attn_math::hopper_prefill::{group_bytes, shared_layout, swizzled, BLOCK_M, BLOCK_N, STAGES, THREADS};
use attn_math::params::AttnParams;
use attn_math::prefill::TABLE_ENTRY;
use attn_math::softmax::OnlineSoftmax;
use core::marker::PhantomData;

const BN: usize = BLOCK_N as usize;

/// The shape the shared helpers see: whole tiles.
type Config<Q, const D: usize> = Wgmma<Q, D, BN>;

/// Copies 128 rows (a Q or K/V tile) of `D` 16-bit columns into the [`swizzled`] layout at
/// `dst` by `NT` threads (`t`: this one's index among them); `src(r)`: row r's address, 0 to
/// zero-fill (`fallback` named then, not read). Consecutive threads take consecutive chunks of
/// a row, so that a warp instruction reads whole rows.
#[inline(always)]
unsafe fn copy_tile<const D: usize, const NT: u32>(dst: u32, t: u32, fallback: u64, src: impl Fn(u32) -> u64) {
    const { assert!(BLOCK_M == BLOCK_N && (NT == THREADS || NT == THREADS / 2)) };
    let chunks = D as u32 / 8;
    static_for::<16>(|i| {
        if i < BLOCK_N as usize * D / 8 / NT as usize {
            let idx = t + i as u32 * NT;
            let (r, c) = (idx / chunks, idx % chunks);
            let a = src(r);
            let (from, bytes) = if a != 0 { (a + c as u64 * 16, 16) } else { (fallback, 0) };
            unsafe { cp_async_16(dst + swizzled(D as u32, r, c), from, bytes) };
        }
    });
}

/// The kernel for head size `D` (QK = V; 64 or 128) and 16-bit Q, K, V of type `Q`.
#[inline(always)]
pub unsafe fn prefill_hopper<Q: WgmmaTiles, const D: usize>(p: &AttnParams) {
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

    let layout = shared_layout(D as u32);
    let gb = group_bytes(D as u32);
    let smem = shared_addr(dynamic_shared::<u8>());
    let tables = KeyTables::<Config<Q, D>> {
        base: smem + layout.table,
        slots: STAGES + 1,
        begin,
        end,
        n_tiles,
        src,
        elem_bytes: 2,
        config: PhantomData,
    };
    let k_stage = |tile: u32| smem + layout.k + (tile % STAGES) * layout.stage;
    let v_stage = |tile: u32| smem + layout.v + (tile % STAGES) * layout.stage;
    // Half a tile's copies, by one warpgroup: K (the first) or V (the second).
    let copy_half = |tile: u32, v: bool| {
        let t = tables.table(tile) + if v { 8 } else { 0 };
        let dst = if v { v_stage(tile) } else { k_stage(tile) };
        unsafe { copy_tile::<D, { THREADS / 2 }>(dst, tid % 128, p.qkv.q, |r| ld_shared_u64(t + r * TABLE_ENTRY)) };
    };

    // Prologue: the address tables of tiles 0 and 1; the queries and tile 0 in one commit group.
    static_for::<2>(|j| unsafe { tables.fill(p, j as u32, tables.locate(p, j as u32)) });
    sync_threads();
    let q_row = |r: u32| {
        let row = unsafe { w.row(p, r) };
        p.qkv.q + (row.token as u64 * p.qkv.q_token_stride + row.head as u64 * p.qkv.q_head_stride) * 2
    };
    unsafe { copy_tile::<D, THREADS>(smem + layout.q, tid, p.qkv.q, q_row) };
    if n_tiles > 0 {
        copy_half(0, wg == 1);
    }
    cp_async_commit();

    // This thread's two rows (g and g + 8 of its warp's 16; a warpgroup's 64 rows are its
    // warps' in order), and the span of positions its warp and warpgroup see.
    let warp_row0 = 16 * warp;
    let rows: [[RowInfo; 2]; 1] = [unsafe { [w.row(p, warp_row0 + g), w.row(p, warp_row0 + g + 8)] }];
    let warp_pos = unsafe { (w.row(p, warp_row0).pos, w.row(p, warp_row0 + 15).pos) };
    let group_row0 = 64 * wg;
    let group_live = group_row0 < w.live;
    let group_max_pos = unsafe { w.row(p, group_row0 + 63).pos };
    let logits = Logits::new(p, p.variant.scale_log2, end);
    let mult = logits.mult();
    let q_desc = wgmma_desc(smem + layout.q + group_row0 * 2 * D as u32, 16, gb, true);

    let mut state = [OnlineSoftmax::EMPTY; 2];
    let mut o = [[0.0f32; 4]; 16];
    // The second warpgroup's weights of the previous tile, added to O at the start of the next
    // (`pending`).
    let mut pf = [[0u32; 4]; 8];
    let mut pending = false;
    // S of a tile, the logits, the softmax step and the tile's weights as `wgmma` A fragments.
    // (Issuing S before the copies and waiting after them measured 5-6% slower on the H100:
    // the in-flight accumulators cost spills inside the loop.)
    let scores_to_weights = |tile: u32, o: &mut [[f32; 4]; 16], state: &mut [OnlineSoftmax; 2]| {
        let kt = begin + tile * BLOCK_N;
        let mut s = [unsafe { Q::scores_64x128::<D>(q_desc, wgmma_desc(k_stage(tile), 16, gb, true)) }];
        unsafe { logits.apply::<Config<Q, D>, 1, 16>(&mut s, &rows, kt, warp_pos, tables.flags(tile), tables.table(tile)) };
        softmax_step::<Config<Q, D>, 16, 16>(&mut s[0], o, state, mult);
        let s = &s[0];
        let pf: [[u32; 4]; 8] = core::array::from_fn(|kk| {
            [
                Q::pack2(s[2 * kk][0], s[2 * kk][1]),
                Q::pack2(s[2 * kk][2], s[2 * kk][3]),
                Q::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                Q::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            ]
        });
        pf
    };
    let v_desc = |tile: u32| wgmma_desc(v_stage(tile), 1024, gb, true);
    let mut tile = 0;
    while tile < n_tiles {
        // The lookup for tile + 2 starts now and lands in its table after this tile's math.
        let ahead = unsafe { tables.locate(p, tile + 2) };
        cp_async_wait::<0>();
        // The copies are read by `wgmma`, through the async proxy.
        fence_proxy_async_shared();
        sync_threads();
        // A warpgroup without live rows, or (causal) whose rows all precede the tile, skips its
        // math (the condition is uniform over the warpgroup, as `wgmma` needs).
        let active = group_live && (p.mask.causal == 0 || begin + tile * BLOCK_N <= group_max_pos);
        if wg == 0 {
            // K of the next tile into the stage both warpgroups' scores of the previous one
            // read; then S, softmax, P V of this tile.
            if tile + 1 < n_tiles {
                copy_half(tile + 1, false);
            }
            cp_async_commit();
            if active {
                let pf = scores_to_weights(tile, &mut o, &mut state);
                unsafe { Q::pv_64xd_k128::<D>(&mut o, &pf, v_desc(tile)) };
            }
        } else {
            // Half a tile behind: P V of the previous tile first (its V stage is then free for
            // the next tile's V), then S and softmax of this one, whose P V waits for the next
            // iteration. The warpgroups' matrix products and softmax steps thus interleave.
            if pending {
                unsafe { Q::pv_64xd_k128::<D>(&mut o, &pf, v_desc(tile - 1)) };
            }
            if tile + 1 < n_tiles {
                copy_half(tile + 1, true);
            }
            cp_async_commit();
            pending = active;
            if active {
                pf = scores_to_weights(tile, &mut o, &mut state);
            }
        }
        unsafe { tables.fill(p, tile + 2, ahead) };
        tile += 1;
    }
    cp_async_wait::<0>();
    if pending {
        unsafe { Q::pv_64xd_k128::<D>(&mut o, &pf, v_desc(n_tiles - 1)) };
    }

    let num_splits = unsafe { w.num_splits(p) };
    // The quad's partial sums, then the output (or the split's partial) per row. (Staging the
    // rows in shared memory for 16-byte stores measured no faster on the H100.)
    static_for::<2>(|h| {
        let mut st = state[h];
        st.sum += shfl_xor(st.sum, 1);
        st.sum += shfl_xor(st.sum, 2);
        if warp_row0 + g + 8 * h as u32 >= w.live {
            return;
        }
        let out = unsafe { RowOut::new(p, &w, &rows[0][h], st, num_splits, t4 == 0, 1.0, D) };
        static_for::<16>(|n| {
            if n < D / 8 {
                unsafe { out.store_pair::<Q>(n as u32 * 8 + 2 * t4, o[n][2 * h], o[n][2 * h + 1]) };
            }
        });
    });
}
