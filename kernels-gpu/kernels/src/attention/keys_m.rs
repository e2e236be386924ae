//! Paged decode on Hopper's `wgmma` with the keys on M (`decode_km_<q><fp8>[_r16]_d<128|256>`
//! over FP8 caches, `decode_km_<q>_r16_d<64|128>` and `decode_km_<q>_d64` over 16-bit ones; shape
//! and layout in `attn_math::keys_m`).
//!
//! A CTA's four warps form a warpgroup over 64-key tiles:
//! - S^T = K Q^T (m64nN, N = the CTA's 8 or 16 query rows): K straight from the staged rows, the
//!   queries staged once a CTA;
//! - O^T += V^T P^T over the tile's 64 keys, P^T stored in shared memory.
//!
//! Each warp copies its own 16 keys of every tile (`super::slab_copy`, as the keys-as-rows
//! kernels), so a slab's block is one lookup, and a bad block is the warp's to mask and report;
//! the copies complete the stage's `mbarrier` phase. S^T's M rows of warp w are its own 16 keys
//! in `mma.sync`'s layout, so the masks are the keys-as-rows kernels'. The warps' row maxima
//! meet through shared memory once a tile (the weights of one product share a max); a second
//! barrier publishes P^T. A stage is refilled once its tile's S^T has retired and V^T is read,
//! as MLA's narrow e4m3 kernel does (`super::mla`).
//!
//! What differs by cache is an [`Operands`] policy:
//! - [`Fp8Rows`]: e4m3 `wgmma` on the cache's bytes. The keys-as-rows kernels run FP8 on
//!   `mma.sync`, which on sm_90a has no FP8 form: every byte pair converted before its MMA, and
//!   below width 128 those conversions and the per-key softmax set their pace, not their bytes
//!   (docs/decode.md). Here the queries are quantised to e4m3 (one scale a row, undone on the
//!   scores), V^T's A fragments come from the staged rows by `ldmatrix.trans` and one `prmt` a
//!   register, and P^T is stored as e4m3 bytes (the weights times 2^7 under a max that may lag
//!   the row's by up to 2^1.5, so small weights keep e4m3's precision). Keys are permuted
//!   between S and P V, which the sum over keys does not see: P^T column (and V^T's A column) k
//!   is tile key `attn_math::mla::e4m3_rho(k)`, the order in which `ldmatrix.trans` hands a lane
//!   its keys; O^T's M row g of block b of warp w is head dimension `16 (W/64 w + b) + 2g`, row
//!   g + 8 the next one.
//! - [`HalfRows`]: 16-bit `wgmma` for 16 rows a kv head (GQA 16), where the keys-as-rows kernel's
//!   two column groups a slab hold it under the read ceiling, and for up to 8 at width 64, whose
//!   128-byte rows take four CTAs an SM as FP8 width 128's: the queries as they are, V^T read
//!   transposed from the staged rows by the instruction itself, P^T in the queries' type (the
//!   weights under 2^8, the keys-as-rows kernels' slack). O^T's M row r of block b of warp w is
//!   head dimension `64 b + 16 w + r`.

use crate::attention::config::{Bits16, CacheFormat};
use crate::attention::logits::Logits;
use crate::attention::output::RowOut;
use crate::attention::slab_copy::{SlabCopy, SlabRows, WarpSlabs};
use crate::attention::work::{work_item, RowInfo};
use crate::blocks::device::{
    atomic_or_global, dynamic_shared, pdl_launch_dependents, pdl_wait, shfl_idx, shfl_xor, static_for, sync_threads, thread_idx_x, vote_any,
};
use crate::blocks::elem::{E4m3, E5m2, Fp8Format};
use crate::blocks::mbarrier;
use crate::blocks::mma::{
    byte_perm, cp_async_commit, cp_async_wait, fence_proxy_async_shared, ld_shared_f32, ld_shared_v4, ldmatrix_x4_trans, shared_addr,
    st_shared_f32, st_shared_u16, st_shared_u64, st_shared_u8, st_shared_v4, wgmma_desc, MmaHalf,
};
use crate::blocks::vec_io::{e4m3x2, load8_nc};
use crate::blocks::wgmma::{wait_pv_km, wait_scores_km, KeysOnMScores, KeysOnMValuesFp8, KeysOnMValuesHalf};
use crate::merge::split_merge::merge_item_splits;
use attn_math::fp8::E4M3_MAX;
use attn_math::keys_m::{layout, TILE_KEYS, WARP_KEYS};
use attn_math::mla::{e4m3_column_of, e4m3_swizzled};
use attn_math::params::AttnParams;
use attn_math::prefill::THREADS;
use attn_math::softmax::{exp2, OnlineSoftmax};
use attn_math::status::BLOCK_OUT_OF_RANGE;

/// A warp's slab in a stage: 16 rows of the tile's K atoms (the warp's rows start `16 w` rows
/// on, which keeps the swizzle), the V rows a tile further.
struct TileRows<K, const W: usize>(core::marker::PhantomData<K>);

impl<K: CacheFormat, const W: usize> SlabRows<W> for TileRows<K, W> {
    type Cache = K;
    const PLANE: u32 = TILE_KEYS * W as u32 * K::ELEM_BYTES;

    #[inline(always)]
    fn at(r: u32, col: u32) -> u32 {
        e4m3_swizzled(TILE_KEYS, r, col)
    }
}

/// What the two products take from the staged rows, by cache: the queries' staging, the
/// instructions, V^T's operand and P's format. `W`: the width (head dimensions), `G` column
/// groups of 8 query rows, `Q` the queries' type.
trait Operands<Q: MmaHalf, const W: usize, const G: usize> {
    type Cache: CacheFormat;
    /// Whether the staged queries are quantised (their scores then undone row by row).
    const QUANTISED: bool;
    /// Whether V^T's operand is in registers once the tile's P^T is published (then the stage
    /// is free at that barrier); else the product reads it from the stage until it retires.
    const V_IN_REGISTERS: bool;
    /// P holds the weights times `2^P_SHIFT`, taken under a row max that may lag the tile's by
    /// `SLACK` (base 2) before O is rescaled: weights under `2^(P_SHIFT + SLACK)`.
    const P_SHIFT: f32;
    const SLACK: f32;

    /// The queries of the CTA's `8G` rows (`live` of them; `q_addr(n)`: row n's address) into
    /// `q` in B's layout (rows of the row bytes, 128-byte swizzle; columns at or past the head
    /// size `head` zero, not read), and with [`Self::QUANTISED`] each row's factor back to true
    /// scores at `dequant`.
    unsafe fn queries(live: u32, q_addr: impl Fn(u32) -> u64, head: u32, q: u32, dequant: u32);
    /// S^T of the tile at `desc_k` against the queries at `desc_q`; not waited for.
    unsafe fn scores(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2];
    /// V^T's A fragments of the tile whose V rows are at `v_tile` (this warp's), where the
    /// product takes them from registers.
    unsafe fn values(v_tile: u32, warp: u32, lane: u32) -> [[u32; 4]; 8];
    /// The weights of tile key `m` for query rows `n0` and `n0 + 1` into P^T at `p`.
    unsafe fn store_weights(p: u32, m: u32, n0: u32, w: [f32; 2]);
    /// O^T += V^T P^T (V rows at `v_tile`, fragments `v`, P^T at `p`); not waited for.
    unsafe fn pv(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8], v_tile: u32, p: u32);
    unsafe fn wait_pv(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8]);
    /// The pair of adjacent head dimensions this thread stores for one query row from M block
    /// `b` (warp `warp`, lane group `g`), given its values of M rows g and g + 8 there: the
    /// first dimension and its two values. Every lane calls it (it may exchange with others).
    fn store_pair(b: u32, warp: u32, g: u32, at_g: f32, at_g8: f32) -> (u32, f32, f32);
}

/// A thread's share of the CTA's `8G` query rows of width `W`: `128 / 8G` threads a row (at most
/// `W / 8`: 8 rows of width 64 take half the threads, the rest none), 8 columns (16 bytes) a
/// chunk; chunks at or past the head size, and rows past the live ones, are zero and not read.
struct QueryChunks {
    /// The row, and this thread's place among its threads.
    n: u32,
    sub: u32,
    per_row: u32,
    /// Chunks a thread (of `v`).
    count: u32,
    v: [[u32; 4]; 4],
}

impl QueryChunks {
    #[inline(always)]
    unsafe fn load<const W: usize, const G: usize>(live: u32, q_addr: impl Fn(u32) -> u64, head: u32) -> Self {
        let per_row = (THREADS / (8 * G as u32)).min(W as u32 / 8);
        let tid = thread_idx_x();
        let n = tid / per_row;
        // Threads past the rows (only where the rows' chunks are fewer than the threads) take none.
        let count = if W * G >= THREADS as usize || n < 8 * G as u32 { W as u32 / (8 * per_row) } else { 0 };
        let mut c = QueryChunks { n, sub: tid % per_row, per_row, count, v: [[0; 4]; 4] };
        let at = if c.n < live { q_addr(c.n) } else { 0 };
        static_for::<4>(|x| {
            let col = c.col(x as u32);
            if (x as u32) < c.count && c.n < live && col < head {
                // Two 8-byte loads: rows are 8-byte aligned (the host's check).
                let (lo, hi) = unsafe { (load8_nc(at + col as u64 * 2), load8_nc(at + col as u64 * 2 + 8)) };
                c.v[x] = [lo[0], lo[1], hi[0], hi[1]];
            }
        });
        c
    }

    /// The first column of chunk `x`.
    #[inline(always)]
    fn col(&self, x: u32) -> u32 {
        8 * (self.sub + self.per_row * x)
    }
}

/// FP8 rows on e4m3 `wgmma` (`K`: `config::Fp8E4M3`, `Fp8E5M2` or their `A8` forms for rows
/// that may start only 8-byte aligned).
struct Fp8Rows<K>(core::marker::PhantomData<K>);

impl<Q: MmaHalf, K: CacheFormat, const W: usize, const G: usize> Operands<Q, W, G> for Fp8Rows<K> {
    type Cache = K;
    const QUANTISED: bool = true;
    const V_IN_REGISTERS: bool = true;
    const P_SHIFT: f32 = 7.0;
    const SLACK: f32 = 1.5;

    /// One scale a row: its largest magnitude to e4m3's 448.
    #[inline(always)]
    unsafe fn queries(live: u32, q_addr: impl Fn(u32) -> u64, head: u32, q: u32, dequant: u32) {
        let c = unsafe { QueryChunks::load::<W, G>(live, q_addr, head) };
        let mut amax = 0.0f32;
        static_for::<4>(|x| {
            if (x as u32) < c.count {
                static_for::<4>(|h| {
                    let (a, b) = Q::unpack2(c.v[x][h]);
                    amax = amax.max(a.abs()).max(b.abs());
                });
            }
        });
        static_for::<4>(|i| {
            if 1 << i < c.per_row {
                amax = amax.max(shfl_xor(amax, 1 << i));
            }
        });
        // Finite for the smallest subnormal magnitudes too (bf16 holds some under 448 / f32::MAX).
        let scale = if amax > 0.0 { (E4M3_MAX / amax).min(f32::MAX) } else { 1.0 };
        static_for::<4>(|x| {
            if (x as u32) < c.count {
                let mut packed = [0u32; 2];
                static_for::<2>(|h| {
                    let (a, b) = Q::unpack2(c.v[x][2 * h]);
                    let (d, e) = Q::unpack2(c.v[x][2 * h + 1]);
                    packed[h] = e4m3x2(a * scale, b * scale) | e4m3x2(d * scale, e * scale) << 16;
                });
                let at = q + e4m3_swizzled(8 * G as u32, c.n, c.col(x as u32));
                unsafe { st_shared_u64(at, (packed[1] as u64) << 32 | packed[0] as u64) };
            }
        });
        if c.sub == 0 && c.count > 0 {
            unsafe { st_shared_f32(dequant + 4 * c.n, 1.0 / scale) };
        }
    }

    #[inline(always)]
    unsafe fn scores(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2] {
        if K::Fp8::E5M2 {
            unsafe { E5m2::scores_km::<W, G>(desc_k, desc_q) }
        } else {
            unsafe { E4m3::scores_km::<W, G>(desc_k, desc_q) }
        }
    }

    /// From `ldmatrix.trans` of the rows as 16-bit pairs: matrices (keys 16u + 0..8, chunk c) and
    /// (keys 16u + 8..16, chunk c) give lane (g, t4) columns 2g, 2g + 1 of the chunk for keys
    /// 2t4, 2t4 + 1 and 8 + 2t4, 9 + 2t4, which one `prmt` each takes apart into the two
    /// columns' registers (M rows g and g + 8 of block c). Warp w's chunks are `W/64 w ..`.
    #[inline(always)]
    unsafe fn values(v_tile: u32, warp: u32, lane: u32) -> [[u32; 4]; 8] {
        let blocks = W as u32 / 64;
        let mut v = [[0u32; 4]; 8];
        static_for::<2>(|cp| {
            if (cp as u32) < blocks / 2 {
                // This lane's row (key lane % 8, + 8 for matrices 1 and 3) and chunk (+ 1 for
                // matrices 2 and 3) from a 16-key group's first row (16-row steps keep the swizzle).
                let lane_at = e4m3_swizzled(TILE_KEYS, lane % 8 + 8 * ((lane / 8) % 2), 16 * (blocks * warp + 2 * cp as u32 + lane / 16));
                static_for::<2>(|ks| {
                    static_for::<2>(|u| {
                        let r = unsafe { ldmatrix_x4_trans(v_tile + (32 * ks as u32 + 16 * u as u32) * 128 + lane_at) };
                        static_for::<2>(|c| {
                            let b = blocks as usize * ks + 2 * cp + c;
                            v[b][2 * u] = byte_perm(r[2 * c], r[2 * c + 1], 0x6420);
                            v[b][2 * u + 1] = byte_perm(r[2 * c], r[2 * c + 1], 0x7531);
                        });
                    });
                });
            }
        });
        v
    }

    #[inline(always)]
    unsafe fn store_weights(p: u32, m: u32, n0: u32, w: [f32; 2]) {
        let (rows, col) = (8 * G as u32, e4m3_column_of(m));
        let pair = e4m3x2(w[0], w[1]);
        unsafe {
            st_shared_u8(p + e4m3_swizzled(rows, n0, col), pair);
            st_shared_u8(p + e4m3_swizzled(rows, n0 + 1, col), pair >> 8);
        }
    }

    #[inline(always)]
    unsafe fn pv(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8], _: u32, p: u32) {
        let desc_p = wgmma_desc(p, 16, 1024, true);
        if K::Fp8::E5M2 {
            unsafe { E5m2::pv_km::<W, G>(o, v, desc_p) }
        } else {
            unsafe { E4m3::pv_km::<W, G>(o, v, desc_p) }
        }
    }

    #[inline(always)]
    unsafe fn wait_pv(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8]) {
        unsafe { wait_pv_km::<W, G, true>(o, v) }
    }

    #[inline(always)]
    fn store_pair(b: u32, warp: u32, g: u32, at_g: f32, at_g8: f32) -> (u32, f32, f32) {
        (16 * (W as u32 / 64 * warp + b) + 2 * g, at_g, at_g8)
    }
}

/// 16-bit rows of the queries' type on 16-bit `wgmma`.
struct HalfRows;

impl<Q: MmaHalf + KeysOnMScores + KeysOnMValuesHalf, const W: usize, const G: usize> Operands<Q, W, G> for HalfRows {
    type Cache = Bits16;
    const QUANTISED: bool = false;
    const V_IN_REGISTERS: bool = false;
    const P_SHIFT: f32 = 0.0;
    const SLACK: f32 = 8.0;

    #[inline(always)]
    unsafe fn queries(live: u32, q_addr: impl Fn(u32) -> u64, head: u32, q: u32, _: u32) {
        let c = unsafe { QueryChunks::load::<W, G>(live, q_addr, head) };
        static_for::<4>(|x| {
            if (x as u32) < c.count {
                unsafe { st_shared_v4(q + e4m3_swizzled(8 * G as u32, c.n, 2 * c.col(x as u32)), c.v[x]) };
            }
        });
    }

    #[inline(always)]
    unsafe fn scores(desc_k: u64, desc_q: u64) -> [[f32; 4]; 2] {
        unsafe { Q::scores_km::<W, G>(desc_k, desc_q) }
    }

    #[inline(always)]
    unsafe fn values(_: u32, _: u32, _: u32) -> [[u32; 4]; 8] {
        [[0; 4]; 8]
    }

    #[inline(always)]
    unsafe fn store_weights(p: u32, m: u32, n0: u32, w: [f32; 2]) {
        let rows = 8 * G as u32;
        let pair = Q::pack2(w[0], w[1]);
        unsafe {
            st_shared_u16(p + e4m3_swizzled(rows, n0, 2 * m), pair);
            st_shared_u16(p + e4m3_swizzled(rows, n0 + 1, 2 * m), pair >> 16);
        }
    }

    /// V^T as A straight from the V rows, M-major: M block b (64 dimensions) is atom b of the
    /// rows (8 KB on), a k-step 16 keys (2 KB); the leading offset (between M blocks) unused.
    #[inline(always)]
    unsafe fn pv(o: &mut [[f32; 4]; 8], _: &[[u32; 4]; 8], v_tile: u32, p: u32) {
        let desc_v = wgmma_desc(v_tile, TILE_KEYS * 128, 1024, true);
        unsafe { Q::pv_km::<W, G>(o, desc_v, wgmma_desc(p, 16, 1024, true)) }
    }

    #[inline(always)]
    unsafe fn wait_pv(o: &mut [[f32; 4]; 8], v: &[[u32; 4]; 8]) {
        unsafe { wait_pv_km::<W, G, false>(o, v) }
    }

    /// M rows g and g + 8 are dimensions 8 apart: lanes of even g take their partner's (g + 1)
    /// value at row g, lanes of odd g the partner's (g - 1) at row g + 8, so that each stores
    /// two adjacent dimensions.
    #[inline(always)]
    fn store_pair(b: u32, warp: u32, g: u32, at_g: f32, at_g8: f32) -> (u32, f32, f32) {
        let odd = g % 2 == 1;
        let theirs = shfl_xor(if odd { at_g } else { at_g8 }, 4);
        let first = 64 * b + 16 * warp + (g & !1) + if odd { 8 } else { 0 };
        if odd {
            (first, theirs, at_g8)
        } else {
            (first, at_g, theirs)
        }
    }
}

/// The kernel: one CTA (one warpgroup) per (work item, kv head), planned as the keys-as-rows
/// kernels are; `W` the width, `G` column groups of 8 query rows (the N of both products is
/// `R = 8 G`), `O` the cache's operands.
#[inline(always)]
unsafe fn decode_keys_m<Q: MmaHalf, O: Operands<Q, W, G>, const W: usize, const G: usize, const R: u32>(p: &AttnParams) {
    // The query staging takes at most one 8-column chunk a thread where the rows have fewer
    // chunks than the threads (`QueryChunks`).
    const { assert!((G == 1 || G == 2) && R == 8 * G as u32 && W * G >= 64) };
    let row_bytes = W as u32 * O::Cache::ELEM_BYTES;
    // M blocks of O^T (64 head dimensions each).
    let blocks = W as u32 / 64;
    let tid = thread_idx_x();
    let (warp, lane) = (tid / 32, tid % 32);
    let (g, t4) = (lane / 4, lane % 4);
    pdl_launch_dependents();
    let Some(w) = (unsafe { work_item(p, R, W as u32) }) else {
        pdl_wait();
        return;
    };
    let keys = unsafe { WarpSlabs::of(p, &w, warp) };

    let head = p.dims.qk_or(W as u32);
    let l = layout(row_bytes, R, O::Cache::HALVES);
    let st = l.stages;
    let smem = shfl_idx(shared_addr(dynamic_shared::<u8>()), 0);
    let stage = |tile: u32| smem + l.ring + (tile % st) * 2 * TILE_KEYS * row_bytes;
    let filled = |tile: u32| smem + l.bars + 8 * (tile % st);
    // This warp's 16 rows of a stage's K plane.
    let slab_at = |tile: u32| stage(tile) + warp * WARP_KEYS * 128;
    let copy = unsafe { SlabCopy::<TileRows<O::Cache, W>, W>::new(p, &w, head) };
    let lookup = |tile: u32| unsafe { keys.block(p, &copy, tile) };

    // The queries, and what their staging and the cache's scales leave to the scores.
    let q_addr = |n: u32| {
        let row = unsafe { w.row(p, n) };
        p.qkv.q + (row.token as u64 * p.qkv.q_token_stride + row.head as u64 * p.qkv.q_head_stride) * 2
    };
    unsafe { O::queries(w.live, q_addr, head, smem + l.q, smem + l.dequant) };
    if tid == 0 {
        static_for::<6>(|b| {
            if (b as u32) < st {
                unsafe { mbarrier::init(smem + l.bars + 8 * b as u32, THREADS) };
            }
        });
    }
    let (k_scale, v_scale) = unsafe { O::Cache::scales(p, w.kv_head) };
    let logits = Logits::new(p, p.variant.scale_log2 * k_scale, keys.end);
    let mult = logits.mult();
    // This thread's rows of each column group (N columns 8c + 2t4, + 1).
    let rows: [[RowInfo; 2]; G] =
        core::array::from_fn(|c| unsafe { [w.row(p, 8 * c as u32 + 2 * t4), w.row(p, 8 * c as u32 + 2 * t4 + 1)] });

    // What is read before waiting for the kernel before (the cache write): the work item, block
    // ids, queries and the rows of the context before the new tokens (`fresh`); the new
    // tokens' rows and every write come after the wait (as the keys-as-rows kernels).
    let fresh = w.seq_len.saturating_sub(w.q_len);
    let mut waited = false;
    let mut bad_ring = 0u32;
    let mut any_bad = false;
    // Copies this warp's slab of `tile` (every tile's, past the keys too: the rows the
    // products read must be finite, so they are zero-filled), then arrives at its stage's
    // barrier when they land.
    let mut issue = |tile: u32, block: u32, bad_ring: &mut u32| {
        if tile < keys.n_tiles {
            let kb = keys.key(tile);
            if !waited && kb + WARP_KEYS > fresh {
                pdl_wait();
                waited = true;
            }
            // Past the keys nothing is read (every row zero-filled) and nothing is bad.
            let past = kb >= keys.end;
            let bad = unsafe { copy.copy(p, kb, if past { 0 } else { block }, keys.end, slab_at(tile)) } && !past;
            let bit = 1 << (tile % st);
            *bad_ring = if bad { *bad_ring | bit } else { *bad_ring & !bit };
            any_bad |= bad;
            // Committed as a group (as MLA's narrow kernel does), tracked by the stage's barrier.
            cp_async_commit();
            unsafe { mbarrier::arrive_when_copies_land(filled(tile)) };
        }
    };
    fence_proxy_async_shared();
    sync_threads();
    let mut ahead = [lookup(0), lookup(1)];
    let mut next_lookup = 2;
    let mut issued = 0;
    while issued < st {
        let block = ahead[0];
        ahead = [ahead[1], lookup(next_lookup)];
        next_lookup += 1;
        issue(issued, block, &mut bad_ring);
        issued += 1;
    }

    let dequant: [[f32; 2]; G] = core::array::from_fn(|c| {
        core::array::from_fn(|h| {
            if O::QUANTISED {
                unsafe { ld_shared_f32(smem + l.dequant + 4 * (8 * c as u32 + 2 * t4 + h as u32)) }
            } else {
                1.0
            }
        })
    });
    let desc_q = wgmma_desc(smem + l.q, 16, 1024, true);
    let mut state = [[OnlineSoftmax::EMPTY; 2]; G];
    let mut o = [[0.0f32; 4]; 8];
    let maxima = smem + l.maxima;
    // The copy a step leaves to the next one (tile, block id), where V^T is read from the stage.
    let mut pending: Option<(u32, u32)> = None;

    let mut tile = 0;
    while tile < keys.n_tiles {
        unsafe {
            mbarrier::wait(filled(tile), (tile / st) & 1);
            fence_proxy_async_shared();
        }
        // Broadcast from lane 0: the same address, but `ptxas` then knows it is warp-uniform and
        // keeps more of the descriptors built from it in uniform registers (16-bit d128: 36
        // moves into them a tile instead of 51; FP8: 19 either way).
        let k_tile = shfl_idx(stage(tile), 0);
        let s = unsafe { O::scores(wgmma_desc(k_tile, 16, 1024, true), desc_q) };
        // The block id of the copy this step issues (tile + st), and the lookup after it.
        let block = ahead[0];
        ahead = [ahead[1], lookup(next_lookup)];
        next_lookup += 1;
        let mut s = unsafe { wait_scores_km::<G>(s) };
        let v_tile = k_tile + TILE_KEYS * row_bytes;
        let v = unsafe { O::values(v_tile, warp, lane) };

        // True scores, the variant's logits and masks (this warp's slab: keys kb + g, + 8).
        let kb = keys.key(tile);
        let bad = bad_ring & (1 << (tile % st)) != 0;
        let mut m = [[f32::NEG_INFINITY; 2]; G];
        static_for::<G>(|c| {
            if O::QUANTISED {
                static_for::<4>(|e| s[c][e] *= dequant[c][e % 2]);
            }
            logits.apply_keys_rows(&mut s[c], &rows[c], kb, keys.pos, bad);
            // Each row's max over the warp's 16 keys.
            static_for::<2>(|h| m[c][h] = s[c][h].max(s[c][h + 2]));
        });
        static_for::<3>(|x| static_for::<G>(|c| static_for::<2>(|h| m[c][h] = m[c][h].max(shfl_xor(m[c][h], 4 << x)))));
        if g == 0 {
            static_for::<G>(|c| {
                static_for::<2>(|h| unsafe { st_shared_f32(maxima + (4 * (8 * c as u32 + 2 * t4 + h as u32) + warp) * 4, m[c][h]) });
            });
        }
        sync_threads();
        // V^T read from the stage: every warp's product of the tile before has retired (each
        // waits for it before this barrier), so its stage takes its copy now.
        if !O::V_IN_REGISTERS {
            if let Some((t, b)) = pending.take() {
                issue(t, b, &mut bad_ring);
            }
        }
        // The tile's max of each row (the four warps'); a row's max moves (and O with it) only
        // when the tile's rises more than `SLACK` past it.
        let mut tile_max = [[f32::NEG_INFINITY; 2]; G];
        let mut grows = false;
        static_for::<G>(|c| {
            static_for::<2>(|h| {
                let all = unsafe { ld_shared_v4(maxima + 4 * (8 * c as u32 + 2 * t4 + h as u32) * 4) };
                tile_max[c][h] = all.iter().fold(f32::NEG_INFINITY, |a, &x| a.max(f32::from_bits(x))) * mult;
                grows |= tile_max[c][h] > state[c][h].max + O::SLACK;
            });
        });
        if vote_any(grows) {
            static_for::<G>(|c| {
                static_for::<2>(|h| {
                    let factor = if tile_max[c][h] > state[c][h].max + O::SLACK { state[c][h].rescale_to(tile_max[c][h]) } else { 1.0 };
                    static_for::<4>(|b| {
                        if (b as u32) < blocks {
                            o[G * b + c][h] *= factor;
                            o[G * b + c][h + 2] *= factor;
                        }
                    });
                });
            });
        }
        // The weights, times 2^P_SHIFT, into P^T (rows: query rows; columns: the keys).
        static_for::<G>(|c| {
            static_for::<2>(|kh| {
                let mut wts = [0.0f32; 2];
                static_for::<2>(|h| {
                    let st = &mut state[c][h];
                    let neg = if st.max == f32::NEG_INFINITY { 0.0 } else { O::P_SHIFT - st.max };
                    let x = s[c][2 * kh + h];
                    let wt = if x == f32::NEG_INFINITY { 0.0 } else { exp2(x * mult + neg) };
                    st.sum += wt;
                    wts[h] = wt;
                });
                unsafe { O::store_weights(smem + l.p, WARP_KEYS * warp + g + 8 * kh as u32, 8 * c as u32 + 2 * t4, wts) };
            });
        });
        fence_proxy_async_shared();
        sync_threads();
        unsafe { O::pv(&mut o, &v, v_tile, smem + l.p) };
        // V^T in registers: this tile's stage is free (S^T retired, every warp past the
        // barrier), and the copy of tile + st goes there now; else after the next step's first
        // barrier (above).
        if O::V_IN_REGISTERS {
            issue(issued, block, &mut bad_ring);
        } else {
            pending = Some((issued, block));
        }
        // Retired before the loop's back edge: with a chain in flight across it, `ptxas`
        // serialised every chain (C7514), as in the prefill kernels.
        unsafe { O::wait_pv(&mut o, &v) };
        issued += 1;
        tile += 1;
    }
    cp_async_wait::<0>();
    if !waited {
        pdl_wait();
    }
    if any_bad && lane == 0 {
        unsafe { atomic_or_global(p.status, BLOCK_OUT_OF_RANGE) };
    }

    // Each row's sum: over the warp's lanes that share it, then the four warps' through the
    // maxima's words (every warp past the loop first).
    let mut sum = [[0.0f32; 2]; G];
    static_for::<G>(|c| {
        static_for::<2>(|h| {
            sum[c][h] = state[c][h].sum;
            static_for::<3>(|x| sum[c][h] += shfl_xor(sum[c][h], 4 << x));
        });
    });
    sync_threads();
    if g == 0 {
        static_for::<G>(|c| {
            static_for::<2>(|h| unsafe { st_shared_f32(maxima + (4 * (8 * c as u32 + 2 * t4 + h as u32) + warp) * 4, sum[c][h]) });
        });
    }
    sync_threads();
    let num_splits = unsafe { w.num_splits(p) };
    static_for::<G>(|c| {
        static_for::<2>(|h| {
            let n = 8 * c as u32 + 2 * t4 + h as u32;
            // Every lane takes its pairs (they may come from other lanes), then the live rows
            // are stored.
            let mut pairs = [(0u32, 0.0f32, 0.0f32); 4];
            static_for::<4>(|b| {
                if (b as u32) < blocks {
                    let acc = o[G * b + c];
                    pairs[b] = O::store_pair(b as u32, warp, g, acc[h], acc[2 + h]);
                }
            });
            if n >= w.live {
                return;
            }
            let all = unsafe { ld_shared_v4(maxima + 4 * n * 4) };
            // P's scale: its max carries the 2^P_SHIFT back out.
            let total = OnlineSoftmax { max: state[c][h].max - O::P_SHIFT, sum: all.iter().fold(0.0, |a, &x| a + f32::from_bits(x)) };
            let out = unsafe { RowOut::new(p, &w, &rows[c][h], total, num_splits, warp == 0 && g == 0, v_scale, p.dims.v_or(W as u32)) };
            static_for::<4>(|b| {
                if (b as u32) < blocks {
                    let (col, x, y) = pairs[b];
                    unsafe { out.store_pair::<Q>(col, x, y) };
                }
            });
        });
    });
    if num_splits > 1 && p.schedule.merge_counters != 0 {
        // The maxima's words are free after a barrier (`merge_item_splits` starts with one):
        // the first carries the "last to arrive" flag.
        unsafe { merge_item_splits::<Q, W, R>(p, &w, num_splits, maxima) };
    }
}

/// An FP8 cache (`decode_km_<q><fp8>[_r16]_d<128|256>`): `K` the cache rows, `W` the width,
/// `G` column groups of 8 rows, `R = 8 G` rows a CTA.
#[inline(always)]
pub unsafe fn decode_keys_m_fp8<Q: MmaHalf, K: CacheFormat, const W: usize, const G: usize, const R: u32>(p: &AttnParams) {
    // e4m3 `wgmma` reads the cache's bytes as they are: the scales must be the cache's own
    // (`hw_fp8`, as on every sm_90a build, converts without a factor).
    const { assert!((W == 128 || W == 256) && K::Fp8::UNPACK_SCALE == 1.0) };
    unsafe { decode_keys_m::<Q, Fp8Rows<K>, W, G, R>(p) }
}

/// A 16-bit cache of the queries' type (`decode_km_<q>[_r16]_d<64|128>`): `G` column groups of 8
/// rows, `R = 8 G` rows a CTA (8 rows at width 64 only).
#[inline(always)]
pub unsafe fn decode_keys_m_half<Q: MmaHalf + KeysOnMScores + KeysOnMValuesHalf, const W: usize, const G: usize, const R: u32>(
    p: &AttnParams,
) {
    const { assert!((W == 64 || W == 128) && (G == 2 || W == 64)) };
    unsafe { decode_keys_m::<Q, HalfRows, W, G, R>(p) }
}
