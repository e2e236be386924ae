//! An FP8 tile converted in place by the warpgroup that scores it (the seesaw order,
//! `super::seesaw`): its raw rows land in the upper half of its two 16-bit slots
//! (`attn_math::mla::SeesawLayout::raw`) and become the slots' 16-bit rows.

use super::slots::store_converted_at;
use crate::blocks::device::{shfl_idx, static_for, thread_idx_x};
use crate::blocks::elem::Fp8Format;
use crate::blocks::mma::{ld_shared_v4, MmaHalf};
use attn_math::mla::{raw_offset, swizzled, GROUP_BYTES, RAW_CHUNKS, SLOT_KEYS};
use attn_math::prefill::MLA_QK;

/// Threads of a warpgroup.
const WARPGROUP: u32 = 128;

/// Raw chunks of a row that become the first four swizzle atoms of its 16-bit row.
const FIRST_ATOMS: u32 = 16;
/// A warpgroup thread's columns in [`convert_in_place`]; the first `LOW_COLUMNS` have chunks
/// below `FIRST_ATOMS`.
const COLUMNS: usize = 5;
const LOW_COLUMNS: usize = 2;

/// One column of a warpgroup thread's share of a tile's conversion: chunk c of rows `r + 8 j`
/// (j = 0..3, one a 8-row group) of one slot. Rows 8 apart sit at one stride in both layouts, so
/// each row's addresses are the column's plus a constant.
#[derive(Clone, Copy)]
struct Column {
    live: bool,
    /// Row r's raw chunk c, and where its 16-bit chunks 2c, 2c + 1 go (the second at `^ 16`).
    raw: u32,
    dst: u32,
}

/// The i-th column of this thread (of a warpgroup): chunks 0-15 of both slots' rows for the
/// first `LOW_COLUMNS`, then chunks 16-35. Eight consecutive threads take the eight rows of a
/// chunk, so that their 16-bit stores cover the bank groups.
#[inline(always)]
fn column(slots: [u32; 2], raw: u32, i: usize) -> Column {
    let t = thread_idx_x() % WARPGROUP;
    let (k, first, width) = if i < LOW_COLUMNS {
        (t + WARPGROUP * i as u32, 0, FIRST_ATOMS)
    } else {
        (t + WARPGROUP * (i - LOW_COLUMNS) as u32, FIRST_ATOMS, RAW_CHUNKS - FIRST_ATOMS)
    };
    let per_slot = 8 * width;
    let slot = if k < per_slot { slots[0] } else { slots[1] };
    let at = k % per_slot;
    let (r, c) = (at % 8, first + at / 8);
    Column { live: k < 2 * per_slot, raw: slot + raw + raw_offset(r, c), dst: slot + swizzled(r, 2 * c) }
}

/// Converts the raw FP8 rows of a tile's two slots (16-bit slot buffers at `slots`, the raw rows
/// in their upper halves, `raw` bytes on: `attn_math::mla::SeesawLayout::raw`) into the 16-bit
/// [`swizzled`] rows of the same buffers, exactly (the unpack scale is folded into the k/v
/// scales), by one warpgroup, in steps that each write only over bytes whose raw rows have been
/// read (`between`: the warpgroup's barrier). A slot's 16-bit 8-row groups 0-1 lie below the raw
/// rows, group 2 over raw rows 0-15, group 3 over raw rows 16-31:
/// 1. rows 0-15 into groups 0-1 (then `rest_landed`: this thread's copies of rows 16-31 have
///    landed; the barrier after makes them visible);
/// 2. rows 16-23 into group 2; rows 24-31's other chunks, which land over themselves, read into
///    registers;
/// 3. rows 24-31's first 16 chunks into group 3's first four atoms (over raw rows 16-23);
/// 4. the held chunks into the rest of group 3.
///
/// The raw copies of rows 0-15 must have landed and be visible to the warpgroup, and a barrier
/// must follow.
#[inline(always)]
pub(super) unsafe fn convert_in_place<Q: MmaHalf, F: Fp8Format>(slots: [u32; 2], raw: u32, rest_landed: impl Fn(), between: impl Fn()) {
    const {
        let raw = attn_math::mla::seesaw_layout().raw;
        assert!(SLOT_KEYS == 32 && raw == 2 * GROUP_BYTES && 3 * GROUP_BYTES <= raw + raw_offset(16, 0));
        assert!(3 * GROUP_BYTES + FIRST_ATOMS / 4 * 1024 <= raw + raw_offset(24, 0));
        assert!(LOW_COLUMNS as u32 * WARPGROUP == 2 * 8 * FIRST_ATOMS);
        assert!(COLUMNS as u32 * WARPGROUP >= LOW_COLUMNS as u32 * WARPGROUP + 2 * 8 * (RAW_CHUNKS - FIRST_ATOMS));
    };
    // Through a move the compiler keeps in place: the columns' addresses are then computed here
    // each time, not held across the key loop around this.
    let slots = [shfl_idx(slots[0], 0), shfl_idx(slots[1], 0)];
    let columns: [Column; COLUMNS] = core::array::from_fn(|i| column(slots, raw, i));
    // Each step loads all its chunks before converting any: shared-memory latency once a step,
    // not once a chunk.
    let load = |c: &Column, j: u32| if c.live { unsafe { ld_shared_v4(c.raw + j * 8 * MLA_QK) } } else { [0; 4] };
    let store = |c: &Column, j: u32, v: [u32; 4]| {
        if c.live {
            unsafe { store_converted_at::<Q, F>(c.dst + j * GROUP_BYTES, v) };
        }
    };
    static_for::<2>(|j| {
        let v: [[u32; 4]; COLUMNS] = core::array::from_fn(|i| load(&columns[i], j as u32));
        static_for::<COLUMNS>(|i| store(&columns[i], j as u32, v[i]));
    });
    rest_landed();
    between();
    let v: [[u32; 4]; COLUMNS] = core::array::from_fn(|i| load(&columns[i], 2));
    let held: [[u32; 4]; COLUMNS - LOW_COLUMNS] = core::array::from_fn(|i| load(&columns[LOW_COLUMNS + i], 3));
    static_for::<COLUMNS>(|i| store(&columns[i], 2, v[i]));
    between();
    let v: [[u32; 4]; LOW_COLUMNS] = core::array::from_fn(|i| load(&columns[i], 3));
    static_for::<LOW_COLUMNS>(|i| store(&columns[i], 3, v[i]));
    between();
    static_for::<{ COLUMNS - LOW_COLUMNS }>(|i| store(&columns[LOW_COLUMNS + i], 3, held[i]));
}
