#!/usr/bin/env bash
# Unpack the Transformer Engine bundle on a bare GPU machine and build its PyTorch extension (source it).
# On the GPU machine, carrying .te1 and .whl:
#   . scripts/gpu_env.sh; . scripts/gpu_te_env.sh
# unpacks the bundle that scripts/te_bundle.sh wrote (.te1/) into /tmp/te_site, puts it on PYTHONPATH and,
# the first time on a machine, compiles transformer_engine_torch (the PyTorch extension) against the torch
# installed there, for sm_90 only, as docker/Dockerfile does for the image: a wheel in /tmp/te_site/wheels,
# installed into /tmp/te_site, and copied to $OUT when that is set, so a later machine can be handed it (carried
# in .whl/, it is installed instead of built).

. "$(dirname "${BASH_SOURCE[0]}")/bundle_unpack.sh"  # _bundle_unpack

_te_env_main() {
  local dest=/tmp/te_site
  _bundle_unpack te "$dest" "$@" || return 1
  if [ "${1:-}" = stash ]; then return 0; fi
  # TE loads the cuDNN under CUDNN_PATH before any other, and cuDNN opens its sub-libraries (libcudnn_cnn.so.9,
  # ...) by name: both must be torch's (pip's), as the image sets it, not the machine's system cuDNN of another
  # version ("libcudnn_cnn.so.9: undefined symbol ..., version libcudnn_graph.so.9")
  CUDNN_PATH=${CUDNN_PATH:-$(python3 -c 'import nvidia.cudnn; print(list(nvidia.cudnn.__path__)[0])')}
  export CUDNN_PATH LD_LIBRARY_PATH="$CUDNN_PATH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  # the extension, once in place, lives in TE's own folder (not importable by its own name)
  if ! compgen -G "$dest/transformer_engine/wheel_lib/transformer_engine_torch*.so" >/dev/null; then
    # a wheel an earlier machine built for this bundle's version (carried in .whl/) saves the build
    local version
    version=$(cut -d' ' -f2 "$dest/te_bundle_stamp.txt") || return 1
    mkdir -p "$dest/wheels"
    cp .whl/transformer_engine_torch-"$version"-*.whl "$dest/wheels/" 2>/dev/null || true
    if ! ls "$dest"/wheels/transformer_engine_torch-*.whl >/dev/null 2>&1; then
      local sdist t0=$SECONDS
      sdist=$(ls "$dest"/src/transformer_engine_torch-*.tar.gz) || return 1
      # the build links that cuDNN too (docker/Dockerfile: CUDNN_PATH); no prebuilt wheel download
      echo "gpu_te_env: compiling $(basename "$sdist") for sm_90 (CUDNN_PATH=$CUDNN_PATH)"
      NVTE_FRAMEWORK=pytorch NVTE_CUDA_ARCHS=90 NVTE_PYTORCH_FORCE_BUILD=TRUE \
        MAX_JOBS=${MAX_JOBS:-16} PATH="$dest/bin:$PATH" \
        python3 -m pip wheel -q --no-build-isolation --no-deps --no-index --wheel-dir "$dest/wheels" "$sdist" ||
        return 1
      if [ -n "${OUT:-}" ]; then cp "$dest"/wheels/transformer_engine_torch-*.whl "$OUT"/; fi
      echo "gpu_te_env: built in $((SECONDS - t0)) s"
    fi
    # unpacked, not pip-installed: its one file goes into transformer_engine/wheel_lib/, which the bundle
    # already holds (pip --target skips a top-level folder that exists)
    python3 -m zipfile -e "$dest"/wheels/transformer_engine_torch-*.whl "$dest" || return 1
  fi
  python3 -c 'import transformer_engine, transformer_engine.pytorch
print("transformer_engine", transformer_engine.__version__, "from", transformer_engine.__path__[0])'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "gpu_te_env: source it (. scripts/gpu_te_env.sh), after scripts/gpu_env.sh" >&2
  exit 1
fi
_te_env_main "$@"
