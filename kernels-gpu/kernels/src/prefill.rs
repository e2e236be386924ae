//! Tiled online-softmax attention on tensor cores (FlashAttention-2's scheme) over a paged
//! cache or packed K/V: prefill, chunked prefill, encoders.
//!
//! One CTA of 4 warps per (work item, kv head). A work item is a request, a tile of
//! `BLOCK_M` = 64 of its query rows (row = token * group + head-in-group, so the query heads of
//! a kv head share every K/V tile) and a split of its keys. Each warp owns 16 rows. K/V tiles of
//! `BN` keys stream through a two-stage `cp.async` pipeline into padded shared memory; per tile
//! a warp computes S = Q K^T with `mma.sync`, applies the mask (only on tiles that cross a
//! boundary), updates its rows' online softmax in registers, and adds P V to its f32
//! accumulators. Tiles that no row of the CTA can see are never loaded.

use crate::device::{atomic_or_global, block_idx_x, dynamic_shared, shfl_xor, static_for, sync_threads, tanh, thread_idx_x};
use crate::mma::{cp_async_16, cp_async_commit, cp_async_wait, ldmatrix_x4, ldmatrix_x4_trans, shared_addr, MmaHalf};
use crate::vec_io::{load_f32_nc, load_u32_nc, store4, store8, store_f32};
use attn_math::paging::CacheStrides;
use attn_math::params::PrefillParams;
use attn_math::prefill::{shared_layout, BLOCK_M, ROW_PAD, THREADS};
use attn_math::softmax::{exp2, OnlineSoftmax, LOG2_E};
use attn_math::status::BLOCK_OUT_OF_RANGE;

const STAGES: u32 = 2;

#[inline(always)]
unsafe fn load_i32(addr: u64) -> i32 {
    unsafe { load_u32_nc(addr) as i32 }
}

/// Where the CTA's keys come from.
#[derive(Clone, Copy)]
struct KvSource {
    /// Paged: the request's block-table row; 0 for packed K/V.
    block_row: u64,
    /// Packed: the request's first key row.
    key_base: u64,
    kv_head: u64,
}

impl KvSource {
    /// Byte address of element 0 of key `key` in the tensor at `base`, or `None` when its block
    /// is outside the cache (reported through the status word; never read).
    #[inline(always)]
    unsafe fn row(&self, p: &PrefillParams, base: u64, strides: &CacheStrides, key: u32) -> Option<u64> {
        if self.block_row == 0 {
            return Some(base + ((self.key_base + key as u64) * strides.token + self.kv_head * strides.head) * 2);
        }
        let block = unsafe { load_i32(self.block_row + (key / p.block_size) as u64 * 4) };
        if block < 0 || block as u32 >= p.num_blocks {
            unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            return None;
        }
        Some(base + strides.offset(block as u64, (key % p.block_size) as u64, self.kv_head, 0) * 2)
    }
}

/// Copies `ROWS` rows of `D` 16-bit elements into shared memory at `dst` (pitch `D + ROW_PAD`),
/// asynchronously; `src(r)` gives a row's address, `None` for a row to zero-fill (`fallback`, a
/// valid address, is named then but not read). Every address is computed first (their loads,
/// block-table lookups, are independent and overlap), then every copy is issued.
#[inline(always)]
unsafe fn load_tile_async<const D: usize, const ROWS: usize>(dst: u32, fallback: u64, src: impl Fn(u32) -> Option<u64>) {
    let chunks = D as u32 / 8;
    let passes = (ROWS as u32 * chunks).div_ceil(THREADS);
    let pitch = (D as u32 + ROW_PAD) * 2;
    let tid = thread_idx_x();
    let mut addr = [(0u64, 0u32); 16];
    static_for::<16>(|i| {
        if (i as u32) < passes {
            let idx = tid + i as u32 * THREADS;
            let r = idx / chunks;
            let c = idx - r * chunks;
            if r < ROWS as u32 {
                addr[i] = match src(r) {
                    Some(a) => (a + c as u64 * 16, 16),
                    None => (fallback, 0),
                };
            }
        }
    });
    static_for::<16>(|i| {
        if (i as u32) < passes {
            let idx = tid + i as u32 * THREADS;
            let r = idx / chunks;
            let c = idx - r * chunks;
            if r < ROWS as u32 {
                unsafe { cp_async_16(dst + r * pitch + c * 16, addr[i].0, addr[i].1) };
            }
        }
    });
}

/// One query row of a thread (each thread holds two: g and g + 8 of its warp's 16).
#[derive(Clone, Copy)]
struct RowInfo {
    token: u32,
    head: u32,
    /// Keys `..= pos` are visible (causal); the window counts back from it.
    pos: u32,
    slope_log2: f32,
}

#[inline(always)]
pub unsafe fn prefill<Q: MmaHalf, const DK: usize, const DV: usize, const BN: usize>(p: &PrefillParams) {
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);

    // Grid x = work item * kv heads + kv head: the kv heads of one tile run together, and the
    // items' longest-first order holds across heads.
    let kv_heads = p.num_q_heads / p.group;
    let item_idx = block_idx_x() / kv_heads;
    let kv_head = block_idx_x() - item_idx * kv_heads;
    let item = p.work_items + item_idx as u64 * 8;
    let req = unsafe { load_u32_nc(item) };
    let tile_split = unsafe { load_u32_nc(item + 4) };
    let (row_tile, split) = (tile_split >> 16, tile_split & 0xffff);
    let q_start = unsafe { load_i32(p.query_start_loc + req as u64 * 4) } as u32;
    let q_len = unsafe { load_i32(p.query_start_loc + req as u64 * 4 + 4) } as u32 - q_start;
    let (seq_len, key_base) = if p.block_table != 0 {
        (unsafe { load_i32(p.seq_lens + req as u64 * 4) }.max(0) as u32, 0)
    } else {
        let k0 = unsafe { load_i32(p.key_start_loc + req as u64 * 4) } as u32;
        (unsafe { load_i32(p.key_start_loc + req as u64 * 4 + 4) } as u32 - k0, k0)
    };
    let n_rows = q_len * p.group;
    let row0 = row_tile * BLOCK_M;
    if row0 >= n_rows {
        return;
    }
    let live = (n_rows - row0).min(BLOCK_M);
    let src = KvSource {
        block_row: if p.block_table != 0 { p.block_table + req as u64 * p.block_table_stride * 4 } else { 0 },
        key_base: key_base as u64,
        kv_head: kv_head as u64,
    };

    // Row r of the tile (rows past the request repeat its last one and are never written).
    let row_at = |r: u32| {
        let gr = row0 + r.min(live - 1);
        let t = gr / p.group;
        let head = kv_head * p.group + (gr - t * p.group);
        RowInfo {
            token: q_start + t,
            head,
            // The request's q_len new tokens are the last ones of its sequence.
            pos: (seq_len + t).saturating_sub(q_len),
            slope_log2: if p.alibi_slopes != 0 { (unsafe { load_f32_nc(p.alibi_slopes + head as u64 * 4) }) * LOG2_E } else { 0.0 },
        }
    };
    let (min_pos, max_pos) = (row_at(0).pos, row_at(live - 1).pos);

    // The keys this CTA attends: its split, cut by causality and the window.
    let mut begin = if p.chunk > 0 { split * p.chunk } else { 0 };
    let mut end = if p.chunk > 0 { (begin + p.chunk).min(seq_len) } else { seq_len };
    if p.causal != 0 {
        end = end.min(max_pos + 1);
    }
    if p.window > 0 {
        begin = begin.max((min_pos + 1).saturating_sub(p.window));
    }
    let n_tiles = if end > begin { (end - begin).div_ceil(BN as u32) } else { 0 };

    let layout = shared_layout(DK as u32, DV as u32);
    let smem = shared_addr(dynamic_shared::<u8>());
    let (q_pitch, k_pitch, v_pitch) = ((DK as u32 + ROW_PAD) * 2, (DK as u32 + ROW_PAD) * 2, (DV as u32 + ROW_PAD) * 2);

    // Queries (group 0 of the pipeline).
    unsafe {
        load_tile_async::<DK, { BLOCK_M as usize }>(smem, p.q, |r| {
            let row = row_at(r);
            Some(p.q + (row.token as u64 * p.q_token_stride + row.head as u64 * p.q_head_stride) * 2)
        })
    };
    let load_kv = |tile: u32| {
        let stage = tile % STAGES;
        let kt = begin + tile * BN as u32;
        let rows = |base: u64, strides: CacheStrides| {
            move |r: u32| {
                let key = kt + r;
                if key < end {
                    unsafe { src.row(p, base, &strides, key) }
                } else {
                    None
                }
            }
        };
        unsafe {
            load_tile_async::<DK, BN>(smem + layout.k + stage * layout.k_stage, p.k, rows(p.k, p.k_strides));
            load_tile_async::<DV, BN>(smem + layout.v + stage * layout.v_stage, p.v, rows(p.v, p.v_strides));
        }
    };
    // Prologue: tiles 0 .. STAGES - 1 in flight (one commit group each, empty ones included, so
    // that "all but STAGES - 1 groups done" always means "this tile is in").
    static_for::<{ STAGES as usize - 1 }>(|s| {
        if (s as u32) < n_tiles {
            load_kv(s as u32);
        }
        cp_async_commit();
    });

    let rows = [row_at(warp * 16 + g), row_at(warp * 16 + g + 8)];
    let softcap_inv = if p.softcap > 0.0 { 1.0 / (p.softcap * LOG2_E) } else { 0.0 };
    let softcap_log2 = p.softcap * LOG2_E;

    let mut state = [OnlineSoftmax::EMPTY; 2];
    let mut o = [[0.0f32; 4]; 32]; // DV / 8 column tiles of 8 used
    let mut q_frag = [[0u32; 4]; 16]; // DK / 16 k-steps used
    let q_base = smem + (warp * 16 + (lane % 8) + 8 * ((lane / 8) % 2)) * q_pitch + 16 * (lane / 16);

    let mut tile = 0;
    while tile < n_tiles {
        let next = tile + STAGES - 1;
        if next < n_tiles {
            load_kv(next);
        }
        cp_async_commit();
        cp_async_wait::<{ STAGES - 1 }>();
        sync_threads();
        if tile == 0 {
            static_for::<16>(|ks| {
                if ks < DK / 16 {
                    q_frag[ks] = unsafe { ldmatrix_x4(q_base + ks as u32 * 32) };
                }
            });
        }
        let stage = tile % STAGES;
        let kt = begin + tile * BN as u32;

        // S = Q K^T: 16 rows x BN keys per warp.
        let mut s = [[0.0f32; 4]; 8];
        let k_base = smem + layout.k + stage * layout.k_stage + ((lane % 8) + 8 * (lane / 16)) * k_pitch + 16 * ((lane / 8) % 2);
        static_for::<16>(|ks| {
            if ks < DK / 16 {
                static_for::<4>(|np| {
                    if np < BN / 16 {
                        let b = unsafe { ldmatrix_x4(k_base + np as u32 * 16 * k_pitch + ks as u32 * 32) };
                        s[2 * np] = Q::mma(q_frag[ks], b[0], b[1], s[2 * np]);
                        s[2 * np + 1] = Q::mma(q_frag[ks], b[2], b[3], s[2 * np + 1]);
                    }
                });
            }
        });

        // Logits in base-2 units, masked where the tile crosses a boundary.
        let needs_mask =
            kt + BN as u32 > end || (p.causal != 0 && kt + BN as u32 - 1 > min_pos) || (p.window > 0 && kt + p.window <= max_pos);
        // Each feature is one uniform branch around its own pass over the tile.
        let key_of = |n: usize, e: usize| kt + n as u32 * 8 + 2 * t4 + (e % 2) as u32;
        static_for::<8>(|n| {
            if n < BN / 8 {
                static_for::<4>(|e| s[n][e] *= p.scale_log2)
            }
        });
        if p.softcap > 0.0 {
            static_for::<8>(|n| {
                if n < BN / 8 {
                    static_for::<4>(|e| s[n][e] = softcap_log2 * tanh(s[n][e] * softcap_inv))
                }
            });
        }
        if p.alibi_slopes != 0 {
            static_for::<8>(|n| {
                if n < BN / 8 {
                    static_for::<4>(|e| {
                        let row = rows[e / 2];
                        s[n][e] += row.slope_log2 * (key_of(n, e) as f32 - row.pos as f32);
                    })
                }
            });
        }
        if needs_mask {
            static_for::<8>(|n| {
                if n < BN / 8 {
                    static_for::<4>(|e| {
                        let row = rows[e / 2];
                        let key = key_of(n, e);
                        let visible = key < end && (p.causal == 0 || key <= row.pos) && (p.window == 0 || key + p.window > row.pos);
                        s[n][e] = if visible { s[n][e] } else { f32::NEG_INFINITY };
                    })
                }
            });
        }

        // Online softmax per row (the 4 lanes of a quad share a row).
        static_for::<2>(|h| {
            let mut m = f32::NEG_INFINITY;
            static_for::<8>(|n| {
                if n < BN / 8 {
                    m = m.max(s[n][2 * h]).max(s[n][2 * h + 1]);
                }
            });
            m = m.max(shfl_xor(m, 1));
            m = m.max(shfl_xor(m, 2));
            let factor = state[h].rescale_to(m);
            if factor != 1.0 {
                static_for::<32>(|n| {
                    if n < DV / 8 {
                        o[n][2 * h] *= factor;
                        o[n][2 * h + 1] *= factor;
                    }
                });
            }
            // A row that has seen nothing yet keeps max -inf: its weights are all 0.
            let m_use = if state[h].max == f32::NEG_INFINITY { 0.0 } else { state[h].max };
            let mut sum = 0.0;
            static_for::<8>(|n| {
                if n < BN / 8 {
                    static_for::<2>(|e| {
                        let w = exp2(s[n][2 * h + e] - m_use);
                        s[n][2 * h + e] = w;
                        sum += w;
                    });
                }
            });
            state[h].sum += sum;
        });

        // O += P V: P from the S registers (C layout = A layout of the next mma).
        let v_base = smem + layout.v + stage * layout.v_stage + ((lane % 8) + 8 * ((lane / 8) % 2)) * v_pitch + 16 * (lane / 16);
        static_for::<4>(|kk| {
            if kk < BN / 16 {
                let a = [
                    Q::pack2(s[2 * kk][0], s[2 * kk][1]),
                    Q::pack2(s[2 * kk][2], s[2 * kk][3]),
                    Q::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                    Q::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
                ];
                static_for::<16>(|dp| {
                    if dp < DV / 16 {
                        let b = unsafe { ldmatrix_x4_trans(v_base + kk as u32 * 16 * v_pitch + dp as u32 * 32) };
                        o[2 * dp] = Q::mma(a, b[0], b[1], o[2 * dp]);
                        o[2 * dp + 1] = Q::mma(a, b[2], b[3], o[2 * dp + 1]);
                    }
                });
            }
        });
        // Every warp is done with this stage before it is refilled.
        sync_threads();
        tile += 1;
    }
    cp_async_wait::<0>();

    // Epilogue: the quad's partial sums, then the output (or the split's partial) per row.
    let num_splits = if p.req_num_splits != 0 { unsafe { load_u32_nc(p.req_num_splits + req as u64 * 4) } } else { 1 };
    static_for::<2>(|h| {
        let r_local = warp * 16 + g + 8 * h as u32;
        let row = rows[h];
        let mut st = state[h];
        st.sum += shfl_xor(st.sum, 1);
        st.sum += shfl_xor(st.sum, 2);
        if r_local >= live {
            return;
        }
        let mut scale = 1.0;
        if num_splits == 1 {
            if p.sinks != 0 {
                let sink = (unsafe { load_f32_nc(p.sinks + row.head as u64 * 4) }) * LOG2_E;
                let (fa, _) = st.merge(OnlineSoftmax { max: sink, sum: 1.0 });
                scale = fa;
            }
            let inv = if st.sum > 0.0 { scale / st.sum } else { 0.0 };
            let out = p.out + (row.token as u64 * p.out_token_stride + row.head as u64 * p.out_head_stride) * 2;
            static_for::<32>(|n| {
                if n < DV / 8 {
                    let col = n as u32 * 8 + 2 * t4;
                    let v = Q::pack2(o[n][2 * h] * inv, o[n][2 * h + 1] * inv);
                    unsafe { store4(out + col as u64 * 2, v) };
                }
            });
            if t4 == 0 && p.lse != 0 {
                unsafe { store_f32(p.lse + (row.token as u64 * p.num_q_heads as u64 + row.head as u64) * 4, st.lse()) };
            }
        } else {
            let base = unsafe { load_u32_nc(p.req_partial_base + req as u64 * 4) } as u64;
            let t = (row.token - q_start) as u64;
            let index = base + (split as u64 * q_len as u64 + t) * p.num_q_heads as u64 + row.head as u64;
            let inv = if st.sum > 0.0 { 1.0 / st.sum } else { 0.0 };
            static_for::<32>(|n| {
                if n < DV / 8 {
                    let col = n as u64 * 8 + 2 * t4 as u64;
                    let v = [(o[n][2 * h] * inv).to_bits(), (o[n][2 * h + 1] * inv).to_bits()];
                    unsafe { store8(p.partial_out + (index * DV as u64 + col) * 4, v) };
                }
            });
            if t4 == 0 {
                unsafe { store_f32(p.partial_lse + index * 4, st.lse()) };
            }
        }
    });
}
