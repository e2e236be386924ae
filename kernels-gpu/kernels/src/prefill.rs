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

use crate::device::{
    atomic_or_global, block_idx_x, dynamic_shared, fma, pdl_prologue, shfl_xor, static_for, sync_threads, sync_warp, tanh, thread_idx_x,
    vote_any,
};
use crate::fp8_direct;
use crate::mma::{
    cp_async_16, cp_async_commit, cp_async_wait, ld_shared_f32x2, ld_shared_u32, ld_shared_u64, ld_shared_v4, ldmatrix_x4,
    ldmatrix_x4_trans, shared_addr, st_shared_f32, st_shared_f32x2, st_shared_u32, st_shared_u64x2, st_shared_v4, MmaHalf,
};
use crate::vec_io::{load_f32_nc, load_u32_nc, store4, store8, store_f32};
use attn_math::params::PrefillParams;
use attn_math::prefill::{block_m, fp8_direct, shared_layout_mla, stages, table_slot_bytes, ROW_PAD, TABLE_ENTRY, THREADS, WARPS};
use attn_math::softmax::{exp2, OnlineSoftmax, LOG2_E};
use attn_math::status::BLOCK_OUT_OF_RANGE;

#[inline(always)]
pub(crate) unsafe fn load_i32(addr: u64) -> i32 {
    unsafe { load_u32_nc(addr) as i32 }
}

/// Where the CTA's keys come from.
#[derive(Clone, Copy)]
pub(crate) struct KvSource {
    /// Paged: the request's block-table row; 0 for packed K/V.
    pub block_row: u64,
    /// Packed: the request's first key row.
    pub key_base: u64,
    pub kv_head: u64,
}

impl KvSource {
    /// The keys of `w`'s request and kv head: its block-table row (paged) or first key row
    /// (packed).
    #[inline(always)]
    pub unsafe fn of(p: &PrefillParams, w: &Work) -> KvSource {
        KvSource {
            block_row: if p.block_table != 0 { p.block_table + w.req as u64 * p.block_table_stride * 4 } else { 0 },
            key_base: if p.block_table != 0 { 0 } else { (unsafe { load_i32(p.key_start_loc + w.req as u64 * 4) }) as u64 },
            kv_head: w.kv_head as u64,
        }
    }

    /// The first half of a key's lookup (a global load, issued early): its block id (paged) or
    /// its row (packed).
    #[inline(always)]
    pub unsafe fn locate(&self, p: &PrefillParams, key: u32) -> i64 {
        if self.block_row == 0 {
            (self.key_base + key as u64) as i64
        } else {
            (unsafe { load_i32(self.block_row + (key / p.block_size) as u64 * 4) }) as i64
        }
    }

    /// The second half: byte addresses of the key's K and V rows for this head, `(0, 0)` when
    /// its block is outside the cache (never read; reported by the CTA's block scan).
    #[inline(always)]
    pub fn addresses(&self, p: &PrefillParams, key: u32, loc: i64, elem_bytes: u64) -> (u64, u64) {
        if self.block_row == 0 {
            let row = loc as u64;
            (
                p.k + (row * p.k_strides.token + self.kv_head * p.k_strides.head) * elem_bytes,
                p.v + (row * p.v_strides.token + self.kv_head * p.v_strides.head) * elem_bytes,
            )
        } else if loc < 0 || loc as u64 >= p.num_blocks as u64 {
            (0, 0)
        } else {
            // A paged cache's K and V planes share their strides.
            let off = p.k_strides.offset(loc as u64, (key % p.block_size) as u64, self.kv_head, 0) * elem_bytes;
            (p.k + off, p.v + off)
        }
    }
}

/// The address tables of a CTA's K/V tiles of `BN` keys (`begin..end`, `n_tiles` tiles): a ring
/// of `slots` slots of `table_slot_bytes(BN)` bytes at `base`. One thread per key (threads
/// `0..BN`) looks its block up (`locate`, a global load issued early) and later writes the K and
/// V row addresses into the tile's slot (`fill`), so that the copies are a shared load and a
/// `cp.async` per 16 bytes, with the block-table latency hidden behind a tile of math.
#[derive(Clone, Copy)]
pub(crate) struct KeyTables<const BN: usize> {
    pub base: u32,
    pub slots: u32,
    pub begin: u32,
    pub end: u32,
    pub n_tiles: u32,
    pub src: KvSource,
    pub elem_bytes: u64,
}

impl<const BN: usize> KeyTables<BN> {
    /// The slot of `tile`: an entry (K, V row addresses; 0 = not read) per key.
    #[inline(always)]
    pub fn table(&self, tile: u32) -> u32 {
        self.base + (tile % self.slots) * table_slot_bytes(BN as u32)
    }

    /// The flags after the entries: one u32 per filling warp, non-zero when a key's block is bad.
    #[inline(always)]
    pub fn flags(&self, tile: u32) -> u32 {
        self.table(tile) + BN as u32 * TABLE_ENTRY
    }

    /// This thread's key's lookup (block id, or packed row); -1 past the keys.
    #[inline(always)]
    pub unsafe fn locate(&self, p: &PrefillParams, tile: u32) -> i64 {
        let tid = thread_idx_x();
        let key = self.begin + tile * BN as u32 + tid;
        if tile < self.n_tiles && tid < BN as u32 && key < self.end {
            unsafe { self.src.locate(p, key) }
        } else {
            -1
        }
    }

    /// Writes this thread's key's entry of `tile` from its lookup `loc`; a block outside the
    /// cache raises the status bit and the warp's flag.
    #[inline(always)]
    pub unsafe fn fill(&self, p: &PrefillParams, tile: u32, loc: i64) {
        let tid = thread_idx_x();
        let key = self.begin + tile * BN as u32 + tid;
        if tile < self.n_tiles && tid < BN as u32 {
            let (ka, va) = if key < self.end { self.src.addresses(p, key, loc, self.elem_bytes) } else { (0, 0) };
            unsafe { st_shared_u64x2(self.table(tile) + tid * TABLE_ENTRY, ka, va) };
            let bad = key < self.end && ka == 0;
            if bad {
                unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            }
            let any_bad = vote_any(bad);
            if tid.is_multiple_of(32) {
                unsafe { st_shared_u32(self.flags(tile) + (tid / 32) * 4, any_bad as u32) };
            }
        }
    }

    /// [`Self::locate`] for a warp that keeps its own keys' entries: lane `l < kw` looks up key
    /// `key_off + l` of `tile`.
    #[inline(always)]
    pub unsafe fn locate_warp(&self, p: &PrefillParams, tile: u32, key_off: u32, kw: u32) -> i64 {
        let lane = thread_idx_x() % 32;
        let key = self.begin + tile * BN as u32 + key_off + lane;
        if tile < self.n_tiles && lane < kw && key < self.end {
            unsafe { self.src.locate(p, key) }
        } else {
            -1
        }
    }

    /// [`Self::fill`] for a warp that keeps its own keys' entries (`key_off .. key_off + kw` of
    /// the slot, and flag `warp`), so that only the warp reads them: a warp barrier orders them.
    #[inline(always)]
    pub unsafe fn fill_warp(&self, p: &PrefillParams, tile: u32, key_off: u32, kw: u32, loc: i64) {
        if tile >= self.n_tiles {
            return;
        }
        let (warp, lane) = (thread_idx_x() / 32, thread_idx_x() % 32);
        let i = key_off + lane;
        let key = self.begin + tile * BN as u32 + i;
        let mut bad = false;
        if lane < kw {
            let (ka, va) = if key < self.end { self.src.addresses(p, key, loc, self.elem_bytes) } else { (0, 0) };
            unsafe { st_shared_u64x2(self.table(tile) + i * TABLE_ENTRY, ka, va) };
            bad = key < self.end && ka == 0;
            if bad {
                unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            }
        }
        // The whole warp votes (lanes past `kw` with `false`).
        let any_bad = vote_any(bad);
        if lane == 0 {
            unsafe { st_shared_u32(self.flags(tile) + warp * 4, any_bad as u32) };
        }
    }
}

/// Copies `ROWS` rows of `chunks` 16-byte chunks into shared memory at `dst` (row pitch `pitch`
/// bytes) asynchronously by `NT` threads (the CTA's, or a warp's: thread `tid % NT` of each
/// group of `NT`); `src(r)` is row r's address, 0 for a row to zero-fill (`fallback`, a valid
/// address, is named then but not read). Thread `t` copies chunks `t + i * NT` (row-major),
/// which [`convert_fp8_rows`] relies on.
#[inline(always)]
pub(crate) unsafe fn copy_rows_async<const ROWS: usize, const NT: u32>(
    dst: u32,
    chunks: u32,
    pitch: u32,
    fallback: u64,
    src: impl Fn(u32) -> u64,
) {
    unsafe { copy_rows_async_to::<ROWS, NT>(|r, c| dst + r * pitch + c * 16, chunks, fallback, src) }
}

/// [`copy_rows_async`] with chunk `c` of row `r` going to shared address `dst(r, c)`.
#[inline(always)]
pub(crate) unsafe fn copy_rows_async_to<const ROWS: usize, const NT: u32>(
    dst: impl Fn(u32, u32) -> u32,
    chunks: u32,
    fallback: u64,
    src: impl Fn(u32) -> u64,
) {
    let passes = (ROWS as u32 * chunks).div_ceil(NT);
    let tid = thread_idx_x() % NT;
    // A plain loop (no register array is indexed): MLA rows take up to 36 passes.
    let mut i = 0;
    while i < passes {
        let idx = tid + i * NT;
        let r = idx / chunks;
        let c = idx - r * chunks;
        if r < ROWS as u32 {
            let a = src(r);
            let (from, bytes) = if a != 0 { (a + c as u64 * 16, 16) } else { (fallback, 0) };
            unsafe { cp_async_16(dst(r, c), from, bytes) };
        }
        i += 1;
    }
}

/// Converts the FP8 rows this thread copied into `staging` (`D` bytes a row) into the 16-bit
/// tile at `tile` (pitch `D + ROW_PAD` elements), exactly (the unpack scale is folded into the
/// k/v scales); `NT` as in the copy. Only after `cp_async_wait` covers those copies; a barrier
/// (of the threads that read the tile) must follow.
#[inline(always)]
unsafe fn convert_fp8_rows<Q: MmaHalf, const D: usize, const ROWS: usize, const NT: u32>(staging: u32, tile: u32) {
    let chunks = D as u32 / 16;
    let passes = (ROWS as u32 * chunks).div_ceil(NT);
    let pitch = (D as u32 + ROW_PAD) * 2;
    let tid = thread_idx_x() % NT;
    let at = |i: u32| {
        let idx = tid + i * NT;
        let r = idx / chunks;
        (r < ROWS as u32, r, idx - r * chunks)
    };
    // Four chunks at a time, all loaded before any is stored: the loads cannot pass the stores
    // (both shared memory), so one chunk at a time would wait a load latency per chunk.
    let mut i0 = 0;
    while i0 < passes {
        let mut raw = [[0u32; 4]; 4];
        static_for::<4>(|j| {
            let (live, r, c) = at(i0 + j as u32);
            if i0 + (j as u32) < passes && live {
                raw[j] = unsafe { ld_shared_v4(staging + r * D as u32 + c * 16) };
            }
        });
        static_for::<4>(|j| {
            let (live, r, c) = at(i0 + j as u32);
            if i0 + (j as u32) < passes && live {
                let mut half = [0u32; 8];
                static_for::<8>(|e| half[e] = Q::from_fp8x2((raw[j][e / 2] >> (16 * (e % 2))) & 0xffff));
                let to = tile + r * pitch + c * 32;
                unsafe { st_shared_v4(to, [half[0], half[1], half[2], half[3]]) };
                unsafe { st_shared_v4(to + 16, [half[4], half[5], half[6], half[7]]) };
            }
        });
        i0 += 4;
    }
}

/// One query row of a thread.
#[derive(Clone, Copy)]
pub(crate) struct RowInfo {
    pub token: u32,
    pub head: u32,
    /// Keys `..= pos` are visible (causal); the window counts back from it.
    pub pos: u32,
    pub slope_log2: f32,
}

/// The CTA's request, split and row tile, with what its rows need.
#[derive(Clone, Copy)]
pub(crate) struct Work {
    pub req: u32,
    pub split: u32,
    pub q_start: u32,
    pub q_len: u32,
    pub seq_len: u32,
    pub row0: u32,
    /// Rows of the tile that exist (the rest repeat the last one and are never written).
    pub live: u32,
    pub kv_head: u32,
    /// MLA: which slice of V's columns this CTA produces (0 otherwise), and its first column.
    slice: u32,
    v_col0: u32,
}

impl Work {
    /// The fields as words, for a CTA's threads to pass a work item through shared memory.
    #[cfg(wgmma)]
    #[inline(always)]
    pub fn to_words(self) -> [u32; 10] {
        [self.req, self.split, self.q_start, self.q_len, self.seq_len, self.row0, self.live, self.kv_head, self.slice, self.v_col0]
    }

    #[cfg(wgmma)]
    #[inline(always)]
    pub fn from_words(w: [u32; 10]) -> Work {
        let [req, split, q_start, q_len, seq_len, row0, live, kv_head, slice, v_col0] = w;
        Work { req, split, q_start, q_len, seq_len, row0, live, kv_head, slice, v_col0 }
    }

    /// The keys `begin..end` the CTA attends, for rows at positions `min_pos..=max_pos`: its
    /// split (keys per split: the launch's, or the device plan's header's), cut by causality
    /// and the window.
    #[inline(always)]
    pub unsafe fn key_range(&self, p: &PrefillParams, min_pos: u32, max_pos: u32) -> (u32, u32) {
        let chunk = if p.plan != 0 { unsafe { load_u32_nc(p.plan + 4) } } else { p.chunk };
        let mut begin = if chunk > 0 { self.split * chunk } else { 0 };
        let mut end = if chunk > 0 { (begin + chunk).min(self.seq_len) } else { self.seq_len };
        if p.causal != 0 {
            end = end.min(max_pos + 1);
        }
        if p.window > 0 {
            begin = begin.max((min_pos + 1).saturating_sub(p.window));
        }
        (begin, end)
    }

    /// The request's splits: the plan's, or `uniform_splits` with no plan on the device (1 when
    /// neither: a request with one split writes its output directly).
    #[inline(always)]
    pub unsafe fn num_splits(&self, p: &PrefillParams) -> u32 {
        if p.req_num_splits != 0 {
            unsafe { load_u32_nc(p.req_num_splits + self.req as u64 * 4) }
        } else {
            p.uniform_splits.max(1)
        }
    }

    /// The first partial row of the request (split-K): the plan's, or with uniform splits and
    /// no plan on the device, `uniform_splits` rows per query row of the requests before.
    #[inline(always)]
    pub unsafe fn partial_base(&self, p: &PrefillParams) -> u64 {
        if p.req_partial_base != 0 {
            (unsafe { load_u32_nc(p.req_partial_base + self.req as u64 * 4) }) as u64
        } else {
            p.uniform_splits as u64 * p.num_q_heads as u64 * self.q_start as u64
        }
    }

    #[inline(always)]
    pub unsafe fn row(&self, p: &PrefillParams, r: u32) -> RowInfo {
        let gr = self.row0 + r.min(self.live - 1);
        let t = gr / p.group;
        let head = self.kv_head * p.group + (gr - t * p.group);
        RowInfo {
            token: self.q_start + t,
            head,
            // The request's q_len new tokens are the last ones of its sequence.
            pos: (self.seq_len + t).saturating_sub(self.q_len),
            slope_log2: if p.alibi_slopes != 0 { (unsafe { load_f32_nc(p.alibi_slopes + head as u64 * 4) }) * LOG2_E } else { 0.0 },
        }
    }
}

/// Where a finished row goes: the output (one split) or the split-K workspace, and the factor
/// its accumulator takes. Writes the row's LSE when `write_lse`.
#[derive(Clone, Copy)]
pub(crate) struct RowOut {
    addr: u64,
    partial: bool,
    inv: f32,
}

impl RowOut {
    #[inline(always)]
    pub unsafe fn new<const DV: usize>(
        p: &PrefillParams,
        w: &Work,
        row: &RowInfo,
        st: OnlineSoftmax,
        num_splits: u32,
        write_lse: bool,
        v_scale: f32,
    ) -> RowOut {
        if num_splits == 1 {
            let mut scale = 1.0;
            let mut st = st;
            if p.sinks != 0 {
                let sink = (unsafe { load_f32_nc(p.sinks + row.head as u64 * 4) }) * LOG2_E;
                scale = st.merge(OnlineSoftmax { max: sink, sum: 1.0 }).0;
            }
            if write_lse && w.slice == 0 && p.lse != 0 {
                unsafe { store_f32(p.lse + (row.token as u64 * p.num_q_heads as u64 + row.head as u64) * 4, st.lse()) };
            }
            let addr = p.out + (row.token as u64 * p.out_token_stride + row.head as u64 * p.out_head_stride + w.v_col0 as u64) * 2;
            RowOut { addr, partial: false, inv: if st.sum > 0.0 { v_scale * scale / st.sum } else { 0.0 } }
        } else {
            let base = unsafe { w.partial_base(p) };
            let t = (row.token - w.q_start) as u64;
            let index = base + (w.split as u64 * w.q_len as u64 + t) * p.num_q_heads as u64 + row.head as u64;
            if write_lse && w.slice == 0 {
                unsafe { store_f32(p.partial_lse + index * 4, st.lse()) };
            }
            let row_width = if p.v_row != 0 { p.v_row as u64 } else { DV as u64 };
            let addr = p.partial_out + (index * row_width + w.v_col0 as u64) * 4;
            RowOut { addr, partial: true, inv: if st.sum > 0.0 { v_scale / st.sum } else { 0.0 } }
        }
    }

    /// Columns `col`, `col + 1` (unnormalised accumulator values).
    #[inline(always)]
    pub unsafe fn store_pair<Q: MmaHalf>(&self, col: u32, a: f32, b: f32) {
        if self.partial {
            unsafe { store8(self.addr + col as u64 * 4, [(a * self.inv).to_bits(), (b * self.inv).to_bits()]) };
        } else {
            unsafe { store4(self.addr + col as u64 * 2, Q::pack2(a * self.inv, b * self.inv)) };
        }
    }
}

/// Reads the CTA's work item and the request's lengths; `None` when the tile has no rows.
#[inline(always)]
pub(crate) unsafe fn work_item(p: &PrefillParams, bm: u32, dv: u32) -> Option<Work> {
    unsafe { work_item_at(p, block_idx_x(), bm, dv) }
}

/// [`work_item`] of the CTA at grid index `x` (persistent kernels take several in turn).
#[inline(always)]
pub(crate) unsafe fn work_item_at(p: &PrefillParams, x: u32, bm: u32, dv: u32) -> Option<Work> {
    // Grid x = (work item * kv heads + kv head) * V slices + slice: the slices and kv heads of
    // one tile run together (they share its K/V tiles in L2), and the items' longest-first
    // order holds across them.
    let slices = p.v_slices.max(1);
    let cta = x / slices;
    let slice = x - cta * slices;
    let kv_heads = p.num_q_heads / p.group;
    let item_idx = cta / kv_heads;
    let kv_head = cta - item_idx * kv_heads;
    let (req, tile_split) = if p.work_items != 0 {
        let item = p.work_items + item_idx as u64 * 8;
        unsafe { (load_u32_nc(item), load_u32_nc(item + 4)) }
    } else {
        // No plan on the device: `uniform_splits` or `cluster` splits a request (row tile 0).
        let splits = if p.uniform_splits > 1 { p.uniform_splits } else { p.cluster.max(1) };
        (item_idx / splits, item_idx % splits)
    };
    let (row_tile, split) = (tile_split >> 16, tile_split & 0xffff);
    let q_start = unsafe { load_i32(p.query_start_loc + req as u64 * 4) } as u32;
    let q_len = unsafe { load_i32(p.query_start_loc + req as u64 * 4 + 4) } as u32 - q_start;
    let seq_len = if p.block_table != 0 {
        unsafe { load_i32(p.seq_lens + req as u64 * 4) }.max(0) as u32
    } else {
        let k0 = unsafe { load_i32(p.key_start_loc + req as u64 * 4) } as u32;
        unsafe { load_i32(p.key_start_loc + req as u64 * 4 + 4) as u32 - k0 }
    };
    let n_rows = q_len * p.group;
    let row0 = row_tile * bm;
    if row0 >= n_rows {
        return None;
    }
    Some(Work { req, split, q_start, q_len, seq_len, row0, live: (n_rows - row0).min(bm), kv_head, slice, v_col0: slice * dv })
}

/// S = Q K^T for a warp: `MT` tiles of 16 rows x `KW` keys starting at `key_off` of the K tile
/// at `k_tile`; every K fragment feeds the `MT` row tiles. `q_frag(mt, ks)`: the A fragment.
#[inline(always)]
pub(crate) fn scores<Q: MmaHalf, const DK: usize, const KW: usize, const MT: usize>(
    q_frag: impl Fn(usize, usize) -> [u32; 4],
    k_tile: u32,
    key_off: u32,
) -> [[[f32; 4]; 8]; MT] {
    let lane = thread_idx_x() % 32;
    let k_pitch = (DK as u32 + ROW_PAD) * 2;
    let mut s = [[[0.0f32; 4]; 8]; MT];
    let k_base = k_tile + (key_off + (lane % 8) + 8 * (lane / 16)) * k_pitch + 16 * ((lane / 8) % 2);
    let mut k_step = |ks: usize| {
        let mut a = [[0u32; 4]; MT];
        static_for::<2>(|mt| {
            if mt < MT {
                a[mt] = q_frag(mt, ks);
            }
        });
        static_for::<4>(|np| {
            if np < KW / 16 {
                let b = unsafe { ldmatrix_x4(k_base + np as u32 * 16 * k_pitch + ks as u32 * 32) };
                static_for::<2>(|mt| {
                    if mt < MT {
                        s[mt][2 * np] = Q::mma(a[mt], b[0], b[1], s[mt][2 * np]);
                        s[mt][2 * np + 1] = Q::mma(a[mt], b[2], b[3], s[mt][2 * np + 1]);
                    }
                });
            }
        });
    };
    if DK / 16 <= 16 {
        // Unrolled: `q_frag` may index a register array by `ks`.
        static_for::<16>(|ks| {
            if ks < DK / 16 {
                k_step(ks)
            }
        });
    } else {
        // MLA's 36 k-steps: a loop (the query fragments come from shared memory then).
        for ks in 0..DK / 16 {
            k_step(ks);
        }
    }
    s
}

/// O += P V for a warp's `MT` row tiles: P (16 rows x `KW` keys each, in the score registers:
/// the C layout of one mma is the A layout of the next) times the V rows `key_off..` of the tile
/// at `v_tile` (row pitch `v_pitch` bytes); every V fragment feeds the `MT` row tiles.
#[inline(always)]
pub(crate) fn accumulate_pv<Q: MmaHalf, const DV: usize, const KW: usize, const MT: usize>(
    s: &[[[f32; 4]; 8]; MT],
    o: &mut [[[f32; 4]; 32]; MT],
    v_tile: u32,
    v_pitch: u32,
    key_off: u32,
) {
    let lane = thread_idx_x() % 32;
    let v_base = v_tile + (key_off + (lane % 8) + 8 * ((lane / 8) % 2)) * v_pitch + 16 * (lane / 16);
    static_for::<4>(|kk| {
        if kk < KW / 16 {
            let mut a = [[0u32; 4]; MT];
            static_for::<2>(|mt| {
                if mt < MT {
                    let s = &s[mt];
                    a[mt] = [
                        Q::pack2(s[2 * kk][0], s[2 * kk][1]),
                        Q::pack2(s[2 * kk][2], s[2 * kk][3]),
                        Q::pack2(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                        Q::pack2(s[2 * kk + 1][2], s[2 * kk + 1][3]),
                    ];
                }
            });
            static_for::<16>(|dp| {
                if dp < DV / 16 {
                    let b = unsafe { ldmatrix_x4_trans(v_base + kk as u32 * 16 * v_pitch + dp as u32 * 32) };
                    static_for::<2>(|mt| {
                        if mt < MT {
                            o[mt][2 * dp] = Q::mma(a[mt], b[0], b[1], o[mt][2 * dp]);
                            o[mt][2 * dp + 1] = Q::mma(a[mt], b[2], b[3], o[mt][2 * dp + 1]);
                        }
                    });
                }
            });
        }
    });
}

/// The online-softmax step of a warp's two rows per thread (h = 0: row g, 1: row g + 8) over
/// `KW` scores each: raises the running max, rescales the accumulators, turns the scores into
/// weights `2^(s * mult - max)` and adds them to the denominators. `mult` is the factor left to
/// apply to the scores (the softmax scale in base-2 units, or 1 when already applied).
#[inline(always)]
pub(crate) fn softmax_step<const DV: usize, const KW: usize, const NB: usize, const NO: usize>(
    s: &mut [[f32; 4]; NB],
    o: &mut [[f32; 4]; NO],
    state: &mut [OnlineSoftmax; 2],
    mult: f32,
) {
    static_for::<2>(|h| {
        let mut m = f32::NEG_INFINITY;
        static_for::<NB>(|n| {
            if n < KW / 8 {
                m = m.max(s[n][2 * h]).max(s[n][2 * h + 1]);
            }
        });
        // The 4 lanes of a quad share a row.
        m = m.max(shfl_xor(m, 1));
        m = m.max(shfl_xor(m, 2));
        let factor = state[h].rescale_to(m * mult);
        if factor != 1.0 {
            static_for::<NO>(|n| {
                if n < DV / 8 {
                    o[n][2 * h] *= factor;
                    o[n][2 * h + 1] *= factor;
                }
            });
        }
        // A row that has seen nothing yet keeps max -inf: its weights are all 0.
        let neg_max = if state[h].max == f32::NEG_INFINITY { 0.0 } else { -state[h].max };
        let mut sum = 0.0;
        static_for::<NB>(|n| {
            if n < KW / 8 {
                static_for::<2>(|e| {
                    let w = exp2(fma(s[n][2 * h + e], mult, neg_max));
                    s[n][2 * h + e] = w;
                    sum += w;
                });
            }
        });
        state[h].sum += sum;
    });
}

/// What turns a tile's scores into logits: the features that need the scores scaled first
/// (soft-cap, ALiBi), and the masks (the request's end, causality, the window, keys whose block
/// is outside the cache).
#[derive(Clone, Copy)]
pub(crate) struct Logits {
    score_scale: f32,
    /// Scores are scaled inside the exponent's FMA unless a feature needs them scaled first.
    prescale: bool,
    softcap_log2: f32,
    softcap_inv: f32,
    alibi: bool,
    causal: bool,
    window: u32,
    /// The CTA's last key + 1.
    end: u32,
}

impl Logits {
    #[inline(always)]
    pub fn new(p: &PrefillParams, score_scale: f32, end: u32) -> Logits {
        let prescale = p.softcap > 0.0 || p.alibi_slopes != 0 || score_scale <= 0.0;
        Logits {
            score_scale,
            prescale,
            softcap_log2: p.softcap * LOG2_E,
            softcap_inv: if p.softcap > 0.0 { 1.0 / (p.softcap * LOG2_E) } else { 0.0 },
            alibi: p.alibi_slopes != 0,
            causal: p.causal != 0,
            window: p.window,
            end,
        }
    }

    /// The factor the softmax step still applies to the logits.
    #[inline(always)]
    pub fn mult(&self) -> f32 {
        if self.prescale {
            1.0
        } else {
            self.score_scale
        }
    }

    /// A score as a logit where a feature needs it scaled first: scaled, soft-capped, ALiBi.
    #[inline(always)]
    fn prescaled(&self, s: f32, key: u32, row: &RowInfo) -> f32 {
        let mut x = s * self.score_scale;
        if self.softcap_inv > 0.0 {
            x = self.softcap_log2 * tanh(x * self.softcap_inv);
        }
        if self.alibi {
            x += row.slope_log2 * (key as f32 - row.pos as f32);
        }
        x
    }

    /// Whether keys `kt .. kt + kw` cross a boundary of rows at `min_pos..=max_pos`: the end,
    /// causality or the window.
    #[inline(always)]
    fn needs_mask(&self, kt: u32, kw: u32, (min_pos, max_pos): (u32, u32)) -> bool {
        kt + kw > self.end || (self.causal && kt + kw - 1 > min_pos) || (self.window > 0 && kt + self.window <= max_pos)
    }

    /// Whether `row` sees `key` (non-short-circuit `&`: a select per element, no branches).
    #[inline(always)]
    fn visible(&self, key: u32, row: &RowInfo) -> bool {
        (key < self.end) & (!self.causal | (key <= row.pos)) & ((self.window == 0) | (key + self.window > row.pos))
    }

    /// [`Self::apply`] for the keys-as-rows score fragment (`crate::keys_rows`): element e of
    /// this thread is key `kt + g + 8 * (e / 2)` of row `rows[e % 2]`; `bad`: the warp's 16 keys
    /// have no block in the cache.
    #[inline(always)]
    pub fn apply_keys_rows(&self, s: &mut [f32; 4], rows: &[RowInfo; 2], kt: u32, pos: (u32, u32), bad: bool) {
        let g = (thread_idx_x() % 32) / 4;
        let key_of = |e: usize| kt + g + 8 * (e / 2) as u32;
        if self.prescale {
            static_for::<4>(|e| s[e] = self.prescaled(s[e], key_of(e), &rows[e % 2]));
        }
        if self.needs_mask(kt, 16, pos) || bad {
            static_for::<4>(|e| s[e] = if self.visible(key_of(e), &rows[e % 2]) & !bad { s[e] } else { f32::NEG_INFINITY });
        }
    }

    /// Turns the scores of `MT` row tiles x `KW` keys from key `kt` into logits, masked where
    /// the tile crosses a boundary for rows `min_pos..=max_pos`. `flags`: the table slot's
    /// `KW / 32` bad-block flags; `table`: the slot's entry for key `kt`.
    #[inline(always)]
    pub unsafe fn apply<const MT: usize, const NB: usize, const KW: usize>(
        &self,
        s: &mut [[[f32; 4]; NB]; MT],
        rows: &[[RowInfo; 2]; MT],
        kt: u32,
        (min_pos, max_pos): (u32, u32),
        flags: u32,
        table: u32,
    ) {
        let t4 = thread_idx_x() % 4;
        let key_of = |n: usize, e: usize| kt + n as u32 * 8 + 2 * t4 + (e % 2) as u32;
        // Every element of the warp's score tiles: (row tile, column tile, register).
        macro_rules! each {
            (|$mt:ident, $n:ident, $e:ident| $body:expr) => {
                static_for::<MT>(|$mt| {
                    static_for::<NB>(|$n| {
                        if $n < KW / 8 {
                            static_for::<4>(|$e| $body)
                        }
                    })
                })
            };
        }
        if self.prescale {
            each!(|mt, n, e| s[mt][n][e] = self.prescaled(s[mt][n][e], key_of(n, e), &rows[mt][e / 2]));
        }
        let mut has_bad = false;
        static_for::<4>(|i| {
            if i < KW.div_ceil(32) {
                has_bad |= unsafe { ld_shared_u32(flags + i as u32 * 4) } != 0;
            }
        });
        if self.needs_mask(kt, KW as u32, (min_pos, max_pos)) || has_bad {
            each!(|mt, n, e| {
                s[mt][n][e] = if self.visible(key_of(n, e), &rows[mt][e / 2]) { s[mt][n][e] } else { f32::NEG_INFINITY };
            });
            if has_bad {
                each!(|mt, n, e| {
                    let key = key_of(n, e);
                    if key < self.end && unsafe { ld_shared_u64(table + (key - kt) * TABLE_ENTRY) } == 0 {
                        s[mt][n][e] = f32::NEG_INFINITY;
                    }
                });
            }
        }
    }
}

/// The kernel. `KEYS`: the decode shape (16 rows, keys split across warps), else the prefill
/// shape (64 rows, rows split across warps).
/// `KW` = the keys of a tile one warp takes: `BN / WARPS` (keys split) or `BN`. `FP8`: the cache
/// is FP8 E4M3 (with `p.k_scale` / `p.v_scale`), staged raw and converted in shared memory.
/// `M`: the tensor cores' input type: `Q`, or f16 for an FP8 cache (one conversion instruction
/// per pair, and exact; bf16 queries are scaled by 2^-8 into f16's range, undone in the scores).
/// `MT`: 16-row tiles per warp (2 on the prefill shape up to head size 128: each K/V fragment
/// read from shared memory feeds twice the MMAs, and the two tiles' chains interleave).
/// `VK` (MLA): V is columns `slice * DV ..` of each K row, read from the K tile; no V copies.
/// No entry point sets it (MLA runs on its own kernel, `crate::mla`); its branches stay because
/// taking them out reorders the registers of other instances' PTX.
#[inline(always)]
pub unsafe fn attention<
    Q: MmaHalf,
    M: MmaHalf,
    const DK: usize,
    const DV: usize,
    const BN: usize,
    const KW: usize,
    const KEYS: bool,
    const FP8: bool,
    const MT: usize,
    const VK: bool,
>(
    p: &PrefillParams,
) {
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let bm = block_m(DK as u32, DV as u32, KEYS, FP8);
    const { assert!(MT == 1 || (MT == 2 && !KEYS)) };
    let Some(w) = (unsafe { work_item(p, bm, DV as u32) }) else { return };
    let src = unsafe { KvSource::of(p, &w) };
    let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };

    let (begin, end) = unsafe { w.key_range(p, min_pos, max_pos) };
    let n_tiles = if end > begin { (end - begin).div_ceil(BN as u32) } else { 0 };

    const { assert!(BN as u32 <= THREADS && KW == if KEYS { BN / WARPS as usize } else { BN }) };
    let st = stages(DK as u32, DV as u32, KEYS, FP8);
    let slots = st + 1;
    let layout = shared_layout_mla(DK as u32, DV as u32, KEYS, FP8, VK);
    let elem_bytes = if FP8 { 1 } else { 2 };
    // Decode from an FP8 cache at head size 64 or 128: fragments converted straight from the
    // staged FP8 rows (`fp8_direct`), no 16-bit tiles.
    let direct = fp8_direct(DK as u32, DV as u32, KEYS, FP8);
    const { assert!(!(VK && fp8_direct(DK as u32, DV as u32, KEYS, FP8))) };
    // FP8: dequantisation folds into the score scale (k) and the output factor (v).
    let (k_scale, v_scale) = if FP8 {
        let unpack = M::FP8_UNPACK_SCALE;
        (unsafe { load_f32_nc(p.k_scale) } * unpack, unsafe { load_f32_nc(p.v_scale) } * unpack)
    } else {
        (1.0, 1.0)
    };
    // Queries converted from Q to M are scaled by `q_conv` (2^-8 from bf16 to f16).
    let q_conv = if Q::IS_BF16 == M::IS_BF16 { 1.0 } else { 1.0 / 256.0 };
    let score_scale = p.scale_log2 * k_scale / q_conv;
    let smem = shared_addr(dynamic_shared::<u8>());
    // Where a stage's 16-bit K and V tiles are read by the math.
    let k_tile = |stage: u32| if FP8 { smem + layout.k_tile } else { smem + layout.k + stage * layout.k_stage };
    let v_tile = |stage: u32| {
        if VK {
            k_tile(stage) + w.v_col0 * 2
        } else if FP8 {
            smem + layout.v_tile
        } else {
            smem + layout.v + stage * layout.v_stage
        }
    };
    let v_pitch = if VK { (DK as u32 + ROW_PAD) * 2 } else { (DV as u32 + ROW_PAD) * 2 };
    let tables = KeyTables::<BN> { base: smem + layout.table, slots, begin, end, n_tiles, src, elem_bytes };
    let table = |tile: u32| tables.table(tile);
    let flags = |tile: u32| tables.flags(tile);
    let tile_keys = |tile: u32| begin + tile * BN as u32;
    // Keys split: each warp runs its own pipeline over its quarter of every tile (`key_off ..
    // key_off + KW`): it looks up, copies, converts and reads only those rows, so the loop
    // needs warp barriers only, and a warp whose data has landed never waits for another's.
    let key_off = if KEYS { warp * KW as u32 } else { 0 };
    let locate = |tile: u32| unsafe {
        if KEYS {
            tables.locate_warp(p, tile, key_off, KW as u32)
        } else {
            tables.locate(p, tile)
        }
    };
    let fill = |tile: u32, loc: i64| unsafe {
        if KEYS {
            tables.fill_warp(p, tile, key_off, KW as u32, loc)
        } else {
            tables.fill(p, tile, loc)
        }
    };
    // Row pitch and 16-byte chunks of a stage's K/V rows: FP8 staging rows, or 16-bit tiles.
    let (k_pitch, v_pitch_st, k_chunks, v_chunks) = if FP8 {
        (DK as u32, DV as u32, DK as u32 / 16, DV as u32 / 16)
    } else {
        ((DK as u32 + ROW_PAD) * 2, (DV as u32 + ROW_PAD) * 2, DK as u32 / 8, DV as u32 / 8)
    };
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
                let to = |base: u32| move |r: u32, c: u32| base + fp8_direct::swizzled(key_off + r, c * 16, DK as u32);
                copy_rows_async_to::<KW, 32>(to(k_base), k_chunks, p.q, k_src);
                copy_rows_async_to::<KW, 32>(to(v_base), v_chunks, p.q, v_src);
            } else if KEYS {
                copy_rows_async::<KW, 32>(k_dst, k_chunks, k_pitch, p.q, k_src);
                if !VK {
                    copy_rows_async::<KW, 32>(v_dst, v_chunks, v_pitch_st, p.q, v_src);
                }
            } else {
                copy_rows_async::<BN, THREADS>(k_dst, k_chunks, k_pitch, p.q, k_src);
                if !VK {
                    copy_rows_async::<BN, THREADS>(v_dst, v_chunks, v_pitch_st, p.q, v_src);
                }
            }
        }
    };
    // The loop's barriers: the warp's own (keys split) or the CTA's. Tile 0's is the CTA's in
    // both shapes: it publishes the queries, which every warp reads.
    let tile_barrier = |tile: u32| {
        if KEYS && tile > 0 {
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
        p.q + (row.token as u64 * p.q_token_stride + row.head as u64 * p.q_head_stride) * 2
    };
    let q_pitch = (DK as u32 + ROW_PAD) * 2;
    if KEYS {
        unsafe { copy_rows_async::<16, THREADS>(smem, DK as u32 / 8, q_pitch, p.q, q_row) };
    } else if MT == 1 {
        unsafe { copy_rows_async::<64, THREADS>(smem, DK as u32 / 8, q_pitch, p.q, q_row) };
    } else {
        unsafe { copy_rows_async::<128, THREADS>(smem, DK as u32 / 8, q_pitch, p.q, q_row) };
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
    let warp_row0 = if KEYS { 0 } else { warp * 16 * MT as u32 };
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
    let q_in_regs = MT == 1 && DK <= 192 && !(FP8 && !KEYS);
    let q_base = smem + (warp_row0 + (lane % 8) + 8 * ((lane / 8) % 2)) * q_pitch + 16 * (lane / 16);

    // Query fragment `ks` of row tile `mt` from shared memory, in the tensor cores' type.
    let load_q = |mt: usize, ks: usize| {
        let mut f = unsafe { ldmatrix_x4(q_base + mt as u32 * 16 * q_pitch + ks as u32 * 32) };
        if Q::IS_BF16 != M::IS_BF16 {
            static_for::<4>(|i| {
                let (lo, hi) = Q::unpack2(f[i]);
                f[i] = M::pack2(lo * q_conv, hi * q_conv);
            });
        }
        f
    };
    // Decode (memory-bound) and the FP8 cache (converted between two barriers anyway) issue
    // each copy before waiting; prefill waits first and needs one barrier per tile.
    let early_issue = KEYS || FP8;
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
        if FP8 && !direct {
            unsafe {
                if KEYS {
                    let (k_half, v_half) = (k_tile(stage) + key_off * (DK as u32 + ROW_PAD) * 2, v_tile(stage) + key_off * v_pitch);
                    convert_fp8_rows::<M, DK, KW, 32>(k_raw + key_off * k_pitch, k_half);
                    if !VK {
                        convert_fp8_rows::<M, DV, KW, 32>(v_raw + key_off * v_pitch_st, v_half);
                    }
                } else {
                    convert_fp8_rows::<M, DK, BN, THREADS>(k_raw, k_tile(stage));
                    if !VK {
                        convert_fp8_rows::<M, DV, BN, THREADS>(v_raw, v_tile(stage));
                    }
                }
            }
        }
        if early_issue {
            tile_barrier(tile);
        }
        if tile == 0 && direct {
            q_frag = unsafe { fp8_direct::query_fragments::<Q, M, DK>(smem, q_pitch, q_conv) };
        } else if tile == 0 && q_in_regs {
            static_for::<16>(|ks| {
                if ks < DK / 16 {
                    q_frag[ks] = load_q(0, ks);
                }
            });
        }
        let kt = tile_keys(tile) + key_off;
        {
            let mut s = if direct {
                // MT = 1 on the keys-split shape.
                [unsafe { fp8_direct::scores::<M, DK>(&q_frag, k_raw, key_off) }; MT]
            } else {
                scores::<M, DK, KW, MT>(|mt, ks| if q_in_regs { q_frag[ks] } else { load_q(mt, ks) }, k_tile(stage), key_off)
            };
            // Keys split: the warp's own flag; else the slot's flags from the first.
            let tile_flags = flags(tile) + if KEYS { warp * 4 } else { 0 };
            unsafe { logits.apply::<MT, 8, KW>(&mut s, &rows, kt, (min_pos, max_pos), tile_flags, table(tile) + key_off * TABLE_ENTRY) };
            static_for::<2>(|mt| {
                if mt < MT {
                    softmax_step::<DV, KW, 8, 32>(&mut s[mt], &mut o[mt], &mut state[mt], mult);
                }
            });
            if direct {
                unsafe { fp8_direct::accumulate_pv::<M, DV>(&s[0], &mut o[0], v_raw, key_off) };
            } else {
                accumulate_pv::<M, DV, KW, MT>(&s, &mut o, v_tile(stage), v_pitch, key_off);
            }
        }
        fill(tile + st, ahead);
        if early_issue {
            // Every warp (or this warp, keys split) is done with this stage and table slot
            // before they are refilled.
            if KEYS {
                sync_warp()
            } else {
                sync_threads()
            }
        }
        tile += 1;
    }
    cp_async_wait::<0>();

    let num_splits = unsafe { w.num_splits(p) };
    if KEYS {
        unsafe {
            finish_keys_split::<Q, DV>(
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
            let out = unsafe { RowOut::new::<DV>(p, &w, &rows[mt][h], st, num_splits, t4 == 0, v_scale) };
            static_for::<32>(|n| {
                if n < DV / 8 {
                    unsafe { out.store_pair::<Q>(n as u32 * 8 + 2 * t4, o[mt][n][2 * h], o[mt][n][2 * h + 1]) };
                }
            });
        });
    }
}

/// Keys-split epilogue: the four warps hold partial states of the same 16 rows; each publishes
/// its (max, sum), rescales its accumulators to the common max and stores them, then all threads
/// add the four up, 8 threads per row, and write the rows.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
unsafe fn finish_keys_split<Q: MmaHalf, const DV: usize>(
    p: &PrefillParams,
    w: &Work,
    smem: u32,
    merge: u32,
    pitch: u32,
    stats: u32,
    mut state: [OnlineSoftmax; 2],
    o: &[[f32; 4]; 32],
    num_splits: u32,
    v_scale: f32,
    permuted: bool,
) {
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    let (merge, stats) = (smem + merge, smem + stats);
    let stat = |wp: u32, r: u32| unsafe {
        let (max, sum) = ld_shared_f32x2(stats + (wp * 16 + r) * 8);
        OnlineSoftmax { max, sum }
    };
    // The K/V stages are free once every warp is past the loop.
    sync_threads();
    static_for::<2>(|h| {
        state[h].sum += shfl_xor(state[h].sum, 1);
        state[h].sum += shfl_xor(state[h].sum, 2);
        if t4 == 0 {
            unsafe { st_shared_f32x2(stats + (warp * 16 + g + 8 * h as u32) * 8, state[h].max, state[h].sum) };
        }
    });
    sync_threads();
    static_for::<2>(|h| {
        let r = g + 8 * h as u32;
        let mut max = f32::NEG_INFINITY;
        static_for::<4>(|wp| max = max.max(stat(wp as u32, r).max));
        let f = if state[h].max == f32::NEG_INFINITY { 0.0 } else { exp2(state[h].max - max) };
        static_for::<32>(|n| {
            if n < DV / 8 {
                let row = merge + (warp * 16 + r) * pitch * 4;
                if permuted {
                    // `fp8_direct`'s accumulator columns.
                    static_for::<2>(|e| unsafe {
                        st_shared_f32(row + fp8_direct::out_col::<DV>(n as u32, e as u32) * 4, o[n][2 * h + e] * f)
                    });
                } else {
                    let col = n as u32 * 8 + 2 * t4;
                    unsafe { st_shared_f32x2(row + col * 4, o[n][2 * h] * f, o[n][2 * h + 1] * f) };
                }
            }
        });
    });
    sync_threads();
    unsafe { store_merged_rows::<Q, DV, 16>(p, w, merge, pitch, stats, num_splits, v_scale) };
}

/// The keys-split epilogue's last step: the warps' partial rows (`R` rows each, f32 at
/// `merge + ((warp * R + r) * pitch + col) * 4`, already at their common max) and (max, sum)
/// pairs (`stats + (warp * R + r) * 8`) added up, `THREADS / R` threads per row, and each row
/// written. After a barrier that publishes them.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
pub(crate) unsafe fn store_merged_rows<Q: MmaHalf, const DV: usize, const R: u32>(
    p: &PrefillParams,
    w: &Work,
    merge: u32,
    pitch: u32,
    stats: u32,
    num_splits: u32,
    v_scale: f32,
) {
    let tid = thread_idx_x();
    let per_row = THREADS / R;
    let (r, t) = (tid / per_row, tid % per_row);
    if r >= w.live {
        return;
    }
    let mut total = OnlineSoftmax::EMPTY;
    static_for::<4>(|wp| {
        let (max, sum) = unsafe { ld_shared_f32x2(stats + (wp as u32 * R + r) * 8) };
        total.merge(OnlineSoftmax { max, sum });
    });
    let row = unsafe { w.row(p, r) };
    let out = unsafe { RowOut::new::<DV>(p, w, &row, total, num_splits, t == 0, v_scale) };
    static_for::<16>(|i| {
        if (i as u32) < DV as u32 / (2 * per_row) {
            let col = 2 * (t + per_row * i as u32);
            let (mut a, mut b) = (0.0, 0.0);
            static_for::<4>(|wp| {
                let (x, y) = unsafe { ld_shared_f32x2(merge + ((wp as u32 * R + r) * pitch + col) * 4) };
                a += x;
                b += y;
            });
            unsafe { out.store_pair::<Q>(col, a, b) };
        }
    });
}
