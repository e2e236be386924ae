//! Hopper prefill with a producer warpgroup (`prefill_wgs_<q>_d{64,80,96,112,128,256}`, sm_90a;
//! geometry in `attn_math::hopper_prefill::ws_layout`).
//!
//! A CTA of one kernel a work item spends a quarter of its time at 8 x 2048 outside its key
//! loop (measured at 8 x 2048: looking up its work item and first blocks, waiting for its first tiles,
//! while nothing else runs on its SM), and its compute warps issue every copy. Here the CTA
//! has a third warpgroup, the producer, and the CTAs are persistent:
//! - the producer takes work items (the grid's own first, then from the counter at
//!   `p.schedule.sched`), decodes each into a descriptor in shared memory, copies its queries
//!   into one of its query buffers (two, one at width 256: `ws_q_buffers`), and for each key
//!   tile looks up the blocks, then for each stage of the tile writes its address table and its
//!   bad-key masks and copies its K and V into a ring of stages (`ws_stages`: [`WS_STAGES`] of
//!   16-bit rows; a stage: a whole tile at head size 64, half a tile up to 128, a quarter at 256,
//!   see `ws_stage_keys`). Every buffer has a
//!   "filled" `mbarrier` (the producer's `cp.async`s land, then it arrives) and a "freed" one
//!   (each compute thread arrives when done with it);
//! - the two compute warpgroups (64 query rows each) work on whatever the rings hold, item
//!   after item; the next item's queries and first tiles are already there when one ends.
//!
//! On e4m3 stages a compute warpgroup works in half tiles of 64 keys (S of a half is 32
//! registers a thread, so two fit beside O) and keeps a chain of its own on the tensor cores
//! while it takes each softmax. Per key tile j it
//! 1. issues S of j's second half;
//! 2. takes the softmax of j's first half (S retired at the end of the last step) and issues
//!    its P V;
//! 3. retires S of j's second half, waits until tile j + 1 has landed and issues S of its first
//!    half;
//! 4. retires P V of j's first half, takes the softmax of j's second half, issues its P V;
//! 5. retires everything (S of j + 1's first half and P V of j's second).
//!
//! Nothing reads an in-flight chain's registers: the waits name them as operands
//! ([`wait_scores64`] returns S for the reads after it, [`wait_pv64`]), and no chain is in flight
//! across the loop's back edge (step 5; with P V in flight there, `ptxas` serialised every
//! chain, C7514). `cargo xtask ptx-report` fails if `ptxas` serialises the chains.
//!
//! Up to width 128 (other than on e4m3 stages) a warpgroup steps over whole 128-key tiles instead, in
//! FA3's order ([`ws_whole_tiles`]): per tile j it issues S of tile j + 1 (both halves; at
//! width 64, whose stages hold whole tiles, one chain of m64n128 steps over the tile's
//! contiguous K rows) and P V of tile j, retires S, takes the softmax of j + 1 (one row max and
//! one rescale for 128 keys) under the P V, and retires the P V before rescaling O. It holds two tiles' stages from
//! one issue to the next wait. The four whole-tile stages of width 64 leave the producer two to
//! fill; on half-tile stages (widths 80 to 128) the P V of tile j's first half is issued before
//! S of j + 1, so that its stage is freed when S retires, before the softmax.
//!
//! At width 256 O takes 128 registers a thread, and two 64-key S blocks beside it would not fit:
//! there a warpgroup steps over 32 keys (`ws_sub_keys`) with one S in flight at a time. Per step
//! x it takes the softmax of x (under P V of x - 1, retired before O is rescaled), issues S of
//! x + 1 and P V of x, and retires S of x + 1; the fourth step of a tile retires both.
//!
//! Above width 64 a warp rescales O only when one of its rows' max moved past the slack
//! (`lazy_rescale::must_rescale`); the other blocks keep each row's running max as it was.
//!
//! `setmaxnreg` moves registers from the producer (which needs few) to the compute warps.
//!
//! An FP8 cache (`prefill_wgs_<q>_fp8_d*`, `attn_math::hopper_prefill::StageFormat`): at widths
//! 64 and 256 the producer converts its rows into 16-bit stages; at widths 80 to 128 the stages hold
//! e4m3 rows, whole tiles of K as copied and V transposed by the producer, and the compute warps
//! quantise each item's queries and run both MMAs on e4m3 (`super::e4m3_stages`). The key loop
//! is the same for every format: its MMAs go through [`HalfMma`].

use crate::attention::config::CacheFormat;
use crate::attention::hopper::e4m3_stages::{copy_tile, quantise_queries, transpose_v};
use crate::attention::hopper::half_mma::HalfMma;
use crate::attention::hopper::steps::{
    convert_fp8_rows, copy_raw_row_pairs, copy_row_pairs, copy_rows, raise_max, rescale_o, row_max, weights,
};
use crate::attention::hopper::Wgmma;
use crate::attention::kv::KvSource;
use crate::attention::lazy_rescale::must_rescale;
use crate::attention::logits::Logits;
use crate::attention::output::RowOut;
use crate::attention::work::{work_item_at, RowInfo, Work};
use crate::blocks::device::{
    atomic_add_global, atomic_or_global, ballot, block_idx_x, dynamic_shared, grid_dim_x, named_barrier, named_barrier_all, pdl_prologue,
    set_max_registers, shfl_idx, shfl_xor, static_for, sync_threads, thread_idx_x,
};
use crate::blocks::elem::Fp8Format;
use crate::blocks::mma::{
    cp_async_commit, cp_async_wait, fence_proxy_async_shared, ld_shared_u32, ld_shared_u64x2, ld_shared_v4, shared_addr, st_shared_u32,
    st_shared_u64x2, st_shared_v4, wgmma_desc,
};
use crate::blocks::vec_io::{load_u32_nc, store4};
use crate::blocks::wgmma::{wait_pv32, wait_scores128, wait_scores32, wait_scores64, Acc, WgmmaTiles, ACC_BLOCKS};
use crate::blocks::{mbarrier, tma};
use attn_math::hopper_prefill::{
    group_bytes, stage_format, ws_e4m3_wide_regs, ws_layout_qk_v, ws_q_buffers, ws_raw_slots, ws_row_bytes, ws_stage_keys, ws_stages,
    ws_sub_keys, ws_tma_stages, ws_v_tile, ws_whole_tiles, StageFormat, WsLayout, BLOCK_M, BLOCK_N, THREADS, WS_COMPUTE_REGS,
    WS_E4M3_COMPUTE_REGS, WS_E4M3_LOOKAHEAD, WS_E4M3_PRODUCER_REGS, WS_E4M3_WIDE_COMPUTE_REGS, WS_E4M3_WIDE_PRODUCER_REGS, WS_FLAG_BYTES,
    WS_FP8_COMPUTE_REGS, WS_FP8_LOOKAHEAD, WS_FP8_PRODUCER_REGS, WS_ITEM_SLOTS, WS_ITEM_WORDS, WS_PRODUCER_REGS, WS_PRODUCER_TABLES,
    WS_STAGES, WS_STAGES_FOUR,
};
use attn_math::params::{AttnParams, PagedKvMaps};
use attn_math::prefill::{table_slot_bytes, TABLE_ENTRY};
use attn_math::softmax::OnlineSoftmax;
use attn_math::status::BLOCK_OUT_OF_RANGE;
use core::marker::PhantomData;

/// Threads of the producer warpgroup.
const PRODUCERS: u32 = 128;
/// Arrivals that complete a "filled" phase: one per producer when its copies have landed
/// (`cp.async.mbarrier.arrive.noinc`), and producer 0's plain arrive, whose release publishes
/// what the producers stored into shared memory with ordinary stores (item, table, flags).
const FILLED_ARRIVALS: u32 = PRODUCERS + 1;
/// Key rows whose table entries a producer reads before issuing their copies
/// ([`copy_row_pairs`]): 2 entries are 8 of the producer's [`WS_PRODUCER_REGS`] registers.
const COPY_BATCH: usize = 2;
/// Whether O's rescale waits until a row's max moves past the slack (`rescale_o`). Not at
/// width 64: there O is 32 registers a thread, and the vote and the branch cost more than the
/// multiplies they skip (8 x 2048 measured 3% slower with them).
const fn lazy_rescale(d: usize) -> bool {
    d > 64
}
/// Named barrier of the producer warpgroup (0 is the CTA's).
const PRODUCER_BARRIER: u32 = 1;

/// An item descriptor's first word.
const ITEM_NONE: u32 = 0;
const ITEM_WORK: u32 = 1;
const ITEM_END: u32 = 2;

/// The shared-memory rings of the kernel of QK head size `D` (which sets the stage count,
/// `ws_stages`) and rows `W` columns wide (whole 128-byte swizzle atoms), indexed by ring position (the CTA's stages
/// counted across its items) or by item count. The compute warps count 64-key half tiles
/// instead ([`Rings::half`]).
struct Rings<const D: usize, const W: usize, const WV: usize, K> {
    smem: u32,
    l: WsLayout,
    cache: PhantomData<K>,
}

impl<const D: usize, const W: usize, const WV: usize, K> Clone for Rings<D, W, WV, K> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<const D: usize, const W: usize, const WV: usize, K> Copy for Rings<D, W, WV, K> {}

impl<const D: usize, const W: usize, const WV: usize, K: CacheFormat> Rings<D, W, WV, K> {
    const STAGES: u32 = ws_stages(D as u32, K::FP8);
    const FORMAT: StageFormat = stage_format(W as u32, K::FP8);
    /// e4m3 stages (`StageFormat::Fp8`): K as copied, V transposed, e4m3 queries.
    const E4M3: bool = matches!(stage_format(W as u32, K::FP8), StageFormat::Fp8);
    /// Raw FP8 slots.
    const RAW: u32 = ws_raw_slots(W as u32, K::FP8);
    /// Query buffers.
    const Q_BUFFERS: u32 = ws_q_buffers(W as u32, K::FP8);
    /// Keys of a stage.
    const KEYS: u32 = ws_stage_keys(W as u32, K::FP8);
    /// Bytes of a stage's key row.
    const ROW_BYTES: u32 = ws_row_bytes(W as u32, K::FP8);
    /// Keys of the compute warps' step (`ws_sub_keys`): 64 (a half tile) or 32.
    const SUB: u32 = ws_sub_keys(W as u32);
    /// Steps a stage holds: 2 (width 64) or 1.
    const SUBS: u32 = Self::KEYS / Self::SUB;
    /// Steps of whole 128-key tiles ([`ws_whole_tiles`]).
    const WHOLE_TILES: bool = ws_whole_tiles(W as u32, K::FP8);
    /// Stages of half a tile (16-bit, widths 80 to 128).
    const HALF_STAGES: bool = Self::KEYS < BLOCK_N;
    /// Stages a tile fills: 1, 2, or 4 at width 256.
    const STAGES_PER_TILE: u32 = BLOCK_N / Self::KEYS;
    /// Bytes V's rows (`WV` columns) take less than K's in a stage.
    const V_SHORT: u32 = Self::KEYS * Self::ROW_BYTES - ws_v_tile(W as u32, WV as u32, K::FP8);

    #[inline(always)]
    fn new(smem: u32) -> Self {
        // The host's layout: the kernel's head sizes (its stages depend on them; its rows are
        // whole atoms of them).
        let dv = if W == WV { D } else { WV };
        Rings { smem, l: ws_layout_qk_v(D as u32, dv as u32, K::FP8), cache: PhantomData }
    }

    #[inline(always)]
    fn stage(u: u32) -> u32 {
        u % Self::STAGES
    }

    /// Parity of position `u`'s use of its stage (uses alternate phases).
    #[inline(always)]
    fn parity(u: u32) -> u32 {
        (u / Self::STAGES) & 1
    }

    #[inline(always)]
    fn k(&self, u: u32) -> u32 {
        // A stage is K's tile and V's, twice K's less what V's rows lack (nothing but at QK 192 /
        // V 128). Written so, the kernels whose rows are as wide compile as they did before V's
        // could be narrower; as a sum of the two tiles, or as a branch on the widths, LLVM shared
        // the stage index differently and the e4m3 kernels spilled more.
        self.smem + self.l.kv + Self::stage(u) * 2 * self.l.tile - Self::stage(u) * Self::V_SHORT
    }

    #[inline(always)]
    fn v(&self, u: u32) -> u32 {
        self.k(u) + self.l.tile
    }

    /// Ring position `u`'s raw FP8 K and V rows.
    #[inline(always)]
    fn raw(&self, u: u32) -> [u32; 2] {
        let k = self.smem + self.l.raw + (u % Self::RAW.max(1)) * 2 * self.l.raw_tile;
        [k, k + self.l.raw_tile]
    }

    /// e4m3 stages: ring position `u`'s raw V rows (K goes straight into the stage).
    #[inline(always)]
    fn raw_v(&self, u: u32) -> u32 {
        self.smem + self.l.raw + (u % Self::RAW.max(1)) * self.l.raw_tile
    }

    /// The block of ones (`WsLayout::ones`).
    #[inline(always)]
    fn ones(&self) -> u32 {
        self.smem + self.l.ones
    }

    /// e4m3 stages: compute warpgroup `wg`'s quantised queries.
    #[inline(always)]
    fn q8(&self, wg: u32) -> u32 {
        self.smem + self.l.q8 + 64 * wg * Self::ROW_BYTES
    }

    #[inline(always)]
    fn scratch(&self) -> u32 {
        self.smem + self.l.scratch
    }

    /// Ring position `u`'s address table (not with converted FP8 rows, whose copies read their
    /// raw tables): the stage's (e4m3 stages), or one of
    /// `attn_math::hopper_prefill::WS_PRODUCER_TABLES` used in turn (16-bit stages).
    #[inline(always)]
    fn table(&self, u: u32) -> u32 {
        let t = if matches!(Self::FORMAT, StageFormat::Bits16) { u % WS_PRODUCER_TABLES } else { Self::stage(u) };
        self.smem + self.l.table + t * table_slot_bytes(Self::KEYS)
    }

    /// Ring position `u`'s bad-key masks (`WsLayout::flags`).
    #[inline(always)]
    fn flags(&self, u: u32) -> u32 {
        self.smem + self.l.flags + Self::stage(u) * WS_FLAG_BYTES
    }

    /// Ring position `u`'s raw table (FP8: the producer's copy of its address table, written
    /// when its raw rows are copied; `attn_math::hopper_prefill::ws_tables`).
    #[inline(always)]
    fn raw_table(&self, u: u32) -> u32 {
        self.smem + self.l.table + (u % Self::RAW.max(1)) * table_slot_bytes(Self::KEYS)
    }

    /// Step `x` (the CTA's steps of [`Self::SUB`] keys counted across its items; half tiles
    /// up to width 128): its stage's ring position and its K, V and bad-key mask addresses.
    #[inline(always)]
    fn half(&self, x: u32) -> Half {
        const { assert!(W == WV || Self::SUBS == 1) };
        let (u, i) = (x / Self::SUBS, x % Self::SUBS);
        let rows = i * Self::SUB * Self::ROW_BYTES;
        Half {
            u,
            first: i == 0,
            last: i == Self::SUBS - 1,
            k: self.k(u) + rows,
            // e4m3: V^T's rows are V's columns; the step's keys are columns of them. (Where V's rows
            // are narrower than K's, a stage is one step: `i` is 0.)
            v: self.v(u) + if Self::E4M3 { i * Self::SUB } else { rows },
            // One mask a 32 keys.
            flags: self.flags(u) + i * (Self::SUB / 32) * 4,
        }
    }

    #[inline(always)]
    fn filled(&self, u: u32) -> u32 {
        self.smem + self.l.bars + 8 * Self::stage(u)
    }

    #[inline(always)]
    fn freed(&self, u: u32) -> u32 {
        self.smem + self.l.bars + 8 * (Self::STAGES + Self::stage(u))
    }

    #[inline(always)]
    fn q(&self, k: u32) -> u32 {
        self.smem + self.l.q + (k % Self::Q_BUFFERS) * self.l.q_bytes
    }

    /// Item `k`'s descriptor: two slots whatever the query buffers, so that a slot is rewritten
    /// only after the compute warps have worked through the next item.
    #[inline(always)]
    fn item(&self, k: u32) -> u32 {
        self.smem + self.l.item + (k % WS_ITEM_SLOTS) * 4 * WS_ITEM_WORDS
    }

    #[inline(always)]
    fn q_filled(&self, k: u32) -> u32 {
        self.smem + self.l.bars + 8 * (2 * Self::STAGES + k % Self::Q_BUFFERS)
    }

    #[inline(always)]
    fn q_freed(&self, k: u32) -> u32 {
        self.smem + self.l.bars + 8 * (2 * Self::STAGES + Self::Q_BUFFERS + k % Self::Q_BUFFERS)
    }

    #[inline(always)]
    fn q_parity(k: u32) -> u32 {
        (k / Self::Q_BUFFERS) & 1
    }
}

/// The producer's TMA copies of a paged 16-bit cache ([`PagedKvMaps`]): a box of `box_keys`
/// keys (8 to 64, a page or a stage, whichever is smaller) per plane.
#[derive(Clone, Copy)]
struct TmaGroups {
    /// Generic address of the K map (V's 128 bytes on); 0: every row by `cp.async` (no maps, or
    /// an FP8 cache).
    map: u64,
    box_keys: u32,
    slots_per_block: u32,
    heads_per_block: u32,
}

impl TmaGroups {
    #[inline(always)]
    fn of(m: &PagedKvMaps, fp8: bool, map: u64) -> Self {
        TmaGroups {
            map: if m.enabled != 0 && !fp8 { map } else { 0 },
            box_keys: m.box_keys,
            slots_per_block: m.slots_per_block,
            heads_per_block: m.heads_per_block,
        }
    }

    /// For the producer `t` holding key `key` (`valid`: before the request's end and in a block
    /// inside the cache; `loc`: its block id) of kv head `kv_head`: its part of the condition for
    /// its stage to go by TMA (its key valid, and where it starts a box, the box starting at a
    /// multiple of the box's keys in its block, so that the box's keys are one block's), with
    /// the box's coordinates in the maps, meaningful in the box's first thread. When every
    /// producer of a stage says yes, every box of the stage is whole.
    #[inline(always)]
    fn group(&self, p: &AttnParams, key: u32, valid: bool, loc: i64, kv_head: u32, t: u32) -> Option<[u32; 5]> {
        if self.map == 0 || !valid {
            return None;
        }
        let off = key % p.shape.block_size;
        if t.is_multiple_of(self.box_keys) && !off.is_multiple_of(self.box_keys) {
            return None;
        }
        // The host bounds `num_blocks * block_size` and `num_blocks * heads` below 2^32.
        let b = loc as u32;
        Some([0, 0, 0, (b * self.slots_per_block + off) / 8, b * self.heads_per_block + kv_head])
    }
}

/// Where a 64-key half tile sits in the ring ([`Rings::half`]).
#[derive(Clone, Copy)]
struct Half {
    /// Its stage's ring position.
    u: u32,
    /// The stage's first half: the compute warps wait for the stage before reading it.
    first: bool,
    /// The stage's last half: done with it, a compute warp frees the stage.
    last: bool,
    k: u32,
    v: u32,
    flags: u32,
}

/// A decoded item: the descriptor's words.
#[derive(Clone, Copy)]
struct Item {
    status: u32,
    work: Work,
    begin: u32,
    end: u32,
    n_tiles: u32,
    num_splits: u32,
}

impl Item {
    /// Decodes grid index `x` (`ITEM_END` past the plan's CTAs); `DV`: the kernel's V width
    /// (where a split's columns start).
    #[inline(always)]
    unsafe fn decode<const DV: usize>(p: &AttnParams, x: u32) -> [u32; 16] {
        let mut d = [ITEM_NONE; 16];
        // A plan on the device (a CUDA-graph step's) counts its tiles in its header; the CTAs are
        // its tiles x kv heads.
        let ctas = if p.schedule.plan != 0 {
            (unsafe { load_u32_nc(p.schedule.plan) }) * (p.shape.num_q_heads / p.shape.group)
        } else {
            p.schedule.ctas
        };
        if x >= ctas {
            d[0] = ITEM_END;
            return d;
        }
        let Some(w) = (unsafe { work_item_at(p, x, BLOCK_M, DV as u32) }) else { return d };
        let (min_pos, max_pos) = unsafe { (w.row(p, 0).pos, w.row(p, w.live - 1).pos) };
        let (begin, end) = unsafe { w.key_range(p, min_pos, max_pos) };
        d[0] = ITEM_WORK;
        d[1..11].copy_from_slice(&w.to_words());
        d[11] = begin;
        d[12] = end;
        d[13] = if end > begin { (end - begin).div_ceil(BLOCK_N) } else { 0 };
        d[14] = unsafe { w.num_splits(p) };
        d
    }

    #[inline(always)]
    unsafe fn store(addr: u32, d: &[u32; 16]) {
        static_for::<4>(|i| unsafe { st_shared_v4(addr + 16 * i as u32, [d[4 * i], d[4 * i + 1], d[4 * i + 2], d[4 * i + 3]]) });
    }

    #[inline(always)]
    unsafe fn load(addr: u32) -> Item {
        let mut d = [0u32; 16];
        static_for::<4>(|i| d[4 * i..4 * i + 4].copy_from_slice(&unsafe { ld_shared_v4(addr + 16 * i as u32) }));
        let mut w = [0u32; 10];
        w.copy_from_slice(&d[1..11]);
        Item { status: d[0], work: Work::from_words(w), begin: d[11], end: d[12], n_tiles: d[13], num_splits: d[14] }
    }
}

/// The kernel for 16-bit Q of type `Q` at QK width `D` (the MMAs' K of S) and V width `DV`
/// (the N of P V, and the accumulators) on shared-memory rows of `W` and `WV` columns (whole
/// 128-byte swizzle atoms: 64, or 128 for widths 80 to 128, whose columns past the width are
/// copied as zeros and never read by the MMAs). QK = V but for QK 192 / V 128
/// (`attn_math::hopper_prefill::QK_V_PAIRS`), whose Q and K rows are three atoms.
///
/// `maps`: the generic address of `kv_maps`' K map (its V map 128 bytes on), in the kernel's
/// parameters.
#[inline(always)]
pub(crate) unsafe fn prefill_specialized<
    Q: WgmmaTiles,
    K: CacheFormat,
    M: HalfMma,
    const D: usize,
    const W: usize,
    const DV: usize,
    const WV: usize,
>(
    p: &AttnParams,
    kv_maps: &PagedKvMaps,
    maps: u64,
) {
    // Programmatic dependent launch: wait for the cache write before reading anything.
    pdl_prologue();
    const {
        assert!(
            (D == DV && W == WV && ((D == 64 && W == 64) || (W == 128 && matches!(D, 80 | 96 | 112 | 128)) || (D == 256 && W == 256)))
                || (D == 192 && W == 192 && DV == 128 && WV == 128 && !K::FP8)
        )
    };
    const { assert!(M::E4M3 == Rings::<D, W, WV, K>::E4M3) };
    let tid = thread_idx_x();
    let rings = Rings::<D, W, WV, K>::new(shared_addr(dynamic_shared::<u8>()));
    if tid == 0 {
        for u in 0..Rings::<D, W, WV, K>::STAGES {
            unsafe { mbarrier::init(rings.filled(u), FILLED_ARRIVALS) };
            unsafe { mbarrier::init(rings.freed(u), THREADS) };
        }
        for k in 0..Rings::<D, W, WV, K>::Q_BUFFERS {
            unsafe { mbarrier::init(rings.q_filled(k), FILLED_ARRIVALS) };
            unsafe { mbarrier::init(rings.q_freed(k), THREADS) };
        }
    }
    // The block of ones the e4m3 P V chain sums the rows' weights against at width 128
    // (`wgmma::pv_blocks_fp8`; at 80 to 112 V's transposes write rows of ones), made visible to
    // the `wgmma`s (the async proxy) before the barrier.
    if M::pv_blocks::<D>() > D / 8 && D == 128 && tid < 64 {
        let one = K::Fp8::from_f32x2(1.0, 1.0) * 0x10001;
        unsafe { st_shared_v4(rings.ones() + 16 * tid, [one; 4]) };
        fence_proxy_async_shared();
    }
    sync_threads();
    if tid >= THREADS {
        if Rings::<D, W, WV, K>::E4M3 && ws_e4m3_wide_regs(D as u32, K::HALVES) {
            set_max_registers::<WS_E4M3_WIDE_PRODUCER_REGS, false>();
        } else if Rings::<D, W, WV, K>::E4M3 {
            set_max_registers::<WS_E4M3_PRODUCER_REGS, false>();
        } else if K::FP8 {
            set_max_registers::<WS_FP8_PRODUCER_REGS, false>();
        } else {
            set_max_registers::<WS_PRODUCER_REGS, false>();
        }
        unsafe { produce::<Q, K, D, W, DV, WV>(p, rings, TmaGroups::of(kv_maps, K::FP8, maps), tid - THREADS) };
    } else {
        if Rings::<D, W, WV, K>::E4M3 && ws_e4m3_wide_regs(D as u32, K::HALVES) {
            set_max_registers::<WS_E4M3_WIDE_COMPUTE_REGS, true>();
        } else if Rings::<D, W, WV, K>::E4M3 {
            set_max_registers::<WS_E4M3_COMPUTE_REGS, true>();
        } else if K::FP8 {
            set_max_registers::<WS_FP8_COMPUTE_REGS, true>();
        } else {
            set_max_registers::<WS_COMPUTE_REGS, true>();
        }
        unsafe { consume::<Q, K, M, D, W, DV, WV>(p, rings, tid) };
    }
}

/// The producer warpgroup (`t`: its thread index): items, queries, tables and K/V tiles into
/// the rings, until the items run out.
#[inline(always)]
unsafe fn produce<Q: WgmmaTiles, K: CacheFormat, const D: usize, const W: usize, const DV: usize, const WV: usize>(
    p: &AttnParams,
    rings: Rings<D, W, WV, K>,
    tma: TmaGroups,
    t: u32,
) {
    // A raw table's bad-key masks, after its entries.
    let raw_flags = |v: u32| rings.raw_table(v) + Rings::<D, W, WV, K>::KEYS * TABLE_ENTRY;
    // FP8, ring position `v`: once its stage is free, its raw table's bad-key masks moved into
    // the stage's, a warp's by its first thread (the warp that wrote it). Done before the
    // producer barrier that precedes the raw table's next writes.
    let publish_table = |v: u32| unsafe {
        mbarrier::wait(rings.freed(v), Rings::<D, W, WV, K>::parity(v) ^ 1);
        if t < Rings::<D, W, WV, K>::KEYS && t.is_multiple_of(32) {
            st_shared_u32(rings.flags(v) + (t / 32) * 4, ld_shared_u32(raw_flags(v) + (t / 32) * 4));
        }
    };
    // FP8: position `v`'s raw rows (this thread's own copies, landed) converted into its stage
    // (free, its table published), made visible to the async proxy the `wgmma`s read through,
    // and the stage marked filled.
    let fill_from_raw = |v: u32| {
        let tile = [rings.k(v), rings.v(v)];
        unsafe {
            match Rings::<D, W, WV, K>::KEYS {
                BLOCK_N => convert_fp8_rows::<Q, K::Fp8, W, BLOCK_N, PRODUCERS>(rings.raw(v), tile, t),
                64 => convert_fp8_rows::<Q, K::Fp8, W, 64, PRODUCERS>(rings.raw(v), tile, t),
                _ => convert_fp8_rows::<Q, K::Fp8, W, 32, PRODUCERS>(rings.raw(v), tile, t),
            }
            fence_proxy_async_shared();
            mbarrier::arrive(rings.filled(v));
            if t == 0 {
                // The count of a 16-bit cache's fills (one arrival a producer, and producer 0's
                // second).
                mbarrier::arrive(rings.filled(v));
            }
        }
    };
    // e4m3 stages: position `v`'s V rows (this thread's own copies, landed) transposed into its
    // stage, whose K copies have landed with them, and the stage marked filled.
    let fill_transposed = |v: u32| unsafe {
        // At widths 80 to 112, V^T's rows D..D+15 are ones (`wgmma::pv_blocks_fp8`).
        let ones = if D < 128 { D / 16 } else { 8 };
        transpose_v(rings.raw_v(v), rings.v(v), t, ones, K::Fp8::from_f32x2(1.0, 1.0) * 0x10001);
        fence_proxy_async_shared();
        mbarrier::arrive(rings.filled(v));
        if t == 0 {
            // As for the other formats: producer 0's second arrival.
            mbarrier::arrive(rings.filled(v));
        }
    };
    // Whether stages may go by TMA ([`TmaGroups`]): at the widths `ws_tma_stages` names, where
    // the head size may fill the rows (the maps take whole 64-column atoms) and V's rows are as
    // wide as K's (the boxes are K's).
    let by_tma_ever = const { D == W && W == WV && ws_tma_stages(W as u32, K::FP8) };
    let mut u = 0u32;
    let mut k = 0u32;
    // Item `k`'s descriptor into its slot, for every producer after the barrier. A macro, not a
    // closure: a closure called from the two places below moved LLVM's layout of the producer
    // and cost the d64 kernel 3.6% on an H100 (docs/prefill.md, "A deeper ring at row width 128").
    macro_rules! decode_item {
        () => {
            if t == 0 {
                // The grid's own index first, then the counter's (which starts past the grid).
                let x = if k == 0 { block_idx_x() } else { grid_dim_x() + unsafe { atomic_add_global(p.schedule.sched, 1) } };
                unsafe { Item::store(rings.item(k), &Item::decode::<DV>(p, x)) };
            }
            named_barrier::<PRODUCER_BARRIER, PRODUCERS>();
        };
    }
    // With one query buffer, freed after the item's output (not on e4m3 stages, whose compute
    // warps free it at the item's start), the next item is decoded before its buffer is free,
    // while the compute warps finish the current one: its descriptor slot was last read by item
    // k - 2, which was done before the buffer was freed for item k - 1 (waited for at that
    // item's start). Measured on an H100 (docs/prefill.md, "A deeper ring at row width 128"):
    // width 256 +2.7-2.9%, QK 192 +1.2-3.1%.
    let decode_ahead = Rings::<D, W, WV, K>::Q_BUFFERS == 1 && !Rings::<D, W, WV, K>::E4M3;
    loop {
        if decode_ahead {
            decode_item!();
        }
        unsafe { mbarrier::wait(rings.q_freed(k), Rings::<D, W, WV, K>::q_parity(k) ^ 1) };
        // This buffer's previous copies (a query buffer's count of query groups ago, or further
        // back counting the key stages' groups between) are this thread's own to complete
        // before it rewrites the buffer. They have landed (the compute warps freed the buffer
        // after waiting on them), so this costs nothing, but it is the completion racecheck
        // tracks: it does not follow the order through the other warps' barriers.
        if Rings::<D, W, WV, K>::Q_BUFFERS == 2 {
            cp_async_wait::<1>();
        } else {
            cp_async_wait::<0>();
        }
        if !decode_ahead {
            decode_item!();
        }
        let it = unsafe { Item::load(rings.item(k)) };
        let w = it.work;
        if it.status == ITEM_WORK && it.n_tiles > 0 {
            let q_row = |r: u32| {
                let gr = w.row0 + r.min(w.live - 1);
                let tok = gr / p.shape.group;
                let head = w.kv_head * p.shape.group + (gr - tok * p.shape.group);
                p.qkv.q + ((w.q_start + tok) as u64 * p.qkv.q_token_stride + head as u64 * p.qkv.q_head_stride) * 2
            };
            unsafe { copy_rows::<W, BLOCK_M, PRODUCERS>(rings.q(k), t, p.dims.qk_or(D as u32) / 8, q_row) };
        }
        unsafe {
            mbarrier::arrive_when_copies_land(rings.q_filled(k));
            if t == 0 {
                // Publishes the item descriptor this thread stored.
                mbarrier::arrive(rings.q_filled(k));
            }
        }
        cp_async_commit();
        if it.status == ITEM_END {
            break;
        }
        if it.status == ITEM_WORK && it.n_tiles > 0 {
            let src = unsafe { KvSource::of(p, &w) };
            // The copy units of a row the head sizes cover (one head size but for QK 192 / V 128).
            let live = K::live_units(p.dims.qk_or(D as u32));
            let live_v = K::live_units(p.dims.v_or(DV as u32));
            // FP8: the item's first ring position (its stages are converted from here on).
            let first = u;
            let key_of = |j: u32| it.begin + j * BLOCK_N + t;
            // Block ids are loaded a tile ahead and widened only where they are used: widened
            // at the load, the current tile's copies waited for it (`KvSource::block_of`).
            let block_of = |j: u32| if key_of(j) < it.end { unsafe { src.block_of(p, key_of(j)) } } else { u32::MAX };
            let mut block = block_of(0);
            let mut j = 0;
            while j < it.n_tiles {
                // This thread's key's entry and its warp's bad-block flag (as `KeyTables::fill`),
                // for the half of the tile the key is in.
                let key = key_of(j);
                let loc = src.located(key, block);
                let (ka, va) = if key < it.end { src.addresses(p, key, loc, K::ELEM_BYTES as u64) } else { (0, 0) };
                let bad = key < it.end && ka == 0;
                if bad {
                    unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
                }
                let bad_keys = ballot(bad);
                // This thread's part of a stage going by TMA, and its box's coordinates.
                let group = if by_tma_ever { tma.group(p, key, key < it.end && ka != 0, loc, w.kv_head, t) } else { None };
                if j + 1 < it.n_tiles {
                    block = block_of(j + 1);
                }
                // The tile's stages (one, two or four).
                static_for::<4>(|h| {
                    if h as u32 >= Rings::<D, W, WV, K>::STAGES_PER_TILE {
                        return;
                    }
                    let uh = u + h as u32;
                    let table = rings.table(uh);
                    if Rings::<D, W, WV, K>::E4M3 {
                        // The stage (a whole tile), once free: its table, then K straight into
                        // it and V's rows into a raw slot. Then the tile before, whose copies
                        // have landed, has its V transposed and is marked filled. A raw slot's
                        // and a stage's previous copies were this thread's own, waited for
                        // before their transposes.
                        unsafe { mbarrier::wait(rings.freed(uh), Rings::<D, W, WV, K>::parity(uh) ^ 1) };
                        unsafe { write_table_entry::<D, W, WV, K>([table, rings.flags(uh)], t, h as u32, (ka, va), bad_keys) };
                        named_barrier::<PRODUCER_BARRIER, PRODUCERS>();
                        // A producer warp copies the rows its own lanes' entries name
                        // (`e4m3_stages::copy_tile`), whole rows an instruction.
                        unsafe { copy_tile::<K>(rings.k(uh), rings.raw_v(uh), t, live, p.qkv.q, table) };
                        cp_async_commit();
                        if uh >= first + WS_E4M3_LOOKAHEAD {
                            cp_async_wait::<{ WS_E4M3_LOOKAHEAD }>();
                            fill_transposed(uh - WS_E4M3_LOOKAHEAD);
                        }
                    } else if K::FP8 {
                        // Raw rows of this stage into its raw slot (their addresses through its
                        // raw table), then the stage `WS_FP8_LOOKAHEAD` back converted into the
                        // ring (the item's first stages have none that far back in the item;
                        // the previous item's last ones were converted at its end). A raw
                        // slot's previous rows were this thread's own, converted by now.
                        let back = uh.wrapping_sub(WS_FP8_LOOKAHEAD);
                        let converting = uh >= first + WS_FP8_LOOKAHEAD;
                        if converting {
                            publish_table(back);
                        }
                        let raw_table = rings.raw_table(uh);
                        unsafe { write_table_entry::<D, W, WV, K>([raw_table, raw_flags(uh)], t, h as u32, (ka, va), bad_keys) };
                        named_barrier::<PRODUCER_BARRIER, PRODUCERS>();
                        unsafe {
                            let rows = |r| ld_shared_u64x2(raw_table + r * TABLE_ENTRY);
                            match Rings::<D, W, WV, K>::KEYS {
                                BLOCK_N => {
                                    copy_raw_row_pairs::<K, W, BLOCK_N, PRODUCERS, COPY_BATCH>(rings.raw(uh), t, live, p.qkv.q, rows)
                                }
                                64 => copy_raw_row_pairs::<K, W, 64, PRODUCERS, COPY_BATCH>(rings.raw(uh), t, live, p.qkv.q, rows),
                                _ => copy_raw_row_pairs::<K, W, 32, PRODUCERS, COPY_BATCH>(rings.raw(uh), t, live, p.qkv.q, rows),
                            }
                        }
                        cp_async_commit();
                        if converting {
                            cp_async_wait::<{ WS_FP8_LOOKAHEAD }>();
                            fill_from_raw(back);
                        }
                    } else {
                        unsafe { mbarrier::wait(rings.freed(uh), Rings::<D, W, WV, K>::parity(uh) ^ 1) };
                        // As for the query buffers: at least `STAGES - 1` groups were committed
                        // since this stage's last fill.
                        if Rings::<D, W, WV, K>::STAGES == WS_STAGES {
                            cp_async_wait::<{ WS_STAGES - 1 }>();
                        } else {
                            cp_async_wait::<{ WS_STAGES_FOUR - 1 }>();
                        }
                        unsafe { write_table_entry::<D, W, WV, K>([table, rings.flags(uh)], t, h as u32, (ka, va), bad_keys) };
                        // By TMA when every box of the stage can go so (`TmaGroups`): each box's
                        // first thread copies it, K and V, counting the bytes on the stage's
                        // barrier before its own arrival. Otherwise row by row.
                        let mine = t / Rings::<D, W, WV, K>::KEYS == h as u32;
                        let by_tma = if by_tma_ever {
                            named_barrier_all::<PRODUCER_BARRIER, PRODUCERS>(!mine || group.is_some())
                        } else {
                            named_barrier::<PRODUCER_BARRIER, PRODUCERS>();
                            false
                        };
                        if by_tma {
                            if let Some(c) = group.filter(|_| mine && t.is_multiple_of(tma.box_keys)) {
                                let dst = (t % Rings::<D, W, WV, K>::KEYS / 8) * group_bytes(W as u32);
                                unsafe {
                                    mbarrier::expect_tx(rings.filled(uh), 2 * (tma.box_keys / 8) * group_bytes(W as u32));
                                    tma::load_5d(rings.k(uh) + dst, tma.map, c, rings.filled(uh));
                                    tma::load_5d(rings.v(uh) + dst, tma.map + 128, c, rings.filled(uh));
                                }
                            }
                        } else {
                            unsafe {
                                let rows = |r| ld_shared_u64x2(table + r * TABLE_ENTRY);
                                let dst = [rings.k(uh), rings.v(uh)];
                                match Rings::<D, W, WV, K>::KEYS {
                                    BLOCK_N => copy_row_pairs::<W, WV, BLOCK_N, PRODUCERS, COPY_BATCH>(dst, t, [live, live_v], rows, true),
                                    64 => copy_row_pairs::<W, WV, 64, PRODUCERS, COPY_BATCH>(dst, t, [live, live_v], rows, true),
                                    _ => copy_row_pairs::<W, WV, 32, PRODUCERS, COPY_BATCH>(dst, t, [live, live_v], rows, true),
                                }
                            }
                        }
                        unsafe {
                            mbarrier::arrive_when_copies_land(rings.filled(uh));
                            if t == 0 {
                                // Publishes every producer's table entry and flag (stored before
                                // the named barrier above).
                                mbarrier::arrive(rings.filled(uh));
                            }
                        }
                        cp_async_commit();
                    }
                });
                u += Rings::<D, W, WV, K>::STAGES_PER_TILE;
                j += 1;
            }
            if Rings::<D, W, WV, K>::E4M3 {
                // The item's last tile not yet transposed (`WS_E4M3_LOOKAHEAD` is 1).
                cp_async_wait::<0>();
                fill_transposed(u - 1);
            } else if K::FP8 {
                // The item's last stages not yet converted: the rows of each have landed once
                // the groups committed after it are all that remain.
                for v in u.saturating_sub(WS_FP8_LOOKAHEAD).max(first)..u {
                    publish_table(v);
                    if v + 1 < u {
                        cp_async_wait::<1>();
                    } else {
                        cp_async_wait::<0>();
                    }
                    fill_from_raw(v);
                }
            }
        }
        k += 1;
    }
    // The last CTA to finish zeroes the counters for the next launch (every other CTA has
    // taken its last index by then).
    if t == 0 && unsafe { atomic_add_global(p.schedule.sched + 4, 1) } == grid_dim_x() - 1 {
        unsafe {
            store4(p.schedule.sched, 0);
            store4(p.schedule.sched + 4, 0);
        }
    }
    // Before exiting, wait for the last phase this thread arrived on at every "filled"
    // barrier. Its earlier phases it has seen complete through its own waits (a "freed" phase
    // completes only after every compute warp waited on the "filled" phase before it); these
    // last ones were still open, held by its `cp.async`s (the END item's query phase counts
    // all of them), so the thread left with copies in flight and phases it had arrived on
    // not yet complete: synccheck's "missing wait" (the groups' own completion does not
    // complete a phase). The compute warps wait on the same
    // phases, so the CTA ends no later; the key loop is unchanged. Nothing arrives after
    // these phases, so each barrier is in that phase or just past it and the parity names it.
    unsafe {
        for i in 0..Rings::<D, W, WV, K>::Q_BUFFERS.min(k + 1) {
            mbarrier::wait(rings.q_filled(k - i), Rings::<D, W, WV, K>::q_parity(k - i));
        }
        for v in u.saturating_sub(Rings::<D, W, WV, K>::STAGES)..u {
            mbarrier::wait(rings.filled(v), Rings::<D, W, WV, K>::parity(v));
        }
    }
}

/// The producer's own key's address-table entry in the table at `table`, if the key (`t`,
/// counted from the tile's first) falls in stage `h` of the tile, and its warp's bad-key mask
/// (`bad_keys`, bit `l` lane `l`'s key, as `KeyTables::fill`) at `flags`.
#[inline(always)]
unsafe fn write_table_entry<const D: usize, const W: usize, const WV: usize, K: CacheFormat>(
    [table, flags]: [u32; 2],
    t: u32,
    h: u32,
    (ka, va): (u64, u64),
    bad_keys: u32,
) {
    if t / Rings::<D, W, WV, K>::KEYS == h {
        let tk = t % Rings::<D, W, WV, K>::KEYS;
        unsafe { st_shared_u64x2(table + tk * TABLE_ENTRY, ka, va) };
        if tk.is_multiple_of(32) {
            unsafe { st_shared_u32(flags + (tk / 32) * 4, bad_keys) };
        }
    }
}

/// The compute warpgroups (`tid` < [`THREADS`]): the half-tile schedule (module docs) over the
/// rings, item after item.
#[inline(always)]
unsafe fn consume<Q: WgmmaTiles, K: CacheFormat, M: HalfMma, const D: usize, const W: usize, const DV: usize, const WV: usize>(
    p: &AttnParams,
    rings: Rings<D, W, WV, K>,
    tid: u32,
) {
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    // Broadcast from lane 0: the same value, but `ptxas` then knows it is warp-uniform, so the
    // query descriptors derived from it live in uniform registers. Computed from the thread
    // index, each of the S chain's `wgmma`s had its A descriptor stepped in vector registers and
    // moved across (two `R2UR`, two moves and an add a `wgmma`: about 40 instructions a warp
    // a half tile).
    let wg = shfl_idx(warp / 4, 0);
    // O's blocks the P V chain writes, and whether the last of them is the rows' sums; the
    // block of ones it sums against where V's rows have no room for them.
    let pv_blocks = M::pv_blocks::<DV>();
    let summed = pv_blocks > DV / 8;
    let desc_ones = wgmma_desc(rings.ones(), 16, 1024, true);
    let k_desc = |addr: u32| M::desc_qk::<W>(addr);
    let v_desc = |addr: u32| M::desc_v::<WV>(addr);
    // Half tile `x`'s stage has landed and is visible to this thread's `wgmma`s (waited for at
    // its first half, which every later half of the stage follows in this warp's program
    // order, so one wait and one proxy fence a stage).
    let wait_filled = |x: u32| {
        let hx = rings.half(x);
        if hx.first {
            unsafe {
                mbarrier::wait(rings.filled(hx.u), Rings::<D, W, WV, K>::parity(hx.u));
                fence_proxy_async_shared();
            }
        }
    };
    // This thread is done with `bar`'s buffer (its warp's `wgmma`s that read it have retired).
    // Every thread arrives, not one a warp: an arrival releases only its own thread's reads (of
    // the stage's table and flags, of the item descriptor). With one arrival a warp, racecheck
    // reported the other lanes' reads against the producer's next writes, and a warp barrier
    // before the arrival did not change that.
    let release = |bar: u32| unsafe { mbarrier::arrive(bar) };
    // This warp is done with step `x`: frees its stage if it was the stage's last step.
    let release_half = |x: u32| {
        let hx = rings.half(x);
        if hx.last {
            release(rings.freed(hx.u));
        }
    };
    let mut u = 0u32;
    let mut k = 0u32;
    loop {
        unsafe { mbarrier::wait(rings.q_filled(k), Rings::<D, W, WV, K>::q_parity(k)) };
        let it = unsafe { Item::load(rings.item(k)) };
        if it.status == ITEM_END {
            break;
        }
        if it.status != ITEM_WORK {
            release(rings.q_freed(k));
            k += 1;
            continue;
        }
        let w = it.work;
        let (end, n_tiles) = (it.end, it.n_tiles);
        // e4m3 stages: the item's queries quantised into the warpgroup's e4m3 rows, whose scale
        // joins the score scale; the 16-bit buffer is then free for the next item's.
        let q_scale = if Rings::<D, W, WV, K>::E4M3 {
            let scale = if n_tiles > 0 { unsafe { quantise_queries::<Q>(rings.q(k), rings.q8(0), rings.scratch(), wg, tid) } } else { 1.0 };
            release(rings.q_freed(k));
            scale
        } else {
            1.0
        };
        let warp_row0 = 16 * warp;
        let rows: [[RowInfo; 2]; 1] = [unsafe { [w.row(p, warp_row0 + g), w.row(p, warp_row0 + g + 8)] }];
        let warp_pos = unsafe { (w.row(p, warp_row0).pos, w.row(p, warp_row0 + 15).pos) };
        // FP8: dequantisation folds into the score scale (k) and the output factor (v, read
        // again where the rows are stored rather than held through the loop); 1 and 1 for a
        // 16-bit cache.
        let (k_scale, _) = unsafe { K::scales(p, w.kv_head) };
        // Those scales carry the 16-bit conversion's unpack factor, which e4m3 MMAs, reading the
        // bytes as they are, must not: it is 1 where the conversion is the hardware's (sm_90a).
        const { assert!(!M::E4M3 || K::Fp8::UNPACK_SCALE == 1.0) };
        let logits = Logits::new(p, p.variant.scale_log2 * k_scale * q_scale, end);
        // The last position this warpgroup's rows see (causal): keys past it are masked for all
        // of them.
        let wg_last_pos = if p.mask.causal != 0 { unsafe { w.row(p, 64 * wg + 63).pos } } else { u32::MAX };
        let mult = logits.mult();
        // The warpgroup's query rows, and S's query operand from them (e4m3 stages: this
        // thread's fragments, read after the quantisation).
        let q_rows = if Rings::<D, W, WV, K>::E4M3 { rings.q8(wg) } else { rings.q(k) + 64 * wg * 2 * W as u32 };
        let q_op = unsafe { M::queries::<W>(q_rows, warp, lane) };

        // The quad's partial sums (or the sums the P V chain took), then the output (or the
        // split's partial) per row. The item is read again from its descriptor rather than kept
        // in registers through the loop.
        let finish = |o: &Acc, state: [OnlineSoftmax; 2]| {
            let it = unsafe { Item::load(rings.item(k)) };
            let w = it.work;
            let (_, v_scale) = unsafe { K::scales(p, w.kv_head) };
            // 16-bit stages: the rows go out through the warp's own query rows, which no
            // `wgmma` reads any more (the buffer is freed after this), as whole rows a store
            // ([`RowOut::store_warp_rows_staged`]); a split's partials and unaligned outputs
            // take their pairs straight from the fragments.
            let staged = !Rings::<D, W, WV, K>::E4M3 && matches!(DV, 64 | 128 | 256) && it.num_splits == 1 && RowOut::output_aligned16(p);
            let mut outs = [RowOut::NONE; 2];
            static_for::<2>(|h| {
                let mut st = state[h];
                if summed {
                    // Every column of the sums' block holds the row's whole sum.
                    st.sum = o[DV / 8][2 * h];
                } else {
                    st.sum += shfl_xor(st.sum, 1);
                    st.sum += shfl_xor(st.sum, 2);
                }
                let r = warp_row0 + g + 8 * h as u32;
                if r >= w.live {
                    return;
                }
                let out = unsafe { RowOut::new(p, &w, &w.row(p, r), st, it.num_splits, t4 == 0, v_scale, p.dims.v_or(DV as u32)) };
                if staged {
                    outs[h] = out;
                } else {
                    unsafe { out.store_blocks::<Q, ACC_BLOCKS>(2 * t4, DV / 8, |n| (o[n][2 * h], o[n][2 * h + 1])) };
                }
            });
            if staged {
                let stage = rings.q(k) + warp_row0 * 2 * W as u32;
                unsafe {
                    RowOut::store_warp_rows_staged::<Q, ACC_BLOCKS>(outs, DV / 8, p.dims.v_or(DV as u32), stage, lane, |n, h| {
                        (o[n][2 * h], o[n][2 * h + 1])
                    })
                };
            }
        };
        if n_tiles == 0 {
            finish(&[[0.0; 4]; ACC_BLOCKS], [OnlineSoftmax::EMPTY; 2]);
        } else if Rings::<D, W, WV, K>::SUB == 32 {
            // Width 256: steps of 32 keys (a quarter tile), one S in flight at a time. Per step
            // x: its softmax (under P V of x - 1, retired before O is rescaled), then S of
            // x + 1 and P V of x issued, and S of x + 1 waited for. The last step of a tile
            // retires both chains (nothing in flight across the loop's back edge, as above).
            let mut state = [OnlineSoftmax::EMPTY; 2];
            let mut o: Acc = [[0.0f32; 4]; ACC_BLOCKS];
            // The weights of the previous step, read by its in-flight P V.
            let mut pf = [[0u32; 4]; 2];
            let q_desc = M::desc_qk::<W>(q_rows);
            wait_filled(4 * u);
            // S of the current step, retired.
            let mut s = unsafe { wait_scores32::<0>(Q::scores_64x32_async::<D>(q_desc, k_desc(rings.half(4 * u).k))) };
            // The softmax of step `i` of tile `j` (S in `s`), its weights into `pf`; then, unless
            // `$last`, S of the next step and this step's P V issued and the S retired (`$wait`:
            // what stays in flight, 1 for the P V or 0); with `$last` its P V alone.
            macro_rules! quarter {
                ($j:expr, $i:literal, $wait:literal, $last:expr) => {{
                    let (j, i): (u32, u32) = ($j, $i);
                    let x = 4 * (u + j) + i;
                    let hx = rings.half(x);
                    let mut st = [s];
                    let kt = it.begin + j * BLOCK_N + 32 * i;
                    unsafe { logits.apply::<Wgmma<Q, D, 32>, 1, 4>(&mut st, &rows, kt, warp_pos, hx.flags) };
                    let [mut s_cur] = st;
                    let m = row_max(&s_cur);
                    // Retire P V of the previous step (O and its weights) before rescaling O.
                    unsafe { wait_pv32::<0, DV>(&mut o, &pf) };
                    if j > 0 || i > 0 {
                        release_half(x - 1);
                    }
                    rescale_o(&mut o, &mut state, m, mult, true, pv_blocks);
                    weights(&mut s_cur, &mut state, mult, summed);
                    pf = core::array::from_fn(|kk| {
                        [
                            Q::pack2(s_cur[2 * kk][0], s_cur[2 * kk][1]),
                            Q::pack2(s_cur[2 * kk][2], s_cur[2 * kk][3]),
                            Q::pack2(s_cur[2 * kk + 1][0], s_cur[2 * kk + 1][1]),
                            Q::pack2(s_cur[2 * kk + 1][2], s_cur[2 * kk + 1][3]),
                        ]
                    });
                    if $last {
                        unsafe { Q::pv_64xd_k32_async::<DV>(&mut o, &pf, v_desc(hx.v)) };
                    } else {
                        wait_filled(x + 1);
                        let s_next = unsafe { Q::scores_64x32_async::<D>(q_desc, k_desc(rings.half(x + 1).k)) };
                        unsafe { Q::pv_64xd_k32_async::<DV>(&mut o, &pf, v_desc(hx.v)) };
                        s = unsafe { wait_scores32::<$wait>(s_next) };
                    }
                }};
            }
            let mut j = 0;
            while j + 1 < n_tiles {
                quarter!(j, 0, 1, false);
                quarter!(j, 1, 1, false);
                quarter!(j, 2, 1, false);
                quarter!(j, 3, 0, false);
                j += 1;
            }
            quarter!(j, 0, 1, false);
            quarter!(j, 1, 1, false);
            quarter!(j, 2, 1, false);
            quarter!(j, 3, 0, true);
            let _ = s;
            unsafe { wait_pv32::<0, DV>(&mut o, &pf) };
            release_half(4 * (u + j) + 3);
            finish(&o, state);
        } else if Rings::<D, W, WV, K>::WHOLE_TILES {
            // Tiles of 128 keys (two 64-key halves, each its own S and P V chain), FA3's order:
            // per tile j, S of tile j + 1 and P V of tile j are issued together, S is retired
            // and its softmax runs under the P V, which is retired before O is rescaled. Nothing
            // is in flight across the loop's back edge.
            let mut state = [OnlineSoftmax::EMPTY; 2];
            let mut o: Acc = [[0.0f32; 4]; ACC_BLOCKS];
            // The weights of tile j's two halves, read by its P V.
            let mut pf = [M::P_ZERO; 2];
            let last = n_tiles - 1;
            // The last tile's second half is masked for every row of warpgroup 0 on an aligned
            // diagonal (its rows end 64 positions before warpgroup 1's): no S or P V of it. The
            // tile that skips it has its own copy of the code: S defined other than by its
            // `wgmma`s on one path made `ptxas` serialise every chain (C7515).
            let skip = wg_last_pos < it.begin + last * BLOCK_N + 64;
            // S of tile `j`'s first half, or of both (`true`: two chains over 64 keys each), or of
            // the whole tile from a whole-tile stage (`tile`: one chain over its 128 contiguous K
            // rows). A whole-tile stage: the second half's stage is the first's.
            macro_rules! issue_scores {
                ($j:expr, false) => {{
                    let x = 2 * (u + $j);
                    wait_filled(x);
                    unsafe { M::scores::<D>(q_op, k_desc(rings.half(x).k)) }
                }};
                ($j:expr, true) => {{
                    let x = 2 * (u + $j);
                    let a = issue_scores!($j, false);
                    wait_filled(x + 1);
                    (a, unsafe { M::scores::<D>(q_op, k_desc(rings.half(x + 1).k)) })
                }};
                ($j:expr, tile) => {{
                    let x = 2 * (u + $j);
                    wait_filled(x);
                    wait_filled(x + 1);
                    unsafe { M::scores_tile::<D>(q_op, k_desc(rings.half(x).k)) }
                }};
            }
            // A whole tile's S as its two halves' blocks (the m64n128 accumulators are the two
            // m64n64 ones side by side).
            let halves = |s: [[f32; 4]; 16]| -> [[[f32; 4]; 8]; 2] { core::array::from_fn(|h| core::array::from_fn(|n| s[8 * h + n])) };
            // P V of half `h` of tile `j` issued.
            macro_rules! issue_pv_half {
                ($j:expr, $h:literal) => {{
                    let x = 2 * (u + $j) + $h;
                    unsafe { M::pv::<DV>(&mut o, &pf[$h], v_desc(rings.half(x).v), desc_ones) };
                }};
            }
            // The softmax of tile `j` over `$nb` 8-key blocks (16: both halves, S in `$s`; 8: the
            // first only); with `$pv_before`, P V of tile j - 1 is in flight and retired (its
            // stage freed) before O is rescaled.
            macro_rules! softmax_tile {
                ($j:expr, $pv_before:expr, $nb:literal, $s:expr) => {{
                    let (j, s): (u32, [[[f32; 4]; 8]; $nb / 8]) = ($j, $s);
                    let x = 2 * (u + j);
                    let kt = it.begin + j * BLOCK_N;
                    let mut full = [[[0.0f32; 4]; $nb]];
                    static_for::<{ $nb / 8 }>(|h| {
                        let hx = rings.half(x + h as u32);
                        let mut sh = [s[h]];
                        unsafe { logits.apply::<Wgmma<Q, D, 64>, 1, 8>(&mut sh, &rows, kt + 64 * h as u32, warp_pos, hx.flags) };
                        static_for::<8>(|n| full[0][8 * h + n] = sh[0][n]);
                    });
                    let [mut full] = full;
                    let m = row_max(&full);
                    if $pv_before {
                        // Half-tile stages: the first half's P V has retired already.
                        if !Rings::<D, W, WV, K>::HALF_STAGES {
                            unsafe { M::wait_pv::<0, DV>(&mut o, &pf[0]) };
                        }
                        unsafe { M::wait_pv::<0, DV>(&mut o, &pf[1]) };
                        release_half(x - 1);
                    }
                    rescale_o(&mut o, &mut state, m, mult, lazy_rescale(DV), pv_blocks);
                    weights(&mut full, &mut state, mult, summed);
                    static_for::<{ $nb / 8 }>(|h| pf[h] = M::pack(&core::array::from_fn(|n| full[8 * h + n])));
                }};
            }
            // Tile 0's S.
            if last == 0 && skip {
                let a = issue_scores!(0, false);
                softmax_tile!(0, false, 8, [unsafe { wait_scores64::<0>(a) }]);
            } else if Rings::<D, W, WV, K>::HALF_STAGES {
                let (a, b) = issue_scores!(0, true);
                softmax_tile!(0, false, 16, unsafe { [wait_scores64::<1>(a), wait_scores64::<0>(b)] });
            } else {
                let s = issue_scores!(0, tile);
                softmax_tile!(0, false, 16, halves(unsafe { wait_scores128::<0>(s) }));
            }
            // Tile j + 1's S and tile j's P V, then tile j + 1's softmax.
            let mut j = 0;
            while j < last {
                // Half-tile stages: P V of j's first half issued before S of j + 1, so that its
                // stage is freed when S is retired, before the softmax.
                if Rings::<D, W, WV, K>::HALF_STAGES {
                    issue_pv_half!(j, 0);
                }
                if j + 1 == last && skip {
                    let a = issue_scores!(j + 1, false);
                    if !Rings::<D, W, WV, K>::HALF_STAGES {
                        issue_pv_half!(j, 0);
                    }
                    issue_pv_half!(j, 1);
                    // In flight: S of j + 1's first half, then P V of j (or its second half).
                    let s = if Rings::<D, W, WV, K>::HALF_STAGES {
                        let s = unsafe { wait_scores64::<1>(a) };
                        unsafe { M::wait_frags::<1>(&pf[0]) };
                        s
                    } else {
                        unsafe { wait_scores64::<2>(a) }
                    };
                    release_half(2 * (u + j));
                    softmax_tile!(j + 1, true, 8, [s]);
                } else if Rings::<D, W, WV, K>::HALF_STAGES {
                    // Two chains: one over the tile's 128 K rows would need both half stages
                    // landed before its first step, and their K rows side by side (tried, with
                    // the stages paired: 2-5% slower, docs/prefill.md).
                    let (a, b) = issue_scores!(j + 1, true);
                    issue_pv_half!(j, 1);
                    // In flight: S of j + 1 (both halves), then P V of j's second half.
                    let s = unsafe { [wait_scores64::<1>(a), wait_scores64::<1>(b)] };
                    unsafe { M::wait_frags::<1>(&pf[0]) };
                    release_half(2 * (u + j));
                    softmax_tile!(j + 1, true, 16, s);
                } else {
                    let s = issue_scores!(j + 1, tile);
                    issue_pv_half!(j, 0);
                    issue_pv_half!(j, 1);
                    // In flight: S of j + 1, then P V of j.
                    let s = unsafe { wait_scores128::<2>(s) };
                    release_half(2 * (u + j));
                    softmax_tile!(j + 1, true, 16, halves(s));
                }
                j += 1;
            }
            issue_pv_half!(last, 0);
            if !skip {
                issue_pv_half!(last, 1);
            }
            unsafe { M::wait_pv::<0, DV>(&mut o, &pf[0]) };
            unsafe { M::wait_pv::<0, DV>(&mut o, &pf[1]) };
            release_half(2 * (u + last));
            // A skipped half's stage is freed once it has been filled (half-tile stages; an
            // arrival before would count toward the stage's previous use).
            wait_filled(2 * (u + last) + 1);
            release_half(2 * (u + last) + 1);
            finish(&o, state);
        } else {
            let mut state = [OnlineSoftmax::EMPTY; 2];
            let mut o: Acc = [[0.0f32; 4]; ACC_BLOCKS];
            // The weights of the previous half tile, read by its in-flight P V.
            let mut pf = M::P_ZERO;
            wait_filled(2 * u);
            // S of the current half tile, retired.
            let mut s = unsafe { wait_scores64::<0>(M::scores::<D>(q_op, k_desc(rings.half(2 * u).k))) };
            // The softmax of half `h` of tile `j` (S in `s`, every chain before it retired but P V
            // of the previous half, and `$next` in flight), then its P V issued.
            macro_rules! softmax_pv {
                ($j:expr, $h:literal, $wait_pv:literal) => {{
                    let (j, h): (u32, u32) = ($j, $h);
                    let uh = 2 * (u + j) + h;
                    let hx = rings.half(uh);
                    let mut st = [s];
                    let kt = it.begin + j * BLOCK_N + 64 * h;
                    let flags = hx.flags;
                    unsafe { logits.apply::<Wgmma<Q, D, 64>, 1, 8>(&mut st, &rows, kt, warp_pos, flags) };
                    let [mut s_cur] = st;
                    let m = row_max(&s_cur);
                    // Retire P V of the previous half (O and its weights) before rescaling O.
                    unsafe { M::wait_pv::<$wait_pv, DV>(&mut o, &pf) };
                    if j > 0 || h > 0 {
                        // P V of the previous half has retired.
                        release_half(uh - 1);
                    }
                    // Written out here, not `rescale_o`: through the helper `ptxas` allocated the e4m3
                    // kernels' registers differently (the same instructions, other registers).
                    if !lazy_rescale(DV) || must_rescale(&state, m, mult) {
                        static_for::<2>(|r| {
                            let factor = raise_max(&mut state[r], m[r] * mult);
                            static_for::<ACC_BLOCKS>(|n| {
                                if n < pv_blocks {
                                    o[n][2 * r] *= factor;
                                    o[n][2 * r + 1] *= factor;
                                }
                            });
                        });
                    }
                    weights(&mut s_cur, &mut state, mult, summed);
                    pf = M::pack(&s_cur);
                    unsafe { M::pv::<DV>(&mut o, &pf, v_desc(hx.v), desc_ones) };
                }};
            }
            // One tile `j` (`$last`: no next tile, so no S of its first half to run ahead).
            macro_rules! step {
                ($j:expr, $last:literal) => {{
                    let j: u32 = $j;
                    let uj = 2 * (u + j);
                    wait_filled(uj + 1);
                    let s_next = unsafe { M::scores::<D>(q_op, k_desc(rings.half(uj + 1).k)) };
                    // In flight: S of j's second half (P V of j - 1 retired at the end of its step).
                    softmax_pv!(j, 0, 1);
                    // In flight: S of j's second half, P V of its first.
                    s = unsafe { wait_scores64::<1>(s_next) };
                    if $last {
                        softmax_pv!(j, 1, 0);
                    } else {
                        wait_filled(uj + 2);
                        let s_next = unsafe { M::scores::<D>(q_op, k_desc(rings.half(uj + 2).k)) };
                        // In flight: P V of j's first half, S of j + 1's first half.
                        softmax_pv!(j, 1, 1);
                        // In flight: S of j + 1's first half, P V of j's second. Both are
                        // retired: with a P V chain in flight across the loop's back edge and O
                        // read after the loop, `ptxas` serialised every chain of this kernel
                        // (C7514). Waiting costs one P V's latency a tile, which the other
                        // warpgroup's chains cover.
                        s = unsafe { wait_scores64::<0>(s_next) };
                    }
                }};
            }
            let mut j = 0;
            while j + 1 < n_tiles {
                step!(j, false);
                j += 1;
            }
            // The last tile's second half is masked for every row of warpgroup 0 on an aligned
            // diagonal (its rows end 64 positions before warpgroup 1's): it skips that half.
            let j_last = n_tiles - 1;
            let u_last = 2 * (u + j_last);
            let skip = wg_last_pos < it.begin + j_last * BLOCK_N + 64;
            if skip {
                softmax_pv!(j_last, 0, 1);
            } else {
                step!(j_last, true);
            }
            let _ = s;
            // One wait, after the branches join: with a `wgmma.wait_group` in each branch,
            // `ptxas` compiled all of the compute warps' code as divergent (a `WARPSYNC` before
            // each chain, the ring addresses and descriptors in vector registers moved to
            // uniform ones before every `wgmma` instead of kept there; d64 key loop 2127
            // instructions instead of 2085).
            unsafe { M::wait_pv::<0, DV>(&mut o, &pf) };
            if skip {
                // Done with the last tile's first half.
                release_half(u_last);
            }
            finish(&o, state);
            // The last half's stage is freed only once it has been filled, also where it was
            // skipped (and never waited for): an arrival before the fill would count toward the
            // phase of the stage's previous use, completing it while the other warpgroup may
            // still be reading that use. Where the half was read this wait has already
            // completed. Outside the branch (inside it, `ptxas` duplicated the item's tail) and
            // after the output (before it, an FP8 producer still draining the item's last
            // stages held the warps: 4% on the FP8 rows).
            wait_filled(u_last + 1);
            release_half(u_last + 1);
        }
        // The item's queries and descriptor are no longer read (e4m3 stages: the queries were
        // released at the start; the descriptor slot is rewritten only two items on).
        if !Rings::<D, W, WV, K>::E4M3 {
            release(rings.q_freed(k));
        }
        u += n_tiles;
        k += 1;
    }
}
