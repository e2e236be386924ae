//! Launch geometry of the MLA latent-attention kernels (`mla_<q>_{narrow,wide}`), shared by the
//! kernel and the host.
//!
//! A CTA of 8 warps takes `block_m` query rows (heads x query tokens) of one request against
//! key tiles of `block_n` latent rows. Q K^T is computed once per tile and P is shared: each
//! tile is two phases with different warp grids over the same CTA,
//! - *scores*: the `block_m x block_n` score tile is cut into `s_row_tiles` 16-row tiles times
//!   `WARPS / s_row_tiles` key groups; a warp computes its part of S over all 576 columns,
//!   publishes its rows' maxima, and (after a barrier) writes its weights P to shared memory;
//! - *values*: the `block_m x 512` output is cut into `pv_row_groups` row groups times
//!   `WARPS / pv_row_groups` column groups; a warp keeps its part of O in registers and adds
//!   P V, V being the first 512 columns of the same shared K tile.
//!
//! Every warp derives the running max of the rows it needs from the published maxima with the
//! same operations, so the rescale factors agree without another exchange; the denominators are
//! summed per key group and added up once at the end.
//!
//! Keys arrive in slots of 32 rows through a ring of slot buffers (a tile is one or two slots).
//! Two shapes: *narrow* (16 rows: up to 16 heads x 1 token; memory-bound: 64-key tiles, a ring
//! of 5 slots so that 3 are in flight during a tile's math; each warp 8 keys and 64 output
//! columns) and *wide* (64 rows: compute-bound: 64-key tiles, a ring of 4 (two slots in flight);
//! each warp 16 x 32 scores and 32 x 128 outputs, or on sm_90a each warpgroup 64 x 32 scores and
//! 64 x 256 outputs on `wgmma`).

use crate::prefill::{MLA_QK, MLA_V};

pub const THREADS: u32 = 256;
pub const WARPS: u32 = THREADS / 32;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaShape {
    pub block_m: u32,
    /// Keys per tile of math: one or two slots of [`SLOT_KEYS`].
    pub block_n: u32,
    /// Slot buffers in the copy ring: while a tile is computed, `ring - block_n / SLOT_KEYS`
    /// slots are in flight.
    pub ring: u32,
    /// 16-row tiles of the score phase's warp grid (the rest of the warps split the keys).
    pub s_row_tiles: u32,
    /// Row groups of the value phase's warp grid (the rest of the warps split the columns).
    pub pv_row_groups: u32,
    /// FP8 caches: the math reads its fragments from the raw rows and converts them in
    /// registers (narrow); otherwise each tile's slots are first converted into 16-bit slots in
    /// shared memory (wide: `wgmma` reads its operands from there).
    pub fp8_in_registers: bool,
}

impl MlaShape {
    /// Key groups of the score phase.
    pub const fn key_groups(self) -> u32 {
        WARPS / self.s_row_tiles
    }
    /// Keys of a tile one warp scores.
    pub const fn keys_per_warp(self) -> u32 {
        self.block_n / self.key_groups()
    }
    /// Column groups of the value phase.
    pub const fn col_groups(self) -> u32 {
        WARPS / self.pv_row_groups
    }
    /// Output columns one warp accumulates.
    pub const fn cols_per_warp(self) -> u32 {
        MLA_V / self.col_groups()
    }
    /// 16-row tiles one warp accumulates.
    pub const fn pv_row_tiles(self) -> u32 {
        self.block_m / self.pv_row_groups / 16
    }
    /// Slots per tile.
    pub const fn slots_per_tile(self) -> u32 {
        self.block_n / SLOT_KEYS
    }
    /// Address tables alive at once: the ring's, and those filled a tile ahead.
    pub const fn tables(self) -> u32 {
        self.ring + self.slots_per_tile()
    }
}

/// Keys per copy slot: the unit of the `cp.async` pipeline (one commit group, one address
/// table filled by one warp).
pub const SLOT_KEYS: u32 = 32;
/// Bytes of a slot's address table: a u64 row address per key, then the slot's flag (non-zero
/// when a key's block is outside the cache), padded to 16 bytes.
pub const TABLE_BYTES: u32 = SLOT_KEYS * 8 + 16;

pub const NARROW: MlaShape = MlaShape { block_m: 16, block_n: 64, ring: 5, s_row_tiles: 1, pv_row_groups: 1, fp8_in_registers: true };
pub const WIDE: MlaShape = MlaShape { block_m: 64, block_n: 64, ring: 4, s_row_tiles: 4, pv_row_groups: 2, fp8_in_registers: false };

/// The shape for requests of up to `rows` query rows (heads x query tokens): narrow up to 16
/// rows (one tile; more would re-read every K tile per 16 rows), else wide.
pub const fn shape_for_rows(rows: u32) -> MlaShape {
    if rows <= NARROW.block_m {
        NARROW
    } else {
        WIDE
    }
}

/// Byte offsets in dynamic shared memory: Q (`block_m` rows) and the ring of K slots
/// (`SLOT_KEYS` rows each) in the [`swizzled`] layout, P (`block_m x block_n`, 16-bit, in the
/// [`p_offset`] layout), the published row maxima `[key_groups][block_m]` f32 (reused for the
/// denominators at the end), the slots' address tables. FP8 caches: the ring holds the raw rows
/// (576 bytes each, in the [`raw_offset`] layout); unless the shape converts in registers, each
/// tile's slots are converted into `converted` (16-bit, [`swizzled`]) before its math. The wide
/// shape takes as many bytes for either cache (the host sizes its launch without knowing
/// whether the module's kernel takes the seesaw order, [`seesaw_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MlaLayout {
    pub q: u32,
    pub k: u32,
    pub k_slot: u32,
    /// FP8 converted in shared memory: the tile's 16-bit slots (`slots_per_tile` x
    /// `converted_slot` bytes); else unused (no bytes).
    pub converted: u32,
    pub converted_slot: u32,
    pub p: u32,
    /// Bytes between P's 8-row groups.
    pub p_group: u32,
    pub row_max: u32,
    pub table: u32,
    pub total: u32,
}

/// 16-byte chunks of a 576-wide row.
pub const ROW_CHUNKS: u32 = MLA_QK / 8;
/// 16-byte chunks of a 576-wide FP8 row.
pub const RAW_CHUNKS: u32 = MLA_QK / 16;
/// Bytes of a group of 8 rows in the [`swizzled`] layout.
pub const GROUP_BYTES: u32 = 8 * MLA_QK * 2;

/// Byte offset of (row, 16-byte chunk) in the layout of Q and K rows in shared memory: groups of
/// 8 rows (`GROUP_BYTES` apart), each 9 atoms of 8 rows x 128 bytes (1024 bytes, one per 64
/// columns); within an atom, row r's chunk c sits at chunk `c ^ r`. It is Hopper `wgmma`'s
/// K-major layout with 128-byte swizzling (atoms 1024-byte aligned; groups `GROUP_BYTES` apart
/// along M/N), every `ldmatrix` (8 rows of one chunk) reads 8 bank groups, and each 128 bytes
/// of a row stay 128 contiguous bytes, so the copies coalesce on both sides.
pub const fn swizzled(row: u32, chunk: u32) -> u32 {
    (row / 8) * GROUP_BYTES + (chunk / 8) * 1024 + (row % 8) * 128 + ((chunk % 8) ^ (row % 8)) * 16
}

/// Byte offset of (row, 16-byte chunk) of an FP8 slot's raw rows: row after row (576 bytes,
/// 36 chunks), chunk `c` of row `r` at chunk `c ^ (r & 6)` (`c ^ (r & 2)` for the last four, the
/// rope part, whose group of 8 is half a row). The narrow shape's fragment loads are then free of
/// bank conflicts: a score load (8 threads: rows `2m, 2m + 1`, chunks `4j + t` of four threads
/// `t`) covers the 8 bank groups, and so does a value load (16 threads: rows `r0 + 2t`, with
/// `r0 % 8` 0 or 1, times two chunks of a 4-chunk group).
pub const fn raw_offset(row: u32, chunk: u32) -> u32 {
    row * MLA_QK + raw_chunk(row, chunk) * 16
}

/// Where chunk `chunk` of row `row` sits among the row's chunks in the [`raw_offset`] layout;
/// its own inverse (the chunk that sits at a place).
pub const fn raw_chunk(row: u32, chunk: u32) -> u32 {
    let flip = if chunk < RAW_CHUNKS / 8 * 8 { row & 6 } else { row & 2 };
    chunk ^ flip
}

/// Byte offset of P's (row, key), `p_group` bytes between 8-row groups: 8 x 8 "core matrices"
/// of 128 contiguous bytes, consecutive along the keys (`wgmma`'s no-swizzle K-major layout:
/// leading offset 128, stride `p_group`). Every `ldmatrix` (one core matrix) and every warp's
/// 4-byte stores of its score fragments are free of bank conflicts.
pub const fn p_offset(row: u32, key: u32, p_group: u32) -> u32 {
    (row / 8) * p_group + (key / 8) * 128 + (row % 8) * 16 + (key % 8) * 2
}

pub const fn shared_layout(s: MlaShape, fp8: bool) -> MlaLayout {
    let q = 0;
    let converted_slot = SLOT_KEYS * MLA_QK * 2;
    // 1024-byte aligned (the swizzle atoms): Q and the 16-bit slots first.
    let converted = q + s.block_m * MLA_QK * 2;
    let separate = fp8 && !s.fp8_in_registers;
    let k = if separate { converted + s.slots_per_tile() * converted_slot } else { converted };
    let k_slot = if fp8 { SLOT_KEYS * MLA_QK } else { converted_slot };
    let p = k + s.ring * k_slot;
    let p_group = s.block_n * 16;
    let row_max = p + s.block_m * s.block_n * 2;
    let table = row_max + s.key_groups() * s.block_m * 4;
    let total = table + s.tables() * TABLE_BYTES;
    MlaLayout { q, k, k_slot, converted, converted_slot, p, p_group, row_max, table, total }
}

/// The wide shape's seesaw order (sm_90a: `mla::seesaw` in the kernels): the two
/// warpgroups take alternate 64-key tiles, each tile in its own half of the ring (two slots,
/// 8-row groups [`GROUP_BYTES`] apart), and a tile's weights P overwrite its rope columns (the
/// last atom of each 8-row group: 64 x 64 16-bit, read by `wgmma` as a 128-byte-swizzled
/// K-major tile), which only its Q K^T reads. The rest of [`shared_layout`]`(WIDE, false)` is
/// reused: Q and the ring where they are, P's region for the published row maxima and, at the
/// end, the row sums (each `[2][block_m]` f32), `tables` address tables and the warpgroups' six
/// `mbarrier`s (8 bytes each). 16-bit caches only (an FP8 one takes [`wide_e4m3_layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SeesawLayout {
    pub maxima: u32,
    pub sums: u32,
    pub table: u32,
    pub tables: u32,
    pub bars: u32,
    /// Bytes of one warpgroup's tile buffer (two slots).
    pub tile: u32,
    /// Where in a tile P starts: the rope atom of its first 8-row group.
    pub p: u32,
}

pub const fn seesaw_layout() -> SeesawLayout {
    let l = shared_layout(WIDE, false);
    // Four tiles' tables alive: each warpgroup's current tile and the one it fills next.
    let (maxima, sums) = (l.p, l.p + 2 * WIDE.block_m * 4);
    let (table, tables) = (sums + 2 * WIDE.block_m * 4, 8);
    let (tile, p) = (2 * l.k_slot, (ROW_CHUNKS / 8 - 1) * 1024);
    SeesawLayout { maxima, sums, table, tables, bars: table + tables * TABLE_BYTES, tile, p }
}

/// The narrow shape over an FP8 cache on sm_90a (`mla::narrow_e4m3` in the kernels): e4m3
/// `wgmma` with the operands swapped, so that a 64-key tile's keys are M (64) and the 16 query
/// rows are N: S^T = K Q^T (K from its rows in shared memory, the queries quantised to e4m3),
/// O^T += V^T P^T (V^T as A fragments in registers, byte-transposed from the same rows, P^T
/// e4m3 in shared memory). Each of the two warpgroups takes alternate tiles with a softmax
/// state and a ring of its own (two tiles), and the two are merged at the end.
///
/// Layout: the quantised queries (16 rows of 640 bytes as five 128-byte-swizzled atoms of 16
/// rows x 128 bytes, [`e4m3_swizzled`]), the ring of [`E4M3_RING`] tiles (64 rows, five atoms
/// of 64 rows x 128 bytes), each warpgroup's P^T (16 rows x 128 bytes, the first 64 used), the
/// row maxima published by its warps (`[16][4]` f32), the rows' score factors (16 f32),
/// [`E4M3_TABLES`] address tables (a tile's 64 entries and two flags) and the `mbarrier`s: one
/// a ring buffer, then the final merge's two.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct NarrowE4m3Layout {
    pub q: u32,
    pub tiles: u32,
    pub p: u32,
    pub maxima: u32,
    pub mult: u32,
    pub tables: u32,
    pub bars: u32,
    pub total: u32,
}

/// Tile buffers of [`narrow_e4m3_layout`]'s ring: three in flight while each warpgroup works
/// on one.
pub const E4M3_RING: u32 = 5;
/// Address tables of [`narrow_e4m3_layout`]: tile t's is rewritten for tile t + 10, which its
/// writer copies once done with tile t + 5, itself copied only after tile t was done.
pub const E4M3_TABLES: u32 = 10;
/// The most CTAs (a request's splits) whose partial rows the e4m3 kernel combines in a
/// thread-block cluster: the combine holds every rank's two warpgroups' row states in
/// registers, 8 a row at 4 ranks. The host plans no larger cluster for it.
pub const E4M3_CLUSTER_RANKS: u32 = 4;
/// Bytes of a tile of 64 FP8 rows in the [`e4m3_swizzled`] layout (five atoms of 128 bytes a
/// row, the last half used).
pub const E4M3_TILE_BYTES: u32 = 5 * 64 * 128;
/// Bytes of an address table of [`NarrowE4m3Layout`]: 64 entries and two flags (padded).
pub const E4M3_TABLE_BYTES: u32 = 64 * 8 + 16;
// The final merge: each warpgroup's half of O^T for the other (`[8][128]` 16-byte entries) and
// its rows' states fit the buffer of its last tile.
const _: () = assert!(8 * 128 * 16 + 16 * 8 <= E4M3_TILE_BYTES);

/// Byte offset of (row, byte column `col`) of `rows` FP8 rows of 576 bytes in `wgmma`'s
/// 128-byte-swizzled K-major layout: atoms of `rows` x 128 bytes (`rows * 128` apart, one per
/// 128 columns), 8-row groups 1024 bytes apart, row r's 16-byte chunk c of an atom at `c ^ r`.
pub const fn e4m3_swizzled(rows: u32, row: u32, col: u32) -> u32 {
    (col / 128) * rows * 128 + row * 128 + (((col % 128) / 16) ^ (row % 8)) * 16 + col % 16
}

/// The tile row (key) whose weight column `k` of [`narrow_e4m3_layout`]'s P^T holds (`k` < 64),
/// and whose V bytes the A fragments' column `k` take: within each 16 columns, column `4a + b`
/// (a: the lane of a quad, b: the byte of its register) is row `2a + (b & 1) + 8 (b >> 1)`,
/// the keys `ldmatrix.trans` of the 16 rows as two 8-row matrices of 16-bit pairs hands lane a
/// of a quad (rows 2a, 2a + 1 of each), which one `prmt` puts in this order.
pub const fn e4m3_rho(k: u32) -> u32 {
    let (base, c) = (k & !15, k & 15);
    let (a, b) = (c / 4, c % 4);
    base + 2 * a + (b & 1) + 8 * (b >> 1)
}

/// The P^T column of tile row `m` (the inverse of [`e4m3_rho`]).
pub const fn e4m3_column_of(m: u32) -> u32 {
    let (base, r) = (m & !15, m & 15);
    base + 4 * ((r & 7) >> 1) + 2 * (r >> 3) + (r & 1)
}

pub const fn narrow_e4m3_layout() -> NarrowE4m3Layout {
    let q = 0;
    let tiles = q + 5 * 16 * 128;
    let p = tiles + E4M3_RING * E4M3_TILE_BYTES;
    let maxima = p + 2 * 16 * 128;
    let mult = maxima + 2 * 16 * 4 * 4;
    let tables = mult + 16 * 4;
    let bars = tables + E4M3_TABLES * E4M3_TABLE_BYTES;
    let total = bars + (E4M3_RING + 2) * 8;
    NarrowE4m3Layout { q, tiles, p, maxima, mult, tables, bars, total }
}

/// The wide shape (17 to 64 query rows) over an FP8 cache on sm_90a (`mla::wide_e4m3` in the
/// kernels): the narrow e4m3 kernel's operands (keys on M, the queries quantised to e4m3, V^T
/// from the rows in registers, P^T e4m3 in shared memory) with 32 query rows on N. Each
/// warpgroup takes 32 of the rows through every tile, with its own softmax state and O^T (all
/// 512 columns, 128 accumulators a thread); the two share only the tiles.
///
/// Layout: the quantised queries (64 rows of 640 bytes, five 128-byte-swizzled atoms of 64
/// rows, [`e4m3_swizzled`]), the ring of [`WIDE_E4M3_RING`] tiles ([`E4M3_TILE_BYTES`] each),
/// each warpgroup's P^T (32 rows x 128 bytes, the first 64 used), the row maxima (and at the
/// end the row sums) published by the warps (`[64][4]` f32), the rows' score factors (64 f32)
/// and positions (64 u32, for the causal mask), [`WIDE_E4M3_TABLES`] address tables and the
/// `mbarrier`s: a ring buffer's "filled", then its "freed".
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WideE4m3Layout {
    pub q: u32,
    pub tiles: u32,
    pub p: u32,
    pub maxima: u32,
    pub mult: u32,
    pub pos: u32,
    pub tables: u32,
    pub bars: u32,
    pub total: u32,
}

/// Tile buffers of [`wide_e4m3_layout`]'s ring (five do not fit beside the 64 query rows).
pub const WIDE_E4M3_RING: u32 = 4;
/// Address tables of [`wide_e4m3_layout`]: tile t's is written at tile t - 3's step of its
/// warpgroup and read at tile t's (the masks) by both; eight keep it from the writes between.
pub const WIDE_E4M3_TABLES: u32 = 8;
/// Bytes of a warpgroup's P^T in [`wide_e4m3_layout`].
pub const WIDE_E4M3_P_BYTES: u32 = 32 * 128;

pub const fn wide_e4m3_layout() -> WideE4m3Layout {
    let q = 0;
    let tiles = q + 5 * 64 * 128;
    let p = tiles + WIDE_E4M3_RING * E4M3_TILE_BYTES;
    let maxima = p + 2 * WIDE_E4M3_P_BYTES;
    let mult = maxima + 64 * 4 * 4;
    let pos = mult + 64 * 4;
    let tables = pos + 64 * 4;
    let bars = tables + WIDE_E4M3_TABLES * E4M3_TABLE_BYTES;
    let total = bars + 2 * WIDE_E4M3_RING * 8;
    WideE4m3Layout { q, tiles, p, maxima, mult, pos, tables, bars, total }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_tile_the_warps_and_fit_shared_memory() {
        for (s, fp8) in [(NARROW, false), (WIDE, false), (NARROW, true), (WIDE, true)] {
            assert_eq!(s.key_groups() * s.s_row_tiles, WARPS);
            assert_eq!(s.s_row_tiles * 16, s.block_m);
            assert!(s.keys_per_warp() % 8 == 0 && s.keys_per_warp() <= 32);
            assert_eq!(s.pv_row_tiles() * 16 * s.pv_row_groups, s.block_m);
            assert!(s.pv_row_tiles() <= 2 && s.cols_per_warp() % 16 == 0);
            assert!(s.block_n <= THREADS);
            let l = shared_layout(s, fp8);
            assert!(l.total <= 227 * 1024, "{s:?}: {}", l.total);
            assert!(s.block_n % SLOT_KEYS == 0 && s.ring > s.slots_per_tile());
            // One warp fills each table: the prologue fills `ring` of them.
            assert!(s.ring * 32 <= THREADS);
            for o in [l.k, l.k_slot, l.p, l.row_max, l.table] {
                assert!(o.is_multiple_of(16), "{s:?}: {l:?}");
            }
            // wgmma descriptors: Q and the slots 1024-byte aligned, addresses within 14 bits >> 4.
            assert!(l.converted.is_multiple_of(1024) && l.k_slot.is_multiple_of(16) && l.total < 1 << 18);
            assert!(fp8 || (l.k.is_multiple_of(1024) && l.k_slot.is_multiple_of(1024)));
        }
    }

    #[test]
    fn e4m3_columns_of_a_lane_pair() {
        // The wide e4m3 kernel's P^T words: keys m = 16 w + g and m + 8 of lane g sit in columns
        // c + g % 2 and c + 2 + g % 2 of c = 16 w + 4 (g / 2), so lanes g and g ^ 1 hold c..c + 3.
        for w in 0..4 {
            for g in 0..8 {
                let c = 16 * w + 4 * (g / 2);
                assert_eq!(e4m3_column_of(16 * w + g), c + g % 2);
                assert_eq!(e4m3_column_of(16 * w + g + 8), c + 2 + g % 2);
            }
        }
    }

    #[test]
    fn wide_e4m3_layout_fits() {
        let l = wide_e4m3_layout();
        assert!(l.total <= 227 * 1024, "{l:?}");
        // wgmma operands 1024-byte aligned (the queries' second half too: 32 rows of 128
        // bytes), the vector loads 16-byte aligned.
        for o in [l.q, l.tiles, l.p, E4M3_TILE_BYTES, WIDE_E4M3_P_BYTES, 32 * 128] {
            assert!(o.is_multiple_of(1024), "{l:?}");
        }
        for o in [l.maxima, l.mult, l.pos, l.tables, E4M3_TABLE_BYTES] {
            assert!(o.is_multiple_of(16), "{l:?}");
        }
        assert!(l.bars.is_multiple_of(8) && l.total < 1 << 18);
    }

    #[test]
    fn narrow_e4m3_layout_fits() {
        let l = narrow_e4m3_layout();
        assert!(l.total <= 227 * 1024);
        // wgmma operands 1024-byte aligned; the merge's exchange (two warpgroups' halves of O^T
        // and their row states) fits the tiles.
        for o in [l.q, l.tiles, l.p, E4M3_TILE_BYTES] {
            assert!(o.is_multiple_of(1024), "{l:?}");
        }
        assert!(l.maxima.is_multiple_of(16) && l.tables.is_multiple_of(16) && E4M3_TABLE_BYTES.is_multiple_of(16));
        assert!(l.bars.is_multiple_of(8));

        // The key permutation and its inverse; each 8-row matrix of an `ldmatrix` (8
        // consecutive keys, one 16-byte chunk) meets eight distinct 16-byte bank groups.
        for k in 0..64 {
            assert_eq!(e4m3_column_of(e4m3_rho(k)), k);
        }
        for (k0, c) in (0..8).flat_map(|k| (0..32).map(move |c| (8 * k, c))) {
            let banks: std::collections::HashSet<_> = (k0..k0 + 8).map(|r| (e4m3_swizzled(64, r, 16 * c) % 128) / 16).collect();
            assert_eq!(banks.len(), 8, "keys {k0}.., chunk {c}");
        }
        // Every byte of a row lands once, inside its atom.
        let mut seen = std::collections::HashSet::new();
        for r in 0..64 {
            for c in 0..MLA_QK {
                let o = e4m3_swizzled(64, r, c);
                assert!(o < E4M3_TILE_BYTES && seen.insert(o));
            }
        }
    }

    #[test]
    fn seesaw_layout_fits_the_wide_shape() {
        let (l, s) = (shared_layout(WIDE, false), seesaw_layout());
        // Maxima and tables inside P's region, which the seesaw order does not use.
        assert!(s.maxima >= l.p && s.sums >= s.maxima + 2 * WIDE.block_m * 4 && s.table >= s.sums + 2 * WIDE.block_m * 4);
        assert!(s.table + s.tables * TABLE_BYTES <= s.bars && s.table.is_multiple_of(16));
        assert!(s.bars.is_multiple_of(8) && s.bars + 6 * 8 <= l.row_max);
        // Two tiles fill the ring; the rope atom is the ninth of a group and holds 64 keys of P.
        assert_eq!(2 * s.tile, WIDE.ring * l.k_slot);
        assert_eq!(s.p, swizzled(0, MLA_V / 8));
        assert_eq!(swizzled(7, ROW_CHUNKS - 8) + 16 - s.p, 1024);
        assert_eq!(MLA_QK - MLA_V, WIDE.block_n);
    }

    #[test]
    fn raw_layout_is_a_bijection_onto_each_row() {
        for r in 0..SLOT_KEYS {
            let mut seen = [false; RAW_CHUNKS as usize];
            for c in 0..RAW_CHUNKS {
                assert_eq!(raw_chunk(r, raw_chunk(r, c)), c);
                let o = raw_offset(r, c) - r * MLA_QK;
                assert!(o < MLA_QK && !std::mem::replace(&mut seen[(o / 16) as usize], true));
            }
        }
    }

    /// The 16-byte bank group (of 8) a raw chunk lands in.
    fn bank_group(r: u32, c: u32) -> u32 {
        raw_offset(r, c) / 16 % 8
    }

    #[test]
    fn raw_layout_fragment_loads_are_free_of_bank_conflicts() {
        // Score loads: rows 2m, 2m + 1 (lanes' g) times chunks 4j + t (lanes' t4), 16 bytes each.
        for m in 0..SLOT_KEYS / 2 {
            for j in 0..RAW_CHUNKS / 4 {
                let mut groups: std::vec::Vec<u32> = (0..8).map(|lane| bank_group(2 * m + lane / 4, 4 * j + lane % 4)).collect();
                groups.sort();
                groups.dedup();
                assert_eq!(groups.len(), 8, "rows {}, {}, chunk group {j}", 2 * m, 2 * m + 1);
            }
        }
        // Value loads: rows r0 + 2 t4 times 8 bytes at 8 g of a warp's 4-chunk column group;
        // 16 lanes (g 0-3 or 4-7) must cover the 8 bank groups.
        for r0 in (0..SLOT_KEYS - 7).filter(|r| r % 8 < 2) {
            for group in 0..RAW_CHUNKS / 4 - 1 {
                for half in 0..2 {
                    let mut groups: std::vec::Vec<u32> =
                        (0..16).map(|lane| bank_group(r0 + 2 * (lane % 4), 4 * group + 2 * half + lane / 8)).collect();
                    groups.sort();
                    groups.dedup();
                    assert_eq!(groups.len(), 8, "rows from {r0}, chunk group {group}, half {half}");
                }
            }
        }
    }

    #[test]
    fn swizzled_layout_is_a_bijection_onto_the_rows_bytes() {
        let mut seen = std::vec![false; (SLOT_KEYS * ROW_CHUNKS) as usize];
        for r in 0..SLOT_KEYS {
            for c in 0..ROW_CHUNKS {
                let o = swizzled(r, c);
                // A row's 128-byte segments stay whole.
                assert_eq!(o / 128, swizzled(r, c - c % 8) / 128);
                assert!(o.is_multiple_of(16) && o < SLOT_KEYS * MLA_QK * 2);
                assert!(!std::mem::replace(&mut seen[(o / 16) as usize], true));
            }
        }
    }
}
