//! Thread-block clusters (sm_90): a CTA's rank in its cluster, the cluster-wide barrier, and
//! reads of another CTA's shared memory (distributed shared memory). The MLA kernel uses them
//! to combine the splits of a request in shared memory instead of a second kernel.

use core::arch::asm;

/// This CTA's rank in its cluster.
#[inline(always)]
pub fn cluster_rank() -> u32 {
    let r: u32;
    unsafe { asm!("mov.u32 {0}, %cluster_ctarank;", out(reg32) r, options(pure, nomem, nostack)) };
    r
}

/// Barrier for every thread of every CTA of the cluster: shared-memory writes before it (release)
/// are visible to reads after it (acquire) in any CTA of the cluster. Every thread must reach it.
#[inline(always)]
pub fn cluster_sync() {
    unsafe { asm!("barrier.cluster.arrive.release.aligned;", "barrier.cluster.wait.acquire.aligned;", options(nostack)) }
}

/// The distributed-shared-memory address of `addr` (this CTA's shared memory) in CTA `rank`.
#[inline(always)]
pub fn map_rank(addr: u32, rank: u32) -> u32 {
    let r: u32;
    unsafe { asm!("mapa.shared::cluster.u32 {0}, {1}, {2};", out(reg32) r, in(reg32) addr, in(reg32) rank, options(pure, nomem, nostack)) };
    r
}

/// 16 bytes at a distributed-shared-memory address (from [`map_rank`]).
#[inline(always)]
pub unsafe fn ld_cluster_v4(addr: u32) -> [u32; 4] {
    let (a, b, c, d): (u32, u32, u32, u32);
    unsafe {
        asm!("ld.shared::cluster.v4.u32 {{{0}, {1}, {2}, {3}}}, [{4}];", out(reg32) a, out(reg32) b, out(reg32) c, out(reg32) d,
             in(reg32) addr, options(readonly, nostack));
    }
    [a, b, c, d]
}

/// 8 bytes at a distributed-shared-memory address (from [`map_rank`]).
#[inline(always)]
pub unsafe fn ld_cluster_v2(addr: u32) -> [u32; 2] {
    let (a, b): (u32, u32);
    unsafe {
        asm!("ld.shared::cluster.v2.u32 {{{0}, {1}}}, [{2}];", out(reg32) a, out(reg32) b, in(reg32) addr, options(readonly, nostack))
    };
    [a, b]
}
