//! Reporting input a kernel refused through the device status block (layout:
//! `attn_math::status`): the offence's bit, and for the first offence since the host last read
//! the block, where it was. Only a thread that found an offence runs any of this.
//!
//! The attention kernels raise `BLOCK_OUT_OF_RANGE` alone (`atomic_or_global`): recording the
//! request and entry there, inlined or as a call, took registers (and in some kernels spills)
//! in their key loops even though it never runs there.

use crate::blocks::device::{atomic_cas_global, atomic_or_global};
use crate::blocks::vec_io::{store4, store8};
use attn_math::status::{INDEX_OUT_OF_RANGE, SLOT_OUT_OF_RANGE, STATUS_CLAIMED, STATUS_ENTRY, STATUS_LIMIT, STATUS_VALUE, STATUS_WHERE};

#[inline(always)]
fn word(status: u64, index: usize) -> u64 {
    status + 4 * index as u64
}

/// Raises `bit`; the thread that claims the empty record fills it in.
#[inline(always)]
unsafe fn report(status: u64, bit: u32, at: u32, entry: u32, value: i64, limit: u64) {
    unsafe {
        atomic_or_global(status, bit);
        if atomic_cas_global(word(status, STATUS_CLAIMED), 0, bit) == 0 {
            store4(word(status, STATUS_WHERE), at);
            store4(word(status, STATUS_ENTRY), entry);
            store8(word(status, STATUS_VALUE), [value as u32, (value >> 32) as u32]);
            store8(word(status, STATUS_LIMIT), [limit as u32, (limit >> 32) as u32]);
        }
    }
}

/// Token `token`'s slot `slot` is at or past the cache's `num_slots`.
#[inline(always)]
pub unsafe fn report_bad_slot(status: u64, token: u32, slot: i64, num_slots: u64) {
    unsafe { report(status, SLOT_OUT_OF_RANGE, token, 0, slot, num_slots) }
}

/// Token `token`'s sparse index entry `entry` holds `index`, which is not -1 (padding) and not
/// a position of its request's `seq_len` keys.
#[inline(always)]
pub unsafe fn report_bad_index(status: u64, token: u32, entry: u32, index: i32, seq_len: u32) {
    unsafe { report(status, INDEX_OUT_OF_RANGE, token, entry, index as i64, seq_len as u64) }
}
