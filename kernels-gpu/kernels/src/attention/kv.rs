//! Where a CTA's keys come from and how they reach shared memory: the K/V source (a paged
//! cache's block-table row, or packed K/V), the per-tile address tables filled one pipeline stage
//! ahead, the asynchronous row copies, and the conversion of staged FP8 rows to 16-bit tiles.

use crate::attention::config::{AttnConfig, CacheFormat, Plane};
use crate::attention::work::{load_i32, Work};
use crate::blocks::device::{atomic_or_global, ballot, static_for, thread_idx_x};
use crate::blocks::mma::{cp_async_16, cp_async_halves, ld_shared_v4, st_shared_u32, st_shared_u64x2, st_shared_v4, MmaHalf};
use attn_math::params::AttnParams;
use attn_math::prefill::{table_slot_bytes, ROW_PAD, TABLE_ENTRY};
use attn_math::status::BLOCK_OUT_OF_RANGE;
use core::marker::PhantomData;

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
    pub unsafe fn of(p: &AttnParams, w: &Work) -> KvSource {
        KvSource {
            block_row: if p.batch.block_table != 0 { p.batch.block_table + w.req as u64 * p.batch.block_table_stride * 4 } else { 0 },
            key_base: if p.batch.block_table != 0 { 0 } else { (unsafe { load_i32(p.batch.key_start_loc + w.req as u64 * 4) }) as u64 },
            kv_head: w.kv_head as u64,
        }
    }

    /// The first half of a key's lookup (a global load, issued early): its block id (paged) or
    /// its row (packed).
    #[inline(always)]
    pub unsafe fn locate(&self, p: &AttnParams, key: u32) -> i64 {
        if self.block_row == 0 {
            (self.key_base + key as u64) as i64
        } else {
            (unsafe { load_i32(self.block_row + (key / p.shape.block_size) as u64 * 4) }) as i64
        }
    }

    /// The second half: byte addresses of the key's K and V rows for this head, `(0, 0)` when
    /// its block is outside the cache (never read; reported by the CTA's block scan).
    #[inline(always)]
    pub fn addresses(&self, p: &AttnParams, key: u32, loc: i64, elem_bytes: u64) -> (u64, u64) {
        if self.block_row == 0 {
            let row = loc as u64;
            (
                p.qkv.k + (row * p.qkv.k_strides.token + self.kv_head * p.qkv.k_strides.head) * elem_bytes,
                p.qkv.v + (row * p.qkv.v_strides.token + self.kv_head * p.qkv.v_strides.head) * elem_bytes,
            )
        } else if loc < 0 || loc as u64 >= p.shape.num_blocks as u64 {
            (0, 0)
        } else {
            // A paged cache's K and V planes share their strides.
            let off = p.qkv.k_strides.offset(loc as u64, (key % p.shape.block_size) as u64, self.kv_head, 0) * elem_bytes;
            (p.qkv.k + off, p.qkv.v + off)
        }
    }
}

/// The address tables of a CTA's K/V tiles of `C::BN` keys (`begin..end`, `n_tiles` tiles): a
/// ring of `slots` slots of `table_slot_bytes(C::BN)` bytes at `base`. One thread per key
/// (threads `0..C::BN`) looks its block up (`locate`, a global load issued early) and later writes the K and
/// V row addresses into the tile's slot (`fill`), so that the copies are a shared load and a
/// `cp.async` per 16 bytes, with the block-table latency hidden behind a tile of math.
pub(crate) struct KeyTables<C> {
    pub base: u32,
    pub slots: u32,
    pub begin: u32,
    pub end: u32,
    pub n_tiles: u32,
    pub src: KvSource,
    pub elem_bytes: u64,
    pub config: PhantomData<C>,
}

// By hand: a derive would require `C: Copy`.
impl<C> Clone for KeyTables<C> {
    #[inline(always)]
    fn clone(&self) -> Self {
        *self
    }
}

impl<C> Copy for KeyTables<C> {}

impl<C: AttnConfig> KeyTables<C> {
    /// The slot of `tile`: an entry (K, V row addresses; 0 = not read) per key.
    #[inline(always)]
    pub fn table(&self, tile: u32) -> u32 {
        self.base + (tile % self.slots) * table_slot_bytes(C::BN as u32)
    }

    /// The bad-key masks after the entries: one u32 per filling warp, bit `l` set when its lane
    /// `l`'s key has a block outside the cache ([`crate::attention::variants::BadBlocks`]).
    #[inline(always)]
    pub fn flags(&self, tile: u32) -> u32 {
        self.table(tile) + C::BN as u32 * TABLE_ENTRY
    }

    /// This thread's key's lookup (block id, or packed row); -1 past the keys.
    #[inline(always)]
    pub unsafe fn locate(&self, p: &AttnParams, tile: u32) -> i64 {
        let tid = thread_idx_x();
        let key = self.begin + tile * C::BN as u32 + tid;
        if tile < self.n_tiles && tid < C::BN as u32 && key < self.end {
            unsafe { self.src.locate(p, key) }
        } else {
            -1
        }
    }

    /// Writes this thread's key's entry of `tile` from its lookup `loc`; a block outside the
    /// cache raises the status bit and the warp's flag.
    #[inline(always)]
    pub unsafe fn fill(&self, p: &AttnParams, tile: u32, loc: i64) {
        let tid = thread_idx_x();
        let key = self.begin + tile * C::BN as u32 + tid;
        if tile < self.n_tiles && tid < C::BN as u32 {
            let (ka, va) = if key < self.end { self.src.addresses(p, key, loc, self.elem_bytes) } else { (0, 0) };
            unsafe { st_shared_u64x2(self.table(tile) + tid * TABLE_ENTRY, ka, va) };
            let bad = key < self.end && ka == 0;
            if bad {
                unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
            }
            let bad_keys = ballot(bad);
            if tid.is_multiple_of(32) {
                unsafe { st_shared_u32(self.flags(tile) + (tid / 32) * 4, bad_keys) };
            }
        }
    }

    /// [`Self::locate`] for a warp that keeps its own keys' entries: lane `l < kw` looks up key
    /// `key_off + l` of `tile`.
    #[inline(always)]
    pub unsafe fn locate_warp(&self, p: &AttnParams, tile: u32, key_off: u32, kw: u32) -> i64 {
        let lane = thread_idx_x() % 32;
        let key = self.begin + tile * C::BN as u32 + key_off + lane;
        if tile < self.n_tiles && lane < kw && key < self.end {
            unsafe { self.src.locate(p, key) }
        } else {
            -1
        }
    }

    /// [`Self::fill`] for a warp that keeps its own keys' entries (`key_off .. key_off + kw` of
    /// the slot, and flag `warp`), so that only the warp reads them: a warp barrier orders them.
    #[inline(always)]
    pub unsafe fn fill_warp(&self, p: &AttnParams, tile: u32, key_off: u32, kw: u32, loc: i64) {
        if tile >= self.n_tiles {
            return;
        }
        let (warp, lane) = (thread_idx_x() / 32, thread_idx_x() % 32);
        let i = key_off + lane;
        let key = self.begin + tile * C::BN as u32 + i;
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
        let bad_keys = ballot(bad);
        if lane == 0 {
            unsafe { st_shared_u32(self.flags(tile) + warp * 4, bad_keys) };
        }
    }
}

/// Copies `rows` rows of `chunks` 16-byte chunks into shared memory at `dst` (row pitch `pitch`
/// bytes) asynchronously by `NT` threads (the CTA's, or a warp's: thread `tid % NT` of each
/// group of `NT`); `src(r)` is row r's address, 0 for a row to zero-fill (`fallback`, a valid
/// address, is named then but not read). Only the first `live` chunks of a row are read; the
/// rest (the columns past a head size below the kernel's width) are zero-filled; `K`'s rows
/// (`live` in its [`CacheFormat::live_units`]). Thread `t` copies chunks `t + i * NT`
/// (row-major), which [`Plane::convert_fp8`] relies on.
#[inline(always)]
pub(crate) unsafe fn copy_rows_async<const NT: u32, K: CacheFormat>(
    rows: u32,
    dst: u32,
    chunks: u32,
    live: u32,
    pitch: u32,
    fallback: u64,
    src: impl Fn(u32) -> u64,
) {
    unsafe { copy_rows_async_to::<NT, K>(rows, |r, c| dst + r * pitch + c * 16, chunks, live, fallback, src) }
}

/// [`copy_rows_async`] with chunk `c` of row `r` going to shared address `dst(r, c)`.
#[inline(always)]
pub(crate) unsafe fn copy_rows_async_to<const NT: u32, K: CacheFormat>(
    rows: u32,
    dst: impl Fn(u32, u32) -> u32,
    chunks: u32,
    live: u32,
    fallback: u64,
    src: impl Fn(u32) -> u64,
) {
    let passes = (rows * chunks).div_ceil(NT);
    let tid = thread_idx_x() % NT;
    // A plain loop (no register array is indexed): MLA rows take up to 36 passes.
    let mut i = 0;
    while i < passes {
        let idx = tid + i * NT;
        let r = idx / chunks;
        let c = idx - r * chunks;
        if r < rows {
            let a = src(r);
            if K::HALVES {
                unsafe { cp_async_halves(dst(r, c), a, c, live, fallback) };
            } else {
                let (from, bytes) = if a != 0 && c < live { (a + c as u64 * 16, 16) } else { (fallback, 0) };
                unsafe { cp_async_16(dst(r, c), from, bytes) };
            }
        }
        i += 1;
    }
}

impl<C: AttnConfig, const V: bool> Plane<C, V> {
    /// Converts the FP8 rows of this plane (`D` bytes a row, `ROWS` rows) this thread copied into
    /// `staging` into the `C::M` tile at `tile` (pitch `D + ROW_PAD` elements), exactly (the unpack
    /// scale is folded into the k/v scales); `NT` as in the copy. Only after `cp_async_wait` covers
    /// those copies; a barrier (of the threads that read the tile) must follow.
    #[inline(always)]
    pub(super) unsafe fn convert_fp8(staging: u32, tile: u32) {
        let chunks = Self::D as u32 / 16;
        let passes = (Self::ROWS as u32 * chunks).div_ceil(Self::NT);
        let pitch = (Self::D as u32 + ROW_PAD) * 2;
        let tid = thread_idx_x() % Self::NT;
        let at = |i: u32| {
            let idx = tid + i * Self::NT;
            let r = idx / chunks;
            (r < Self::ROWS as u32, r, idx - r * chunks)
        };
        // Four chunks at a time, all loaded before any is stored: the loads cannot pass the stores
        // (both shared memory), so one chunk at a time would wait a load latency per chunk.
        let mut i0 = 0;
        while i0 < passes {
            let mut raw = [[0u32; 4]; 4];
            static_for::<4>(|j| {
                let (live, r, c) = at(i0 + j as u32);
                if i0 + (j as u32) < passes && live {
                    raw[j] = unsafe { ld_shared_v4(staging + r * Self::D as u32 + c * 16) };
                }
            });
            static_for::<4>(|j| {
                let (live, r, c) = at(i0 + j as u32);
                if i0 + (j as u32) < passes && live {
                    let mut half = [0u32; 8];
                    static_for::<4>(|w| {
                        let [lo, hi] = C::M::from_fp8x4::<<C::Cache as CacheFormat>::Fp8>(raw[j][w]);
                        (half[2 * w], half[2 * w + 1]) = (lo, hi);
                    });
                    let to = tile + r * pitch + c * 32;
                    unsafe { st_shared_v4(to, [half[0], half[1], half[2], half[3]]) };
                    unsafe { st_shared_v4(to + 16, [half[4], half[5], half[6], half[7]]) };
                }
            });
            i0 += 4;
        }
    }
}

/// [`KvSource::locate`] in two steps, for a loop that issues the lookup a tile ahead (the
/// Hopper prefill's producer).
impl KvSource {
    /// A paged cache's block id for `key` as the table's 32 bits (a packed cache has no lookup:
    /// 0), left unconverted until [`Self::located`], so that nothing waits for the load where it
    /// is issued.
    #[inline(always)]
    pub unsafe fn block_of(&self, p: &AttnParams, key: u32) -> u32 {
        if self.block_row == 0 {
            0
        } else {
            unsafe { crate::blocks::vec_io::load_u32_nc(self.block_row + (key / p.shape.block_size) as u64 * 4) }
        }
    }

    /// What [`Self::locate`] gives for `key`, from its [`Self::block_of`].
    #[inline(always)]
    pub fn located(&self, key: u32, block: u32) -> i64 {
        if self.block_row == 0 {
            (self.key_base + key as u64) as i64
        } else {
            block as i32 as i64
        }
    }
}
