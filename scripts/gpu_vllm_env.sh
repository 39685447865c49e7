#!/usr/bin/env bash
# On the GPU machine, after `. scripts/gpu_env.sh`: unpack the vLLM bundle that scripts/vllm_bundle.sh
# wrote (.vllm1/, and .vllm2/ if the bundle needed two chunks) into /tmp/vllm_site, put it on PYTHONPATH
# and set the environment for vLLM's offline, in-process path:
#   . scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh
# Two chunks travel in two commands: the first carries .vllm1 and runs `bash scripts/gpu_vllm_env.sh stash`
# (copies it to /tmp/vllm_parts/); the second carries .vllm2 and sources this file, which finds the parts
# in .vllm1/, .vllm2/ or /tmp/vllm_parts/. An unpacked bundle with the same sha256 is reused.
# Attention: 0.25.1 has no VLLM_ATTENTION_BACKEND variable; without the flash-attn extensions the
# selector falls back to TRITON_ATTN by itself, or pass LLM(..., attention_config={"backend": "TRITON_ATTN"}).

_vllm_env_main() {
  local dest=/tmp/vllm_site stash=/tmp/vllm_parts manifest="" d sha parts=() name found
  if [ "${1:-}" = stash ]; then
    mkdir -p "$stash"
    for d in .vllm1 .vllm2; do
      if [ -d "$d" ]; then cp -f "$d"/* "$stash"/; fi
    done
    echo "gpu_vllm_env: stashed $(find "$stash" -type f | wc -l) files in $stash"
    return 0
  fi
  for d in .vllm1 .vllm2 "$stash"; do
    if [ -f "$d/MANIFEST" ]; then manifest=$d/MANIFEST; break; fi
  done
  if [ -z "$manifest" ]; then
    echo "gpu_vllm_env: no MANIFEST in .vllm1/, .vllm2/ or $stash (run scripts/vllm_bundle.sh and carry .vllm1)" >&2
    return 1
  fi
  sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
  if [ "$(cat "$dest/.bundle_sha256" 2>/dev/null)" != "$sha" ]; then
    while read -r kind name; do
      [ "$kind" = part ] || continue
      found=""
      for d in .vllm1 .vllm2 "$stash"; do
        if [ -f "$d/$name" ]; then found=$d/$name; break; fi
      done
      if [ -z "$found" ]; then
        echo "gpu_vllm_env: bundle part $name is missing (carry .vllm2, or stash .vllm1 first)" >&2
        return 1
      fi
      parts+=("$found")
    done <"$manifest"
    if [ "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)" != "$sha" ]; then
      echo "gpu_vllm_env: bundle parts do not match the sha256 in $manifest" >&2
      return 1
    fi
    rm -rf "$dest"
    mkdir -p "$dest"
    if command -v xz >/dev/null; then
      cat "${parts[@]}" | tar -xJf - -C "$dest" || return 1
    else
      cat "${parts[@]}" | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="data")' "$dest" || return 1
    fi
    echo "$sha" >"$dest/.bundle_sha256"
    echo "gpu_vllm_env: unpacked ${#parts[@]} part(s) into $dest ($(du -sm "$dest" | cut -f1) MiB)"
  fi
  case ":${PYTHONPATH:-}:" in
    *":$dest:"*) ;;
    *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dest" ;;
  esac
  # In-process engine (no EngineCore subprocess, no ZMQ sockets between processes); no FlashInfer here;
  # nothing may phone home; weights and tokenizers come from local paths only.
  export VLLM_ENABLE_V1_MULTIPROCESSING=0 VLLM_USE_FLASHINFER_SAMPLER=0
  export VLLM_NO_USAGE_STATS=1 VLLM_DO_NOT_TRACK=1 DO_NOT_TRACK=1
  export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 HF_HUB_DISABLE_TELEMETRY=1
  python3 -c 'import vllm; print("vllm", vllm.__version__, "from", vllm.__path__[0])'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  _vllm_env_main "$@"
  exit $?
fi
_vllm_env_main "$@"
