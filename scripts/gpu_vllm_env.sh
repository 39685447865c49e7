#!/usr/bin/env bash
# Unpack the vLLM bundle on a bare GPU machine and set vLLM's environment (source it).
# On the GPU machine, after `. scripts/gpu_env.sh`: unpack the vLLM bundle that scripts/vllm_bundle.sh
# wrote (.vllm1/, and .vllm2/ if the bundle needed two chunks) into /tmp/vllm_site, put it on PYTHONPATH
# and set the environment for vLLM's offline, in-process path:
#   . scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh
# Two chunks travel in two commands: the first carries .vllm1 and runs `bash scripts/gpu_vllm_env.sh stash`
# (copies it to /tmp/vllm_parts/); the second carries .vllm2 and sources this file, which finds the parts
# in .vllm1/, .vllm2/ or /tmp/vllm_parts/. An unpacked bundle with the same sha256 is reused.
# Attention: 0.25.1 has no VLLM_ATTENTION_BACKEND variable; without the flash-attn extensions the
# selector falls back to TRITON_ATTN by itself, or pass LLM(..., attention_config={"backend": "TRITON_ATTN"}).
# DeepSeek-V4: when the add-on that `bash scripts/vllm_bundle.sh --v4` writes is here (.vllmv41/, .vllmv42/)
# or stashed (/tmp/vllmv4_parts/), it is unpacked on top of /tmp/vllm_site (DeepGEMM, FlashMLA, tilelang,
# CuTe DSL, quack, Marlin PTX; JIT caches under /tmp/jit_cache). It takes two commands: the first carries
# .vllmv41 and runs `bash scripts/gpu_vllm_env.sh stash`; the second, sent while the machine is still warm,
# carries .vllmv42, .vllm1 and .whl and sources gpu_env.sh and this file. `stash` stashes every chunk that is
# here, of either bundle. Without the add-on (here or stashed) the site is the main bundle alone.
# _bundle_unpack (scripts/bundle_unpack.sh) is shared: scripts/gpu_verl_env.sh unpacks the verl bundle (.verl1/)
# with it, and scripts/gpu_te_env.sh the Transformer Engine bundle.

. "$(dirname "${BASH_SOURCE[0]}")/bundle_unpack.sh"  # _bundle_unpack

_vllm_env_main() {
  local site=/tmp/vllm_site v4="" d line
  for d in .vllmv41 .vllmv42 /tmp/vllmv4_parts; do
    if [ -f "$d/MANIFEST" ]; then v4=1; fi
  done
  if [ "${1:-}" = stash ]; then
    _bundle_unpack vllm "$site" stash || return 1
    if [ -d .vllmv41 ] || [ -d .vllmv42 ]; then _bundle_unpack vllmv4 "$site" stash || return 1; fi
    return 0
  fi
  # an add-on left in the site by an earlier command, but not here now: start from the main bundle again
  if [ -z "$v4" ] && [ -f "$site/.bundle_sha256.vllmv4" ]; then rm -f "$site/.bundle_sha256"; fi
  _bundle_unpack vllm "$site" "$@" || return 1
  if [ -n "$v4" ]; then
    _bundle_unpack vllmv4 "$site" overlay || return 1
    # PYTHONPATH folders get no .pth processing: add what the add-on's .pth files name (the CuTe DSL's
    # nvidia_cutlass_dsl/python_packages, where `cutlass` lives)
    for d in "$site"/*.pth; do
      [ -f "$d" ] || continue
      while read -r line || [ -n "$line" ]; do  # a .pth may end without a newline
        case "$line" in "" | "#"* | import*) continue ;; esac
        if [ -d "$site/$line" ]; then
          case ":${PYTHONPATH:-}:" in
            *":$site/$line:"*) ;;
            *) export PYTHONPATH="$PYTHONPATH:$site/$line" ;;
          esac
        fi
      done <"$d"
    done
    # JIT compilers and their caches: DeepGEMM (nvcc), tilelang (nvcc), the CuTe DSL (its own ptxas), the
    # driver's PTX JIT (Marlin's compute_80 PTX; a bigger cache than the default keeps it across runs)
    if [ -z "${CUDA_HOME:-}" ]; then
      for d in /usr/local/cuda /usr/local/cuda-13*; do
        if [ -x "$d/bin/nvcc" ]; then export CUDA_HOME=$d; break; fi
      done
    fi
    # DeepGEMM's _C links libnvrtc.so.13 without a runpath: if the loader does not know it, use the copy in
    # torch's nvidia-cuda-nvrtc wheel
    if ! ldconfig -p 2>/dev/null | grep -q 'libnvrtc\.so\.13 '; then
      d=$(python3 -c 'import glob, os, sys
hits = [h for p in sys.path for h in glob.glob(os.path.join(p, "nvidia", "*", "lib", "libnvrtc.so.13"))]
print(os.path.dirname(hits[0]) if hits else "")')
      if [ -n "$d" ] && [[ ":${LD_LIBRARY_PATH:-}:" != *":$d:"* ]]; then
        export LD_LIBRARY_PATH="$d${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
      fi
    fi
    export DG_JIT_CACHE_DIR=${DG_JIT_CACHE_DIR:-/tmp/jit_cache/deep_gemm}
    export TILELANG_CACHE_DIR=${TILELANG_CACHE_DIR:-/tmp/jit_cache/tilelang}
    export TVM_FFI_CACHE_DIR=${TVM_FFI_CACHE_DIR:-/tmp/jit_cache/tvm-ffi}
    export CUTE_DSL_CACHE_DIR=${CUTE_DSL_CACHE_DIR:-/tmp/jit_cache/cute_dsl}
    export CUDA_CACHE_PATH=${CUDA_CACHE_PATH:-/tmp/jit_cache/nv} CUDA_CACHE_MAXSIZE=${CUDA_CACHE_MAXSIZE:-4294967296}
    # a bare machine has no DeepGEMM cache, and vLLM's start-up warm-up ("relax") compiles the FP8 GEMMs for
    # a range of token counts each (1,834 for small-deepseek-v4 under rollout.fp8_weights: over 9 minutes);
    # `skip` compiles on first use only the ones a run meets (vllm/model_executor/warmup/kernel_warmup.py)
    export VLLM_DEEP_GEMM_WARMUP=${VLLM_DEEP_GEMM_WARMUP:-skip}
  fi
  # In-process engine (no EngineCore subprocess, no ZMQ sockets between processes); no FlashInfer here;
  # nothing may phone home; weights and tokenizers come from local paths only.
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  python3 -c 'import vllm; print("vllm", vllm.__version__, "from", vllm.__path__[0])'
  if [ -n "$v4" ]; then
    echo "gpu_vllm_env: DeepSeek-V4 add-on, CUDA_HOME=${CUDA_HOME:-unset}"
    python3 -c '
import importlib, torch  # noqa: F401  (torch first: the extensions link its CUDA libraries)
for m in ("vllm._flashmla_C", "vllm.third_party.deep_gemm", "tilelang", "cutlass", "quack"):
    try:
        importlib.import_module(m)
        print("gpu_vllm_env: import", m, "ok")
    except Exception as e:
        print("gpu_vllm_env: import", m, "FAILED:", type(e).__name__, e)
'
  fi
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _vllm_env_main "$@"
  exit $?
fi
_vllm_env_main "$@"
