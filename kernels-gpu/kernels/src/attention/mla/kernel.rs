//! The MLA kernel (module docs of [`crate::attention::mla`]).

#[cfg(wgmma)]
use super::combine::cluster_combine;
use super::keys::KeySource;
use super::slots::{convert_slot_fp8, copy_queries, copy_slot, copy_slot_fp8};
use super::tile::{
    accumulate_pv, accumulate_pv_fp8, fp8_pair_column, fp8_pairs, query_fragments_fp8, score_k_lane, scores, scores_fp8, K_STEPS,
};
use crate::attention::config::CacheFormat;
use crate::attention::output::RowOut;
use crate::blocks::device::{
    dynamic_shared, fma, pdl_launch_dependents, pdl_wait, shfl_xor, static_for, sync_threads, thread_idx_x, vote_any, PdlGate,
};
use crate::blocks::elem::{Fp8Format, F16};
use crate::blocks::mma::{
    cp_async_commit, cp_async_wait, ld_shared_f32, ld_shared_u32, ld_shared_u64, ldmatrix_x4, ldmatrix_x4_pinned, shared_addr,
    st_shared_f32, st_shared_u32, st_shared_u64, MmaHalf,
};
use crate::blocks::vec_io::{load_f32_nc, load_u32_nc};
use attn_math::mla::{self, p_offset, shared_layout, swizzled, SLOT_KEYS, TABLE_BYTES};
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_V;
use attn_math::softmax::{exp2, OnlineSoftmax};

/// The kernel; `WIDE` picks the shape (`attn_math::mla::{NARROW, WIDE}`; on sm_90a the wide
/// shape takes `super::seesaw`); `K`: the cache's rows, 16-bit or FP8 ([`CacheFormat`]: E4M3 or
/// E5M2, with `p.fp8.k_scale`), FP8 converted to
/// f16 in registers (narrow) or to Q's type tile by tile in shared memory (wide); `S`: where key
/// j's row comes from (`super::keys`: a request's sequence, dense; a token's index list,
/// sparse).
#[inline(always)]
pub unsafe fn mla_attention<Q: MmaHalf, const WIDE: bool, K: CacheFormat, S: KeySource>(p: &AttnParams) {
    let shape = const {
        if WIDE {
            mla::WIDE
        } else {
            mla::NARROW
        }
    };
    let (bm, bn) = (shape.block_m, shape.block_n);
    let (kg, kw, cg, cw) = (shape.key_groups(), shape.keys_per_warp(), shape.col_groups(), shape.cols_per_warp());
    let (nkt, nct) = ((kw / 8) as usize, (cw / 8) as usize);
    let mt = shape.pv_row_tiles() as usize;
    // Memory-bound (narrow): the next copy goes out before waiting, with a barrier at the end of
    // the tile; compute-bound (wide): wait, barrier, then copy into the slot just freed.
    let early_issue = !WIDE;
    let layout = shared_layout(shape, K::FP8);
    // FP8 fragments straight from the raw rows (no 16-bit copy of the tile).
    let in_registers = K::FP8 && shape.fp8_in_registers;
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    // Programmatic dependent launch. The work item, block tables and queries are read before
    // waiting for the kernel ahead, the cache rows after it (`gate.prologue()`), except on the
    // dense narrow shape: there the next kernel may launch into the SMs this one frees at once,
    // and the context's rows are copied before the wait too, the new tokens' rows and every
    // write after it (`PdlGate`; docs/mla.md: 1.03-1.13x, where the wide shape lost 2-4%).
    let reads_ahead = !WIDE && S::READS_AHEAD;
    if reads_ahead {
        pdl_launch_dependents();
    }
    let Some((w, src)) = (unsafe { S::work(p, bm) }) else {
        if reads_ahead {
            pdl_wait();
        }
        return;
    };
    let gate = if reads_ahead { PdlGate::new(src.ready_before_wait(&w)) } else { PdlGate::late() };
    // Sparse: the index list is the mask.
    let causal = S::CAUSAL && p.mask.causal != 0;
    let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };
    let chunk = if p.schedule.plan != 0 { unsafe { load_u32_nc(p.schedule.plan + 4) } } else { p.shape.chunk };
    let begin = if chunk > 0 { w.split * chunk } else { 0 };
    let mut end = if chunk > 0 { (begin + chunk).min(w.seq_len) } else { w.seq_len };
    if causal {
        end = end.min(max_pos + 1);
    }
    let q_row = |r: u32| {
        let row = unsafe { w.row(p, r) };
        p.qkv.q + (row.token as u64 * p.qkv.q_token_stride + row.head as u64 * p.qkv.q_head_stride) * 2
    };
    // Narrow over an FP8 cache on sm_90a: e4m3 `wgmma` with the operands swapped
    // (`super::narrow_e4m3`), with its own layout, tables and pipeline; none of what follows.
    #[cfg(wgmma)]
    if !WIDE && K::FP8 {
        unsafe { super::narrow_e4m3::narrow_e4m3::<Q, K, S>(p, &w, src, &gate, begin, end, causal, min_pos, q_row) };
        return;
    }
    // Wide over an FP8 cache on sm_90a: the same operands with the 64 query rows on N
    // (`super::wide_e4m3`).
    #[cfg(wgmma)]
    if WIDE && K::FP8 {
        unsafe { super::wide_e4m3::wide_e4m3::<Q, K, S>(p, &w, src, &gate, begin, end, causal, min_pos, q_row) };
        return;
    }
    let n_slots = if end > begin { (end - begin).div_ceil(SLOT_KEYS) } else { 0 };
    let spt = shape.slots_per_tile();
    let n_tiles = n_slots.div_ceil(spt);
    // Slots the tiles cover: a last tile's second slot past the keys is zero-filled all the same
    // (its weights are 0, but 0 x NaN in uninitialised shared memory is NaN).
    let tile_slots = n_tiles * spt;
    // Slots issued before the first tile; each tile then issues `spt` more.
    let pre = shape.ring - spt;

    let smem = shared_addr(dynamic_shared::<u8>());
    // Where slot j lands (raw FP8 rows, or already 16-bit), and where the math reads the current
    // tile's slot i (`slot0`: the tile's first).
    let slot_buf = |j: u32| smem + layout.k + (j % shape.ring) * layout.k_slot;
    // FP8 on the wide shape: a tile's raw rows are converted into the tile's 16-bit slots.
    let converts = K::FP8 && !in_registers;
    let tile_buf = |slot0: u32, i: u32| if converts { smem + layout.converted + i * layout.converted_slot } else { slot_buf(slot0 + i) };
    // The tile's raw FP8 rows to 16-bit ones, once every raw copy has landed and is visible (a
    // barrier); a barrier must follow.
    let convert_tile = |slot0: u32| {
        static_for::<2>(|i| {
            if (i as u32) < spt {
                unsafe { convert_slot_fp8::<Q, K::Fp8>(slot_buf(slot0 + i as u32), tile_buf(slot0, i as u32)) };
            }
        });
    };
    // FP8: dequantisation folds into the score scale (k) and the output factor (v).
    let (k_scale, v_scale) = if K::FP8 {
        let unpack = K::Fp8::UNPACK_SCALE;
        (unsafe { load_f32_nc(p.fp8.k_scale) } * unpack, unsafe { load_f32_nc(p.fp8.v_scale) } * unpack)
    } else {
        (1.0, 1.0)
    };
    // Wide on sm_90a (a 16-bit cache: FP8 ones returned above): the seesaw order
    // (`super::seesaw`), with tables of its own.
    let seesaw = WIDE && cfg!(wgmma);
    let (tables_at, n_tables) =
        if seesaw { (mla::seesaw_layout().table, mla::seesaw_layout().tables) } else { (layout.table, shape.tables()) };
    let table = |j: u32| smem + tables_at + (j % n_tables) * TABLE_BYTES;
    let flag = |j: u32| table(j) + SLOT_KEYS * 8;
    // Address tables: one warp a slot, one lane a key; the source's first load (`early`, the
    // index entry of a sparse list) two tiles before the entry is written, the block-table load
    // (`locate`) a tile before (`fill`), and the entry a tile before the copy reads it.
    let early = |j: u32| {
        let key = begin + j * SLOT_KEYS + lane;
        if j < n_slots && key < end {
            unsafe { src.early(p, key) }
        } else {
            S::NO_EARLY
        }
    };
    let locate = |j: u32, e: S::Early| {
        let key = begin + j * SLOT_KEYS + lane;
        if j < n_slots && key < end {
            unsafe { src.locate(p, key, e) }
        } else {
            S::NO_LOC
        }
    };
    // A slot's flag: whether any of its keys is not read (the mask then reads the entries).
    let fill = |j: u32, loc: S::Loc| {
        if j < tile_slots {
            let key = begin + j * SLOT_KEYS + lane;
            let ka = if key < end { unsafe { src.address(p, key, loc, if K::FP8 { 1 } else { 2 }) } } else { 0 };
            unsafe { st_shared_u64(table(j) + lane * 8, ka) };
            let skipped = key < end && ka == 0;
            let any_skipped = vote_any(skipped);
            if lane == 0 {
                unsafe { st_shared_u32(flag(j), any_skipped as u32) };
            }
        }
    };
    // Issues slot j's copy (if a tile covers it) as one commit group.
    let issue = |j: u32| {
        if j < tile_slots {
            gate.before_keys(begin + (j + 1) * SLOT_KEYS);
            if K::FP8 {
                unsafe { copy_slot_fp8(slot_buf(j), table(j), p.qkv.q) };
            } else {
                unsafe { copy_slot(slot_buf(j), table(j), p.qkv.q) };
            }
        }
        cp_async_commit();
    };
    // A tile's slots from `first` on, each one commit group.
    let issue_tile = |first: u32| {
        static_for::<2>(|i| {
            if (i as u32) < spt {
                issue(first + i as u32);
            }
        });
    };

    #[cfg(wgmma)]
    if seesaw {
        let span = super::seesaw::Span { begin, end, n_tiles, causal, min_pos };
        unsafe { super::seesaw::seesaw::<Q, S>(p, &w, span, p.variant.scale_log2, early, locate, fill, table, q_row) };
        return;
    }

    // Prologue: the tables of the slots issued before and at the first tile, the queries (a
    // commit group of their own), then `pre` slots in flight.
    if warp < shape.ring {
        fill(warp, locate(warp, early(warp)));
    }
    // The first steps of the first tile's lookups (slots `ring ..`).
    let mut early_next = if warp < spt { early(shape.ring + warp) } else { S::NO_EARLY };
    sync_threads();
    unsafe { copy_queries(smem + layout.q, bm, q_row) };
    // Narrow waits for the queries alone (to hold them in registers before the first tile).
    cp_async_commit();
    gate.prologue();
    static_for::<4>(|j| {
        if (j as u32) < pre {
            issue(j as u32);
        }
    });

    // Score phase: each warp 16 rows x `kw` keys; consecutive warps take consecutive row tiles (a
    // warpgroup's 4 warps make the 64 rows of one `wgmma`), then the key groups. Value phase:
    // each warp `mt` row tiles x `cw` columns.
    let key_group = warp / shape.s_row_tiles;
    let (s_row0, key_off) = ((warp % shape.s_row_tiles) * 16, key_group * kw);
    let (pv_row0, col0) = ((warp / cg) * mt as u32 * 16, (warp % cg) * cw);
    let s_rows = unsafe { [w.row(p, s_row0 + g), w.row(p, s_row0 + g + 8)] };
    // This lane's ldmatrix rows and chunks (the layout's swizzle depends on both).
    let q_lane = (s_row0 + lane % 8 + 8 * ((lane / 8) % 2), lane / 16);
    let q_at = |ks: usize| smem + layout.q + swizzled(q_lane.0, q_lane.1 + 2 * ks as u32);
    let k_lane = score_k_lane(nkt, lane, key_off % SLOT_KEYS);
    let p_row_lane = pv_row0 + lane % 8 + 8 * ((lane / 8) % 2);
    let p_at = |m: u32, kk: u32| smem + layout.p + p_offset(p_row_lane + 16 * m, 16 * kk + 8 * (lane / 16), layout.p_group);
    let v_lane = (lane % 8 + 8 * ((lane / 8) % 2), col0 / 8 + lane / 16);
    let row_max = |group: u32, r: u32| smem + layout.row_max + (group * bm + r) * 4;
    // The running max of a row after this tile, from the published maxima (raw scores).
    let tile_max = |r: u32| {
        let mut m = f32::NEG_INFINITY;
        static_for::<8>(|i| {
            if (i as u32) < kg {
                m = m.max(unsafe { ld_shared_f32(row_max(i as u32, r)) });
            }
        });
        m
    };
    // FP8 in registers: the MMAs take f16 (one conversion instruction per pair of cache bytes),
    // bf16 queries scaled by 2^-8 into its range and P in f16; the scores undo the scale.
    let q_conv = if in_registers && Q::IS_BF16 { 1.0 / 256.0 } else { 1.0 };
    let mult = p.variant.scale_log2 * k_scale / q_conv;
    // Score-phase state (this warp's keys' share of the denominators) and value-phase maxima.
    let mut s_state = [OnlineSoftmax::EMPTY; 2];
    let mut o_state = [[OnlineSoftmax::EMPTY; 2]; 2];
    let mut o = [[[0.0f32; 4]; 32]; 2];
    // Narrow: the queries stay in registers (144 of them; every warp needs all 16 rows, and
    // re-reading them per tile was 2/3 of the shared-memory traffic). Wide: from shared memory.
    let mut q_frag = [[0u32; 4]; K_STEPS as usize];
    if !WIDE {
        if pre == 3 {
            cp_async_wait::<3>();
        } else {
            cp_async_wait::<2>();
        }
        sync_threads();
        if in_registers {
            q_frag = unsafe { query_fragments_fp8::<Q>(smem + layout.q, q_conv) };
        } else {
            static_for::<{ K_STEPS as usize / 2 }>(|i| {
                static_for::<2>(|j| q_frag[2 * i + j] = unsafe { ldmatrix_x4_pinned(q_at(2 * i + j)) })
            });
        }
    }

    let mut tile = 0;
    while tile < n_tiles {
        // This tile issues slots `spt * tile + pre ..`; the next one's lookups start now.
        let first_issued = spt * tile + pre;
        let ahead = if warp < spt { locate(first_issued + spt + warp, early_next) } else { S::NO_LOC };
        early_next = if warp < spt { early(first_issued + 2 * spt + warp) } else { S::NO_EARLY };
        if early_issue {
            // The copies go out before waiting: `pre` slots stay in flight through the wait.
            issue_tile(first_issued);
            if pre == 3 {
                cp_async_wait::<3>();
            } else {
                cp_async_wait::<2>();
            }
            sync_threads();
        } else {
            // Wait, then refill the slot every warp has just finished with.
            match pre - spt {
                0 => cp_async_wait::<0>(),
                1 => cp_async_wait::<1>(),
                _ => cp_async_wait::<2>(),
            }
            sync_threads();
            issue_tile(first_issued);
        }
        let slot0 = spt * tile;
        if converts {
            // The tile's raw rows into 16-bit ones (landed and visible: the barrier above).
            convert_tile(slot0);
            sync_threads();
        }

        // Scores, masked where the tile crosses a boundary; this warp's row maxima published.
        let my_slot = slot0 + key_off / SLOT_KEYS;
        let my_buf = tile_buf(slot0, key_off / SLOT_KEYS);
        let mut s = if in_registers {
            unsafe { scores_fp8::<K::Fp8>(&q_frag, my_buf, key_off % SLOT_KEYS) }
        } else if WIDE {
            let k_at = |rows: u32, chunks: u32| my_buf + swizzled(k_lane.0 + rows, k_lane.1 + chunks);
            scores::<Q, true>(nkt, |ks| unsafe { ldmatrix_x4(q_at(ks)) }, k_at)
        } else {
            let k_at = |rows: u32, chunks: u32| my_buf + swizzled(k_lane.0 + rows, k_lane.1 + chunks);
            scores::<Q, true>(nkt, |ks| q_frag[ks], k_at)
        };
        let first = begin + tile * bn + key_off;
        let mut has_bad = false;
        static_for::<2>(|i| {
            if (i as u32) < spt {
                has_bad |= unsafe { ld_shared_u32(flag(slot0 + i as u32)) } != 0;
            }
        });
        let needs_mask = first + kw > end || (causal && first + kw - 1 > min_pos) || has_bad;
        if needs_mask {
            let t = table(my_slot) + (key_off % SLOT_KEYS) * 8;
            static_for::<4>(|n| {
                if n < nkt {
                    static_for::<4>(|e| {
                        let row = s_rows[e / 2];
                        let key = first + n as u32 * 8 + 2 * t4 + (e % 2) as u32;
                        let visible =
                            key < end && (!causal || key <= row.pos) && (!has_bad || unsafe { ld_shared_u64(t + (key - first) * 8) } != 0);
                        if !visible {
                            s[n][e] = f32::NEG_INFINITY;
                        }
                    });
                }
            });
        }
        // Both rows' shuffles before the one lane's stores: a shuffle after a branch taken by
        // some lanes compiles to a warp-collective fallback the warps then take.
        let mut m = [f32::NEG_INFINITY; 2];
        static_for::<2>(|h| {
            static_for::<4>(|n| {
                if n < nkt {
                    m[h] = m[h].max(s[n][2 * h]).max(s[n][2 * h + 1]);
                }
            });
            m[h] = m[h].max(shfl_xor(m[h], 1));
            m[h] = m[h].max(shfl_xor(m[h], 2));
        });
        if t4 == 0 {
            static_for::<2>(|h| unsafe { st_shared_f32(row_max(key_group, s_row0 + g + 8 * h as u32), m[h]) });
        }
        sync_threads();

        // Weights under the tile's row maxima, into P; this warp's share of the denominators.
        static_for::<2>(|h| {
            let r = s_row0 + g + 8 * h as u32;
            s_state[h].rescale_to(tile_max(r) * mult);
            let neg_max = if s_state[h].max == f32::NEG_INFINITY { 0.0 } else { -s_state[h].max };
            static_for::<4>(|n| {
                if n < nkt {
                    let w0 = exp2(fma(s[n][2 * h], mult, neg_max));
                    let w1 = exp2(fma(s[n][2 * h + 1], mult, neg_max));
                    s_state[h].sum += w0 + w1;
                    let key = key_off + n as u32 * 8 + 2 * t4;
                    let at = smem + layout.p + p_offset(r, key, layout.p_group);
                    let pair = if in_registers { F16::pack2(w0, w1) } else { Q::pack2(w0, w1) };
                    unsafe { st_shared_u32(at, pair) };
                }
            });
        });
        sync_threads();

        // The value phase: rescale to the same maxima, then O += P V.
        static_for::<2>(|m| {
            if m < mt {
                static_for::<2>(|h| {
                    let r = pv_row0 + 16 * m as u32 + g + 8 * h as u32;
                    let factor = o_state[m][h].rescale_to(tile_max(r) * mult);
                    if factor != 1.0 {
                        static_for::<32>(|n| {
                            if n < nct {
                                o[m][n][2 * h] *= factor;
                                o[m][n][2 * h + 1] *= factor;
                            }
                        });
                    }
                });
            }
        });
        let v_at = |kk: u32, dp: u32| tile_buf(slot0, kk / 2) + swizzled(v_lane.0 + 16 * (kk % 2), v_lane.1 + 2 * dp);
        if in_registers {
            unsafe { accumulate_pv_fp8::<K::Fp8>(&mut o[0], |kk| p_at(0, kk), |i| tile_buf(slot0, i), col0) };
        } else {
            accumulate_pv::<Q>(&mut o, mt, nct, bn as usize, p_at, v_at);
        }
        if warp < spt {
            fill(first_issued + spt + warp, ahead);
        }
        if early_issue {
            sync_threads();
        }
        tile += 1;
    }
    cp_async_wait::<0>();
    gate.before_writes();

    // The denominators: each score warp's share, summed per row through shared memory.
    sync_threads();
    let mut sum = [s_state[0].sum, s_state[1].sum];
    static_for::<2>(|h| {
        sum[h] += shfl_xor(sum[h], 1);
        sum[h] += shfl_xor(sum[h], 2);
    });
    if t4 == 0 {
        static_for::<2>(|h| unsafe { st_shared_f32(row_max(key_group, s_row0 + g + 8 * h as u32), sum[h]) });
    }
    sync_threads();
    // Each row's state: the value phase's max and the score warps' summed denominators.
    let row_state = |m: usize, h: usize| {
        let r = pv_row0 + 16 * m as u32 + g + 8 * h as u32;
        let mut sum = 0.0;
        static_for::<8>(|i| {
            if (i as u32) < kg {
                sum += unsafe { ld_shared_f32(row_max(i as u32, r)) };
            }
        });
        OnlineSoftmax { max: o_state[m][h].max, sum }
    };
    // The output as pairs of adjacent columns (`o[m][n]`: row g and row g + 8, two columns each
    // from `pair_column(n)`).
    if in_registers {
        o[0] = fp8_pairs(&o[0]);
    }
    let pair_column = |n: u32| if in_registers { fp8_pair_column(n, col0) } else { col0 + n * 8 + 2 * t4 };
    #[cfg(wgmma)]
    if !WIDE && p.mla.cluster > 1 {
        // The ring is free now (every copy landed, every tile's reads passed the barrier).
        let states = [row_state(0, 0), row_state(0, 1)];
        unsafe { cluster_combine::<Q>(p, &w, smem + layout.k, &o[0], states, pair_column, v_scale) };
        return;
    }
    let num_splits = unsafe { w.num_splits(p) };
    static_for::<2>(|m| {
        if m < mt {
            static_for::<2>(|h| {
                let r = pv_row0 + 16 * m as u32 + g + 8 * h as u32;
                if r >= w.live {
                    return;
                }
                let state = row_state(m, h);
                let row = unsafe { w.row(p, r) };
                let out = unsafe { RowOut::new(p, &w, &row, state, num_splits, t4 == 0 && col0 == 0, v_scale, MLA_V) };
                static_for::<32>(|n| {
                    if n < nct {
                        unsafe { out.store_pair::<Q>(pair_column(n as u32), o[m][n][2 * h], o[m][n][2 * h + 1]) };
                    }
                });
            });
        }
    });
}
