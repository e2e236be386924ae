//! LSE merges of partial attention results: pass 2 of split-K decode, and the public
//! `merge_attn_states` (two partial results of the same queries over disjoint keys: a shared
//! prefix and a suffix, or two GPUs' shares of a context). One warp per (token, head); lanes
//! walk the head dimension. The weights come from `attn_math::softmax::combine_lse`, the same
//! code the CPU reference runs.

use crate::blocks::device::{
    block_dim_x, block_idx_x, dynamic_shared, fma, pdl_prologue, shfl_xor, static_for, sync_threads, thread_idx_x,
};
use crate::blocks::elem::HalfFloat;
use crate::blocks::mma::{ld_shared_f32, shared_addr, st_shared_v4};
use crate::blocks::vec_io::{load16, load_f32, load_f32_nc, load_u32_nc, store_f32, store_u16};
use attn_math::params::{DecodeMergeParams, MergeStatesParams, MERGE_THREADS};
use attn_math::softmax::{combine_lse, exp2, log2, partial_weight, LN_2, LOG2_E};

#[inline(always)]
fn warp_index() -> u32 {
    (block_idx_x() * block_dim_x() + thread_idx_x()) / 32
}

#[inline(always)]
fn lane() -> u32 {
    thread_idx_x() % 32
}

/// A value of an output element type.
pub trait OutElem {
    const BYTES: u64;
    unsafe fn load(addr: u64) -> f32;
    unsafe fn store(addr: u64, x: f32);
}

pub struct Half<H>(core::marker::PhantomData<H>);
impl<H: HalfFloat> OutElem for Half<H> {
    const BYTES: u64 = 2;
    #[inline(always)]
    unsafe fn load(addr: u64) -> f32 {
        let w = unsafe { load_u32_nc(addr & !3) };
        let (lo, hi) = H::unpack2(w);
        if addr & 2 == 0 {
            lo
        } else {
            hi
        }
    }
    #[inline(always)]
    unsafe fn store(addr: u64, x: f32) {
        unsafe { store_u16(addr, H::pack(x)) }
    }
}

pub struct F32Out;
impl OutElem for F32Out {
    const BYTES: u64 = 4;
    #[inline(always)]
    unsafe fn load(addr: u64) -> f32 {
        unsafe { load_f32_nc(addr) }
    }
    #[inline(always)]
    unsafe fn store(addr: u64, x: f32) {
        unsafe { store_f32(addr, x) }
    }
}

/// Pass 2 of split-K: one CTA of [`MERGE_THREADS`] per (token, head). Every warp finds the
/// splits' max LSE and denominator (lanes stride over the splits); then the threads form split
/// groups of `head_size / 4` (one 16-byte chunk of the row each): group g adds up splits g,
/// g + groups, ..., and the groups' sums meet in shared memory (MLA's 512: one group, which
/// stores its sums directly). Requests with one split were written by pass 1 and are skipped.
/// Head sizes: multiples of 4 up to [`MAX_MERGE_HEAD_SIZE`].
#[inline(always)]
pub unsafe fn decode_merge<O: OutElem>(p: &DecodeMergeParams) {
    let cta = block_idx_x();
    if cta >= p.num_tokens * p.num_q_heads {
        return;
    }
    // The plan and the batch's metadata were on the device before pass 1 started, so they are
    // read before waiting for it (programmatic dependent launch): only the partials' two
    // round trips are left after the wait.
    let (token, head) = (cta / p.num_q_heads, cta % p.num_q_heads);
    // No `query_start_loc`: every token is its own request (sparse MLA plans per query token;
    // their `token_request` names the batch's request, which the merge does not need).
    let per_token = p.query_start_loc == 0;
    let req = if per_token { token } else { unsafe { load_u32_nc(p.token_request + token as u64 * 4) } };
    let splits = unsafe { load_u32_nc(p.req_num_splits + req as u64 * 4) };
    if splits <= 1 {
        return; // written directly by pass 1
    }
    let (tid, lane) = (thread_idx_x(), lane());
    let (q_start, q_len) = if per_token {
        (token, 1)
    } else {
        let q_start = unsafe { load_u32_nc(p.query_start_loc + req as u64 * 4) };
        (q_start, unsafe { load_u32_nc(p.query_start_loc + req as u64 * 4 + 4) } - q_start)
    };
    let base = unsafe { load_u32_nc(p.req_partial_base + req as u64 * 4) } as u64;
    let sink = if p.sinks != 0 { unsafe { load_f32_nc(p.sinks + head as u64 * 4) } } else { f32::NEG_INFINITY };
    pdl_prologue();
    // Split s's partial row: two values held through the loops, whatever the batch's shape.
    let (row0, step) = (base + (token - q_start) as u64 * p.num_q_heads as u64 + head as u64, q_len as u64 * p.num_q_heads as u64);
    let index = |s: u32| row0 + s as u64 * step;
    // Partials were written by the previous kernel: plain (coherent) loads.
    let lse = |s: u32| unsafe { load_f32(p.partial_lse + index(s) * 4) };
    let mut max = sink;
    let mut s = lane;
    while s < splits {
        max = max.max(lse(s));
        s += 32;
    }
    static_for::<5>(|i| max = max.max(shfl_xor(max, 1 << i)));
    // The sink joins the denominator once (lane 0's share).
    let mut sum = if lane == 0 && max != f32::NEG_INFINITY { exp2((sink - max) * LOG2_E) } else { 0.0 };
    let mut s = lane;
    while s < splits && max != f32::NEG_INFINITY {
        sum += exp2((lse(s) - max) * LOG2_E);
        s += 32;
    }
    static_for::<5>(|i| sum += shfl_xor(sum, 1 << i));
    let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
    let partial = shared_addr(dynamic_shared::<f32>());
    let d = p.head_size;
    let chunks = d / 4;
    let groups = MERGE_THREADS / chunks;
    let (group, chunk) = (tid / chunks, tid % chunks);
    let weight = |s: u32| exp2((lse(s) - max) * LOG2_E) * inv;
    let row = |s: u32| p.partial_out + index(s) * d as u64 * 4 + chunk as u64 * 16;
    let mut acc = [0.0f32; 4];
    let mut add = |wgt: f32, v: [u32; 4]| {
        // A zero weight skips its partial: an empty split's output may be anything.
        if wgt != 0.0 {
            static_for::<4>(|i| acc[i] = fma(wgt, f32::from_bits(v[i]), acc[i]));
        }
    };
    let mut s = group;
    while group < groups && inv != 0.0 && s < splits {
        // Two splits at a time: both rows' loads go out before either sum.
        let (w0, w1) = (weight(s), if s + groups < splits { weight(s + groups) } else { 0.0 });
        let v0 = if w0 != 0.0 { unsafe { load16(row(s)) } } else { [0; 4] };
        let v1 = if w1 != 0.0 { unsafe { load16(row(s + groups)) } } else { [0; 4] };
        add(w0, v0);
        add(w1, v1);
        s += 2 * groups;
    }
    let out = p.out + (token as u64 * p.out_token_stride + head as u64 * p.out_head_stride) * O::BYTES;
    if groups == 1 {
        static_for::<4>(|i| unsafe { O::store(out + (4 * chunk as u64 + i as u64) * O::BYTES, acc[i]) });
    } else {
        if group < groups {
            unsafe { st_shared_v4(partial + (group * d + 4 * chunk) * 4, acc.map(f32::to_bits)) };
        }
        sync_threads();
        let mut i = tid;
        while i < d {
            let mut o = 0.0;
            let mut g = 0;
            while g < groups {
                o += unsafe { ld_shared_f32(partial + (g * d + i) * 4) };
                g += 1;
            }
            unsafe { O::store(out + i as u64 * O::BYTES, o) };
            i += MERGE_THREADS;
        }
    }
    if thread_idx_x() == 0 && p.lse != 0 {
        let out_lse = if sum > 0.0 { max + log2(sum) * LN_2 } else { f32::NEG_INFINITY };
        unsafe { store_f32(p.lse + (token as u64 * p.num_q_heads as u64 + head as u64) * 4, out_lse) };
    }
}

#[inline(always)]
pub unsafe fn merge_states<O: OutElem>(p: &MergeStatesParams) {
    let w = warp_index();
    if w >= p.num_tokens * p.num_heads {
        return;
    }
    let (token, head) = ((w / p.num_heads) as u64, (w % p.num_heads) as u64);
    let lse_at = token * p.lse_token_stride + head * p.lse_head_stride;
    let lses = [unsafe { load_f32(p.prefix_lse + lse_at * 4) }, unsafe { load_f32(p.suffix_lse + lse_at * 4) }];
    let (out_lse, max, sum) = combine_lse(lses.iter().copied(), f32::NEG_INFINITY);
    let (wp, ws) = (partial_weight(lses[0], max, sum), partial_weight(lses[1], max, sum));
    let mut d = lane() as u64;
    while d < p.head_size as u64 {
        let at = (token * p.token_stride + head * p.head_stride + d) * O::BYTES;
        // A zero weight skips its input: an empty partial's output may be anything.
        let mut o = 0.0;
        if wp != 0.0 {
            o += wp * unsafe { O::load(p.prefix_out + at) };
        }
        if ws != 0.0 {
            o += ws * unsafe { O::load(p.suffix_out + at) };
        }
        unsafe { O::store(p.out + at, o) };
        d += 32;
    }
    if lane() == 0 && p.out_lse != 0 {
        unsafe { store_f32(p.out_lse + lse_at * 4, out_lse) };
    }
}
