#!/usr/bin/env bash
# A CUDA 13.0 toolkit from PyPI, for building crates beside attn-rs that compile CUDA with nvcc
# (candle-core's `cuda` feature) on a machine with no CUDA installation and no driver:
#
#     bash scripts/cuda-toolkit.sh && . .cuda-home/env.sh
#
# - `.venv-cuda/`: the pinned NVIDIA wheels (nvcc, NVVM, CRT and CCCL headers, runtime, cuBLAS,
#   cuRAND, NVRTC), all of CUDA 13.0 update 2. The version matters: PTX from a newer nvcc is
#   refused by a CUDA 13.0 driver (580) with CUDA_ERROR_UNSUPPORTED_PTX_VERSION.
# - `.cuda-home/`: a CUDA_HOME of symlinks into the wheels (`bin`, `include`, `nvvm`, `lib64`
#   with the libraries under their unversioned names too) and, as `lib64/libcuda.so`, a stub of
#   the driver library for the linker (soname `libcuda.so.1`; every entry point returns
#   CUDA_ERROR_STUB_LIBRARY). No file here is named `libcuda.so.1`, the name the loader looks
#   for: at run time the real driver loads.
# - `.cuda-home/env.sh`: exports CUDA_HOME/CUDA_PATH, PATH (nvcc), CUDARC_CUDA_VERSION=13000,
#   CUDA_COMPUTE_CAP (90 unless already set) and LIBRARY_PATH (the stub, cuBLAS, cuRAND, NVRTC
#   for the linker).
#
# Idempotent: a second run checks the stamps and returns in about a second.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv="$root/.venv-cuda"
home="$root/.cuda-home"

packages=(
  nvidia-cuda-nvcc==13.0.88
  nvidia-nvvm==13.0.88
  nvidia-cuda-crt==13.0.88
  nvidia-cuda-cccl==13.0.85
  nvidia-cuda-runtime==13.0.96
  nvidia-cuda-nvrtc==13.0.88
  nvidia-cublas==13.1.0.3
  nvidia-curand==10.4.0.35
)
# .cuda-home is remade when the packages or this script change.
wanted="${packages[*]} $(sha256sum <"${BASH_SOURCE[0]}" | cut -c1-16)"

if [ "$(cat "$venv/.installed" 2>/dev/null)" != "${packages[*]}" ]; then
  echo "cuda-toolkit: installing ${packages[*]} into .venv-cuda"
  [ -x "$venv/bin/python" ] || python3 -m venv "$venv"
  "$venv/bin/pip" install --quiet --disable-pip-version-check "${packages[@]}"
  echo "${packages[*]}" >"$venv/.installed"
fi

if [ "$(cat "$home/.built" 2>/dev/null)" != "$wanted" ]; then
  site=$("$venv/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
  cu="$site/nvidia/cu13"
  [ -x "$cu/bin/nvcc" ] || { echo "cuda-toolkit: no nvcc in $cu/bin" >&2; exit 1; }
  tmp="$home.tmp"
  rm -rf "$tmp"
  mkdir -p "$tmp/lib64"
  for d in bin include nvvm; do ln -s "$cu/$d" "$tmp/$d"; done
  # Every library under its own names, plus the unversioned name the linker asks for.
  for lib in "$cu"/lib/lib*.so*; do
    name=$(basename "$lib")
    ln -sf "$lib" "$tmp/lib64/$name"
    ln -sf "$lib" "$tmp/lib64/${name%%.so*}.so"
  done
  # The driver stub: one function per entry point that cuda.h declares.
  gcc -E -P -I "$cu/include" "$cu/include/cuda.h" \
    | grep -oE '\bcu[A-Z][A-Za-z0-9_]*[[:space:]]*\(' | tr -d '( \t' | sort -u \
    | awk '{ printf "int %s(void) { return 34; /* CUDA_ERROR_STUB_LIBRARY */ }\n", $1 }' >"$tmp/libcuda-stub.c"
  gcc -shared -fPIC -O0 -Wl,-soname,libcuda.so.1 -o "$tmp/lib64/libcuda.so" "$tmp/libcuda-stub.c"
  rm "$tmp/libcuda-stub.c"
  cat >"$tmp/env.sh" <<ENV
# Written by scripts/cuda-toolkit.sh: source it (. .cuda-home/env.sh) before building crates that
# compile CUDA (candle-core's \`cuda\` feature) beside attn-rs.
export CUDA_HOME="$home"
export CUDA_PATH="$home"
case ":\$PATH:" in *":$home/bin:"*) ;; *) export PATH="$home/bin:\$PATH" ;; esac
# cudarc 0.19 binds the API of the toolkit's version (and knows no newer one than it lists).
export CUDARC_CUDA_VERSION=13000
# The GPU candle's kernels are compiled for (9.0: H100/H200); a caller's value is kept.
export CUDA_COMPUTE_CAP="\${CUDA_COMPUTE_CAP:-90}"
# For the linker only: the driver stub and cuBLAS/cuRAND/NVRTC. Not LD_LIBRARY_PATH: at run
# time the real driver's libcuda.so.1 loads (on a GPU machine, LD_LIBRARY_PATH names its own
# CUDA libraries, e.g. /usr/local/cuda/lib64).
case ":\${LIBRARY_PATH:-}:" in *":$home/lib64:"*) ;; *) export LIBRARY_PATH="$home/lib64\${LIBRARY_PATH:+:\$LIBRARY_PATH}" ;; esac
ENV
  echo "$wanted" >"$tmp/.built"
  rm -rf "$home"
  mv "$tmp" "$home"
  echo "cuda-toolkit: built .cuda-home ($(grep -c . <(nm -D --defined-only "$home/lib64/libcuda.so" | grep ' T cu')) stub entry points)"
fi
echo "cuda-toolkit: $("$home/bin/nvcc" --version | tail -2 | head -1); . .cuda-home/env.sh to use it"
