//! MLA latent attention on tensor cores: Q K^T once per key tile, P shared through shared
//! memory by warps that each own a slice of the output (`attn_math::mla` describes the CTA's
//! two warp grids and the shapes).
//!
//! Per tile: the K rows (576 columns) land in shared memory through the same `cp.async`
//! pipeline and address tables as the attention kernel's ([`crate::prefill`]); each warp
//! scores its 16 rows x its keys, masks, publishes its rows' maxima (barrier), turns its scores
//! into weights under the tile's row maxima and stores them as 16-bit P (barrier); then each
//! warp rescales its accumulators by the same maxima and adds P V for its rows and columns, V
//! being the first 512 columns of the K rows already in shared memory. Each latent row is read
//! from global memory once per CTA.

use crate::device::{atomic_or_global, dynamic_shared, fma, pdl_prologue, shfl_xor, static_for, sync_threads, thread_idx_x, vote_any};
use crate::mma::{
    cp_async_commit, cp_async_wait, ld_shared_f32, ld_shared_u32, ld_shared_u64, ldmatrix_x4, ldmatrix_x4_trans, shared_addr, st_shared_f32,
    st_shared_u32, st_shared_u64x2, MmaHalf,
};
use crate::prefill::{copy_rows_async, work_item, KvSource, RowOut};
use crate::vec_io::load_u32_nc;
use attn_math::mla::{self, row_pitch, shared_layout, THREADS};
use attn_math::params::PrefillParams;
use attn_math::prefill::{table_slot_bytes, MLA_QK, MLA_V, TABLE_ENTRY};
use attn_math::softmax::{exp2, OnlineSoftmax};
use attn_math::status::BLOCK_OUT_OF_RANGE;

/// 16-column k-steps of a 576-wide row.
const K_STEPS: u32 = MLA_QK / 16;

/// S = Q K^T for one warp: 16 query rows times `nkt * 8` keys, over all 576 columns. `q_addr`
/// and `k_addr`: this lane's `ldmatrix` row addresses (see [`score_addresses`]). Two k-steps
/// per iteration, in two accumulator chains.
#[inline(always)]
fn scores<Q: MmaHalf>(nkt: usize, q_addr: u32, k_addr: u32) -> [[f32; 4]; 4] {
    let pitch = row_pitch();
    let mut even = [[0.0f32; 4]; 4];
    let mut odd = [[0.0f32; 4]; 4];
    let mut ks = 0;
    while ks < K_STEPS {
        let a0 = unsafe { ldmatrix_x4(q_addr + ks * 32) };
        let a1 = unsafe { ldmatrix_x4(q_addr + ks * 32 + 32) };
        if nkt == 1 {
            // 8 keys x 32 columns: matrices 0, 1 are k-step ks, 2, 3 are ks + 1.
            let b = unsafe { ldmatrix_x4(k_addr + ks * 32) };
            even[0] = Q::mma(a0, b[0], b[1], even[0]);
            odd[0] = Q::mma(a1, b[2], b[3], odd[0]);
        } else {
            // 16 keys x 16 columns per load: matrices 0, 1 are keys 0-7, 2, 3 keys 8-15.
            static_for::<2>(|np| {
                if np < nkt / 2 {
                    let at = k_addr + np as u32 * 16 * pitch + ks * 32;
                    let b0 = unsafe { ldmatrix_x4(at) };
                    let b1 = unsafe { ldmatrix_x4(at + 32) };
                    even[2 * np] = Q::mma(a0, b0[0], b0[1], even[2 * np]);
                    even[2 * np + 1] = Q::mma(a0, b0[2], b0[3], even[2 * np + 1]);
                    odd[2 * np] = Q::mma(a1, b1[0], b1[1], odd[2 * np]);
                    odd[2 * np + 1] = Q::mma(a1, b1[2], b1[3], odd[2 * np + 1]);
                }
            });
        }
        ks += 2;
    }
    static_for::<4>(|n| static_for::<4>(|e| even[n][e] += odd[n][e]));
    even
}

/// This lane's row addresses (byte offsets) for [`scores`]' K loads from a tile: 8-key loads
/// span 32 columns, 16-key loads 16.
#[inline(always)]
fn score_k_offset(nkt: usize, lane: u32, key_off: u32) -> u32 {
    let pitch = row_pitch();
    if nkt == 1 {
        (key_off + lane % 8) * pitch + 16 * (lane / 8)
    } else {
        (key_off + lane % 8 + 8 * (lane / 16)) * pitch + 16 * ((lane / 8) % 2)
    }
}

/// O += P V for one warp: `mt` 16-row tiles of P (at `p_addr`, this lane's `ldmatrix` address;
/// row-tile pitch `p_tile`) times the tile's `bn` keys of V at `v_addr` (this lane's transposed
/// `ldmatrix` address at the warp's first column), `nct * 8` columns.
#[inline(always)]
fn accumulate_pv<Q: MmaHalf>(o: &mut [[[f32; 4]; 16]; 2], mt: usize, nct: usize, bn: usize, p_addr: u32, p_tile: u32, v_addr: u32) {
    let pitch = row_pitch();
    static_for::<4>(|kk| {
        if kk < bn / 16 {
            let mut a = [[0u32; 4]; 2];
            static_for::<2>(|m| {
                if m < mt {
                    a[m] = unsafe { ldmatrix_x4(p_addr + m as u32 * p_tile + kk as u32 * 32) };
                }
            });
            static_for::<8>(|dp| {
                if dp < nct / 2 {
                    let b = unsafe { ldmatrix_x4_trans(v_addr + kk as u32 * 16 * pitch + dp as u32 * 32) };
                    static_for::<2>(|m| {
                        if m < mt {
                            o[m][2 * dp] = Q::mma(a[m], b[0], b[1], o[m][2 * dp]);
                            o[m][2 * dp + 1] = Q::mma(a[m], b[2], b[3], o[m][2 * dp + 1]);
                        }
                    });
                }
            });
        }
    });
}

/// The kernel; `WIDE` picks the shape (`attn_math::mla::{NARROW, WIDE}`). 16-bit caches.
#[inline(always)]
pub unsafe fn mla_attention<Q: MmaHalf, const WIDE: bool>(p: &PrefillParams) {
    // Programmatic dependent launch: wait for the cache write before reading anything.
    pdl_prologue();
    let shape = const { if WIDE { mla::WIDE } else { mla::NARROW } };
    let (bm, bn, st) = (shape.block_m, shape.block_n, shape.stages);
    let (kg, kw, cg, cw) = (shape.key_groups(), shape.keys_per_warp(), shape.col_groups(), shape.cols_per_warp());
    let (nkt, nct, mt) = ((kw / 8) as usize, (cw / 8) as usize, shape.pv_row_tiles() as usize);
    // Memory-bound (narrow): the next copy goes out before waiting, with a barrier at the end of
    // the tile; compute-bound (wide): wait, barrier, then copy into the stage just freed.
    let early_issue = !WIDE;
    let layout = shared_layout(shape);
    let pitch = row_pitch();
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let Some(w) = (unsafe { work_item(p, bm, MLA_V) }) else { return };
    let src = KvSource { block_row: p.block_table + w.req as u64 * p.block_table_stride * 4, key_base: 0, kv_head: 0 };
    let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };
    let chunk = if p.plan != 0 { unsafe { load_u32_nc(p.plan + 4) } } else { p.chunk };
    let begin = if chunk > 0 { w.split * chunk } else { 0 };
    let mut end = if chunk > 0 { (begin + chunk).min(w.seq_len) } else { w.seq_len };
    if p.causal != 0 {
        end = end.min(max_pos + 1);
    }
    let n_tiles = if end > begin { (end - begin).div_ceil(bn) } else { 0 };

    let smem = shared_addr(dynamic_shared::<u8>());
    let k_tile = |stage: u32| smem + layout.k + stage * layout.k_stage;
    let table = |tile: u32| smem + layout.table + (tile % (st + 1)) * table_slot_bytes(bn);
    let flags = |tile: u32| table(tile) + bn * TABLE_ENTRY;
    let tile_keys = |tile: u32| begin + tile * bn;
    // Address tables, one thread per key (as in the attention kernel): the block-table load
    // early, the entry a tile of math later.
    let locate = |tile: u32| {
        let key = tile_keys(tile) + tid;
        if tile < n_tiles && tid < bn && key < end {
            unsafe { src.locate(p, key) }
        } else {
            -1
        }
    };
    let fill = |tile: u32, loc: i64| {
        let key = tile_keys(tile) + tid;
        if tile < n_tiles && tid < bn {
            let (ka, va) = if key < end { src.addresses(p, key, loc, 2) } else { (0, 0) };
            unsafe { st_shared_u64x2(table(tile) + tid * TABLE_ENTRY, ka, va) };
            let bad = key < end && ka == 0;
            if bad {
                unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            }
            let any_bad = vote_any(bad);
            if lane == 0 {
                unsafe { st_shared_u32(flags(tile) + warp * 4, any_bad as u32) };
            }
        }
    };
    let load_k = |tile: u32| {
        let t = table(tile);
        let dst = k_tile(tile % st);
        let row = |r: u32| unsafe { ld_shared_u64(t + r * TABLE_ENTRY) };
        if WIDE {
            unsafe { copy_rows_async::<{ mla::WIDE.block_n as usize }, THREADS>(dst, MLA_QK / 8, pitch, p.q, row) };
        } else {
            unsafe { copy_rows_async::<{ mla::NARROW.block_n as usize }, THREADS>(dst, MLA_QK / 8, pitch, p.q, row) };
        }
    };

    // Prologue: the first `st` address tables, the queries, tiles 0 .. st - 2 in flight (one
    // commit group each, empty ones included).
    static_for::<4>(|j| {
        if (j as u32) < st {
            fill(j as u32, locate(j as u32));
        }
    });
    sync_threads();
    let q_row = |r: u32| {
        let row = unsafe { w.row(p, r) };
        p.q + (row.token as u64 * p.q_token_stride + row.head as u64 * p.q_head_stride) * 2
    };
    if WIDE {
        unsafe { copy_rows_async::<{ mla::WIDE.block_m as usize }, THREADS>(smem + layout.q, MLA_QK / 8, pitch, p.q, q_row) };
    } else {
        unsafe { copy_rows_async::<{ mla::NARROW.block_m as usize }, THREADS>(smem + layout.q, MLA_QK / 8, pitch, p.q, q_row) };
    }
    static_for::<3>(|j| {
        if (j as u32) < st - 1 {
            if (j as u32) < n_tiles {
                load_k(j as u32);
            }
            cp_async_commit();
        }
    });

    // The score phase's grid: 16 rows x `kw` keys; the value phase's: `mt` row tiles x `cw` columns.
    let (s_row0, key_off) = ((warp / kg) * 16, (warp % kg) * kw);
    let (pv_row0, col0) = ((warp / cg) * mt as u32 * 16, (warp % cg) * cw);
    let s_rows = unsafe { [w.row(p, s_row0 + g), w.row(p, s_row0 + g + 8)] };
    let q_addr = smem + layout.q + (s_row0 + lane % 8 + 8 * ((lane / 8) % 2)) * pitch + 16 * (lane / 16);
    let k_offset = score_k_offset(nkt, lane, key_off);
    let p_addr = smem + layout.p + (pv_row0 + lane % 8 + 8 * ((lane / 8) % 2)) * layout.p_pitch + 16 * (lane / 16);
    let v_offset = (lane % 8 + 8 * ((lane / 8) % 2)) * pitch + 16 * (lane / 16) + col0 * 2;
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
    let mult = p.scale_log2;
    // Score-phase state (this warp's keys' share of the denominators) and value-phase maxima.
    let mut s_state = [OnlineSoftmax::EMPTY; 2];
    let mut o_state = [[OnlineSoftmax::EMPTY; 2]; 2];
    let mut o = [[[0.0f32; 4]; 16]; 2];

    let mut tile = 0;
    while tile < n_tiles {
        let ahead = locate(tile + st);
        let next = tile + st - 1;
        if early_issue {
            if next < n_tiles {
                load_k(next);
            }
            cp_async_commit();
            if st == 3 {
                cp_async_wait::<2>();
            } else {
                cp_async_wait::<1>();
            }
            sync_threads();
        } else {
            if st == 3 {
                cp_async_wait::<1>();
            } else {
                cp_async_wait::<0>();
            }
            sync_threads();
            if next < n_tiles {
                load_k(next);
            }
            cp_async_commit();
        }
        let kt = k_tile(tile % st);

        // Scores, masked where the tile crosses a boundary; this warp's row maxima published.
        let mut s = scores::<Q>(nkt, q_addr, kt + k_offset);
        let first = tile_keys(tile) + key_off;
        let mut has_bad = false;
        static_for::<2>(|i| {
            if (i as u32) < bn / 32 {
                has_bad |= unsafe { ld_shared_u32(flags(tile) + i as u32 * 4) } != 0;
            }
        });
        let needs_mask = first + kw > end || (p.causal != 0 && first + kw - 1 > min_pos) || has_bad;
        if needs_mask {
            let t = table(tile) + key_off * TABLE_ENTRY;
            static_for::<4>(|n| {
                if n < nkt {
                    static_for::<4>(|e| {
                        let row = s_rows[e / 2];
                        let key = first + n as u32 * 8 + 2 * t4 + (e % 2) as u32;
                        let visible = key < end
                            && (p.causal == 0 || key <= row.pos)
                            && (!has_bad || unsafe { ld_shared_u64(t + (key - first) * TABLE_ENTRY) } != 0);
                        if !visible {
                            s[n][e] = f32::NEG_INFINITY;
                        }
                    });
                }
            });
        }
        static_for::<2>(|h| {
            let mut m = f32::NEG_INFINITY;
            static_for::<4>(|n| {
                if n < nkt {
                    m = m.max(s[n][2 * h]).max(s[n][2 * h + 1]);
                }
            });
            m = m.max(shfl_xor(m, 1));
            m = m.max(shfl_xor(m, 2));
            if t4 == 0 {
                unsafe { st_shared_f32(row_max(warp % kg, s_row0 + g + 8 * h as u32), m) };
            }
        });
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
                    let at = smem + layout.p + r * layout.p_pitch + (key_off + n as u32 * 8 + 2 * t4) * 2;
                    unsafe { st_shared_u32(at, Q::pack2(w0, w1)) };
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
                        static_for::<16>(|n| {
                            if n < nct {
                                o[m][n][2 * h] *= factor;
                                o[m][n][2 * h + 1] *= factor;
                            }
                        });
                    }
                });
            }
        });
        accumulate_pv::<Q>(&mut o, mt, nct, bn as usize, p_addr, 16 * layout.p_pitch, kt + v_offset);
        fill(tile + st, ahead);
        if early_issue {
            sync_threads();
        }
        tile += 1;
    }
    cp_async_wait::<0>();

    // The denominators: each score warp's share, summed per row through shared memory.
    sync_threads();
    static_for::<2>(|h| {
        let mut sum = s_state[h].sum;
        sum += shfl_xor(sum, 1);
        sum += shfl_xor(sum, 2);
        if t4 == 0 {
            unsafe { st_shared_f32(row_max(warp % kg, s_row0 + g + 8 * h as u32), sum) };
        }
    });
    sync_threads();
    let num_splits = if p.req_num_splits != 0 { unsafe { load_u32_nc(p.req_num_splits + w.req as u64 * 4) } } else { 1 };
    static_for::<2>(|m| {
        if m < mt {
            static_for::<2>(|h| {
                let r = pv_row0 + 16 * m as u32 + g + 8 * h as u32;
                if r >= w.live {
                    return;
                }
                let mut sum = 0.0;
                static_for::<8>(|i| {
                    if (i as u32) < kg {
                        sum += unsafe { ld_shared_f32(row_max(i as u32, r)) };
                    }
                });
                let state = OnlineSoftmax { max: o_state[m][h].max, sum };
                let row = unsafe { w.row(p, r) };
                let out = unsafe { RowOut::new::<{ MLA_V as usize }>(p, &w, &row, state, num_splits, t4 == 0 && col0 == 0, 1.0) };
                static_for::<16>(|n| {
                    if n < nct {
                        unsafe { out.store_pair::<Q>(col0 + n as u32 * 8 + 2 * t4, o[m][n][2 * h], o[m][n][2 * h + 1]) };
                    }
                });
            });
        }
    });
}
