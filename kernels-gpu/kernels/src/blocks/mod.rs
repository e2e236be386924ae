//! Building blocks shared by the kernel families: thread and warp intrinsics ([`device`]),
//! global loads and stores ([`vec_io`]), element types ([`elem`]), shared memory, `cp.async` and
//! `mma.sync` ([`mma`]), the status word ([`status`]); and for sm_90a's attention kernels,
//! `wgmma` chains ([`wgmma`]), `mbarrier`s ([`mbarrier`]), TMA copies ([`tma`]) and clusters
//! ([`cluster`]).

// Each family uses a part of the first five.
#[allow(dead_code)]
pub(crate) mod device;
#[allow(dead_code)]
pub(crate) mod elem;
#[allow(dead_code)]
pub(crate) mod mma;
#[allow(dead_code)]
pub(crate) mod status;
#[allow(dead_code)]
pub(crate) mod vec_io;

#[cfg(all(kernels = "attention", wgmma))]
pub(crate) mod cluster;
#[cfg(all(kernels = "attention", wgmma))]
pub(crate) mod mbarrier;
#[cfg(all(kernels = "attention", wgmma))]
pub(crate) mod tma;
#[cfg(all(kernels = "attention", wgmma))]
pub(crate) mod wgmma;
