//! The MLA kernel's copies into shared memory: a slot's K rows (16-bit, or raw FP8 and then
//! converted into separate slots) and the query rows, in the swizzled layout
//! (`attn_math::mla::swizzled`).

use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::elem::Fp8Format;
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

/// [`copy_slot`] for 64-column atoms `FIRST..END` of a whole 64-row tile by one warpgroup (the
/// seesaw order: each warpgroup copies its own tiles): rows 0-31 from the table at `tables[0]`,
/// 32-63 from `tables[1]`, into the two slots' rows at `dst` ([`swizzled`] layout, 8-row groups
/// continuing across the slots). One commit group an atom, in order: a tile copied as atoms
/// 0-3 and later 4-8 is the nine groups [`MmaHalf::wgmma_64x64_k576_landing_async`] waits for.
#[cfg(wgmma)]
#[inline(always)]
pub(super) unsafe fn copy_tile_warpgroup<const FIRST: usize, const END: usize>(dst: u32, tables: [u32; 2], fallback: u64) {
    const { assert!(FIRST < END && END <= (ROW_CHUNKS / 8) as usize) };
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
        if a < FIRST || a >= END {
            return;
        }
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

/// 16 FP8 bytes as 16 values of `Q` (exact: the unpack scale is folded into the k/v scales),
/// stored at the 16-bit chunk at `at` of a [`swizzled`] row and the row's next chunk (its place
/// in the atom with the low bit flipped: `at ^ 16`).
#[inline(always)]
unsafe fn store_converted_at<Q: MmaHalf, F: Fp8Format>(at: u32, v: [u32; 4]) {
    let mut h = [0u32; 8];
    static_for::<4>(|j| [h[2 * j], h[2 * j + 1]] = Q::from_fp8x4::<F>(v[j]));
    unsafe { st_shared_v4(at, [h[0], h[1], h[2], h[3]]) };
    unsafe { st_shared_v4(at ^ 16, [h[4], h[5], h[6], h[7]]) };
}

/// Raw chunk `idx` of a slot (16 FP8 bytes, in the order the chunks sit in the [`raw_offset`]
/// layout) converted ([`store_converted_at`]) into its row's two 16-byte chunks of the
/// [`swizzled`] slot at `dst`.
#[inline(always)]
unsafe fn store_converted<Q: MmaHalf, F: Fp8Format>(dst: u32, idx: u32, v: [u32; 4]) {
    let (r, c) = (idx / RAW_CHUNKS, raw_chunk(idx / RAW_CHUNKS, idx % RAW_CHUNKS));
    const { assert!(swizzled(3, 5) ^ 16 == swizzled(3, 4) && swizzled(9, 11) == swizzled(9, 10) ^ 16) };
    unsafe { store_converted_at::<Q, F>(dst + swizzled(r, 2 * c), v) };
}

/// Converts an FP8 slot's raw rows (at `raw`) into the 16-bit [`swizzled`] slot at `dst`,
/// exactly (the unpack scale is folded into the k/v scales). Every thread of the CTA takes part;
/// the raw copies must have landed and a barrier must follow.
#[inline(always)]
pub(super) unsafe fn convert_slot_fp8<Q: MmaHalf, F: Fp8Format>(raw: u32, dst: u32) {
    let tid = thread_idx_x();
    static_for::<{ (SLOT_KEYS * RAW_CHUNKS).div_ceil(THREADS) as usize }>(|i| {
        let idx = tid + i as u32 * THREADS;
        if idx < SLOT_KEYS * RAW_CHUNKS {
            // The raw chunks in the order they sit (one offset for every slot), and where each
            // goes.
            unsafe { store_converted::<Q, F>(dst, idx, ld_shared_v4(raw + idx * 16)) };
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
