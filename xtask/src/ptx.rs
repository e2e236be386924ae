//! `build-ptx`: the kernels crate compiled once per GPU target with rustc's nvptx backend.
//!
//! rustc cannot link for nvptx here (no `llvm-bitcode-linker`), so the build asks for the
//! assembly (`--emit=asm`) of the fat-LTO'd cdylib, which is the whole self-contained PTX module,
//! and passes `-C linker=true` so the skipped link step succeeds.

use crate::repo_root;
use crate::report::find_ptxas;
use crate::toolchain::{nightly, nightly_version, run, GpuTarget, FAMILIES, NIGHTLY_VERSION, TARGETS};
use std::path::PathBuf;
use std::process::Command;

pub fn kernels_dir() -> PathBuf {
    repo_root().join("kernels-gpu/kernels")
}

pub fn ptx_dir() -> PathBuf {
    repo_root().join("host/ptx")
}

/// A module as committed: `host/ptx/<target>/<family>.<ext>.zst` (`ext`: `ptx`, or `cubin` for
/// its SASS), compressed with zstd so that the published crate holds every module with room to
/// spare (PTX text compresses 17x, SASS 11x; gzip, which packaging applies, 6x and 4x).
pub fn committed_path(target: &str, family: &str, ext: &str) -> PathBuf {
    ptx_dir().join(target).join(format!("{family}.{ext}.zst"))
}

/// The same module uncompressed, written by `build-ptx` for reading and diffing (not committed).
pub fn unpacked_path(target: &str, family: &str, ext: &str) -> PathBuf {
    repo_root().join("target/ptx").join(target).join(format!("{family}.{ext}"))
}

/// zstd's level for the committed modules: its highest without `--ultra`'s memory (about 10 s
/// for the 20 MB sm_90a attention PTX; the host decodes any level at the same speed).
const ZSTD_LEVEL: i32 = 19;

/// The committed module, decompressed (empty when there is none).
pub fn read_committed(target: &str, family: &str, ext: &str) -> Result<Vec<u8>, String> {
    let path = committed_path(target, family, ext);
    match std::fs::read(&path) {
        Ok(packed) => zstd::decode_all(&packed[..]).map_err(|e| format!("{}: {e}", path.display())),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(Vec::new()),
        Err(e) => Err(format!("{}: {e}", path.display())),
    }
}

/// Writes a module compressed where it is committed, and as it is under `target/ptx/`.
fn write_module(target: &str, family: &str, ext: &str, data: &[u8]) -> Result<(), String> {
    let packed = zstd::encode_all(data, ZSTD_LEVEL).map_err(|e| e.to_string())?;
    let (committed, unpacked) = (committed_path(target, family, ext), unpacked_path(target, family, ext));
    std::fs::create_dir_all(unpacked.parent().expect("a module's folder")).map_err(|e| e.to_string())?;
    std::fs::write(&committed, packed).map_err(|e| format!("{}: {e}", committed.display()))?;
    std::fs::write(&unpacked, data).map_err(|e| format!("{}: {e}", unpacked.display()))
}

/// Assembles `ptx` for `arch` with ptxas (the pinned one from `.venv-ptxas` in CI).
fn assemble(ptx: &str, arch: &str, family: &str) -> Result<Vec<u8>, String> {
    let dir = std::env::temp_dir().join(format!("attn-cubin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| e.to_string())?;
    let (src, out) = (dir.join(format!("{arch}-{family}.ptx")), dir.join(format!("{arch}-{family}.cubin")));
    std::fs::write(&src, ptx).map_err(|e| e.to_string())?;
    let ptxas = find_ptxas();
    let status = Command::new(&ptxas)
        .arg(format!("-arch={arch}"))
        .arg(&src)
        .arg("-o")
        .arg(&out)
        .status()
        .map_err(|e| format!("{}: {e} (pip install nvidia-cuda-nvcc, or set PTXAS)", ptxas.display()))?;
    if !status.success() {
        return Err(format!("ptxas -arch={arch} failed on {family}"));
    }
    let cubin = std::fs::read(&out).map_err(|e| e.to_string())?;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(cubin)
}

/// Builds one family for one target and returns its PTX text. The family's `--cfg` goes to the
/// kernels crate only (after `--`), so `core` is built once per target and reused.
fn build_target(t: &GpuTarget, family: &str) -> Result<String, String> {
    let dir = kernels_dir();
    let target_dir = dir.join("target").join(t.name);
    run(nightly("cargo")
        .current_dir(&dir)
        .args(["rustc", "--quiet", "--release", "--locked", "-Zbuild-std=core", "--target", "nvptx64-nvidia-cuda"])
        .arg("--target-dir")
        .arg(&target_dir)
        .args(["--", "--emit=asm", "-C", "linker=true"])
        .arg(format!("-Ctarget-cpu={}", t.cpu))
        .arg(format!("-Ctarget-feature={}", t.features))
        .args(t.cfgs.iter().flat_map(|c| ["--cfg", c]))
        .arg("--cfg")
        .arg(format!("kernels=\"{family}\""))
        // Panic locations are strings in the PTX: remap local paths (for every crate, hence
        // RUSTFLAGS) so the output does not depend on where the repo is checked out.
        // Kernels are built from small closures over constant indices (`static_for`); they must
        // all inline for register arrays to stay in registers.
        .env("RUSTFLAGS", format!("--remap-path-prefix={}=. -Cllvm-args=-inline-threshold=10000", repo_root().display())))?;
    let asm = target_dir.join("nvptx64-nvidia-cuda/release/deps/kernels_gpu.s");
    let text = std::fs::read_to_string(&asm).map_err(|e| format!("no PTX at {}: {e}", asm.display()))?;
    check_self_contained(&format!("{}/{family}", t.name), &text)?;
    Ok(with_tensor_map_params(&with_launch_bounds(&text)))
}

/// Kernels (name prefixes) whose parameter block holds TMA tensor maps at multiples of 64 bytes
/// (`attn_math::params::WgsParams`), which `cp.async.bulk.tensor` reads in place and needs
/// 64-byte aligned. rustc declares the block at most 16-byte aligned, so it is raised here.
const TENSOR_MAP_PARAMS: &[&str] = &["prefill_wgs_"];

/// `ptx` with the parameter block of each kernel in [`TENSOR_MAP_PARAMS`] declared
/// `.align 64`.
fn with_tensor_map_params(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len());
    let mut kernel: Option<&str> = None;
    for line in ptx.lines() {
        if let Some(name) = line.strip_prefix(".visible .entry ").and_then(|l| l.strip_suffix('(')) {
            kernel = TENSOR_MAP_PARAMS.iter().any(|pre| name.starts_with(pre)).then_some(name);
        }
        match kernel {
            Some(name) if line.trim_start().starts_with(".param .align ") && line.contains(&format!(" {name}_param_0[")) => {
                let rest = line.trim_start().trim_start_matches(".param .align ");
                let after = rest.split_once(' ').map_or("", |(_, a)| a);
                out.push_str(&format!("\t.param .align 64 {after}"));
                kernel = None;
            }
            _ => out.push_str(line),
        }
        out.push('\n');
    }
    out
}

/// The launch bounds (threads, CTAs an SM) of kernel `name`: the decode kernels' CTAs an SM as
/// `attn_math` plans them (`keys_m::ctas_per_sm`, `keys_rows::ctas_per_sm`, from the kernel's
/// name: its cache format, its head size `_d<W>`, `_r16` for 16 rows, `_long` for the deep
/// pipeline), so that `ptxas` fits their registers; and the warp-specialised Hopper prefill,
/// whose three warpgroups start at 168 registers a thread before `setmaxnreg` moves registers
/// from the producer to the compute warps. Two CTAs of 128 threads fit at 255 registers a
/// thread, so the keys-as-rows kernels carry a bound only above two; the keys-on-M kernels carry
/// theirs at two as well, as they were built and measured (without it `ptxas` schedules their
/// code differently). rustc has no launch-bounds attribute for nvptx, so the directives are
/// added to the PTX here.
fn launch_bounds(name: &str) -> Option<(u32, u32)> {
    use attn_math::{hopper_prefill, keys_m, keys_rows, prefill};
    if name.starts_with("prefill_wgs_") {
        return Some((hopper_prefill::WS_THREADS, 1));
    }
    let (keys_on_m, rest) = match (name.strip_prefix("decode_km_"), name.strip_prefix("decode_kr_")) {
        (Some(rest), _) => (true, rest),
        (_, Some(rest)) => (false, rest),
        _ => return None,
    };
    let parts: Vec<&str> = rest.split('_').collect();
    let width: u32 = parts.last()?.strip_prefix('d')?.parse().ok()?;
    let fp8 = parts.iter().any(|&p| p == "fp8" || p == "e5m2");
    let rows = if parts.contains(&"r16") { keys_rows::WIDE_ROWS } else { keys_rows::MAX_ROWS };
    let ctas = if keys_on_m {
        keys_m::ctas_per_sm(width * if fp8 { 1 } else { 2 }, rows)
    } else {
        keys_rows::ctas_per_sm(width, fp8, parts.contains(&"long"), rows)
    };
    (keys_on_m || ctas > 2).then_some((prefill::THREADS, ctas))
}

/// `ptx` with `.maxntid` / `.minnctapersm` after the parameter list of each kernel that has
/// [`launch_bounds`].
fn with_launch_bounds(ptx: &str) -> String {
    let mut out = String::with_capacity(ptx.len() + 256);
    let mut pending: Option<(u32, u32)> = None;
    for line in ptx.lines() {
        if let Some(name) = line.strip_prefix(".visible .entry ").and_then(|l| l.strip_suffix('(')) {
            pending = launch_bounds(name);
        }
        if line == "{" {
            if let Some((threads, ctas)) = pending.take() {
                out.push_str(&format!(".maxntid {threads}, 1, 1\n.minnctapersm {ctas}\n"));
            }
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// A module with an unresolved `.extern .func` would fail to load at run time.
pub fn check_self_contained(name: &str, ptx: &str) -> Result<(), String> {
    let externs: Vec<&str> = ptx.lines().filter(|l| l.contains(".extern") && l.contains(".func")).collect();
    if externs.is_empty() {
        Ok(())
    } else {
        Err(format!("{name}: unresolved externs:\n{}", externs.join("\n")))
    }
}

/// `only`: the one target to build (`--target sm_90a`: a trial on one GPU in half the time); the
/// others' committed modules stay as they are.
pub fn build_ptx(check: bool, only: Option<&str>) -> Result<(), String> {
    let version = nightly_version()?;
    if version != NIGHTLY_VERSION {
        eprintln!("warning: kernels are pinned to `{NIGHTLY_VERSION}`, this is `{version}`; the PTX may differ");
    }
    if let Some(name) = only.filter(|n| !TARGETS.iter().any(|t| t.name == *n)) {
        return Err(format!("--target {name}: not a GPU target ({})", TARGETS.iter().map(|t| t.name).collect::<Vec<_>>().join(", ")));
    }
    let mut stale = Vec::new();
    for t in TARGETS.iter().filter(|t| only.is_none_or(|n| n == t.name)) {
        std::fs::create_dir_all(ptx_dir().join(t.name)).map_err(|e| e.to_string())?;
        for family in FAMILIES {
            let ptx = build_target(t, family)?;
            let cubin = assemble(&ptx, t.cpu, family)?;
            if check {
                for (ext, fresh) in [("ptx", ptx.as_bytes()), ("cubin", &cubin[..])] {
                    if read_committed(t.name, family, ext)? != fresh {
                        stale.push(committed_path(t.name, family, ext).display().to_string());
                    }
                }
            } else {
                write_module(t.name, family, "ptx", ptx.as_bytes())?;
                write_module(t.name, family, "cubin", &cubin)?;
                println!(
                    "wrote {} ({} kernels) and its SASS ({} KiB); uncompressed under {}",
                    committed_path(t.name, family, "ptx").display(),
                    ptx.matches(".entry").count(),
                    cubin.len() / 1024,
                    unpacked_path(t.name, family, "ptx").parent().expect("a module's folder").display()
                );
            }
        }
    }
    if stale.is_empty() {
        if check {
            println!("committed PTX and SASS match the kernels' source ({} targets x {} families)", TARGETS.len(), FAMILIES.len());
        }
        Ok(())
    } else {
        Err(format!("committed PTX/SASS is stale (run `cargo xtask build-ptx` and commit): {}", stale.join(", ")))
    }
}

#[cfg(test)]
mod tests {
    use super::launch_bounds;

    /// Bounds of kernels of each family, and kernels without.
    #[test]
    fn launch_bounds_follow_the_planned_occupancy() {
        let cases = [
            ("decode_km_bf16_d64", Some((128, 4))),
            ("decode_km_f16_r16_d64", Some((128, 3))),
            ("decode_km_bf16_fp8_d128", Some((128, 4))),
            ("decode_km_bf16_e5m2_r16_d128", Some((128, 3))),
            ("decode_km_bf16_r16_d128", Some((128, 2))),
            ("decode_km_bf16_fp8_d256", Some((128, 2))),
            ("decode_kr_bf16_d64", Some((128, 4))),
            ("decode_kr_f16_d128", Some((128, 3))),
            ("decode_kr_bf16_r16_d64", Some((128, 3))),
            ("decode_kr_bf16_r16_d96", None),
            ("decode_kr_bf16_fp8_d64", Some((128, 4))),
            ("decode_kr_f16_e5m2_a8_d128", Some((128, 3))),
            ("decode_kr_bf16_fp8_long_d128", None),
            ("decode_kr_bf16_d256", None),
            ("prefill_wgs_bf16_fp8_d128", Some((384, 1))),
            ("prefill_bf16_dk128_dv128", None),
            ("mla_bf16_narrow", None),
        ];
        for (name, want) in cases {
            assert_eq!(launch_bounds(name), want, "{name}");
        }
    }
}
