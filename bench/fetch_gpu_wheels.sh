#!/usr/bin/env bash
# Download the wheels of bench/gpu_wheels.txt for the GPU machine (CPython 3.12, x86-64) into
# DEST (default .whl/ at the repository root; it is git-ignored). Run it where a package registry
# is reachable; docs/gpu.md says how to install them on the GPU machine.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
dest=${1:-$root/.whl}
mkdir -p "$dest"
platforms=()
for n in 2_17 2_24 2_27 2_28 2_31 2_34 2_35; do platforms+=(--platform "manylinux_${n}_x86_64"); done
grep -v '^#' "$root/bench/gpu_wheels.txt" | grep -v '^$' | while read -r spec; do
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --abi cp312 --abi abi3 --abi none "${platforms[@]}" --platform manylinux2014_x86_64 --platform any \
    -d "$dest" "$spec"
done
ls "$dest" | wc -l
du -sh "$dest"
