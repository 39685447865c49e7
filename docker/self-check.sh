#!/usr/bin/env bash
# The image's own check, run as the last step of its build: every component imports and every installed
# version equals the stack's pins (`mlite doctor --strict`). A build has no GPU and no driver, so the
# CUDA driver stub stands in for libcuda.so.1 during the check only (imports link it; nothing runs on it).
set -euo pipefail

STUB_DIR=${STUB_DIR:-/usr/local/cuda/lib64/stubs}  # where the CUDA image keeps libcuda.so (the stub)

shim=$(mktemp -d)
trap 'rm -rf "$shim"' EXIT
ln -s "$STUB_DIR/libcuda.so" "$shim/libcuda.so.1"
LD_LIBRARY_PATH="$shim:${LD_LIBRARY_PATH:-}" mlite doctor --strict "$@"
