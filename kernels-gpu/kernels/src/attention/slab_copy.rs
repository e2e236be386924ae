//! A warp's copies of its 16-key slabs of a work item's kv head from the paged cache into
//! shared memory (`cp.async`): the block lookup, and each lane's share of a slab's 16-byte chunks.
//! A slab of 16 keys lies in one cache block (block sizes are multiples of 16, slabs start on
//! multiples of 16), so its rows are one block-table entry away. Used by the keys-as-rows decode
//! (`super::keys_rows`, a ring of slabs a warp) and by the FP8 decode on `wgmma`
//! (`super::keys_m`, each warp's slab a quarter of the CTA's tile).

use crate::attention::config::CacheFormat;
use crate::attention::kv::KvSource;
use crate::attention::work::Work;
use crate::blocks::device::{static_for, thread_idx_x};
use crate::blocks::mma::{cp_async_16, cp_async_halves};
use crate::blocks::vec_io::load_u32_nc;
use attn_math::keys_rows::{TILE_KEYS, WARP_KEYS};
use attn_math::params::AttnParams;

/// Where a slab's rows are staged: the cache rows, and the byte offset of (row, byte column)
/// in a staged K plane of 16 rows, whose V plane is `PLANE` bytes on.
pub(crate) trait SlabRows<const D: usize> {
    /// The cache rows the slabs hold.
    type Cache: CacheFormat;
    /// Bytes from a slab's K plane to its V plane.
    const PLANE: u32;
    fn at(r: u32, col: u32) -> u32;
}

/// Where a warp's slabs come from and go: the block lookup, and each lane's share of a slab's
/// 16-byte chunks (`CHUNKS` per lane per plane: row `(lane + 32 i) / (D / 8)`, column chunk the
/// rest) as offsets from the slab's first K row and from the stage.
pub(crate) struct SlabCopy<F: SlabRows<D>, const D: usize> {
    /// The request's block-table row.
    block_row: u64,
    /// log2 of the block size when it is a power of two, else 32.
    bs_shift: u32,
    /// Byte distance from a K row to its V row.
    v_delta: u64,
    /// Byte stride between the keys of a block.
    token_bytes: u64,
    /// Byte offset of (block 0, token 0, this kv head) in K.
    head_base: u64,
    block_bytes: u64,
    /// Bytes of a row that are read (the launch's head size): the chunks past them are
    /// zero-filled.
    live_bytes: u32,
    format: core::marker::PhantomData<F>,
}

impl<F: SlabRows<D>, const D: usize> SlabCopy<F, D> {
    /// The copies of work item `w`'s slabs of its kv head, rows read up to head size `head`.
    #[inline(always)]
    pub unsafe fn new(p: &AttnParams, w: &Work, head: u32) -> Self {
        let (strides, eb) = (p.qkv.k_strides, F::Cache::ELEM_BYTES as u64);
        SlabCopy {
            block_row: unsafe { KvSource::of(p, w) }.block_row,
            bs_shift: if p.shape.block_size.is_power_of_two() { p.shape.block_size.trailing_zeros() } else { 32 },
            v_delta: p.qkv.v.wrapping_sub(p.qkv.k),
            token_bytes: strides.token * eb,
            head_base: strides.head * w.kv_head as u64 * eb,
            block_bytes: strides.block * eb,
            live_bytes: head * F::Cache::ELEM_BYTES,
            format: core::marker::PhantomData,
        }
    }

    /// 16-byte chunks of a row, and a lane's chunks of a plane.
    const ROW_CHUNKS: u32 = D as u32 * F::Cache::ELEM_BYTES / 16;
    const CHUNKS: usize = (WARP_KEYS * Self::ROW_CHUNKS / 32) as usize;

    /// Lane's chunk `i`: (row in the slab, byte column).
    #[inline(always)]
    fn chunk(i: usize) -> (u32, u32) {
        let lane = thread_idx_x() % 32;
        let c = lane + 32 * i as u32;
        (c / Self::ROW_CHUNKS, (c % Self::ROW_CHUNKS) * 16)
    }

    /// Key `kb`'s (block index in the request, key within the block): a shift and a mask for
    /// the usual power-of-two block sizes, a division otherwise.
    #[inline(always)]
    fn split_key(&self, p: &AttnParams, kb: u32) -> (u32, u32) {
        if self.bs_shift < 32 {
            (kb >> self.bs_shift, kb & (p.shape.block_size - 1))
        } else {
            (kb / p.shape.block_size, kb % p.shape.block_size)
        }
    }

    /// The slab at key `kb` (a multiple of 16, below the request's end): its block id, as the
    /// table's 32 bits. Kept unconverted until [`Self::copy`] so that nothing uses the load
    /// where it is issued, iterations before its slab is copied.
    #[inline(always)]
    pub unsafe fn block(&self, p: &AttnParams, kb: u32) -> u32 {
        let (index, _) = self.split_key(p, kb);
        unsafe { load_u32_nc(self.block_row + index as u64 * 4) }
    }

    /// Copies the slab at key `kb` (block `block`) into `stage`: K rows, then V rows. Rows at or
    /// past `end`, and every row of a block outside the cache, are zero-filled (never read).
    /// Returns whether the block is outside the cache.
    #[inline(always)]
    pub unsafe fn copy(&self, p: &AttnParams, kb: u32, block: u32, end: u32, stage: u32) -> bool {
        let bad = (block as i32) < 0 || block >= p.shape.num_blocks;
        let row0 = if bad {
            p.qkv.k
        } else {
            p.qkv.k + self.head_base + block as u64 * self.block_bytes + self.split_key(p, kb).1 as u64 * self.token_bytes
        };
        let plane = F::PLANE;
        static_for::<16>(|i| {
            if i < Self::CHUNKS {
                let (r, col) = Self::chunk(i);
                if F::Cache::HALVES {
                    // Rows 8-byte aligned: the chunk as two halves, each read if inside the row.
                    let row = if !bad && kb + r < end { row0 + r as u64 * self.token_bytes } else { 0 };
                    let (c, halves) = (col / 16, self.live_bytes / 8);
                    let dst = stage + F::at(r, col);
                    unsafe {
                        cp_async_halves(dst, row, c, halves, p.qkv.k);
                        cp_async_halves(dst + plane, if row != 0 { row.wrapping_add(self.v_delta) } else { 0 }, c, halves, p.qkv.k);
                    }
                } else {
                    // A zero-filled chunk (source size 0) reads nothing: it keeps its own
                    // address rather than a selected stand-in (fewer instructions a slab).
                    let live = !bad && kb + r < end && col < self.live_bytes;
                    let src = row0 + r as u64 * self.token_bytes + col as u64;
                    let bytes = if live { 16 } else { 0 };
                    let dst = stage + F::at(r, col);
                    unsafe {
                        cp_async_16(dst, src, bytes);
                        cp_async_16(dst + plane, src.wrapping_add(self.v_delta), bytes);
                    }
                }
            }
        });
        bad
    }
}

/// A decode CTA's keys as 64-key tiles of four warps' 16-key slabs: the work item's key range
/// (its first key rounded down to a slab: a window's first key may not start one, the mask
/// covers the rest), and the positions of its first and last query rows, which the masks take.
#[derive(Clone, Copy)]
pub(crate) struct WarpSlabs {
    /// The range's end (exclusive).
    pub end: u32,
    pub n_tiles: u32,
    /// (position of the item's first row, of its last).
    pub pos: (u32, u32),
    /// The first key of tile 0.
    begin: u32,
    warp: u32,
}

impl WarpSlabs {
    /// Work item `w`'s slabs of warp `warp`.
    #[inline(always)]
    pub unsafe fn of(p: &AttnParams, w: &Work, warp: u32) -> Self {
        let pos = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };
        let (begin, end) = unsafe { w.key_range(p, pos.0, pos.1) };
        let begin = begin & !(WARP_KEYS - 1);
        let n_tiles = if end > begin { (end - begin).div_ceil(TILE_KEYS) } else { 0 };
        WarpSlabs { end, n_tiles, pos, begin, warp }
    }

    /// The first key of this warp's slab of `tile`.
    #[inline(always)]
    pub fn key(&self, tile: u32) -> u32 {
        self.begin + tile * TILE_KEYS + self.warp * WARP_KEYS
    }

    /// The block id of this warp's slab of `tile` (`u32::MAX` past the keys: zero-filled rows).
    #[inline(always)]
    pub unsafe fn block<F: SlabRows<D>, const D: usize>(&self, p: &AttnParams, copy: &SlabCopy<F, D>, tile: u32) -> u32 {
        let kb = self.key(tile);
        if tile < self.n_tiles && kb < self.end {
            unsafe { copy.block(p, kb) }
        } else {
            u32::MAX
        }
    }
}
