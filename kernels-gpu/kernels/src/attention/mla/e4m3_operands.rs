//! What the e4m3 kernels ([`super::narrow_e4m3`], [`super::wide_e4m3`]) do the same way around
//! their products: the queries quantised to e4m3 in shared memory, the rows' addresses looked up
//! into a tile's table, a tile's rows copied into the ring, V^T's A fragments taken from the
//! rows, and the masks of a tile that crosses a boundary. The kernels differ in which rows and
//! tiles a thread takes, so each passes those; the instructions are the same.

use super::keys::KeySource;
use super::narrow_e4m3::TILE;
use crate::blocks::device::{shfl_xor, static_for, vote_any};
use crate::blocks::mbarrier;
use crate::blocks::mma::{
    byte_perm, cp_async_16, cp_async_commit, ld_shared_u64, ldmatrix_x4_trans, st_shared_f32, st_shared_u32, st_shared_u64, MmaHalf,
};
use crate::blocks::vec_io::{e4m3x2, load8_nc, load_f32_nc};
use attn_math::fp8::E4M3_MAX;
use attn_math::mla::e4m3_swizzled;
use attn_math::params::AttnParams;
use attn_math::prefill::MLA_QK;

/// `$body` with `$f` the cache's FP8 format `$k::Fp8` as the type the e4m3 chains
/// (`NarrowFp8Chains`, `WideFp8Chains`) are implemented for: `CacheFormat::Fp8` is bound only by
/// `Fp8Format`. The test is a constant, so one branch is compiled.
macro_rules! with_fp8_chains {
    ($k:ty, $f:ident => $body:expr) => {
        if <<$k as crate::attention::config::CacheFormat>::Fp8 as crate::blocks::elem::Fp8Format>::E5M2 {
            type $f = crate::blocks::elem::E5m2;
            $body
        } else {
            type $f = crate::blocks::elem::E4m3;
            $body
        }
    };
}
pub(super) use with_fp8_chains;

/// Query row `n` (0 when not `live`), quantised to e4m3 into the `rows`-row swizzled Q at `q`
/// with one scale a row (its largest magnitude to 448), by 16 threads (`sub` of them), 4
/// columns at a time. The row's first thread stores its score factor at `mult + 4 n`: the
/// softmax's base-2 scale times K's FP8 scale over the row's (e4m3 `wgmma` reads the cache's
/// bytes as they are).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn quantise_query_row<Q: MmaHalf>(p: &AttnParams, n: u32, sub: u32, live: bool, row: u64, q: u32, rows: u32, mult: u32) {
    let mut v = [[0u32; 2]; 9];
    let mut amax = 0.0f32;
    static_for::<9>(|x| {
        if live {
            v[x] = unsafe { load8_nc(row + (4 * (sub + 16 * x as u32)) as u64 * 2) };
        }
        static_for::<2>(|h| {
            let (a, b) = Q::unpack2(v[x][h]);
            amax = amax.max(a.abs()).max(b.abs());
        });
    });
    static_for::<4>(|i| amax = amax.max(shfl_xor(amax, 1 << i)));
    let scale = if amax > 0.0 { E4M3_MAX / amax } else { 1.0 };
    static_for::<9>(|x| {
        let (a, b) = Q::unpack2(v[x][0]);
        let (c, d) = Q::unpack2(v[x][1]);
        let packed = e4m3x2(a * scale, b * scale) | e4m3x2(c * scale, d * scale) << 16;
        let col = 4 * (sub + 16 * x as u32);
        unsafe { st_shared_u32(q + e4m3_swizzled(rows, n, col), packed) };
    });
    if sub == 0 {
        let k_scale = unsafe { load_f32_nc(p.fp8.k_scale) };
        unsafe { st_shared_f32(mult + 4 * n, p.variant.scale_log2 * k_scale / scale) };
    }
}

/// The three steps of a key's address lookup ([`KeySource`]) for the lanes that look keys up
/// (`ok`), keys past `end` not looked up.
#[derive(Clone, Copy)]
pub(super) struct Lookups<'a, S: KeySource> {
    pub p: &'a AttnParams,
    pub src: S,
    pub end: u32,
}

impl<S: KeySource> Lookups<'_, S> {
    /// The first step, two copies ahead.
    #[inline(always)]
    pub fn early(&self, key: u32, ok: bool) -> S::Early {
        if ok && key < self.end {
            unsafe { self.src.early(self.p, key) }
        } else {
            S::NO_EARLY
        }
    }

    /// The second step, a copy ahead.
    #[inline(always)]
    pub fn locate(&self, key: u32, ok: bool, e: S::Early) -> S::Loc {
        if ok && key < self.end {
            unsafe { self.src.locate(self.p, key, e) }
        } else {
            S::NO_LOC
        }
    }

    /// The key's entry of a tile's table (its row's address, 0 when not read) at `entry`, and
    /// from lane 0 whether any key of the warp's 32 is skipped, at `flag`. Before the copy, by
    /// the lanes that look keys up only (the caller's branch keeps the addresses inside it).
    #[inline(always)]
    pub fn fill(&self, key: u32, loc: S::Loc, entry: u32, flag: u32, lane: u32) {
        let ka = if key < self.end { unsafe { self.src.address(self.p, key, loc, 1) } } else { 0 };
        unsafe { st_shared_u64(entry, ka) };
        let any_skipped = vote_any(key < self.end && ka == 0);
        if lane == 0 {
            unsafe { st_shared_u32(flag, any_skipped as u32) };
        }
    }
}

/// Copy 16 `R` rows of a tile, whose addresses are in its `table`, into its buffer `buf`: thread
/// `t` of a warpgroup takes rows `row0 + t / 8 + 16 r`, chunks `t % 8 + 8 a` (atom a), so that a
/// warp copies 128 contiguous bytes of each of 4 rows an instruction. The copies complete the
/// buffer's phase at `filled` (an arrival for each thread as they land, and thread 0's, whose
/// release publishes the table its warpgroup wrote before its barrier). A warpgroup barrier
/// must separate the table's writes from this.
#[inline(always)]
pub(super) unsafe fn copy_tile_rows<const R: usize>(p: &AttnParams, table: u32, buf: u32, row0: u32, t: u32, filled: u32) {
    let c = t % 8;
    static_for::<R>(|r| {
        let row = row0 + t / 8 + 16 * r as u32;
        let at = unsafe { ld_shared_u64(table + row * 8) };
        let (from, bytes) = if at != 0 { (at + 16 * c as u64, 16) } else { (p.qkv.q, 0) };
        static_for::<5>(|a| {
            let col = 16 * c + 128 * a as u32;
            if col < MLA_QK {
                let to = buf + e4m3_swizzled(TILE, row, col);
                // A zero-filled chunk (`bytes` 0) reads nothing: its address is never used,
                // and one base a row keeps the offsets immediate.
                unsafe { cp_async_16(to, from + 128 * a as u64, bytes) };
            }
        });
    });
    cp_async_commit();
    unsafe {
        mbarrier::arrive_when_copies_land(filled);
        if t == 0 {
            mbarrier::arrive(filled);
        }
    }
}

/// This lane's `ldmatrix` row (key lane % 8, + 8 for matrices 1 and 3) and chunk (2 cp, + 1 for
/// matrices 2 and 3) in atom `warp`, from a 16-key group's first row (16-row steps keep the
/// swizzle: they add), for [`v_fragments`].
#[inline(always)]
pub(super) fn v_lanes(warp: u32, lane: u32) -> [u32; 4] {
    core::array::from_fn(|cp| e4m3_swizzled(TILE, lane % 8 + 8 * ((lane / 8) % 2), 128 * warp + 16 * (2 * cp as u32 + lane / 16)))
}

/// V^T's A fragments of keys `32 ks ..` of the tile at `tile` into `v[first..first + 8]`, from
/// `ldmatrix.trans` of the rows as 16-bit pairs: matrices (keys 16 x .. + 7, chunk c) and (keys
/// 16 x + 8 .., chunk c) give lane (g, t4) columns 2g, 2g + 1 of the chunk for keys 2t4, 2t4 + 1
/// and 8 + 2t4, 9 + 2t4 of the 16, which one `prmt` each takes apart into the two columns'
/// registers, keys in `attn_math::mla::e4m3_rho`'s order. Chunk b of atom `warp` is M block b
/// (M rows g, g + 8 of this warp: columns 2g and 2g + 1).
#[inline(always)]
pub(super) unsafe fn v_fragments<const N: usize>(tile: u32, ks: u32, v_lane: &[u32; 4], v: &mut [[u32; 4]; N], first: usize) {
    static_for::<2>(|u| {
        static_for::<4>(|cp| {
            let r = unsafe { ldmatrix_x4_trans(tile + (32 * ks + 16 * u as u32) * 128 + v_lane[cp]) };
            static_for::<2>(|c| {
                let b = first + 2 * cp + c;
                v[b][2 * u] = byte_perm(r[2 * c], r[2 * c + 1], 0x6420);
                v[b][2 * u + 1] = byte_perm(r[2 * c], r[2 * c + 1], 0x7531);
            });
        });
    });
}

/// Scores of keys that are not visible set to -inf, in a tile whose first key is `first`: keys
/// at or past `end`, past the row's position `pos(r)` (state index r), and, where the tile's
/// flags say some are (`has_bad`), keys whose table entry is 0. Key of `s[j][e]`:
/// `16 warp + g + 8 (e >> 1)`, row `2 j + (e & 1)`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) fn mask_scores<const J: usize>(
    s: &mut [[f32; 4]; J],
    first: u32,
    end: u32,
    has_bad: bool,
    table: u32,
    warp: u32,
    g: u32,
    pos: impl Fn(usize) -> u32,
) {
    static_for::<J>(|j| {
        static_for::<4>(|e| {
            let m = 16 * warp + g + 8 * (e as u32 >> 1);
            let key = first + m;
            let pos = pos(2 * j + (e & 1));
            let visible = key < end && key <= pos && (!has_bad || unsafe { ld_shared_u64(table + m * 8) } != 0);
            if !visible {
                s[j][e] = f32::NEG_INFINITY;
            }
        });
    });
}
