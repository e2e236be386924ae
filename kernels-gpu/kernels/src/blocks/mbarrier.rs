//! Shared-memory `mbarrier`s (sm_80+; phases tracked by parity) for the producer/consumer rings
//! of the warp-specialised prefill kernel: a slot's "filled" barrier completes a phase when the
//! producer's copies into it have landed, its "freed" barrier when every consumer is done with it.

use core::arch::asm;

/// Sets up the barrier at `bar` to complete a phase after `count` arrivals (current phase 0).
/// The CTA must synchronise before another thread uses it.
#[inline(always)]
pub unsafe fn init(bar: u32, count: u32) {
    unsafe { asm!("mbarrier.init.shared::cta.b64 [{0}], {1};", in(reg32) bar, in(reg32) count, options(nostack)) }
}

/// One arrival (release: this thread's earlier shared-memory writes are visible to a thread
/// whose wait sees the phase complete).
#[inline(always)]
pub unsafe fn arrive(bar: u32) {
    unsafe { asm!("mbarrier.arrive.shared::cta.b64 _, [{0}];", in(reg32) bar, options(nostack)) }
}

/// One arrival, made asynchronously once every `cp.async` this thread issued so far has landed
/// (`.noinc`: the pending count is not raised first, so the barrier's count includes these
/// arrivals). A thread with no copies in flight arrives at once.
#[inline(always)]
pub unsafe fn arrive_when_copies_land(bar: u32) {
    unsafe { asm!("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [{0}];", in(reg32) bar, options(nostack)) }
}

/// Whether the phase of parity `parity` has completed (a fresh barrier counts the phase before
/// its first, parity 1, as complete). `try_wait` may suspend the thread a while before it says no.
#[inline(always)]
pub unsafe fn try_wait(bar: u32, parity: u32) -> bool {
    let done: u32;
    unsafe {
        asm!("{{ .reg .pred p; mbarrier.try_wait.parity.shared::cta.b64 p, [{1}], {2}; selp.u32 {0}, 1, 0, p; }}",
             out(reg32) done, in(reg32) bar, in(reg32) parity, options(nostack));
    }
    done != 0
}

/// Waits until the phase of parity `parity` has completed (acquire).
#[inline(always)]
pub unsafe fn wait(bar: u32, parity: u32) {
    while !unsafe { try_wait(bar, parity) } {}
}

/// Raises the barrier's expected transaction bytes of the current phase by `bytes` (no
/// arrival): the phase then also waits for that many bytes of asynchronous copies that name
/// the barrier ([`crate::blocks::tma`]). Made before the copies and before this thread's own
/// arrival, so that the phase cannot complete without them.
#[inline(always)]
pub unsafe fn expect_tx(bar: u32, bytes: u32) {
    unsafe { asm!("mbarrier.expect_tx.relaxed.cta.shared::cta.b64 [{0}], {1};", in(reg32) bar, in(reg32) bytes, options(nostack)) }
}
