//! The MLA kernel's copies into shared memory: a slot's K rows (16-bit, or raw FP8 and then
//! converted, into separate slots or in place) and the query rows, in the swizzled layout
//! (`attn_math::mla::swizzled`).

use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::mma::{cp_async_16, ld_shared_u64, ld_shared_v4, st_shared_v4, MmaHalf};
use attn_math::mla::{raw_chunk, raw_offset, swizzled, RAW_CHUNKS, ROW_CHUNKS, SLOT_KEYS, THREADS};

/// Copies a slot's 32 rows (their addresses in the table at `table`; 0: zero-fill, `fallback`
/// named but not read) into the slot buffer at `dst` ([`swizzled`] layout). A warp copies 4 rows x
/// 8 chunks per instruction (128 contiguous bytes of each row: whole cache lines); a thread
/// reads one table entry.
#[inline(always)]
pub(super) unsafe fn copy_slot(dst: u32, table: u32, fallback: u64) {
    const { assert!(THREADS == 8 * SLOT_KEYS && ROW_CHUNKS.is_multiple_of(8)) };
    let tid = thread_idx_x();
    let (r, c0) = (tid / 8, tid % 8);
    let src = unsafe { ld_shared_u64(table + r * 8) };
    let (from, bytes, step) = if src != 0 { (src + c0 as u64 * 16, 16, 128) } else { (fallback, 0, 0) };
    let to = dst + swizzled(r, c0);
    // Chunks c0 + 8 i: the same place in the next 1024-byte atom.
    static_for::<{ (ROW_CHUNKS / 8) as usize }>(|i| unsafe { cp_async_16(to + i as u32 * 1024, from + i as u64 * step, bytes) });
}

/// [`copy_slot`] for a whole 64-row tile by one warpgroup (the seesaw order: each warpgroup
/// copies its own tiles): rows 0-31 from the table at `tables[0]`, 32-63 from `tables[1]`, into
/// the two slots' rows at `dst` ([`swizzled`] layout, 8-row groups continuing across the slots).
/// One commit group a 64-column atom, in order (what
/// [`MmaHalf::wgmma_64x64_k576_landing_async`] waits for).
#[cfg(wgmma)]
#[inline(always)]
pub(super) unsafe fn copy_tile_warpgroup(dst: u32, tables: [u32; 2], fallback: u64) {
    const ROWS: usize = (2 * SLOT_KEYS / 16) as usize;
    let t = thread_idx_x() % 128;
    let (r, c0) = (t / 8, t % 8);
    let mut from = [(fallback, 0, 0); ROWS];
    static_for::<ROWS>(|i| {
        let row = r + 16 * i as u32;
        let src = unsafe { ld_shared_u64(tables[(row / SLOT_KEYS) as usize] + (row % SLOT_KEYS) * 8) };
        if src != 0 {
            from[i] = (src + c0 as u64 * 16, 16, 128);
        }
    });
    static_for::<{ (ROW_CHUNKS / 8) as usize }>(|a| {
        static_for::<ROWS>(|i| {
            let (src, bytes, step) = from[i];
            let to = dst + swizzled(r + 16 * i as u32, c0) + a as u32 * 1024;
            unsafe { cp_async_16(to, src + a as u64 * step, bytes) };
        });
        crate::blocks::mma::cp_async_commit();
    });
}

/// [`copy_slot`] for an FP8 cache: the 32 raw rows of 576 bytes at `dst` ([`raw_offset`]).
#[inline(always)]
pub(super) unsafe fn copy_slot_fp8(dst: u32, table: u32, fallback: u64) {
    let tid = thread_idx_x();
    let (r, c0) = (tid / 8, tid % 8);
    let src = unsafe { ld_shared_u64(table + r * 8) };
    let (from, bytes, step) = if src != 0 { (src + c0 as u64 * 16, 16, 128) } else { (fallback, 0, 0) };
    static_for::<{ RAW_CHUNKS.div_ceil(8) as usize }>(|i| {
        if c0 + 8 * (i as u32) < RAW_CHUNKS {
            unsafe { cp_async_16(dst + raw_offset(r, c0 + 8 * i as u32), from + i as u64 * step, bytes) };
        }
    });
}

/// Raw chunk `idx` of a slot (16 FP8 bytes, in the order the chunks sit in the [`raw_offset`]
/// layout) as 16 values of `Q` (exact: the unpack scale is folded into the k/v scales), stored
/// at its row's two 16-byte chunks of the [`swizzled`] slot at `dst`.
#[inline(always)]
unsafe fn store_converted<Q: MmaHalf>(dst: u32, idx: u32, v: [u32; 4]) {
    let (r, c) = (idx / RAW_CHUNKS, raw_chunk(idx / RAW_CHUNKS, idx % RAW_CHUNKS));
    let mut h = [0u32; 8];
    static_for::<8>(|j| h[j] = Q::from_fp8x2((v[j / 2] >> (16 * (j % 2))) & 0xffff));
    unsafe { st_shared_v4(dst + swizzled(r, 2 * c), [h[0], h[1], h[2], h[3]]) };
    unsafe { st_shared_v4(dst + swizzled(r, 2 * c + 1), [h[4], h[5], h[6], h[7]]) };
}

/// Converts an FP8 slot's raw rows (at `raw`) into the 16-bit [`swizzled`] slot at `dst`,
/// exactly (the unpack scale is folded into the k/v scales). Every thread of the CTA takes part;
/// the raw copies must have landed and a barrier must follow.
#[inline(always)]
pub(super) unsafe fn convert_slot_fp8<Q: MmaHalf>(raw: u32, dst: u32) {
    let tid = thread_idx_x();
    static_for::<{ (SLOT_KEYS * RAW_CHUNKS).div_ceil(THREADS) as usize }>(|i| {
        let idx = tid + i as u32 * THREADS;
        if idx < SLOT_KEYS * RAW_CHUNKS {
            // The raw chunks in the order they sit (one offset for every slot), and where each
            // goes.
            unsafe { store_converted::<Q>(dst, idx, ld_shared_v4(raw + idx * 16)) };
        }
    });
}

/// Raw chunks of one half of a slot's rows (16 rows of 36).
const HALF_CHUNKS: u32 = SLOT_KEYS / 2 * RAW_CHUNKS;
/// Raw chunks a thread takes of a tile's two slots' halves.
const PER_THREAD: usize = (2 * HALF_CHUNKS).div_ceil(THREADS) as usize;

/// Converts the raw FP8 rows of a tile's two slots (16-bit slot buffers at `slots`, the raw rows
/// in their upper halves, `raw` bytes on: `attn_math::mla::MlaLayout::raw`) into the 16-bit
/// [`swizzled`] rows of the same buffers, exactly (the unpack scale is folded into the k/v
/// scales). Rows 0-15 become 16-bit rows in the lower half, where no raw row is, so they are
/// converted straight from shared memory; rows 16-31 become the upper half, over every raw row,
/// so their raw chunks are first held in registers and written after `between` (a barrier: every
/// thread has then read what it converts). Every thread of the CTA takes part; the raw copies
/// must have landed, and a barrier must follow.
#[inline(always)]
pub(super) unsafe fn convert_in_place<Q: MmaHalf>(slots: [u32; 2], raw: u32, between: impl Fn()) {
    let tid = thread_idx_x();
    // Chunk k of the tile's halves: slot k / HALF_CHUNKS, the raw chunks in the order they sit
    // (one offset for every slot) from row `first`.
    let chunk = |i: usize, first: u32| {
        let k = tid + i as u32 * THREADS;
        let (slot, idx) = (slots[(k / HALF_CHUNKS) as usize % 2], k % HALF_CHUNKS + first * RAW_CHUNKS);
        (k < 2 * HALF_CHUNKS, slot, idx)
    };
    let mut held = [[0u32; 4]; PER_THREAD];
    static_for::<PER_THREAD>(|i| {
        let (live, slot, idx) = chunk(i, SLOT_KEYS / 2);
        if live {
            held[i] = unsafe { ld_shared_v4(slot + raw + idx * 16) };
        }
    });
    static_for::<PER_THREAD>(|i| {
        let (live, slot, idx) = chunk(i, 0);
        if live {
            unsafe { store_converted::<Q>(slot, idx, ld_shared_v4(slot + raw + idx * 16)) };
        }
    });
    between();
    static_for::<PER_THREAD>(|i| {
        let (live, slot, idx) = chunk(i, SLOT_KEYS / 2);
        if live {
            unsafe { store_converted::<Q>(slot, idx, held[i]) };
        }
    });
}

/// Copies `rows` query rows (`src(r)`: row r's address) into the [`swizzled`] layout at `dst`.
#[inline(always)]
pub(super) unsafe fn copy_queries(dst: u32, rows: u32, src: impl Fn(u32) -> u64) {
    let tid = thread_idx_x();
    let mut idx = tid;
    while idx < rows * ROW_CHUNKS {
        let (r, c) = (idx / ROW_CHUNKS, idx % ROW_CHUNKS);
        unsafe { cp_async_16(dst + swizzled(r, c), src(r) + c as u64 * 16, 16) };
        idx += THREADS;
    }
}
