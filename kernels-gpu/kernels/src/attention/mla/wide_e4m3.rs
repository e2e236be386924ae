//! The wide shape (17 to 64 query rows) over an FP8 cache on sm_90a: e4m3 `wgmma` with the keys
//! on M, as the narrow shape's ([`super::narrow_e4m3`]), with 32 query rows on N (layout in
//! `attn_math::mla::wide_e4m3_layout`).
//!
//! The seesaw order converted each FP8 tile to 16-bit rows in shared memory before its MMAs
//! and reached 0.8-0.88 of the bf16 cache's rate at 128 heads (docs/mla.md, "FP8 on the
//! seesaw order"). Here the cache's bytes are the operands as they are. Each warpgroup takes 32
//! of the query rows through every tile, with a softmax state and O^T of its own:
//! - S^T = K Q^T: 18 k-steps of m64n32k32, K straight from its rows, the queries quantised to
//!   e4m3 once per CTA (one scale a row, folded into the row's score factor);
//! - O^T += V^T P^T: 8 M blocks of 64 columns (128 accumulators a thread), a chain for each
//!   32 keys; V^T's A fragments come from the rows by `ldmatrix.trans` and one `prmt` a
//!   register (a chain's worth at a time), P^T is e4m3 in shared memory (the weights times 2^7
//!   under a max that may lag the row's by up to 2^1.5).
//!
//! The warpgroups share only the tiles, so that one's softmax runs under the other's MMAs. A
//! first build split the columns between them instead (each scoring half the rows, both adding
//! P V of all of them): every tile then needed both halves of P and a CTA barrier, the
//! warpgroups ran in step, and the tensor pipe waited through each softmax (1.09x the seesaw
//! order, against 1.3x and more predicted; docs/mla.md). Tiles come through a ring of four
//! buffers: a warpgroup done reading tile t arrives on its "freed" barrier, and at tile t + 1
//! it copies its 32 rows of tile t + 4 into that buffer once both have arrived.
//!
//! Keys are permuted between S and P V as in the narrow kernel (`attn_math::mla::e4m3_rho`).

use super::e4m3_operands::{copy_tile_rows, mask_scores, quantise_query_row, v_fragments, v_lanes, with_fp8_chains, Lookups};
use super::e4m3_softmax::{final_state, lazy_factors, publish_row_maxima, publish_row_sums, tile_maxima, weights_into_p};
use super::keys::KeySource;
// The tile and the warpgroup barrier: the narrow kernel's.
use super::narrow_e4m3::{warpgroup_barrier, TILE};
use crate::attention::config::CacheFormat;
use crate::attention::output::RowOut;
use crate::attention::work::Work;
use crate::blocks::device::{dynamic_shared, shfl_idx, static_for, sync_threads, thread_idx_x, PdlGate};
use crate::blocks::mbarrier;
use crate::blocks::mma::{
    cp_async_wait, fence_proxy_async_shared, ld_shared_f32, ld_shared_u32, shared_addr, st_shared_u32, wgmma_desc, MmaHalf,
};
use crate::blocks::vec_io::load_f32_nc;
use crate::blocks::wgmma::{wait_pv_t32, wait_scores_t32, WideFp8Chains};
use attn_math::mla::{wide_e4m3_layout, E4M3_TABLE_BYTES, E4M3_TILE_BYTES, WIDE_E4M3_P_BYTES, WIDE_E4M3_RING, WIDE_E4M3_TABLES};
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::softmax::OnlineSoftmax;

/// The ring's buffers.
const RING: u32 = WIDE_E4M3_RING;

/// The kernel body for `mla_<q>_<fp8>_wide` on sm_90a (`super::kernel::mla_attention` calls it
/// for an FP8 cache's wide shape): work item `w`, its keys `begin..end` from `src`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn wide_e4m3<Q: MmaHalf, K: CacheFormat, S: KeySource>(
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
    let l = wide_e4m3_layout();
    let smem = shared_addr(dynamic_shared::<u8>());
    let tid = thread_idx_x();
    // Broadcast from lane 0, so that `ptxas` knows it is warp-uniform (the narrow kernel's
    // reason: descriptors derived from it stay in uniform registers).
    let (wg, t) = (shfl_idx(tid / 128, 0), tid % 128);
    let (warp, lane) = (t / 32, t % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let n_tiles = if end > begin { (end - begin).div_ceil(TILE) } else { 0 };
    let buf = |tile: u32| smem + l.tiles + (tile % RING) * E4M3_TILE_BYTES;
    let filled = |tile: u32| smem + l.bars + 8 * (tile % RING);
    let freed = |tile: u32| smem + l.bars + 8 * (RING + tile % RING);
    let table = |tile: u32| smem + l.tables + (tile % WIDE_E4M3_TABLES) * E4M3_TABLE_BYTES;
    let flag = |tile: u32, half: u32| table(tile) + TILE * 8 + 4 * half;
    let p_buf = smem + l.p + wg * WIDE_E4M3_P_BYTES;
    // The first of this warpgroup's 32 rows (of the queries, and of each tile it copies).
    let row0 = 32 * wg;

    // Address lookups, warp 0 of each warpgroup, a key of its 32 rows a lane: `early` two
    // copies ahead, `locate` one ahead, the entry (`fill`) before the copy.
    let key_of = |tile: u32| begin + tile * TILE + row0 + lane;
    let looks_up = |tile: u32| warp == 0 && tile < n_tiles;
    let lookups = Lookups { p, src, end };
    let early = |tile: u32| lookups.early(key_of(tile), looks_up(tile));
    let locate = |tile: u32, e: S::Early| lookups.locate(key_of(tile), looks_up(tile), e);
    let fill = |tile: u32, loc: S::Loc| {
        if looks_up(tile) {
            lookups.fill(key_of(tile), loc, table(tile) + (row0 + lane) * 8, flag(tile, wg), lane)
        }
    };
    // Copy this warpgroup's 32 rows of `tile` into its buffer. The copies complete the buffer's
    // phase with 256 arrivals as they land and each warpgroup's thread 0's (the other
    // warpgroup's masks read the table this one wrote). A warpgroup barrier must separate the
    // table's writes from this.
    let copy = |tile: u32| {
        if tile < n_tiles {
            // Rows of the new tokens wait for the kernel ahead (the cache write).
            gate.before_keys(begin + (tile + 1) * TILE);
            unsafe { copy_tile_rows::<2>(p, table(tile), buf(tile), row0, t, filled(tile)) };
        }
    };

    // The queries, quantised to e4m3 (16 threads a row, 16 rows a pass), each row's score
    // factor and position.
    static_for::<4>(|pass| {
        let (n, sub) = (16 * pass as u32 + tid / 16, tid % 16);
        let live = n < w.live;
        let row = if live { q_row(n) } else { 0 };
        unsafe { quantise_query_row::<Q>(p, n, sub, live, row, smem + l.q, 64, smem + l.mult) };
        if sub == 0 {
            let pos = if causal { unsafe { w.row(p, n).pos } } else { u32::MAX };
            unsafe { st_shared_u32(smem + l.pos + 4 * n, pos) };
        }
    });
    if tid == 0 {
        static_for::<{ RING as usize }>(|b| unsafe {
            mbarrier::init(filled(b as u32), 256 + 2);
            mbarrier::init(freed(b as u32), 256);
        });
    }
    // The tables of the ring's first tiles, and the lookups of the next two.
    static_for::<{ RING as usize }>(|m| fill(m as u32, locate(m as u32, early(m as u32))));
    let mut loc_next = locate(RING, early(RING));
    let mut early_next = early(RING + 1);
    fence_proxy_async_shared();
    sync_threads();
    gate.prologue();
    static_for::<{ RING as usize }>(|m| copy(m as u32));

    // This thread's rows of S^T and O^T: N columns 8j + 2t4 + e1 (r = 2j + e1) of its
    // warpgroup's 32.
    let rows_s = |r: usize| row0 + 8 * (r as u32 / 2) + 2 * t4 + (r as u32 & 1);
    // The rows' score factors and positions are read from shared memory where they are used:
    // held across the loop they pushed `ptxas` past 255 registers.
    let mult = || -> [f32; 8] { core::array::from_fn(|r| unsafe { ld_shared_f32(smem + l.mult + 4 * rows_s(r)) }) };
    let mut state = [OnlineSoftmax::EMPTY; 8];
    let mut o = [[0.0f32; 4]; 32];
    let mut v = [[0u32; 4]; 8];
    let desc_q = wgmma_desc(smem + l.q + row0 * 128, 16, 1024, true);
    let desc_p = wgmma_desc(p_buf, 16, 1024, true);
    // V^T's A fragments, the narrow kernel's, a chain's worth (32 keys) at a time.
    let v_lane = v_lanes(warp, lane);
    let fragments = |tile: u32, ks: u32, v: &mut [[u32; 4]; 8]| unsafe { v_fragments(tile, ks, &v_lane, v, 0) };
    // This thread's output columns: `v_out + 16 b + h` for M block b, M row g + 8 h.
    let v_out = 128 * warp + 2 * g;

    let mut this = 0;
    while this < n_tiles {
        unsafe {
            mbarrier::wait(filled(this), (this / RING) & 1);
            fence_proxy_async_shared();
        }
        let tile = buf(this);
        let s = unsafe { with_fp8_chains!(K, F => F::scores_t32(wgmma_desc(tile, 16, 1024, true), desc_q)) };
        // From the second tile on, this step copies tile this + 3 into the buffer of tile
        // this - 1: its table now, the lookups of the two after it.
        let next = this + RING - 1;
        if this > 0 {
            fill(next, loc_next);
            loc_next = locate(next + 1, early_next);
            early_next = early(next + 2);
        }
        fragments(tile, 0, &mut v);
        let mut s = unsafe { wait_scores_t32(s) };

        // Masks where the tile crosses a boundary: key m = 16 warp + g + 8 (e >> 1).
        let first = begin + this * TILE;
        let has_bad = unsafe { ld_shared_u32(flag(this, 0)) | ld_shared_u32(flag(this, 1)) } != 0;
        let masked = first + TILE > end || (causal && first + TILE - 1 > min_pos) || has_bad;
        if masked {
            let pos = |r: usize| unsafe { ld_shared_u32(smem + l.pos + 4 * rows_s(r)) };
            mask_scores(&mut s, first, end, has_bad, table(this), warp, g, pos);
        }
        // Each row's max over the warp's 16 keys, then the warpgroup's through shared memory.
        publish_row_maxima::<4, 8>(&s, |r| smem + l.maxima + 4 * rows_s(r) * 4, warp, g);
        warpgroup_barrier(wg);
        let mult = mult();
        let tile_max = tile_maxima(|r| smem + l.maxima + 4 * rows_s(r) * 4, &mult);
        if let Some(factor) = lazy_factors(&mut state, &tile_max) {
            static_for::<32>(|i| static_for::<4>(|e| o[i][e] *= factor[2 * (i % 4) + (e & 1)]));
        }
        weights_into_p(&mut s, &mut state, &mult, masked, p_buf, 32, warp, lane);
        fence_proxy_async_shared();
        warpgroup_barrier(wg);
        unsafe { with_fp8_chains!(K, F => F::pv_t32(&mut o, &v, desc_p)) };
        unsafe { wait_pv_t32(&mut o, &v) };
        fragments(tile, 1, &mut v);
        // This warpgroup is done reading the tile (S retired, V in registers).
        unsafe { mbarrier::arrive(freed(this)) };
        unsafe { with_fp8_chains!(K, F => F::pv_t32(&mut o, &v, desc_p + 2)) };
        // Tile this + 3 into the buffer of tile this - 1, once both warpgroups are done with it
        // (the other one a step ago at the latest, unless it lags).
        if this > 0 && next < n_tiles {
            unsafe { mbarrier::wait(freed(this - 1), ((this - 1) / RING) & 1) };
            copy(next);
        }
        // Retired before the loop's back edge (the narrow kernel's reason: `ptxas` serialises
        // every chain otherwise, C7514).
        unsafe { wait_pv_t32(&mut o, &v) };
        this += 1;
    }
    cp_async_wait::<0>();
    gate.before_writes();

    // Each row's sum over the warpgroup (every warp holds the same max).
    publish_row_sums(&state, |r| smem + l.maxima + 4 * rows_s(r) * 4, warp, g, wg);
    let v_scale = unsafe { load_f32_nc(p.fp8.v_scale) };
    let num_splits = unsafe { w.num_splits(p) };
    static_for::<8>(|r| {
        let n = rows_s(r);
        if n >= w.live {
            return;
        }
        let st = final_state(&state[r], smem + l.maxima + 4 * n * 4);
        let row = unsafe { w.row(p, n) };
        let out = unsafe { RowOut::new(p, w, &row, st, num_splits, warp == 0 && g == 0, v_scale, MLA_V) };
        let (j, e1) = (r / 2, r % 2);
        // Block b of this row: columns v_out + 16 b and + 1 (M rows g, g + 8).
        static_for::<8>(|b| {
            let acc = o[4 * b + j];
            unsafe { out.store_pair::<Q>(v_out + 16 * b as u32, acc[e1], acc[2 + e1]) };
        });
    });
}
