//! The kernels, built to PTX by `cargo xtask build-ptx` and committed under `host/ptx/`, embedded
//! here so that an engine depending on this crate needs neither nightly Rust nor the CUDA toolkit.

/// One embedded module: the target it was built for and the compute capabilities it runs on.
pub(crate) struct PtxModule {
    pub target: &'static str,
    pub ptx: &'static str,
    /// Runs on devices whose compute capability is in `min..=max` (as major*10+minor).
    pub min_cc: u32,
    pub max_cc: u32,
}

/// Best first: the first module whose range holds the device's capability is loaded.
pub(crate) const MODULES: &[PtxModule] = &[
    // sm_90a code uses Hopper-only instructions and runs on compute capability 9.0 exactly.
    PtxModule { target: "sm_90a", ptx: include_str!("../ptx/sm_90a.ptx"), min_cc: 90, max_cc: 90 },
    // Ampere PTX is JIT-compiled by the driver for every newer GPU.
    PtxModule { target: "sm_80", ptx: include_str!("../ptx/sm_80.ptx"), min_cc: 80, max_cc: u32::MAX },
];

pub(crate) fn module_for(cc: u32) -> Option<&'static PtxModule> {
    MODULES.iter().find(|m| (m.min_cc..=m.max_cc).contains(&cc))
}

pub(crate) fn available_targets() -> String {
    MODULES.iter().map(|m| m.target).collect::<Vec<_>>().join(", ")
}
