//! `bundle`: release builds of the GPU tests (package `attn-rs`), the benchmarks and the engine
//! simulator (package `attn-tools`), gathered with a runner script
//! into `bundle/` so that a machine with only an NVIDIA driver (no Rust, no CUDA toolkit) can run
//! them. `bench`: the benchmark, run here.

use crate::repo_root;
use crate::toolchain::run;
use std::path::Path;
use std::process::Command;

/// Test targets (in `tests/`) that need a GPU; the bundle runs these.
const GPU_TESTS: &[&str] = &[
    "gpu_cache_write",
    "gpu_decode",
    "gpu_soundness",
    "gpu_prefill",
    "gpu_forward",
    "gpu_mla",
    "gpu_mla_sparse",
    "gpu_graph",
    "gpu_cascade",
    "gpu_context_parallel",
    "gpu_layers",
];
/// The package of the binaries the bundle runs (`tools/`).
const TOOLS_PACKAGE: &str = "attn-tools";
const BENCH_BIN: &str = "attn-bench";
const SIM_BIN: &str = "engine-sim";
const STEP_BIN: &str = "step-bench";
const CP_BIN: &str = "cp-bench";

const RUN_SH: &str = r#"#!/usr/bin/env bash
# Runs every GPU test, the benchmark, then the engine simulator. Needs only an NVIDIA driver.
#   bundle/run.sh                 tests, benchmark (JSON to $OUT/bench.json if OUT is set), engine-sim
#   SANITIZE=1 bundle/run.sh      also runs each GPU test under compute-sanitizer: memcheck,
#                                 racecheck and synccheck (ATTN_TEST_QUICK=1: a smaller matrix;
#                                 any finding fails the run)
#   SANITIZE=only bundle/run.sh   only the sanitizer runs (no plain test runs; BENCH, STEP and SIM
#                                 default to 0)
#   SANITIZE_TOOLS="synccheck"    these compute-sanitizer tools (default "memcheck racecheck synccheck")
#   SANITIZE_TIMEOUT=540          seconds per sanitizer run (one tool over one test binary)
#   BENCH_ARGS="--quick" bundle/run.sh   extra benchmark arguments
#   TESTS="gpu_prefill" bundle/run.sh    only these test binaries (TESTS=none: no tests)
#   TEST_ARGS="d64 --test-threads 1"     arguments to every test binary (a name filter: one case)
#   BENCH=0 bundle/run.sh                no benchmark (with python3 and torch, the benchmark is
#                                        followed by sdpa-anchor.py: torch SDPA on the prefill shapes)
#   STEP=0 bundle/run.sh                 no step benchmark (cascade, CUDA graphs; STEP_ARGS="--quick")
#   SIM=0 bundle/run.sh                  no engine-sim (SIM_ARGS="--model llama": its arguments)
#   CP=0 bundle/run.sh                   no cp-bench (context-parallel decode across GPUs: checks and
#                                        timings, run when the machine has 2 or more GPUs; CP_ARGS)
# A sanitizer pass over every binary with every tool takes longer than one 10-minute command:
# run one tool (SANITIZE_TOOLS) over one binary (TESTS) at a time, e.g.
#   SANITIZE=only SANITIZE_TOOLS=synccheck TESTS=gpu_prefill bundle/run.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
status=0
sanitize=${SANITIZE:-0}
if [ "$sanitize" = only ]; then
  BENCH=${BENCH:-0} STEP=${STEP:-0} SIM=${SIM:-0}
fi
sanitizer=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
# One tool over one test binary; a finding exits 99 (--error-exitcode), a run past the time
# limit 124.
# racecheck runs the tests one at a time: with CUDA graphs captured on parallel test threads it
# loses track of a launch (gpu_forward: reported as a hazard) or stops progressing (gpu_graph).
sanitize_run() {
  local tool=$1 t=$2 opts rc log threads=()
  case $tool in
    memcheck) opts=(--tool memcheck) ;;
    racecheck)
      opts=(--tool racecheck --racecheck-report all)
      case " ${TEST_ARGS:-} " in *test-threads*) ;; *) threads=(--test-threads 1) ;; esac ;;
    synccheck) opts=(--tool synccheck) ;;
    *) opts=(--tool "$tool") ;;
  esac
  echo "== compute-sanitizer ${opts[*]} $(basename "$t")"
  log=$(mktemp)
  ATTN_TEST_QUICK=1 timeout "${SANITIZE_TIMEOUT:-540}" "$sanitizer" "${opts[@]}" --error-exitcode 99 --print-limit 20 \
    "$t" ${threads[@]+"${threads[@]}"} ${TEST_ARGS:-} 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  # A filter that names no case of the quick matrix runs nothing, and the tool finds nothing.
  if [ $rc = 0 ] && grep -q "test result: ok. 0 passed" "$log"; then
    echo "== compute-sanitizer $tool $(basename "$t"): no test ran (TEST_ARGS names no case of the quick matrix)"
    status=1
  elif [ $rc = 0 ]; then
    echo "== compute-sanitizer $tool $(basename "$t"): clean"
  else
    echo "== compute-sanitizer $tool $(basename "$t"): FAILED (exit $rc; 99: findings, 124: timed out)"
    status=1
  fi
  rm -f "$log"
}
for t in "$here"/tests/*; do
  case " ${TESTS:-$(basename "$t")} " in *" $(basename "$t") "*) ;; *) continue ;; esac
  if [ "$sanitize" != only ]; then
    echo "== $(basename "$t")"
    timeout 300 "$t" ${TEST_ARGS:-} || status=1
  fi
  if [ "$sanitize" != 0 ]; then
    for tool in ${SANITIZE_TOOLS:-memcheck racecheck synccheck}; do
      sanitize_run "$tool" "$t"
    done
  fi
done
if [ "${BENCH:-1}" != 0 ]; then
  json=${OUT:-/tmp}/bench.json
  echo "== benchmark"
  "$here/attn-bench" --json "$json" ${BENCH_ARGS:-} || status=1
  # Same-run anchors: torch's SDPA (cuDNN, FLASH) on the prefill rows' shapes and the bf16
  # matmul rate, into the same JSON.
  if command -v python3 >/dev/null && python3 -c "import torch" 2>/dev/null; then
    python3 "$here/sdpa-anchor.py" "$json" || status=1
  else
    echo "(no python3 with torch: no SDPA anchors)"
  fi
fi
if [ "${STEP:-1}" != 0 ]; then
  echo "== step-bench (cascade, CUDA graphs)"
  "$here/step-bench" --json "${OUT:-/tmp}/step-bench.json" ${STEP_ARGS:-} || status=1
fi
if [ "${CP:-1}" != 0 ]; then
  gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
  if [ "${gpus:-0}" -ge 2 ]; then
    echo "== cp-bench (context-parallel decode across $gpus GPUs)"
    # NCCL's wheel ships libnccl.so.2 only; cudarc looks for libnccl.so: a link to it.
    nccl=$(python3 -c 'import glob, os, site; print(next(f for d in site.getsitepackages() for f in glob.glob(os.path.join(d, "nvidia", "**", "libnccl.so*"), recursive=True)))' 2>/dev/null ||
      ldconfig -p | awk '/libnccl.so/ {print $NF; exit}')
    if [ -n "$nccl" ]; then
      links=$(mktemp -d) && ln -sf "$nccl" "$links/libnccl.so"
      # NVLink multicast off: an 8 KB all-gather has no use for it.
      NCCL_NVLS_ENABLE=0 LD_LIBRARY_PATH="$links${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}" \
        "$here/cp-bench" --json "${OUT:-/tmp}/cp-bench.json" ${CP_ARGS:-} || status=1
    else
      echo "(no libnccl found: no cp-bench)"; status=1
    fi
  fi
fi
if [ "${SIM:-1}" != 0 ]; then
  echo "== engine-sim"
  "$here/engine-sim" ${SIM_ARGS:-} || status=1
fi
exit $status
"#;

/// Paths of the test executables cargo builds for `targets`, from its JSON messages.
fn test_executables(root: &Path, targets: &[&str]) -> Result<Vec<(String, String)>, String> {
    let mut cmd = Command::new(env!("CARGO"));
    cmd.current_dir(root).args(["test", "--release", "--locked", "-p", "attn-rs", "--no-run", "--message-format=json"]);
    for t in targets {
        cmd.args(["--test", t]);
    }
    let out = cmd.output().map_err(|e| e.to_string())?;
    if !out.status.success() {
        return Err(format!("building tests failed:\n{}", String::from_utf8_lossy(&out.stderr)));
    }
    let mut found = Vec::new();
    for line in String::from_utf8_lossy(&out.stdout).lines() {
        let Ok(msg) = serde_json::from_str::<serde_json::Value>(line) else { continue };
        if let (Some(exe), Some(name)) = (msg["executable"].as_str(), msg["target"]["name"].as_str()) {
            if targets.contains(&name) {
                found.push((name.to_string(), exe.to_string()));
            }
        }
    }
    Ok(found)
}

pub fn bundle() -> Result<(), String> {
    let root = repo_root();
    let out = root.join("bundle");
    let _ = std::fs::remove_dir_all(&out);
    std::fs::create_dir_all(out.join("tests")).map_err(|e| e.to_string())?;
    for bin in [BENCH_BIN, STEP_BIN, SIM_BIN, CP_BIN] {
        run(Command::new(env!("CARGO")).current_dir(&root).args(["build", "--release", "--locked", "-p", TOOLS_PACKAGE, "--bin", bin]))?;
        std::fs::copy(root.join("target/release").join(bin), out.join(bin)).map_err(|e| e.to_string())?;
    }
    for (name, exe) in test_executables(&root, GPU_TESTS)? {
        std::fs::copy(&exe, out.join("tests").join(&name)).map_err(|e| format!("{exe}: {e}"))?;
    }
    std::fs::copy(root.join("scripts/sdpa-anchor.py"), out.join("sdpa-anchor.py")).map_err(|e| e.to_string())?;
    let script = out.join("run.sh");
    std::fs::write(&script, RUN_SH).map_err(|e| e.to_string())?;
    run(Command::new("chmod").arg("+x").arg(&script))?;
    // The same folder compressed (the embedded PTX compresses ~5x): what is copied to a GPU
    // machine, small enough to travel with the source tree.
    let dist = root.join("bundle-dist");
    let _ = std::fs::remove_dir_all(&dist);
    std::fs::create_dir_all(&dist).map_err(|e| e.to_string())?;
    // xz with a 64 MiB window: every binary embeds the same PTX and SASS (~37 MB each), and a
    // window longer than a binary finds the repeats across files (7 MB; xz's default 8 MiB
    // window gave 30 MB).
    run(Command::new("tar").current_dir(&root).env("XZ_OPT", "--lzma2=preset=6,dict=64MiB -T0").args([
        "cJf",
        "bundle-dist/bundle.tar.xz",
        "bundle",
    ]))?;
    println!("bundle ready: {} (run bundle/run.sh on the GPU machine; bundle-dist/bundle.tar.xz is the same, compressed)", out.display());
    Ok(())
}

pub fn bench(args: &[String]) -> Result<(), String> {
    run(Command::new(env!("CARGO"))
        .current_dir(repo_root())
        .args(["run", "--release", "--locked", "-p", TOOLS_PACKAGE, "--bin", BENCH_BIN, "--"])
        .args(args))
}
