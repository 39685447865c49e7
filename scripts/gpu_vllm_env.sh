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
# _bundle_unpack is shared: scripts/gpu_verl_env.sh unpacks the verl bundle (.verl1/) with it.

# _bundle_unpack NAME DEST [stash]: unpack the bundle whose chunks are .NAME1/, .NAME2/ (or the stash folder
# /tmp/NAME_parts/) into DEST, unless DEST already holds that sha256, and put DEST on PYTHONPATH; with
# `stash`, only copy the chunks that are here to /tmp/NAME_parts/. Messages start with gpu_NAME_env.
_bundle_unpack() {
  local name=$1 dest=$2 mode=${3:-} tag="gpu_$1_env" stash=/tmp/$1_parts manifest="" d sha parts=() part found
  local dirs=(".${name}1" ".${name}2" "$stash")
  if [ "$mode" = stash ]; then
    mkdir -p "$stash"
    for d in "${dirs[@]:0:2}"; do
      if [ -d "$d" ]; then cp -f "$d"/* "$stash"/; fi
    done
    echo "$tag: stashed $(find "$stash" -type f | wc -l) files in $stash"
    return 0
  fi
  for d in "${dirs[@]}"; do
    if [ -f "$d/MANIFEST" ]; then manifest=$d/MANIFEST; break; fi
  done
  if [ -z "$manifest" ]; then
    echo "$tag: no MANIFEST in ${dirs[0]}/, ${dirs[1]}/ or $stash (run scripts/${name}_bundle.sh and carry ${dirs[0]})" >&2
    return 1
  fi
  sha=$(awk '$1 == "sha256" {print $2}' "$manifest")
  if [ "$(cat "$dest/.bundle_sha256" 2>/dev/null)" != "$sha" ]; then
    while read -r kind part; do
      [ "$kind" = part ] || continue
      found=""
      for d in "${dirs[@]}"; do
        if [ -f "$d/$part" ]; then found=$d/$part; break; fi
      done
      if [ -z "$found" ]; then
        echo "$tag: bundle part $part is missing (carry ${dirs[1]}, or stash ${dirs[0]} first)" >&2
        return 1
      fi
      parts+=("$found")
    done <"$manifest"
    if [ "$(cat "${parts[@]}" | sha256sum | cut -d' ' -f1)" != "$sha" ]; then
      echo "$tag: bundle parts do not match the sha256 in $manifest" >&2
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
    echo "$tag: unpacked ${#parts[@]} part(s) into $dest ($(du -sm "$dest" | cut -f1) MiB)"
  fi
  case ":${PYTHONPATH:-}:" in
    *":$dest:"*) ;;
    *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dest" ;;
  esac
}

_vllm_env_main() {
  _bundle_unpack vllm /tmp/vllm_site "$@" || return 1
  if [ "${1:-}" = stash ]; then return 0; fi
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
