//! Launch geometry of the Hopper prefill kernel (`prefill_wgs_<q>_d<head_size>`, sm_90a only),
//! shared by the kernel and the host.
//!
//! A CTA has two compute warpgroups (8 warps) and a producer warpgroup ([`WS_THREADS`]); each
//! compute warpgroup owns 64 of the CTA's [`BLOCK_M`] query rows, so that one `wgmma` (m64)
//! covers a warpgroup's rows. Per key tile of [`BLOCK_N`] keys a
//! warpgroup computes S = Q K^T with `wgmma` from shared memory (Q and K both K-major), updates
//! the online softmax in registers (the accumulator layout is `mma.sync`'s C layout per warp),
//! and adds P V with P from registers (the C layout is the A layout) and V read N-major from the
//! same K/V tile rows. Q, K and V tiles sit in the 128-byte-swizzled layout of [`swizzled`].

/// Threads of the two compute warpgroups.
pub const THREADS: u32 = 256;
/// Query rows per CTA: 64 per warpgroup.
pub const BLOCK_M: u32 = 128;
/// Keys per tile.
pub const BLOCK_N: u32 = 128;
/// Widths (QK = V) of the Hopper prefill kernels: the MMAs' K of S and N of P V. Their
/// shared-memory rows are [`row_width`] columns. Width 256 also takes every head size from 136
/// to 248 (its columns past the head size are copied as zeros, as the narrower widths' are).
pub const HEAD_SIZES: [u32; 6] = [64, 80, 96, 112, 128, 256];
/// Unequal head sizes (QK, V) of the Hopper prefill kernels (`prefill_wgs_<q>_dk192_dv128`,
/// 16-bit K/V): DeepSeek's prefill over MLA's decompressed keys (128 + 64 rope columns) and
/// values. The functions below that take one width take its QK width, 192, for it: K and Q rows
/// of 192 columns (three swizzle atoms), V rows and O of 128, stages and steps as at width 128.
pub const QK_V_PAIRS: [(u32, u32); 1] = [(192, 128)];

/// Columns of the shared-memory rows of the kernel of width `d`: whole 128-byte swizzle atoms
/// (64 columns each), so 128 for widths 80 to 112, whose columns past `d` hold zeros.
pub const fn row_width(d: u32) -> u32 {
    d.div_ceil(64) * 64
}

/// Bytes of a group of 8 rows of `d` 16-bit columns in the [`swizzled`] layout.
pub const fn group_bytes(d: u32) -> u32 {
    8 * d * 2
}

/// Byte offset of (row, 16-byte chunk) of rows of `d` 16-bit columns: groups of 8 rows
/// ([`group_bytes`] apart), each `d / 64` atoms of 8 rows x 128 bytes (1024 bytes apart); within
/// an atom, row r's chunk c sits at chunk `c ^ r`. This is `wgmma`'s 128-byte-swizzled layout:
/// K-major for Q and K (stride = group bytes), N-major for V (leading = 1024, stride = group
/// bytes); every 128 bytes of a row stay contiguous, so `cp.async` copies coalesce.
pub const fn swizzled(d: u32, row: u32, chunk: u32) -> u32 {
    (row / 8) * group_bytes(d) + (chunk / 8) * 1024 + (row % 8) * 128 + ((chunk % 8) ^ (row % 8)) * 16
}

/// The warp-specialised kernels (`prefill_wgs_<q>_d<head_size>`): the two
/// warpgroups of [`THREADS`] compute (64 query rows each, in half tiles of 64 keys), and a third, the
/// producer, does every global load: it takes work items from a counter until none are left
/// (the CTAs are persistent), looks up each tile's blocks and copies Q, K and V into rings of
/// shared memory, each slot guarded by a pair of `mbarrier`s (filled, freed). So the next
/// item's tables, queries and first tiles arrive while the current one finishes, and the
/// compute warps issue no copies.
pub const WS_THREADS: u32 = THREADS + 128;
/// K/V stages in the ring of the 16-bit kernels of [`WS_FIVE_STAGE_WIDTHS`] (a stage: K then V
/// of [`ws_stage_keys`] keys): five, which the bad-key masks in place of the compute warps'
/// address tables let fit beside the query buffers ([`ws_tables`]). At half-tile stages (widths
/// 80 to 128) four hold two tiles, and the next tile's second stage, freed last (by the P V of
/// the tile before, inside the softmax), is the one needed first; a fifth gives the producer a
/// stage's lead there.
pub const WS_STAGES: u32 = 5;
/// Stages of the other kernels: 16-bit rows at the other widths and at QK 192 / V 128 (40 KB
/// each; five would not fit), e4m3 rows (whole tiles).
pub const WS_STAGES_FOUR: u32 = 4;
/// Widths whose 16-bit kernels take [`WS_STAGES`]: 128 only. Measured on an H100 against four
/// stages, both with the bad-key masks (docs/prefill.md, "A fifth stage at width 128"): d128
/// +0.6-2.4% paged and +3.5% packed; d80, d96, d112 -1.2 to -2.3%, d64 -1 to -1.5%, d256 -0.9%
/// (their loops are longer in instructions, not in waits for stages).
pub const WS_FIVE_STAGE_WIDTHS: [u32; 1] = [128];
/// The producer's address tables where the compute warps read none (16-bit stages): written
/// before a stage's copies and read by them, so two, used in turn, suffice (a stage's
/// producer barrier orders a table's reads before its next writes).
pub const WS_PRODUCER_TABLES: u32 = 2;
/// Widths of the kernels that read an FP8 cache (`prefill_wgs_<q>_fp8_d<width>`): at 64 and 256
/// their producer copies the raw rows into a ring of its own ([`ws_raw_slots`]) and converts them
/// into the 16-bit stages the compute warps read ([`StageFormat::Fp8Converted`]; at 256 three
/// stages of a quarter tile beside the raw ring and one query buffer); at 80 to 128 the MMAs run
/// on e4m3 ([`StageFormat::Fp8`]).
pub const FP8_HEAD_SIZES: [u32; 6] = [64, 80, 96, 112, 128, 256];
/// Whether the kernel of width `d` is built for FP8 rows that start only 8-byte aligned (the
/// `_a8` twins, head sizes an odd multiple of 8): not at width 256, whose `_a8` build `ptxas`
/// cannot allocate for bf16 queries over E5M2 at any register split; head sizes 136 to 248 that
/// are odd multiples of 8 keep the `mma.sync` kernel there.
pub const fn ws_takes_a8(d: u32) -> bool {
    d != 256
}

/// Stages an FP8 kernel's raw copies run ahead of its conversions: a stage's rows land while
/// the producer converts the two before it.
pub const WS_FP8_LOOKAHEAD: u32 = 2;

/// How a kernel's ring stages hold K and V.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StageFormat {
    /// 16-bit rows as the cache holds them.
    Bits16,
    /// An FP8 cache's rows converted to 16 bits by the producer (width 64: its 64-byte FP8 rows
    /// are half a 128-byte swizzle atom, which the e4m3 operands below would need; width 256:
    /// the compute warps' 16-bit steps of 32 keys, whose O takes 128 registers a thread).
    Fp8Converted,
    /// An FP8 cache's rows as e4m3 operands of `wgmma` (widths 80 to 128, 128-byte rows): K as
    /// copied, V transposed by the producer (8-bit `wgmma` operands must be K-major, and V's K
    /// is the key), the queries quantised to e4m3 by the compute warps, P rounded to e4m3.
    Fp8,
}

/// The stage format of the kernel of width `d` for a 16-bit or an FP8 cache.
pub const fn stage_format(d: u32, fp8: bool) -> StageFormat {
    if !fp8 {
        StageFormat::Bits16
    } else if row_width(d) == 128 {
        StageFormat::Fp8
    } else {
        StageFormat::Fp8Converted
    }
}

/// Stages an e4m3 kernel's raw V copies run ahead of their transposes: a whole-tile stage's V
/// rows land while the producer transposes the tile before.
pub const WS_E4M3_LOOKAHEAD: u32 = 1;

/// Bytes from one raw V row of an e4m3 stage to the next: 128 and 16 of padding, so that the
/// same 16 bytes of eight consecutive rows, which one `ldmatrix` matrix of the transpose reads,
/// lie in eight different bank groups.
pub const E4M3_RAW_ROW: u32 = 144;

/// K/V stages in the ring of the kernel of width `d` (its head size, not its rows'):
/// [`WS_STAGES`] of 16-bit rows at [`WS_FIVE_STAGE_WIDTHS`], three with converted FP8 rows
/// (whose raw ring takes the fourth's room), else [`WS_STAGES_FOUR`].
pub const fn ws_stages(d: u32, fp8: bool) -> u32 {
    match stage_format(d, fp8) {
        StageFormat::Fp8Converted => 3,
        StageFormat::Bits16 if crate::keys_rows::listed(&WS_FIVE_STAGE_WIDTHS, d) => WS_STAGES,
        _ => WS_STAGES_FOUR,
    }
}

/// Raw FP8 slots (none for a 16-bit cache): the stage being copied and those ahead of the
/// conversion ([`WS_FP8_LOOKAHEAD`]) or of the transpose ([`WS_E4M3_LOOKAHEAD`]; V rows only).
pub const fn ws_raw_slots(d: u32, fp8: bool) -> u32 {
    match stage_format(d, fp8) {
        StageFormat::Bits16 => 0,
        StageFormat::Fp8Converted => WS_FP8_LOOKAHEAD + 1,
        StageFormat::Fp8 => WS_E4M3_LOOKAHEAD + 1,
    }
}

/// Address tables. The compute warps read none: a stage's bad keys reach them as masks
/// (`WsLayout::flags`). 16-bit stages: [`WS_PRODUCER_TABLES`]. Converted FP8 rows: one a raw
/// slot, for its copies (a stage's masks are moved into the stage's when it is converted).
/// e4m3 stages copy K straight into the stage, once it is free, and their tables serve the raw
/// V copies too: one a stage.
pub const fn ws_tables(d: u32, fp8: bool) -> u32 {
    match stage_format(d, fp8) {
        StageFormat::Bits16 => WS_PRODUCER_TABLES,
        StageFormat::Fp8Converted => ws_raw_slots(d, fp8),
        StageFormat::Fp8 => ws_stages(d, fp8),
    }
}
/// Keys of a ring stage: a whole tile at head size 64 (32 KB a stage), half a tile at 128
/// (32 KB; four whole-tile stages would not fit beside the two query buffers) and at QK 192 / V
/// 128 (40 KB: four beside one 48 KB query buffer), a quarter at 256 (32 KB: four of them beside
/// one 64 KB query buffer). Half-tile stages are freed as soon as
/// the compute warps are done with that half, which keeps the producer a tile ahead; whole-tile
/// stages at 128 (two of them) left it half a tile ahead and the kernel 9-12% slower than
/// `prefill_wg_*`, while half-tile stages at 64 (eight) cost 6-10% there in extra barriers and
/// producer work. e4m3 rows at 128: a whole tile (K and V^T, 32 KB), four of them.
pub const fn ws_stage_keys(d: u32, fp8: bool) -> u32 {
    if d <= 64 || matches!(stage_format(d, fp8), StageFormat::Fp8) {
        BLOCK_N
    } else if d <= 192 {
        BLOCK_N / 2
    } else {
        BLOCK_N / 4
    }
}

/// Whether the producer at width `d` copies 16-bit stages with TMA where the cache allows it
/// (`params::PagedKvMaps`; else row by row with `cp.async`). Measured in one run against the
/// release that copied rows (H200, paged, block size 16): width 256 +2.8%, 128 -0.6 to -1.2%,
/// 64 -11% (docs/prefill.md), so width 256 only. The kernel of a width without it is built
/// without the TMA path.
pub const fn ws_tma_stages(d: u32, fp8: bool) -> bool {
    d == 256 && !fp8
}

/// Bytes of a key row in a stage: 16-bit columns, or one byte a column for e4m3 stages.
pub const fn ws_row_bytes(d: u32, fp8: bool) -> u32 {
    match stage_format(d, fp8) {
        StageFormat::Fp8 => row_width(d),
        _ => row_width(d) * 2,
    }
}

/// Keys of the compute warps' step (the N of S, the K of P V): 64 up to width 128 and at QK 192
/// (V 128); 32 at 256, where O takes 128 registers a thread and a 64-key S (32 registers) in
/// flight beside the one being turned into weights would not fit.
pub const fn ws_sub_keys(d: u32) -> u32 {
    if d <= 192 {
        64
    } else {
        32
    }
}

/// Whether the compute warps step over whole 128-key tiles (FA3's order: S of tile j + 1 and
/// P V of tile j issued together, the softmax of j + 1 under that P V) rather than 64-key
/// halves (S of the next half under each half's softmax): up to width 128 and at QK 192 (V 128),
/// but not on e4m3 stages. The order holds two tiles' stages from one issue to the next wait; on half-tile
/// stages (16-bit widths 80 to 128) the P V of a tile's first half is issued before the next
/// S, so that its stage is freed when S retires and the producer has a stage to fill during
/// the softmax. Measured on an H200 against halves (docs/prefill.md):
/// - width 64: +5-6% with a 16-bit cache, +2-6% with an FP8 one (converted stages);
/// - width 128: +1.4% at 4 x 4096, +3.6% at 1 x 16384; without the early free it lost 7-9%
///   (the producer had nothing to fill ahead);
/// - e4m3 stages: even, and the compute warps spill 232 bytes (120 with halves). With the two
///   warpgroups taking turns to issue (FA3's ping-pong) they gained 1.5-2%, 16-bit width 64
///   lost as much.
pub const fn ws_whole_tiles(d: u32, fp8: bool) -> bool {
    d <= 192 && !matches!(stage_format(d, fp8), StageFormat::Fp8)
}

/// Query buffers: the current item's and the next one's up to width 128; at 256 one (the next
/// item's queries are copied once the current item's last tile is done with them: about 2 us an
/// item of 30-70 us at 4 x 4096), and at QK 192 (two of 48 KB and four stages of 40 KB exceed
/// the 227 KB; the stages' count, which the whole-tile order needs, is kept). e4m3 stages: one, free as soon as the compute warps have
/// quantised its queries into their e4m3 buffer at the item's start.
pub const fn ws_q_buffers(d: u32, fp8: bool) -> u32 {
    if d <= 128 && !matches!(stage_format(d, fp8), StageFormat::Fp8) {
        2
    } else {
        1
    }
}
/// Registers a thread after `setmaxnreg`: compute and producer warpgroups. The CTA starts at
/// 65536 / [`WS_THREADS`] (168) each; the producer gives up what the compute warps take:
/// 2 x 128 x (208 - 168) <= 128 x (168 - 72). `ptxas` allocates both roles as one function:
/// at 224 / 56 the producer spilled (8 local loads an item at widths 80 to 128, 9 a key tile at
/// 256) and the compute warps did not need the 16 registers more; at 208 / 72 neither spills
/// up to width 128 and the compute warps' key loop is the same length. Measured on an H200
/// against 224 / 56 (docs/prefill.md, "The 16-bit kernels' register split"): 1.005-1.03x on
/// every 16-bit row, d64 to d256.
pub const WS_COMPUTE_REGS: u32 = 208;
pub const WS_PRODUCER_REGS: u32 = 72;
/// The same with an FP8 cache converted into 16-bit stages (widths 64 and 256), whose producer
/// also converts the rows: at 56 registers it spilled 104-128 bytes a thread (`ptx-report`,
/// beside a local array since removed); at 72 at most 32, and the compute warps' 216 hold their
/// state. Width 256 took 232 / 40 while `ptxas` could not allocate its compute warps in 216 (the
/// producer then reloaded 9 words a key tile); it can now, and 216 / 72 measured 1.03x on its
/// FP8 rows on an H200 (docs/prefill.md, "The 16-bit kernels' register split").
pub const WS_FP8_COMPUTE_REGS: u32 = 216;
pub const WS_FP8_PRODUCER_REGS: u32 = 72;
/// The same with e4m3 stages, whose producer transposes V (eight 16-byte rows in registers) and
/// whose compute warps hold P in 8 registers instead of 16 and the queries' A fragments in 16
/// (`e4m3_stages::query_frags`).
pub const WS_E4M3_COMPUTE_REGS: u32 = 208;
pub const WS_E4M3_PRODUCER_REGS: u32 = 88;
/// The same at width 128 with 16-byte rows (head size 128): at 208 registers its compute warps
/// spilled in the key loop (its P V chain also sums the rows against a block of ones), at 216
/// they do not, and the producer at 72 keeps 12 words of its tile loop on the stack. Measured
/// on an H200 against 208 / 88 (docs/prefill.md, "The e4m3 queries as register fragments"):
/// width 128 1.05x, widths 80 to 112 0.98-1.01x, width 128 with 8-byte rows (`_a8`) 0.99x.
/// Measured again with the uniform key loop, whose compute warps no longer spill at 208: 208 /
/// 88 took the producer's item-level spills away but was 0.99-1.01x, so 216 / 72 stays.
pub const WS_E4M3_WIDE_COMPUTE_REGS: u32 = 216;
pub const WS_E4M3_WIDE_PRODUCER_REGS: u32 = 72;
/// Whether the e4m3 kernel of width `d` takes [`WS_E4M3_WIDE_COMPUTE_REGS`] (`a8`: its FP8 rows
/// copied in 8-byte halves).
pub const fn ws_e4m3_wide_regs(d: u32, a8: bool) -> bool {
    d == 128 && !a8
}
/// Bytes of a stage's bad-key masks: a word for each 32 of a stage's at most 128 keys.
pub const WS_FLAG_BYTES: u32 = 16;
/// Item descriptor slots (the current item's and the next one's), also where one query buffer
/// serves both.
pub const WS_ITEM_SLOTS: u32 = 2;
/// u32 words of an item's descriptor in shared memory (what the producer decoded: status,
/// the work item's fields, its key range, tiles and splits), padded to 16-byte loads.
pub const WS_ITEM_WORDS: u32 = 16;

/// Byte offsets of the warp-specialised kernels' shared memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WsLayout {
    /// Query buffer b ([`ws_q_buffers`] of them) at `q + b * q_bytes` (16-bit, as copied).
    pub q: u32,
    pub q_bytes: u32,
    /// e4m3 stages: the queries quantised to e4m3 ([`BLOCK_M`] rows of [`row_width`] bytes,
    /// each compute warpgroup its 64); `q8 == kv` (no bytes) otherwise.
    pub q8: u32,
    /// Stage s: K at `kv + s * (tile + ws_v_tile(..))`, V `tile` bytes after (`tile`:
    /// [`ws_stage_keys`] rows of [`ws_row_bytes`]; e4m3 stages hold V transposed, a row a V
    /// column; V's bytes are `tile` but at QK 192 / V 128, [`ws_v_tile`]).
    pub kv: u32,
    pub tile: u32,
    /// Raw FP8 slot s ([`ws_raw_slots`]): K rows at `raw + s * 2 * raw_tile` ([`row_width`]
    /// bytes each, in row order), V `raw_tile` bytes after; e4m3 stages: V rows only, at
    /// `raw + s * raw_tile`, [`E4M3_RAW_ROW`] bytes apart.
    pub raw: u32,
    pub raw_tile: u32,
    /// Address table t ([`ws_tables`]) at `table + t * table_slot_bytes(ws_stage_keys(d))`.
    pub table: u32,
    /// Item descriptor slot b ([`WS_ITEM_SLOTS`]) at `item + b * 4 * WS_ITEM_WORDS`.
    pub item: u32,
    /// `mbarrier`s (8 bytes each): stage filled [stages], stage freed [stages], query
    /// buffer filled [q buffers], query buffer freed [q buffers].
    pub bars: u32,
    /// Stage s's bad-key masks at `flags + s * WS_FLAG_BYTES`: a u32 a 32 keys, bit `l` set when
    /// the word's key `l` has a block outside the cache (what the compute warps mask).
    pub flags: u32,
    /// The compute warps' scratch words (e4m3 stages: each warp's largest query magnitude, for
    /// its warpgroup's quantisation scale).
    pub scratch: u32,
    /// e4m3 stages at width 128: 1 KB of ones (eight 128-byte rows of the cache's FP8 format),
    /// the B operand of the `wgmma`s that sum each row's weights beside P V (at widths 80 to 112
    /// V^T has rows to spare for them). `total` (no bytes) elsewhere.
    pub ones: u32,
    pub total: u32,
}

/// The layout of the kernel of width `d` (its rows are [`row_width`] columns) for a 16-bit or
/// an FP8 cache.
pub const fn ws_layout(d: u32, fp8: bool) -> WsLayout {
    ws_layout_qk_v(d, d, fp8)
}

/// Bytes of a stage's V rows in the kernel of QK width `dk` and V width `dv`: K's
/// (`WsLayout::tile`) where they are equal, else 16-bit rows of [`row_width`]`(dv)` columns.
pub const fn ws_v_tile(dk: u32, dv: u32, fp8: bool) -> u32 {
    let keys = ws_stage_keys(dk, fp8);
    if dv == dk {
        keys * ws_row_bytes(dk, fp8)
    } else {
        keys * row_width(dv) * 2
    }
}

/// The layout of the kernel of QK width `dk` and V width `dv` (equal but for [`QK_V_PAIRS`], whose
/// K/V are 16-bit): [`ws_layout`]'s, with V's rows [`row_width`]`(dv)` columns.
pub const fn ws_layout_qk_v(dk: u32, dv: u32, fp8: bool) -> WsLayout {
    let d = dk;
    let format = stage_format(d, fp8);
    let e4m3 = matches!(format, StageFormat::Fp8);
    let keys = ws_stage_keys(d, fp8);
    let row_bytes = ws_row_bytes(d, fp8);
    let ones_bytes = if e4m3 && d == 128 { 1024 } else { 0 };
    let stages = ws_stages(d, fp8);
    let d = row_width(d);
    let q_buffers = ws_q_buffers(d, fp8);
    let q_bytes = BLOCK_M * d * 2;
    let tile = keys * row_bytes;
    let v_tile = ws_v_tile(dk, dv, fp8);
    let raw_tile = keys * if e4m3 { E4M3_RAW_ROW } else { d };
    let q = 0;
    let q8 = q + q_buffers * q_bytes;
    let kv = q8 + if e4m3 { BLOCK_M * d } else { 0 };
    let raw = kv + stages * (tile + v_tile);
    let raw_planes = if e4m3 { 1 } else { 2 };
    let table = raw + ws_raw_slots(d, fp8) * raw_planes * raw_tile;
    let item = table + ws_tables(d, fp8) * crate::prefill::table_slot_bytes(keys);
    let bars = item + WS_ITEM_SLOTS * 4 * WS_ITEM_WORDS;
    let flags = bars + 8 * 2 * (stages + q_buffers);
    let scratch = flags + WS_FLAG_BYTES * stages;
    let end = scratch + 4 * THREADS / 32;
    let ones = if ones_bytes > 0 { end.next_multiple_of(1024) } else { end };
    let total = ones + ones_bytes;
    WsLayout { q, q_bytes, q8, kv, tile, raw, raw_tile, table, item, bars, flags, scratch, ones, total }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warp_specialised_layout_fits_and_aligns() {
        let layouts = HEAD_SIZES.map(|d| (d, ws_layout(d, false))).into_iter().chain(FP8_HEAD_SIZES.map(|d| (d, ws_layout(d, true))));
        let pairs = QK_V_PAIRS.map(|(dk, dv)| (dk, ws_layout_qk_v(dk, dv, false)));
        for (d, l) in layouts.chain(pairs) {
            assert!(l.total <= 227 * 1024, "d{d}: {l:?}");
            for o in [l.q, l.q_bytes, l.q8, l.kv, l.tile, l.raw, l.raw_tile] {
                assert!(o.is_multiple_of(1024), "d{d}: {l:?}");
            }
            assert!(l.table.is_multiple_of(16) && l.item.is_multiple_of(16) && l.bars.is_multiple_of(8));
            assert!(l.ones == l.total || (l.ones.is_multiple_of(1024) && l.total == l.ones + 1024), "d{d}: {l:?}");
        }
        // setmaxnreg: the producer frees at least what the compute warps take, in steps of 8.
        let start = (65536 / WS_THREADS) / 8 * 8;
        for (compute, producer) in [
            (WS_COMPUTE_REGS, WS_PRODUCER_REGS),
            (WS_FP8_COMPUTE_REGS, WS_FP8_PRODUCER_REGS),
            (WS_E4M3_COMPUTE_REGS, WS_E4M3_PRODUCER_REGS),
            (WS_E4M3_WIDE_COMPUTE_REGS, WS_E4M3_WIDE_PRODUCER_REGS),
        ] {
            assert!(THREADS * (compute - start) <= 128 * (start - producer));
            assert!(compute.is_multiple_of(8) && producer.is_multiple_of(8) && producer >= 24);
        }
    }

    /// QK 192 / V 128: width 128's stages and steps (whole tiles of two 64-key stages, four of
    /// them) with K rows of 192 columns and one query buffer.
    #[test]
    fn qk_192_v_128_layout() {
        let l = ws_layout_qk_v(192, 128, false);
        assert_eq!((ws_stages(192, false), ws_stage_keys(192, false), ws_sub_keys(192), ws_q_buffers(192, false)), (4, 64, 64, 1));
        assert!(ws_whole_tiles(192, false) && !ws_tma_stages(192, false));
        assert_eq!((l.q_bytes, l.tile, ws_v_tile(192, 128, false)), (128 * 192 * 2, 64 * 192 * 2, 64 * 128 * 2));
        assert_eq!(l.raw, l.kv + 4 * (l.tile + ws_v_tile(192, 128, false)));
        assert_eq!(ws_layout_qk_v(128, 128, false), ws_layout(128, false));
    }

    #[test]
    fn swizzled_layout_is_a_bijection_keeping_128_byte_runs() {
        for d in HEAD_SIZES.map(row_width).into_iter().chain([192]) {
            let chunks = d / 8;
            let mut seen = std::vec![false; (16 * chunks) as usize];
            for r in 0..16 {
                for c in 0..chunks {
                    let o = swizzled(d, r, c);
                    assert_eq!(o / 128, swizzled(d, r, c - c % 8) / 128);
                    assert!(!std::mem::replace(&mut seen[(o / 16) as usize], true));
                }
            }
        }
    }
}
