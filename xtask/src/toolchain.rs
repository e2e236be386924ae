//! The pinned nightly that builds the kernels, and the GPU targets.

use std::process::Command;

/// The toolchain (rustup name) that builds `kernels-gpu`. The committed PTX was produced by
/// [`NIGHTLY_VERSION`]; another nightly may produce different (equally valid) PTX, which
/// `build-ptx --check` reports.
pub const NIGHTLY: &str = "nightly";
pub const NIGHTLY_VERSION: &str = "rustc 1.97.0-nightly (e50aa6fba 2026-05-19)";

/// A GPU target: the PTX file name and the rustc codegen flags.
pub struct GpuTarget {
    pub name: &'static str,
    pub cpu: &'static str,
    pub features: &'static str,
    /// `--cfg` flags for the kernels (e.g. `hw_fp8` where the FP8 conversion instructions exist).
    pub cfgs: &'static [&'static str],
}

/// Kernel families: each is built into its own PTX module per target (`host/ptx/<target>/<family>.ptx`),
/// which the host loads on first use. Must match `host/src/ptx.rs`.
pub const FAMILIES: &[&str] = &["cache_write", "merge", "attention"];

/// Every target the host embeds. Adding one is one line here (and the host picks it up by name).
pub const TARGETS: &[GpuTarget] = &[
    GpuTarget { name: "sm_80", cpu: "sm_80", features: "+ptx70", cfgs: &[] },
    GpuTarget { name: "sm_90a", cpu: "sm_90a", features: "+ptx80", cfgs: &["hw_fp8", "pdl", "wgmma", "l2_prefetch"] },
];

/// A `Command` for the pinned nightly, cleared of what an outer cargo (running this xtask)
/// exports: those would pin the inner build to the stable toolchain or redirect its outputs.
pub fn nightly(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars() {
        if (key.starts_with("CARGO_") && key != "CARGO_HOME") || key.starts_with("RUSTC") || key == "RUSTFLAGS" || key == "RUSTDOCFLAGS" {
            cmd.env_remove(key);
        }
    }
    cmd.env("RUSTUP_TOOLCHAIN", NIGHTLY);
    cmd
}

pub fn nightly_version() -> Result<String, String> {
    let out = nightly("rustc").arg("--version").output().map_err(|e| format!("cannot run rustc: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "the `{NIGHTLY}` toolchain is missing: install it with rust-src \
             (`rustup component add rust-src --toolchain {NIGHTLY}`)"
        ));
    }
    Ok(String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// Runs a command, turning a non-zero exit into an error that names it.
pub fn run(cmd: &mut Command) -> Result<(), String> {
    let status = cmd.status().map_err(|e| format!("cannot start {cmd:?}: {e}"))?;
    if status.success() {
        Ok(())
    } else {
        Err(format!("{cmd:?} failed with {status}"))
    }
}
