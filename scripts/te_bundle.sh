#!/usr/bin/env bash
# Build the Transformer Engine bundle that travels to a bare, offline GPU machine (H100/H200, torch 2.11+cu130,
# Python 3.12): .te1/, one chunk. On the GPU machine, `. scripts/gpu_env.sh; . scripts/gpu_te_env.sh` unpacks it
# and compiles TE's PyTorch extension there.
#
# What the bundle holds, at the image's pin (docker/stacks, the one source of truth) or TE_VERSION (below):
#   - transformer_engine (the Python package) and transformer_engine_cu13 (its CUDA core,
#     libtransformer_engine.so), installed into a site folder, the core's fat binary cut to its sm_90
#     cubins (scripts/fatbin.py: 2.16.1's 465 MiB of cubins for eight architectures -> 54 MiB, 12 MiB in
#     xz; 2.12.0's 440 -> 53 MiB, 10 MiB);
#   - the source of transformer_engine_torch, the PyTorch extension, which must be compiled against the
#     torch it runs with (as docker/Dockerfile does), and the build tools the device lacks.
#
# Usage: TE_VERSION=2.12.0 bash scripts/te_bundle.sh  (network: PyPI; one core: about 3 minutes)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the image's pin, unless TE_VERSION names another: the device machine's torch 2.11 brings cuBLAS 13.1 (its
# cuda-toolkit 13.0.2 pin), and TE 2.13 and newer link cublasLtGroupedMatrixLayoutInit_internal, which
# cuBLAS 13.2 (CUDA 13.1) first exports; the image installs that cuBLAS (docker/stacks), the device cannot
# (250 MiB in xz once cut to sm_90), so there TE_VERSION=2.12.0, the newest whose core links against 13.1
TE_VERSION=${TE_VERSION:-$(cd "$REPO" && python3 -c 'from mlite.images.stacks import load_stack; print(load_stack().wheels["transformer-engine"])')}
CHUNK_MAX=$((60 * 1024 * 1024))
PIP_TARGET=(--only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_12_x86_64
  --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64)
# what building transformer_engine_torch imports or runs, beside torch and setuptools: its setup.py imports
# wheel and packaging, its extension pybind11; torch's extension builder runs ninja (else one file at a time)
BUILD_TOOLS=(pybind11 ninja wheel packaging)
WORK=$(mktemp -d /tmp/te_bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site
mkdir -p "$SITE/src"

echo "te_bundle: downloading transformer-engine $TE_VERSION (core cu13, Python package, torch extension source)"
python3 -m pip download -q --no-deps "${PIP_TARGET[@]}" -d "$WORK/wheels" \
  "transformer_engine==$TE_VERSION" "transformer_engine_cu13==$TE_VERSION" "${BUILD_TOOLS[@]}"
# the source archive (pip prepares its metadata in an isolated build environment, with a CPU torch)
python3 -m pip download -q --no-deps -d "$SITE/src" "transformer_engine_torch==$TE_VERSION"

python3 - "$WORK/wheels" "$SITE" "$REPO/scripts" <<'PY'
import sys, zipfile
from pathlib import Path

sys.path.insert(0, sys.argv[3])
from fatbin import prune  # noqa: E402

wheels, site = Path(sys.argv[1]), Path(sys.argv[2])
for wheel in sorted(wheels.glob("*.whl")):
    with zipfile.ZipFile(wheel) as z:
        z.extractall(site)
libs = list(site.glob("transformer_engine/**/libtransformer_engine.so"))
if len(libs) != 1:
    sys.exit(f"te_bundle: expected one libtransformer_engine.so, found {len(libs)}")
prune(libs[0])
# ninja's executable, with the mode a zip extraction drops, where gpu_te_env.sh puts it on PATH
ninja = next(site.glob("ninja-*.data/scripts/ninja"))
(site / "bin").mkdir()
ninja.rename(site / "bin" / "ninja")
(site / "bin" / "ninja").chmod(0o755)
PY
echo "transformer-engine $TE_VERSION" >"$SITE/te_bundle_stamp.txt"

bundle=te-bundle.tar.xz
tar -C "$SITE" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . | xz -9e -T1 >"$WORK/$bundle"
size=$(stat -c %s "$WORK/$bundle")
if [ "$size" -gt "$CHUNK_MAX" ]; then
  echo "te_bundle: the bundle is $((size / 1024 / 1024)) MiB, more than one command carries" >&2
  exit 1
fi
rm -rf "$REPO/.te1"
mkdir -p "$REPO/.te1"
mv "$WORK/$bundle" "$REPO/.te1/$bundle.part-aa"
printf 'sha256 %s\npart %s\n' "$(sha256sum "$REPO/.te1/$bundle.part-aa" | cut -d' ' -f1)" "$bundle.part-aa" \
  >"$REPO/.te1/MANIFEST"
echo "te_bundle: .te1/$bundle.part-aa $((size / 1024 / 1024)) MiB"
