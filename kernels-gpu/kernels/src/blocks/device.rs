//! The device-side basics that Rust-CUDA's `cuda_std` would give: thread and block indices,
//! barriers, atomics, and the PTX instructions the kernels need, through inline `asm!`.

use core::arch::asm;

macro_rules! special_register {
    ($name:ident, $reg:literal) => {
        #[inline(always)]
        pub fn $name() -> u32 {
            let r: u32;
            unsafe { asm!(concat!("mov.u32 {0}, ", $reg, ";"), out(reg32) r, options(pure, nomem, nostack)) };
            r
        }
    };
}

special_register!(thread_idx_x, "%tid.x");
special_register!(block_idx_x, "%ctaid.x");
special_register!(block_idx_y, "%ctaid.y");
special_register!(block_idx_z, "%ctaid.z");
special_register!(block_dim_x, "%ntid.x");
special_register!(grid_dim_x, "%nctaid.x");
special_register!(lane_id, "%laneid");

/// Ends the kernel with an error (the launch fails with an illegal-instruction error).
#[inline(always)]
pub fn trap() -> ! {
    unsafe { asm!("trap;", options(noreturn, nostack)) }
}

/// Barrier for all threads of the CTA (`bar.sync 0`, which every thread of a warp must reach at
/// the same instruction). Through LLVM's barrier intrinsic, not `asm!`: the intrinsic is
/// `convergent`, so LLVM never copies it into the paths of a branch that threads take apart. As
/// inline assembly it did (the split merge's fold, docs/sanitizers.md), and warps reached the
/// barrier at two addresses.
#[inline(always)]
pub fn sync_threads() {
    unsafe { core::arch::nvptx::_syncthreads() }
}

/// Barrier for the 32 threads of the warp, with memory ordering among them (their shared-memory
/// writes before it are visible to each other after it).
#[inline(always)]
pub fn sync_warp() {
    unsafe { asm!("bar.warp.sync 0xffffffff;", options(nostack)) }
}

/// `vote.sync.any` over the full warp.
#[inline(always)]
pub fn vote_any(x: bool) -> bool {
    let r: u32;
    unsafe {
        asm!("{{ .reg .pred p, q; setp.ne.u32 p, {1}, 0; vote.sync.any.pred q, p, 0xffffffff; selp.u32 {0}, 1, 0, q; }}",
             out(reg32) r, in(reg32) x as u32, options(nomem, nostack));
    }
    r != 0
}

/// `vote.sync.ballot` over the full warp: bit `l` is lane `l`'s `x`.
#[inline(always)]
pub fn ballot(x: bool) -> u32 {
    let r: u32;
    unsafe {
        asm!("{{ .reg .pred p; setp.ne.u32 p, {1}, 0; vote.sync.ballot.b32 {0}, p, 0xffffffff; }}",
             out(reg32) r, in(reg32) x as u32, options(nomem, nostack));
    }
    r
}

/// Atomically OR `bits` into a global u32 (no return value: a reduction).
#[inline(always)]
pub unsafe fn atomic_or_global(addr: u64, bits: u32) {
    unsafe { asm!("red.global.or.b32 [{0}], {1};", in(reg64) addr, in(reg32) bits, options(nostack)) }
}

/// Atomically replaces a global u32 with `new` if it equals `expected`; returns the value before.
#[inline(always)]
pub unsafe fn atomic_cas_global(addr: u64, expected: u32, new: u32) -> u32 {
    let old: u32;
    unsafe {
        asm!("atom.global.cas.b32 {0}, [{1}], {2}, {3};", out(reg32) old, in(reg64) addr, in(reg32) expected, in(reg32) new,
             options(nostack));
    }
    old
}

/// Atomically adds `v` to a global u32 and returns the value before.
#[inline(always)]
pub unsafe fn atomic_add_global(addr: u64, v: u32) -> u32 {
    let old: u32;
    unsafe { asm!("atom.global.add.u32 {0}, [{1}], {2};", out(reg32) old, in(reg64) addr, in(reg32) v, options(nostack)) };
    old
}

/// [`atomic_add_global`] with acquire-release semantics at GPU scope: the writes this thread
/// (and, through a barrier before it, its warp) made are released with it, and the writes of
/// those that added before it are acquired.
#[inline(always)]
pub unsafe fn atomic_add_acq_rel_gpu(addr: u64, v: u32) -> u32 {
    let old: u32;
    unsafe { asm!("atom.acq_rel.gpu.global.add.u32 {0}, [{1}], {2};", out(reg32) old, in(reg64) addr, in(reg32) v, options(nostack)) };
    old
}

/// Barrier `ID` (1..15) for `THREADS` threads (whole warps), with memory ordering among them.
#[inline(always)]
pub fn named_barrier<const ID: u32, const THREADS: u32>() {
    unsafe { asm!("bar.sync {id}, {n};", id = const ID, n = const THREADS, options(nostack)) }
}

/// The named barrier of warpgroup `wg` (128 threads): barrier `FIRST` for warpgroup 0,
/// `SECOND` for warpgroup 1.
#[inline(always)]
pub fn warpgroup_barrier<const FIRST: u32, const SECOND: u32>(wg: u32) {
    if wg == 0 {
        named_barrier::<FIRST, 128>();
    } else {
        named_barrier::<SECOND, 128>();
    }
}

/// [`named_barrier`] that also says whether `x` holds in every one of the `THREADS` threads.
#[inline(always)]
pub fn named_barrier_all<const ID: u32, const THREADS: u32>(x: bool) -> bool {
    let r: u32;
    unsafe {
        asm!("{{ .reg .pred p, q; setp.ne.u32 p, {x}, 0; bar.red.and.pred q, {id}, {n}, p; selp.u32 {r}, 1, 0, q; }}",
             r = out(reg32) r, x = in(reg32) x as u32, id = const ID, n = const THREADS, options(nostack));
    }
    r != 0
}

/// `setmaxnreg` (sm_90a): the executing warpgroup's registers a thread become `N`, taken from
/// (`inc`) or given back to (`!inc`) the CTA's pool. Every thread of the warpgroup executes it.
#[cfg(wgmma)]
#[inline(always)]
pub fn set_max_registers<const N: u32, const INC: bool>() {
    if INC {
        unsafe { asm!("setmaxnreg.inc.sync.aligned.u32 {n};", n = const N, options(nostack)) }
    } else {
        unsafe { asm!("setmaxnreg.dec.sync.aligned.u32 {n};", n = const N, options(nostack)) }
    }
}

/// `shfl.sync.bfly`: the value of lane `lane ^ mask` (all 32 lanes take part).
#[inline(always)]
pub fn shfl_xor(x: f32, mask: u32) -> f32 {
    let y: f32;
    unsafe {
        asm!("shfl.sync.bfly.b32 {0}, {1}, {2}, 0x1f, 0xffffffff;", out(reg32) y, in(reg32) x, in(reg32) mask,
             options(nomem, nostack));
    }
    y
}

/// `shfl.sync.idx`: lane `src`'s value (all 32 lanes take part).
#[inline(always)]
pub fn shfl_idx(x: u32, src: u32) -> u32 {
    let y: u32;
    unsafe {
        asm!("shfl.sync.idx.b32 {0}, {1}, {2}, 0x1f, 0xffffffff;", out(reg32) y, in(reg32) x, in(reg32) src,
             options(nomem, nostack));
    }
    y
}

/// `tanh` (hardware approximation, sm_75+).
#[inline(always)]
pub fn tanh(x: f32) -> f32 {
    let y: f32;
    unsafe { asm!("tanh.approx.f32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// The block's dynamic shared memory (sized at launch) as `T`s.
#[inline(always)]
pub fn dynamic_shared<T>() -> *mut T {
    core::intrinsics::gpu::gpu_launch_sized_workgroup_mem::<T>()
}

/// Calls `f(0), f(1), ..., f(N - 1)` with each index a constant after inlining, so register
/// arrays indexed by it stay in registers (a loop LLVM declines to unroll would put them in
/// local memory). N <= 32.
#[inline(always)]
pub fn static_for<const N: usize>(mut f: impl FnMut(usize)) {
    const { assert!(N <= 32) };
    macro_rules! step {
        ($($i:literal)*) => { $( if $i < N { f($i) } )* };
    }
    step!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31);
}

/// `a * b + c` in one rounding (rustc does not contract `a * b + c` into an FMA by itself).
#[inline(always)]
pub fn fma(a: f32, b: f32, c: f32) -> f32 {
    let d: f32;
    unsafe { asm!("fma.rn.f32 {0}, {1}, {2}, {3};", out(reg32) d, in(reg32) a, in(reg32) b, in(reg32) c, options(pure, nomem, nostack)) };
    d
}

/// Programmatic dependent launch (sm_90): waits until the grid this one depends on has finished
/// and its writes are visible, then lets the next dependent grid start launching. Kernels call
/// it first thing, before reading anything; launched without the PDL attribute it is a no-op.
#[inline(always)]
pub fn pdl_prologue() {
    pdl_wait();
    pdl_launch_dependents();
}

/// Programmatic dependent launch, in two halves for kernels that read old data before waiting:
/// lets the next dependent grid start launching (into SM slots this grid frees) now.
#[inline(always)]
pub fn pdl_launch_dependents() {
    #[cfg(pdl)]
    unsafe {
        asm!("griddepcontrol.launch_dependents;", options(nostack))
    }
}

/// Waits until the grid this one depends on has finished and its writes are visible. Every
/// CTA calls it before it writes anything or exits, so that this grid's completion implies
/// the one before (a grid whose CTAs all skipped it could finish first).
#[inline(always)]
pub fn pdl_wait() {
    #[cfg(pdl)]
    unsafe {
        asm!("griddepcontrol.wait;", options(nostack))
    }
}

/// The wait of programmatic dependent launch for a kernel that streams a request's context
/// before it: the rows of keys below `ready` were written before the kernel ahead started (in
/// an engine step only the new tokens' rows are that kernel's, the cache write), so copies of
/// them go out at once; the first copy that reaches `ready`, and every thread's first write,
/// wait for the kernel ahead. Each thread waits at most once, through a predicated instruction
/// rather than a branch: the copies it guards sit inside key loops with `wgmma` chains in
/// flight, where a branch that joins again can make LLVM copy a chain's registers.
///
/// A kernel that does not read ahead takes [`PdlGate::late`]: it waits at one place
/// ([`PdlGate::prologue`]) and the gate's other calls compile to nothing.
pub struct PdlGate {
    ready: u32,
    armed: bool,
    waited: core::cell::Cell<bool>,
}

impl PdlGate {
    /// Keys `0..ready` may be read before the wait; the caller has let the next grid launch
    /// ([`pdl_launch_dependents`]) at its start.
    #[inline(always)]
    pub fn new(ready: u32) -> Self {
        PdlGate { ready, armed: true, waited: core::cell::Cell::new(false) }
    }

    /// Nothing read ahead: the kernel waits at [`PdlGate::prologue`].
    #[inline(always)]
    pub fn late() -> Self {
        PdlGate { ready: 0, armed: false, waited: core::cell::Cell::new(true) }
    }

    /// A late gate's wait ([`pdl_prologue`]), after the reads of metadata and queries and before
    /// the first copy of the cache; nothing for an armed gate.
    #[inline(always)]
    pub fn prologue(&self) {
        if !self.armed {
            pdl_prologue();
        }
    }

    /// Before copying keys up to `key_end` (exclusive).
    #[inline(always)]
    pub fn before_keys(&self, key_end: u32) {
        if self.armed {
            let now = (key_end > self.ready) & !self.waited.get();
            pdl_wait_if(now);
            self.waited.set(self.waited.get() | now);
        }
    }

    /// Before anything is written, and before the CTA exits.
    #[inline(always)]
    pub fn before_writes(&self) {
        if self.armed {
            pdl_wait_if(!self.waited.get());
            self.waited.set(true);
        }
    }
}

/// [`pdl_wait`] where `now` holds, as one predicated instruction.
#[inline(always)]
fn pdl_wait_if(now: bool) {
    #[cfg(pdl)]
    unsafe {
        asm!(
            "{{ .reg .pred p; setp.ne.u32 p, {0}, 0; @p griddepcontrol.wait; }}",
            in(reg32) now as u32,
            options(nostack)
        )
    }
    #[cfg(not(pdl))]
    let _ = now;
}

/// `x` unchanged, through an instruction the compiler does not see through. For a per-tile base
/// address that a loop adds constant offsets to: LLVM regroups `(base + invariant) + constant`
/// as `base + (invariant + constant)` and keeps every such sum in a register of its own across
/// the loop, where `opaque(base + invariant) + constant` leaves the constants to the
/// instructions' immediate offsets.
#[inline(always)]
pub fn opaque(x: u32) -> u32 {
    let y: u32;
    unsafe { asm!("mov.b32 {0}, {1};", out(reg32) y, in(reg32) x, options(pure, nomem, nostack)) };
    y
}

/// `x` unchanged, through an instruction the compiler treats as having effects: what is
/// computed from it is computed where the call is, neither merged with another call's nor
/// moved out of the branch it is in (which [`opaque`] allows).
#[inline(always)]
pub fn fresh(x: u32) -> u32 {
    let y: u32;
    unsafe { asm!("mov.b32 {0}, {1};", out(reg32) y, in(reg32) x, options(nomem, nostack)) };
    y
}
