//! Tiled online-softmax attention on tensor cores (FlashAttention-2's scheme) over a paged
//! cache or packed K/V: prefill, chunked prefill, encoders, and decode.
//!
//! One CTA of 4 warps per (work item, kv head). A work item is a request, a tile of its query
//! rows (row = token * group + head-in-group, so the query heads of a kv head share every K/V
//! tile) and a split of its keys. K/V tiles of `BN` keys stream through a multi-stage
//! `cp.async` pipeline into padded shared memory; per tile a warp computes S = Q K^T with
//! `mma.sync`, masks (only tiles that cross a boundary), updates its rows' online softmax in
//! registers and adds P V to its f32 accumulators. Tiles no row of the CTA can see are never
//! loaded. The CTA shapes (rows split across warps for prefill, keys split across warps for
//! decode) are described in `attn_math::prefill`.
//!
//! The row addresses of each K/V tile (block-table lookups) are computed one pipeline stage
//! ahead by one thread per key into a shared table, so the copies themselves are a shared load
//! and a `cp.async` per 16 bytes, and the block-table latency is hidden behind a tile of math.
//! A key whose block id is outside the cache gets no address: it is never read, its tile is
//! masked key by key, and the status word reports it.

use crate::attention::config::{AttnConfig, Bits16, CacheFormat};
use crate::attention::fp8_direct;
use crate::attention::kv::{copy_rows_async, copy_rows_async_to, KeyTables, KvSource};
use crate::attention::logits::{softmax_step, Logits};
use crate::attention::output::{finish_keys_split, RowOut};
use crate::attention::tile_mma::{accumulate_pv, scores};
use crate::attention::work::{work_item, RowInfo};
use crate::blocks::device::{dynamic_shared, pdl_prologue, shfl_xor, static_for, sync_threads, sync_warp, thread_idx_x};
use crate::blocks::elem::HalfFloat;
use crate::blocks::mma::{cp_async_commit, cp_async_wait, ld_shared_u64, ldmatrix_x4, shared_addr, MmaHalf};
use attn_math::params::AttnParams;
use attn_math::prefill::{block_m, fp8_direct, shared_layout_mla, stages, ROW_PAD, TABLE_ENTRY, THREADS, WARPS};
use attn_math::softmax::OnlineSoftmax;
use core::marker::PhantomData;

/// The kernel for config `C` ([`AttnConfig`]: the types, the cache format, the head sizes and
/// the shape, decode or prefill). `MT` is `C::MT`, the 16-row tiles per warp: it sizes the
/// accumulator arrays, which an associated const of `C` cannot (`crate::attention::config`).
#[inline(always)]
pub unsafe fn attention<C: AttnConfig, const MT: usize>(p: &AttnParams) {
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let bm = block_m(C::DK as u32, C::DV as u32, C::KEYS, C::Cache::FP8);
    const { assert!(MT == C::MT && (MT == 1 || (MT == 2 && !C::KEYS))) };
    let Some(w) = (unsafe { work_item(p, bm, C::DV as u32) }) else { return };
    let src = unsafe { KvSource::of(p, &w) };
    let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };

    let (begin, end) = unsafe { w.key_range(p, min_pos, max_pos) };
    let (begin, end) = if C::LOCAL { w.local_range(p, min_pos, max_pos, (begin, end)) } else { (begin, end) };
    let n_tiles = if end > begin { (end - begin).div_ceil(C::BN as u32) } else { 0 };

    const { assert!(C::BN as u32 <= THREADS && C::KW == if C::KEYS { C::BN / WARPS as usize } else { C::BN }) };
    let st = stages(C::DK as u32, C::DV as u32, C::KEYS, C::Cache::FP8);
    let slots = st + 1;
    let layout = shared_layout_mla(C::DK as u32, C::DV as u32, C::KEYS, C::Cache::FP8, C::VK);
    let elem_bytes = C::Cache::ELEM_BYTES as u64;
    // Decode from an FP8 cache at head size 64 or 128: fragments converted straight from the
    // staged FP8 rows (`fp8_direct`), no 16-bit tiles.
    let direct = fp8_direct(C::DK as u32, C::DV as u32, C::KEYS, C::Cache::FP8);
    const { assert!(!(C::VK && fp8_direct(C::DK as u32, C::DV as u32, C::KEYS, C::Cache::FP8))) };
    // FP8: dequantisation folds into the score scale (k) and the output factor (v).
    let (k_scale, v_scale) = unsafe { C::Cache::scales(p, w.kv_head) };
    // Queries converted from Q to M are scaled by `q_conv` (2^-8 from bf16 to f16).
    let q_conv = if C::Q::IS_BF16 == C::M::IS_BF16 { 1.0 } else { 1.0 / 256.0 };
    let score_scale = p.variant.scale_log2 * k_scale / q_conv;
    let smem = shared_addr(dynamic_shared::<u8>());
    // Where a stage's 16-bit K and V tiles are read by the math.
    let k_tile = |stage: u32| if C::Cache::CONVERTS { smem + layout.k_tile } else { smem + layout.k + stage * layout.k_stage };
    let v_tile = |stage: u32| {
        if C::VK {
            k_tile(stage) + w.v_col0 * 2
        } else if C::Cache::CONVERTS {
            smem + layout.v_tile
        } else {
            smem + layout.v + stage * layout.v_stage
        }
    };
    let v_pitch = if C::VK { (C::DK as u32 + ROW_PAD) * 2 } else { (C::DV as u32 + ROW_PAD) * 2 };
    let tables = KeyTables::<C> { base: smem + layout.table, slots, begin, end, n_tiles, src, elem_bytes, config: PhantomData };
    let table = |tile: u32| tables.table(tile);
    let flags = |tile: u32| tables.flags(tile);
    let tile_keys = |tile: u32| begin + tile * C::BN as u32;
    // Keys split: each warp runs its own pipeline over its quarter of every tile (`key_off ..
    // key_off + KW`): it looks up, copies, converts and reads only those rows, so the loop
    // needs warp barriers only, and a warp whose data has landed never waits for another's.
    let key_off = if C::KEYS { warp * C::KW as u32 } else { 0 };
    let locate = |tile: u32| unsafe {
        if C::KEYS {
            tables.locate_warp(p, tile, key_off, C::KW as u32)
        } else {
            tables.locate(p, tile)
        }
    };
    let fill = |tile: u32, loc: i64| unsafe {
        if C::KEYS {
            tables.fill_warp(p, tile, key_off, C::KW as u32, loc)
        } else {
            tables.fill(p, tile, loc)
        }
    };
    // Row pitch and 16-byte chunks of a stage's K/V rows: FP8 staging rows, or 16-bit tiles.
    let (k_pitch, v_pitch_st) = (C::Cache::staged_pitch(C::DK as u32), C::Cache::staged_pitch(C::DV as u32));
    let (k_chunks, v_chunks) = (C::Cache::staged_chunks(C::DK as u32), C::Cache::staged_chunks(C::DV as u32));
    // The launch's head sizes (at most the kernel's widths): the chunks past them are
    // zero-filled, so they add nothing to the scores and the accumulators, and are not stored.
    let (head_qk, head_v) = (p.dims.qk_or(C::DK as u32), p.dims.v_or(C::DV as u32));
    let (k_live, v_live) = (C::Cache::live_units(head_qk), C::Cache::live_units(head_v));
    let load_kv = |tile: u32| {
        let stage = tile % st;
        let t = table(tile) + key_off * TABLE_ENTRY;
        let k_dst = smem + layout.k + stage * layout.k_stage + key_off * k_pitch;
        let v_dst = smem + layout.v + stage * layout.v_stage + key_off * v_pitch_st;
        let k_src = |r: u32| unsafe { ld_shared_u64(t + r * TABLE_ENTRY) };
        let v_src = |r: u32| unsafe { ld_shared_u64(t + r * TABLE_ENTRY + 8) };
        unsafe {
            if direct {
                // Swizzled rows (`fp8_direct`), at their row in the stage.
                let (k_base, v_base) = (smem + layout.k + stage * layout.k_stage, smem + layout.v + stage * layout.v_stage);
                let to = |base: u32| move |r: u32, c: u32| base + fp8_direct::swizzled(key_off + r, c * 16, C::DK as u32);
                copy_rows_async_to::<32, C::Cache>(C::KW as u32, to(k_base), k_chunks, k_live, p.qkv.q, k_src);
                copy_rows_async_to::<32, C::Cache>(C::KW as u32, to(v_base), v_chunks, v_live, p.qkv.q, v_src);
            } else if C::KEYS {
                copy_rows_async::<32, C::Cache>(C::KW as u32, k_dst, k_chunks, k_live, k_pitch, p.qkv.q, k_src);
                if !C::VK {
                    copy_rows_async::<32, C::Cache>(C::KW as u32, v_dst, v_chunks, v_live, v_pitch_st, p.qkv.q, v_src);
                }
            } else {
                copy_rows_async::<THREADS, C::Cache>(C::BN as u32, k_dst, k_chunks, k_live, k_pitch, p.qkv.q, k_src);
                if !C::VK {
                    copy_rows_async::<THREADS, C::Cache>(C::BN as u32, v_dst, v_chunks, v_live, v_pitch_st, p.qkv.q, v_src);
                }
            }
        }
    };
    // The loop's barriers: the warp's own (keys split) or the CTA's. Tile 0's is the CTA's in
    // both shapes: it publishes the queries, which every warp reads.
    let tile_barrier = |tile: u32| {
        if C::KEYS && tile > 0 {
            sync_warp()
        } else {
            sync_threads()
        }
    };

    // Prologue: the address tables of the first `st` tiles; the queries; tiles 0 .. st - 2 in
    // flight (one commit group each, empty ones included, so that "all but st - 1 groups done"
    // always means "this tile is in").
    static_for::<5>(|j| {
        if (j as u32) < st {
            fill(j as u32, locate(j as u32));
        }
    });
    sync_threads();
    let q_row = |r: u32| {
        let row = unsafe { w.row(p, r) };
        p.qkv.q + (row.token as u64 * p.qkv.q_token_stride + row.head as u64 * p.qkv.q_head_stride) * 2
    };
    let q_pitch = (C::DK as u32 + ROW_PAD) * 2;
    if C::KEYS {
        unsafe { copy_rows_async::<THREADS, Bits16>(16, smem, C::DK as u32 / 8, head_qk / 8, q_pitch, p.qkv.q, q_row) };
    } else if MT == 1 {
        unsafe { copy_rows_async::<THREADS, Bits16>(64, smem, C::DK as u32 / 8, head_qk / 8, q_pitch, p.qkv.q, q_row) };
    } else {
        unsafe { copy_rows_async::<THREADS, Bits16>(128, smem, C::DK as u32 / 8, head_qk / 8, q_pitch, p.qkv.q, q_row) };
    }
    // Programmatic dependent launch (sm_90a): everything above (work item, block tables,
    // queries, scales) was on the device before the kernel ahead of this one started, so it
    // overlaps that kernel's end; the cache rows wait for it (the cache write).
    pdl_prologue();
    static_for::<4>(|j| {
        if (j as u32) < st - 1 {
            if (j as u32) < n_tiles {
                load_kv(j as u32);
            }
            cp_async_commit();
        }
    });

    // Rows split across warps (prefill) or keys split across warps (decode).
    let warp_row0 = if C::KEYS { 0 } else { warp * 16 * MT as u32 };
    let rows: [[RowInfo; 2]; MT] = core::array::from_fn(|mt| {
        let r = warp_row0 + 16 * mt as u32 + g;
        unsafe { [w.row(p, r), w.row(p, r + 8)] }
    });
    let logits = Logits::new(p, score_scale, end);
    let mult = logits.mult();

    let mut state = [[OnlineSoftmax::EMPTY; 2]; MT];
    // Accumulators (DV / 8 column tiles of 8 used) and query fragments (DK / 16 k-steps used).
    let mut o = [[[0.0f32; 4]; 32]; MT];
    let mut q_frag = [[0u32; 4]; 16];
    // The query fragments stay in registers up to head size 192; at 256 (64 registers), and on
    // the FP8 prefill shape (whose conversion needs registers too), they would push the
    // accumulators into local memory, so they are re-read from shared memory each tile.
    let q_in_regs = MT == 1 && C::DK <= 192 && !(C::Cache::CONVERTS && !C::KEYS);
    let q_base = smem + (warp_row0 + (lane % 8) + 8 * ((lane / 8) % 2)) * q_pitch + 16 * (lane / 16);

    // Query fragment `ks` of row tile `mt` from shared memory, in the tensor cores' type.
    let load_q = |mt: usize, ks: usize| {
        let mut f = unsafe { ldmatrix_x4(q_base + mt as u32 * 16 * q_pitch + ks as u32 * 32) };
        if C::Q::IS_BF16 != C::M::IS_BF16 {
            static_for::<4>(|i| {
                let (lo, hi) = C::Q::unpack2(f[i]);
                f[i] = C::M::pack2(lo * q_conv, hi * q_conv);
            });
        }
        f
    };
    // Decode (memory-bound) and the FP8 cache (converted between two barriers anyway) issue
    // each copy before waiting; prefill waits first and needs one barrier per tile.
    let early_issue = C::KEYS || C::Cache::CONVERTS;
    let mut tile = 0;
    while tile < n_tiles {
        // The lookup for tile + st starts now and lands in the table after this tile's math.
        let ahead = locate(tile + st);
        let next = tile + st - 1;
        if early_issue {
            // Memory-bound shapes: the next copy goes out before waiting, so st - 1 tiles are
            // in flight while this one lands; a second barrier at the end protects the stage.
            if next < n_tiles {
                load_kv(next);
            }
            cp_async_commit();
            match st {
                5 => cp_async_wait::<4>(),
                4 => cp_async_wait::<3>(),
                3 => cp_async_wait::<2>(),
                _ => cp_async_wait::<1>(),
            }
        } else {
            // Compute-bound shapes: one barrier per tile. After it the tile is visible to every
            // warp and every warp is done with the previous one, whose stage (and table slot)
            // the next copy refills.
            if st == 3 {
                cp_async_wait::<1>();
            } else {
                cp_async_wait::<0>();
            }
            sync_threads();
            if next < n_tiles {
                load_kv(next);
            }
            cp_async_commit();
        }
        let stage = tile % st;
        let (k_raw, v_raw) = (smem + layout.k + stage * layout.k_stage, smem + layout.v + stage * layout.v_stage);
        if C::Cache::CONVERTS && !direct {
            unsafe {
                if C::KEYS {
                    let (k_half, v_half) = (k_tile(stage) + key_off * (C::DK as u32 + ROW_PAD) * 2, v_tile(stage) + key_off * v_pitch);
                    C::Cache::convert::<C, false>(k_raw + key_off * k_pitch, k_half);
                    if !C::VK {
                        C::Cache::convert::<C, true>(v_raw + key_off * v_pitch_st, v_half);
                    }
                } else {
                    C::Cache::convert::<C, false>(k_raw, k_tile(stage));
                    if !C::VK {
                        C::Cache::convert::<C, true>(v_raw, v_tile(stage));
                    }
                }
            }
        }
        if early_issue {
            tile_barrier(tile);
        }
        if tile == 0 && direct {
            q_frag = unsafe { fp8_direct::query_fragments::<C>(smem, q_pitch, q_conv) };
        } else if tile == 0 && q_in_regs {
            static_for::<16>(|ks| {
                if ks < C::DK / 16 {
                    q_frag[ks] = load_q(0, ks);
                }
            });
        }
        let kt = tile_keys(tile) + key_off;
        {
            let mut s = if direct {
                // MT = 1 on the keys-split shape.
                [unsafe { fp8_direct::scores::<C>(&q_frag, k_raw, key_off) }; MT]
            } else {
                scores::<C, MT>(|mt, ks| if q_in_regs { q_frag[ks] } else { load_q(mt, ks) }, k_tile(stage), key_off)
            };
            // Keys split: the warp's own flag; else the slot's flags from the first.
            let tile_flags = flags(tile) + if C::KEYS { warp * 4 } else { 0 };
            unsafe { logits.apply::<C, MT, 8>(&mut s, &rows, kt, (min_pos, max_pos), tile_flags) };
            static_for::<2>(|mt| {
                if mt < MT {
                    softmax_step::<C, 8, 32>(&mut s[mt], &mut o[mt], &mut state[mt], mult);
                }
            });
            if direct {
                unsafe { fp8_direct::accumulate_pv::<C>(&s[0], &mut o[0], v_raw, key_off) };
            } else {
                accumulate_pv::<C, MT>(&s, &mut o, v_tile(stage), v_pitch, key_off);
            }
        }
        fill(tile + st, ahead);
        if early_issue {
            // Every warp (or this warp, keys split) is done with this stage and table slot
            // before they are refilled.
            if C::KEYS {
                sync_warp()
            } else {
                sync_threads()
            }
        }
        tile += 1;
    }
    cp_async_wait::<0>();

    let num_splits = unsafe { w.num_splits(p) };
    if C::KEYS {
        unsafe {
            finish_keys_split::<C>(
                p,
                &w,
                smem,
                layout.merge,
                layout.merge_pitch,
                layout.stats,
                state[0],
                &o[0],
                num_splits,
                v_scale,
                direct,
            )
        };
    } else {
        // The quad's partial sums, then the output (or the split's partial) per row.
        static_for::<4>(|i| {
            let (mt, h) = (i / 2, i % 2);
            if mt >= MT {
                return;
            }
            let mut st = state[mt][h];
            st.sum += shfl_xor(st.sum, 1);
            st.sum += shfl_xor(st.sum, 2);
            if warp_row0 + 16 * mt as u32 + g + 8 * h as u32 >= w.live {
                return;
            }
            let out = unsafe { RowOut::new(p, &w, &rows[mt][h], st, num_splits, t4 == 0, v_scale, head_v) };
            static_for::<32>(|n| {
                if n < C::DV / 8 {
                    unsafe { out.store_pair::<C::Q>(n as u32 * 8 + 2 * t4, o[mt][n][2 * h], o[mt][n][2 * h + 1]) };
                }
            });
        });
    }
}
