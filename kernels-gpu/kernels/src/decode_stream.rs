//! Stream-K paged decode (`decode_st_*`): a persistent grid whose every group of warps (a warp
//! per kv head) streams an equal, contiguous range of the batch's 16-key tiles
//! (`attn_math::stream` lays the requests end to end and cuts the line).
//!
//! Each warp is independent: its own copy pipeline (`stages` K/V tiles in flight), its own
//! address tables, its own query fragments, and only warp barriers. The pipeline runs across
//! pair boundaries: a walker a few tiles ahead of the math looks the keys' blocks up, writes
//! their row addresses and the tile's pair (a [`SlotHeader`]) into a table slot, and the copy
//! and the math only read the slot. So a warp never waits for a pair's start, and the next
//! pair's first tiles are in flight while the last one's math runs.
//!
//! A (request, kv head) pair inside the group's range is written directly. A pair cut by a range
//! end is finished by the last of its warps to arrive: each writes its partial rows and LSE to
//! its slot, releases them (`fence.acq_rel.gpu`) and adds its tiles to the pair's counter; the
//! one that completes the count merges the partials with their LSE weights (and the sink),
//! writes the rows and zeroes the counter.
//!
//! The tile math is the keys-split kernel's (`crate::prefill`): a warp's S = Q K^T of 16 rows x
//! 16 keys, the masks, the online-softmax step and O += P V. 16-bit caches only: the FP8 cache
//! measured slower this way than on the split-K kernel (BENCHMARKS.md).

use crate::device::{
    atomic_add_acq_rel_gpu, atomic_or_global, block_idx_x, dynamic_shared, pdl_prologue, shfl_idx, shfl_xor, static_for, sync_warp,
    thread_idx_x, vote_any,
};
use crate::mma::{
    cp_async_commit, cp_async_wait, ld_shared_u64, ld_shared_v4, shared_addr, st_shared_u32, st_shared_u64x2, st_shared_v4, MmaHalf,
};
use crate::prefill::{accumulate_pv, copy_rows_async, load_i32, scores, softmax_step, KvSource, Logits, RowInfo, RowOut, Work};
use crate::vec_io::{load_f32_cg, load_u32_nc, store4, store_f32};
use attn_math::params::PrefillParams;
use attn_math::prefill::ROW_PAD;
use attn_math::softmax::{OnlineSoftmax, LOG2_E};
use attn_math::status::BLOCK_OUT_OF_RANGE;
use attn_math::stream::{
    has_tiles, pair_counter, pair_tiles, pair_workers, partial_slot, range_begin, share, warp_layout, SlotHeader, HEADER_WORDS, SLOT_BYTES,
    SLOT_FLAG, SLOT_HEADER, STAGES, TILE_KEYS, WARPS,
};

const KW: usize = TILE_KEYS as usize;

/// A request's lengths: (seq_len, q_start, q_len); zeros past the batch.
#[inline(always)]
unsafe fn request(p: &PrefillParams, r: u32) -> (u32, u32, u32) {
    if r >= p.stream_reqs {
        return (0, 0, 0);
    }
    let seq_len = unsafe { load_i32(p.seq_lens + r as u64 * 4) }.max(0) as u32;
    let q_start = unsafe { load_i32(p.query_start_loc + r as u64 * 4) } as u32;
    let q_end = unsafe { load_i32(p.query_start_loc + r as u64 * 4 + 4) } as u32;
    (seq_len, q_start, q_end - q_start)
}

/// The address-table walker: the tile the tables reach next, with its request (the warp's kv
/// head is fixed).
#[derive(Clone, Copy)]
struct Walker {
    at: SlotHeader,
}

impl Walker {
    /// At tile `x` of the line, the first of group `group`'s range, for kv head `k`.
    #[inline(always)]
    unsafe fn start(p: &PrefillParams, x: u32, group: u32, k: u32) -> Walker {
        let (req, before) = match x.checked_div(p.stream_pair_tiles) {
            Some(r) => (r, r * p.stream_pair_tiles),
            None => {
                let e = p.stream_starts + group as u64 * 8;
                unsafe { (load_u32_nc(e), load_u32_nc(e + 4)) }
            }
        };
        let (seq_len, _, q_len) = unsafe { request(p, req) };
        let (first_tile, tiles) = pair_tiles(seq_len, q_len, p.window);
        Walker { at: SlotHeader { req, kv_head: k, tile: x - before, tiles, first_tile, at: before, seq_len } }
    }

    /// On to the next tile of the line (the host launches this kernel only for batches without
    /// empty requests, so every request has tiles).
    #[inline(always)]
    unsafe fn advance(&mut self, p: &PrefillParams) {
        let h = &mut self.at;
        h.tile += 1;
        if h.tile < h.tiles {
            return;
        }
        h.tile = 0;
        h.at += h.tiles;
        h.req += 1;
        let (seq_len, _, q_len) = unsafe { request(p, h.req) };
        h.seq_len = seq_len;
        (h.first_tile, h.tiles) = pair_tiles(seq_len, q_len, p.window);
    }

    /// The kv-head source of the tile's pair.
    #[inline(always)]
    fn source(&self, p: &PrefillParams) -> KvSource {
        KvSource { block_row: p.block_table + self.at.req as u64 * p.block_table_stride * 4, key_base: 0, kv_head: self.at.kv_head as u64 }
    }

    /// Lane l < 16 looks up key l of the tile: its block id (-1 past the keys).
    #[inline(always)]
    unsafe fn locate(&self, p: &PrefillParams) -> i64 {
        let key = self.at.key() + thread_idx_x() % 32;
        if thread_idx_x() % 32 < TILE_KEYS && key < self.at.seq_len {
            unsafe { self.source(p).locate(p, key) }
        } else {
            -1
        }
    }

    /// Writes the tile's table slot from the lookups: (K, V) row addresses per key (0: not
    /// read), the bad-block flag (raising the status bit) and the header.
    #[inline(always)]
    unsafe fn fill(&self, p: &PrefillParams, slot: u32, loc: i64, elem_bytes: u64) {
        let lane = thread_idx_x() % 32;
        let key = self.at.key() + lane;
        let mut bad = false;
        if lane < TILE_KEYS {
            let (ka, va) = if key < self.at.seq_len { self.source(p).addresses(p, key, loc, elem_bytes) } else { (0, 0) };
            unsafe { st_shared_u64x2(slot + lane * 16, ka, va) };
            bad = key < self.at.seq_len && ka == 0;
            if bad {
                unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            }
        }
        let any_bad = vote_any(bad);
        if lane == 0 {
            let w = self.at.to_words();
            unsafe {
                st_shared_u32(slot + SLOT_FLAG, any_bad as u32);
                st_shared_v4(slot + SLOT_HEADER, [w[0], w[1], w[2], w[3]]);
                st_shared_v4(slot + SLOT_HEADER + 16, [w[4], w[5], w[6], 0]);
            }
        }
    }
}

/// The header a slot carries.
#[inline(always)]
unsafe fn read_header(slot: u32) -> SlotHeader {
    let (a, b) = unsafe { (ld_shared_v4(slot + SLOT_HEADER), ld_shared_v4(slot + SLOT_HEADER + 16)) };
    let w: [u32; HEADER_WORDS] = [a[0], a[1], a[2], a[3], b[0], b[1], b[2]];
    SlotHeader::from_words(w)
}

/// The kernel, for queries and cache of type `Q` at head size `D`.
#[inline(always)]
pub unsafe fn decode_stream<Q: MmaHalf, const D: usize>(p: &PrefillParams) {
    let lane = thread_idx_x() % 32;
    let warp = thread_idx_x() / 32;
    let (g, t4) = (lane / 4, lane % 4);
    let line = Line::of(p);
    let (begin, end) = line.range();
    let n = end - begin;
    if line.group >= line.groups || n == 0 {
        pdl_prologue();
        return;
    }
    let st = STAGES;
    let slots = st + 1;
    let (k_stage, v_stage, warp_bytes) = warp_layout(D as u32);
    let smem = shared_addr(dynamic_shared::<u8>()) + warp * warp_bytes;
    let (k_base, v_base, table_base) = (smem, smem + st * k_stage, smem + st * (k_stage + v_stage));
    let slot = |i: u32| table_base + (i % slots) * SLOT_BYTES;
    let elem_bytes = 2;
    let row_bytes = (D as u32 + ROW_PAD) * 2;
    let score_scale = p.scale_log2;

    let load_kv = |i: u32| {
        let (k_dst, v_dst) = (k_base + (i % st) * k_stage, v_base + (i % st) * v_stage);
        let t = slot(i);
        let k_src = |r: u32| unsafe { ld_shared_u64(t + r * 16) };
        let v_src = |r: u32| unsafe { ld_shared_u64(t + r * 16 + 8) };
        unsafe {
            copy_rows_async::<KW, 32>(k_dst, D as u32 / 8, row_bytes, p.q, k_src);
            copy_rows_async::<KW, 32>(v_dst, D as u32 / 8, row_bytes, p.q, v_src);
        }
    };

    // Prologue: the first `st` tiles' lookups (all issued before any is used), their slots;
    // then, once the kernel ahead is done (it may have written the cache), their copies.
    let mut walker = unsafe { Walker::start(p, begin, line.group, line.k) };
    let mut first = [walker; 8];
    let mut locs = [-1i64; 8];
    static_for::<8>(|j| {
        if (j as u32) < st && (j as u32) < n {
            first[j] = walker;
            locs[j] = unsafe { walker.locate(p) };
            if (j as u32) + 1 < n {
                unsafe { walker.advance(p) };
            }
        }
    });
    static_for::<8>(|j| {
        if (j as u32) < st && (j as u32) < n {
            unsafe { first[j].fill(p, slot(j as u32), locs[j], elem_bytes) };
        }
    });
    sync_warp();
    pdl_prologue();
    static_for::<8>(|j| {
        if (j as u32) < st - 1 {
            if (j as u32) < n {
                load_kv(j as u32);
            }
            cp_async_commit();
        }
    });

    let mut o = [[[0.0f32; 4]; 32]];
    let mut state = [OnlineSoftmax::EMPTY; 2];
    let mut q_frag = [[0u32; 4]; 16];
    // The current pair's request's first query token and query tokens.
    let (mut q_start, mut q_len) = (0, 1);
    let mut i = 0;
    while i < n {
        // The walker is at tile i + st: its lookup lands in the table after this tile's math.
        let ahead = if i + st < n { unsafe { walker.locate(p) } } else { -1 };
        if i + st - 1 < n {
            load_kv(i + st - 1);
        }
        cp_async_commit();
        const { assert!(STAGES == 3) };
        cp_async_wait::<2>();
        sync_warp();
        let t = slot(i);
        // The tile's pair, its rows and masks: rebuilt from the slot's header each tile (a few
        // instructions) rather than kept in registers across the loop.
        let h = unsafe { read_header(t) };
        let new_pair = i == 0 || h.tile == 0;
        if new_pair {
            (_, q_start, q_len) = unsafe { request(p, h.req) };
        }
        let work = Work::decode_pair(h.req, q_start, q_len, h.seq_len, h.kv_head, p.group);
        let rows = [unsafe { [work.row(p, g), work.row(p, g + 8)] }];
        if new_pair {
            // Its query fragments, straight from global memory.
            let q_row = |r: &RowInfo| p.q + (r.token as u64 * p.q_token_stride + r.head as u64 * p.q_head_stride) * 2;
            let q_rows = [q_row(&rows[0][0]), q_row(&rows[0][1])];
            q_frag = {
                let mut f = [[0u32; 4]; 16];
                static_for::<16>(|ks| {
                    if ks < D / 16 {
                        let col = |c: u32| (16 * ks as u32 + c + 2 * t4) as u64 * 2;
                        f[ks] = unsafe {
                            [
                                load_u32_nc(q_rows[0] + col(0)),
                                load_u32_nc(q_rows[1] + col(0)),
                                load_u32_nc(q_rows[0] + col(8)),
                                load_u32_nc(q_rows[1] + col(8)),
                            ]
                        };
                    }
                });
                f
            };
            o = [[[0.0f32; 4]; 32]];
            state = [OnlineSoftmax::EMPTY; 2];
        }
        // The rows' positions are the request's last q_len.
        let pos_range = (h.seq_len - q_len, h.seq_len - 1);
        let logits = Logits::new(p, score_scale, h.seq_len);
        let stage = i % st;
        let (k_tile, v_tile) = (k_base + stage * k_stage, v_base + stage * v_stage);
        {
            let mut s = scores::<Q, D, KW, 1>(|_, ks| q_frag[ks], k_tile, 0);
            unsafe { logits.apply::<1, 8, KW>(&mut s, &rows, h.key(), pos_range, t + SLOT_FLAG, t) };
            softmax_step::<D, KW, 8, 32>(&mut s[0], &mut o[0], &mut state, logits.mult());
            accumulate_pv::<Q, D, KW, 1>(&s, &mut o, v_tile, row_bytes, 0);
        }
        if i + st < n {
            unsafe { walker.fill(p, slot(i + st), ahead, elem_bytes) };
            if i + st + 1 < n {
                unsafe { walker.advance(p) };
            }
        }
        if i + 1 == n || h.tile + 1 == h.tiles {
            unsafe { finish_pair::<Q, D>(p, &work, &h, &rows[0], state, &o[0]) };
        }
        // The warp is done with this stage and slot before they are refilled.
        sync_warp();
        i += 1;
    }
    cp_async_wait::<0>();
}

/// This warp's place in the line: its group (of `groups`, a warp per kv head) and kv head.
#[derive(Clone, Copy)]
struct Line {
    total: u32,
    groups: u32,
    group: u32,
    k: u32,
    kv_heads: u32,
}

impl Line {
    #[inline(always)]
    fn of(p: &PrefillParams) -> Line {
        let kv_heads = p.num_q_heads / p.group;
        let warp = block_idx_x() * WARPS + thread_idx_x() / 32;
        Line { total: p.stream_tiles, groups: p.stream_groups, group: warp / kv_heads, k: warp % kv_heads, kv_heads }
    }

    /// The group's tiles of the line.
    #[inline(always)]
    fn range(&self) -> (u32, u32) {
        (range_begin(self.group, self.total, self.groups), range_begin(self.group + 1, self.total, self.groups))
    }

    /// Partial row `r` of group `w`'s share of a split request ending at `pair_end`.
    #[inline(always)]
    fn partial_row(&self, p: &PrefillParams, w: u32, pair_end: u32, r: u32) -> u64 {
        (partial_slot(w, self.k, self.kv_heads, pair_end, self.total, self.groups) * p.stream_rows + r) as u64
    }
}

/// Output column of accumulator tile `n`, element `e` of this thread.
#[inline(always)]
fn column(n: usize, e: usize) -> u32 {
    n as u32 * 8 + 2 * (thread_idx_x() % 4) + e as u32
}

/// The end of the warp's share of a pair: the rows themselves when the pair lies inside the
/// group's range; else its partial, and the warp whose share completes the pair adds the other
/// shares' partials to its own registers and writes the rows.
#[inline(always)]
unsafe fn finish_pair<Q: MmaHalf, const D: usize>(
    p: &PrefillParams,
    work: &Work,
    h: &SlotHeader,
    rows: &[RowInfo; 2],
    mut state: [OnlineSoftmax; 2],
    o: &[[f32; 4]; 32],
) {
    // The warp's range again (not kept in registers through the loop).
    let line = Line::of(p);
    let (begin, end) = line.range();
    let lane = thread_idx_x() % 32;
    let (g, t4) = (lane / 4, lane % 4);
    let whole = h.at >= begin && h.at + h.tiles <= end;
    let pair_end = h.at + h.tiles;
    let mut o = *o;
    static_for::<2>(|hh| {
        state[hh].sum += shfl_xor(state[hh].sum, 1);
        state[hh].sum += shfl_xor(state[hh].sum, 2);
    });
    if !whole {
        // The share's partial: normalised rows and their LSE.
        static_for::<2>(|hh| {
            let r = g + 8 * hh as u32;
            if r < work.live {
                let index = line.partial_row(p, line.group, pair_end, r);
                if t4 == 0 {
                    unsafe { store_f32(p.partial_lse + index * 4, state[hh].lse()) };
                }
                let inv = if state[hh].sum > 0.0 { 1.0 / state[hh].sum } else { 0.0 };
                let row = p.partial_out + index * D as u64 * 4;
                static_for::<32>(|n| {
                    if n < D / 8 {
                        static_for::<2>(|e| unsafe { store_f32(row + column(n, e) as u64 * 4, o[n][2 * hh + e] * inv) });
                    }
                });
            }
        });
        // Release it and add the share's tiles (lane 0, after a warp barrier that orders the
        // other lanes' stores before its release); the warp that completes the count acquires
        // the others' partials with the same atomic. Cheaper than a full fence per lane, which
        // would also wait for the warp's copies in flight.
        let (w0, w1) = pair_workers(h.at, h.tiles, line.total, line.groups);
        let mine = share(h.at, h.tiles, begin, end);
        sync_warp();
        let counter = p.sched + pair_counter(h.at, line.k, line.kv_heads, line.total, line.groups) as u64 * 4;
        let old = if lane == 0 { unsafe { atomic_add_acq_rel_gpu(counter, mine) } } else { 0 };
        if shfl_idx(old, 0) + mine != h.tiles {
            return;
        }
        if lane == 0 {
            unsafe { store4(counter, 0) };
        }
        sync_warp();
        // The other shares, one at a time: each row's LSE and this thread's columns of it are
        // loaded together (one round trip), then folded into the accumulator as a softmax
        // state of denominator 1.
        let mut w = w0;
        while w <= w1 {
            if w != line.group && has_tiles(w, line.total, line.groups) {
                static_for::<2>(|hh| {
                    let r = (g + 8 * hh as u32).min(work.live - 1);
                    let index = line.partial_row(p, w, pair_end, r);
                    let lse = unsafe { load_f32_cg(p.partial_lse + index * 4) };
                    let row = p.partial_out + index * D as u64 * 4;
                    let mut v = [[0.0f32; 2]; 32];
                    static_for::<32>(|n| {
                        if n < D / 8 {
                            static_for::<2>(|e| v[n][e] = unsafe { load_f32_cg(row + column(n, e) as u64 * 4) });
                        }
                    });
                    let (a, b) = state[hh].merge(OnlineSoftmax { max: lse * LOG2_E, sum: 1.0 });
                    static_for::<32>(|n| {
                        if n < D / 8 {
                            static_for::<2>(|e| o[n][2 * hh + e] = o[n][2 * hh + e] * a + if b != 0.0 { v[n][e] * b } else { 0.0 });
                        }
                    });
                });
            }
            w += 1;
        }
    }
    static_for::<2>(|hh| {
        if g + 8 * (hh as u32) < work.live {
            let out = unsafe { RowOut::new::<D>(p, work, &rows[hh], state[hh], 1, t4 == 0, 1.0) };
            static_for::<32>(|n| {
                if n < D / 8 {
                    unsafe { out.store_pair::<Q>(column(n, 0), o[n][2 * hh], o[n][2 * hh + 1]) };
                }
            });
        }
    });
}
