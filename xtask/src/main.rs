//! Developer commands: `cargo xtask <command>`.
//!
//! - `build-ptx [--check] [--target NAME]`: build the kernels to PTX (and `ptxas` SASS) for every
//!   GPU target (or the one named) into `host/ptx/`, zstd-compressed, with uncompressed copies
//!   under `target/ptx/` (`--check`: fail if the committed modules differ from what the source
//!   produces).
//! - `ptx-report`: assemble every PTX with `ptxas` and print registers, spills, shared memory and
//!   stack per kernel (also fails if any module does not assemble or has unresolved externs).
//! - `bundle`: build the GPU test binaries (package `attn-rs`) and the binaries `attn-bench`,
//!   `step-bench` and `engine-sim` (package `attn-tools`) into `bundle/`, with `run.sh`, for a
//!   machine that has only an NVIDIA driver.
//! - `bench [ARGS]`: run the benchmark (`attn-tools`' `attn-bench`) here (needs a GPU).

mod bundle;
mod ptx;
mod report;
mod toolchain;

use std::path::PathBuf;
use std::process::ExitCode;

fn repo_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().expect("xtask lives in the repo").to_path_buf()
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let result = match args.first().map(String::as_str) {
        Some("build-ptx") => {
            let only = args.iter().position(|a| a == "--target").map(|i| args.get(i + 1).map(String::as_str).unwrap_or(""));
            ptx::build_ptx(args.iter().any(|a| a == "--check"), only)
        }
        Some("ptx-report") => report::ptx_report(),
        Some("bundle") => bundle::bundle(),
        Some("bench") => bundle::bench(&args[1..]),
        _ => Err("usage: cargo xtask <build-ptx [--check] [--target NAME] | ptx-report | bundle | bench [ARGS]>".to_string()),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("xtask: {e}");
            ExitCode::FAILURE
        }
    }
}
