//! Paged decode attention, pass 1 of split-K (flash-decoding), on CUDA cores.
//!
//! One CTA of 4 warps per (group of `ROWS` query rows, work item = request and split, kv head).
//! Every query row that shares the kv head is in the CTA (up to `ROWS`), so each K/V byte of
//! the split is read once. Inside the CTA, 8 lanes share one token (each lane holds a slice of
//! the head dimension), 16 such groups walk the split's tokens two at a time, and keep an online
//! softmax per row; groups then merge through shuffles and shared memory. A request with one
//! split writes its output (with the sink and LSE) directly; otherwise the partial output and
//! its LSE go to the workspace for the merge kernel (`decode_merge`).

use crate::device::{
    atomic_or_global, block_idx_x, block_idx_y, block_idx_z, dynamic_shared, fma, shfl_xor, static_for, sync_threads, tanh, thread_idx_x,
};
use crate::elem::{load_chunk_half, store_half, CacheFormat, HalfFloat};
use crate::vec_io::{load_f32_nc, load_u32_nc, store_f32};
use attn_math::decode::{THREADS, WARPS};
use attn_math::params::DecodeParams;
use attn_math::softmax::{OnlineSoftmax, LOG2_E};
use attn_math::status::BLOCK_OUT_OF_RANGE;

const LANES_PER_TOKEN: u32 = 8;
const GROUPS: u32 = THREADS / LANES_PER_TOKEN;
/// Tokens a group has in flight per step.
const TOKENS_PER_STEP: u32 = 2;

#[inline(always)]
unsafe fn load_i32_nc(addr: u64) -> i32 {
    unsafe { load_u32_nc(addr) as i32 }
}

/// Where one query row of the CTA comes from and where its key range ends.
#[derive(Clone, Copy)]
struct Row {
    token: u32,
    head: u32,
    /// Position of the query token in its sequence: it sees keys `..= pos` (and, with a window,
    /// only the last `window` of those).
    pos: u32,
    slope_log2: f32,
}

#[inline(always)]
pub unsafe fn decode<Q: HalfFloat, C: CacheFormat, const D: usize, const ROWS: usize, const VPL: usize>(p: &DecodeParams) {
    // Chunks of 8 elements in a head; lane `sub` holds chunks sub, sub + 8, ... (VPL of them).
    let chunks = (D / 8) as u32;
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (group, sub) = (tid / LANES_PER_TOKEN, tid % LANES_PER_TOKEN);

    // Grid: x = row group (fastest, so the CTAs that read the same K/V run together and share
    // it through L2), y = work item, z = kv head.
    let item = unsafe { load_u32_nc(p.work_items + block_idx_y() as u64 * 4) };
    let (req, split) = (item >> 16, item & 0xffff);
    let kv_head = block_idx_z();
    let row0 = block_idx_x() * ROWS as u32;
    let seq_len = unsafe { load_i32_nc(p.seq_lens + req as u64 * 4) }.max(0) as u32;
    let q_start = unsafe { load_i32_nc(p.query_start_loc + req as u64 * 4) } as u32;
    let q_len = unsafe { load_i32_nc(p.query_start_loc + req as u64 * 4 + 4) } as u32 - q_start;
    let n_rows = q_len * p.group;
    if row0 >= n_rows {
        return;
    }
    let live_rows = (n_rows - row0).min(ROWS as u32);
    let k_scale = if p.k_scale != 0 { unsafe { load_f32_nc(p.k_scale) } } else { 1.0 } * C::UNPACK_SCALE;
    let v_scale = if p.v_scale != 0 { unsafe { load_f32_nc(p.v_scale) } } else { 1.0 } * C::UNPACK_SCALE;

    // Row m of the CTA (rows past the request's repeat its last one and are never written).
    let row_at = |m: u32| {
        let r = row0 + m.min(live_rows - 1);
        let t = r / p.group;
        let head = kv_head * p.group + (r - t * p.group);
        Row {
            token: q_start + t,
            head,
            // The request's q_len new tokens are the last ones of its sequence.
            pos: (seq_len + t).saturating_sub(q_len),
            slope_log2: if p.alibi_slopes != 0 { (unsafe { load_f32_nc(p.alibi_slopes + head as u64 * 4) }) * LOG2_E } else { 0.0 },
        }
    };
    let mut rows = [Row { token: 0, head: 0, pos: 0, slope_log2: 0.0 }; ROWS];
    static_for::<ROWS>(|m| rows[m] = row_at(m as u32));
    // Rows are in token order, so the first has the smallest position.
    let min_pos = rows[0].pos;

    // Queries into shared memory as f32, scaled so that q.k is the logit in base-2 units.
    let smem = dynamic_shared::<f32>();
    let q_smem = smem;
    let q_mult = p.scale_log2 * k_scale;
    let mut c = tid;
    while c < ROWS as u32 * chunks {
        let m = c / chunks;
        let chunk = c - m * chunks;
        let row = row_at(m);
        let vals = if m < live_rows {
            unsafe {
                load_chunk_half::<Q>(p.q + (row.token as u64 * p.q_token_stride + row.head as u64 * p.q_head_stride + chunk as u64 * 8) * 2)
            }
        } else {
            [0.0; 8]
        };
        static_for::<8>(|e| unsafe { *q_smem.add((m * D as u32 + chunk * 8) as usize + e) = vals[e] * q_mult });
        c += THREADS;
    }
    sync_threads();

    // The split's keys, narrowed by the window of the earliest row.
    let mut begin = split * p.chunk;
    let end = (begin + p.chunk).min(seq_len);
    if p.window > 0 {
        begin = begin.max((min_pos + 1).saturating_sub(p.window));
    }

    let mut state = [OnlineSoftmax::EMPTY; ROWS];
    let mut acc = [[[0.0f32; 8]; VPL]; ROWS];
    let block_row = p.block_table + req as u64 * p.block_table_stride * 4;
    let softcap_inv = if p.softcap > 0.0 { 1.0 / (p.softcap * LOG2_E) } else { 0.0 };
    let softcap_log2 = p.softcap * LOG2_E;

    // The loop bound is the same for the whole CTA (lanes past `end` mask their tokens): the
    // shuffles below need every lane of the warp.
    let mut step_base = begin;
    while step_base < end {
        let t0 = step_base + group * TOKENS_PER_STEP;
        let mut k = [[C::ZERO; VPL]; TOKENS_PER_STEP as usize];
        let mut v = [[C::ZERO; VPL]; TOKENS_PER_STEP as usize];
        let mut ok = [false; TOKENS_PER_STEP as usize];
        static_for::<{ TOKENS_PER_STEP as usize }>(|j| {
            let t = t0 + j as u32;
            if t < end {
                let block_id = unsafe { load_i32_nc(block_row + (t / p.block_size) as u64 * 4) };
                if block_id >= 0 && (block_id as u32) < p.num_blocks {
                    ok[j] = true;
                    let offset = t % p.block_size;
                    static_for::<VPL>(|x| {
                        let chunk = sub + LANES_PER_TOKEN * x as u32;
                        if chunk < chunks {
                            let e = p.cache_strides.offset(block_id as u64, offset as u64, kv_head as u64, chunk as u64 * 8) * C::BYTES;
                            k[j][x] = unsafe { C::load_raw(p.k_cache + e) };
                            v[j][x] = unsafe { C::load_raw(p.v_cache + e) };
                        }
                    });
                } else if sub == 0 {
                    unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
                }
            }
        });
        static_for::<ROWS>(|m| {
            let row = rows[m];
            let mut s = [f32::NEG_INFINITY; TOKENS_PER_STEP as usize];
            let mut step_max = f32::NEG_INFINITY;
            static_for::<{ TOKENS_PER_STEP as usize }>(|j| {
                let mut dot = 0.0f32;
                static_for::<VPL>(|x| {
                    let chunk = sub + LANES_PER_TOKEN * x as u32;
                    if chunk < chunks {
                        let qrow = unsafe { q_smem.add(m * D + chunk as usize * 8) };
                        let kx = C::unpack(k[j][x]);
                        static_for::<8>(|e| dot = fma(unsafe { *qrow.add(e) }, kx[e], dot));
                    }
                });
                dot += shfl_xor(dot, 1);
                dot += shfl_xor(dot, 2);
                dot += shfl_xor(dot, 4);
                let t = t0 + j as u32;
                let visible = ok[j] && t <= row.pos && (p.window == 0 || t + p.window > row.pos);
                if visible {
                    let mut logit = dot;
                    if p.softcap > 0.0 {
                        logit = softcap_log2 * tanh(logit * softcap_inv);
                    }
                    logit += row.slope_log2 * (t as f32 - row.pos as f32);
                    s[j] = logit;
                    step_max = step_max.max(logit);
                }
            });
            let factor = state[m].rescale_to(step_max);
            if factor != 1.0 {
                static_for::<VPL>(|x| static_for::<8>(|e| acc[m][x][e] *= factor));
            }
            static_for::<{ TOKENS_PER_STEP as usize }>(|j| {
                let w = state[m].weight(s[j]);
                static_for::<VPL>(|x| {
                    let vx = C::unpack(v[j][x]);
                    static_for::<8>(|e| acc[m][x][e] = fma(w, vx[e], acc[m][x][e]));
                });
            });
        });
        step_base += GROUPS * TOKENS_PER_STEP;
    }

    // Merge the 4 groups of each warp (lanes 8 and 16 apart hold the same dims).
    static_for::<2>(|i| {
        let mask = 8u32 << i;
        static_for::<ROWS>(|m| {
            let other = OnlineSoftmax { max: shfl_xor(state[m].max, mask), sum: shfl_xor(state[m].sum, mask) };
            let (fa, fb) = state[m].merge(other);
            static_for::<VPL>(|x| {
                static_for::<8>(|e| {
                    let o = shfl_xor(acc[m][x][e], mask);
                    acc[m][x][e] = fma(acc[m][x][e], fa, o * fb);
                })
            });
        });
    });
    // Then the warps, through shared memory: per warp and row, D accumulators + max + sum.
    let merge_smem = unsafe { smem.add(ROWS * D) };
    let stride_w = ROWS * (D + 2);
    if lane < LANES_PER_TOKEN {
        static_for::<ROWS>(|m| {
            let base = unsafe { merge_smem.add(warp as usize * stride_w + m * (D + 2)) };
            static_for::<VPL>(|x| {
                let chunk = sub + LANES_PER_TOKEN * x as u32;
                if chunk < chunks {
                    static_for::<8>(|e| unsafe { *base.add(chunk as usize * 8 + e) = acc[m][x][e] });
                }
            });
            if sub == 0 {
                unsafe {
                    *base.add(D) = state[m].max;
                    *base.add(D + 1) = state[m].sum;
                }
            }
        });
    }
    sync_threads();

    let num_splits = unsafe { load_u32_nc(p.req_num_splits + req as u64 * 4) };
    let mut idx = tid;
    while idx < live_rows * D as u32 {
        let m = (idx / D as u32) as usize;
        let d = idx as usize - m * D;
        let mut total = OnlineSoftmax::EMPTY;
        let mut o = 0.0f32;
        for w in 0..WARPS {
            let base = unsafe { merge_smem.add(w * stride_w + m * (D + 2)) };
            let (fa, fb) = total.merge(unsafe { OnlineSoftmax { max: *base.add(D), sum: *base.add(D + 1) } });
            o = o * fa + unsafe { *base.add(d) } * fb;
        }
        let row = row_at(m as u32);
        if num_splits == 1 {
            // Final output: the sink joins the denominator as a logit with no value.
            if p.sinks != 0 {
                let sink = (unsafe { load_f32_nc(p.sinks + row.head as u64 * 4) }) * LOG2_E;
                let (fa, _) = total.merge(OnlineSoftmax { max: sink, sum: 1.0 });
                o *= fa;
            }
            let out = if total.sum > 0.0 { o / total.sum * v_scale } else { 0.0 };
            let addr = p.out + (row.token as u64 * p.out_token_stride + row.head as u64 * p.out_head_stride + d as u64) * 2;
            unsafe { store_half::<Q>(addr, out) };
            if d == 0 && p.lse != 0 {
                unsafe { store_f32(p.lse + (row.token as u64 * p.num_q_heads as u64 + row.head as u64) * 4, total.lse()) };
            }
        } else {
            let base = unsafe { load_u32_nc(p.req_partial_base + req as u64 * 4) } as u64;
            let t = (row.token - q_start) as u64;
            let index = base + (split as u64 * q_len as u64 + t) * p.num_q_heads as u64 + row.head as u64;
            let out = if total.sum > 0.0 { o / total.sum * v_scale } else { 0.0 };
            unsafe { store_f32(p.partial_out + (index * D as u64 + d as u64) * 4, out) };
            if d == 0 {
                unsafe { store_f32(p.partial_lse + index * 4, total.lse()) };
            }
        }
        idx += THREADS;
    }
}
