#!/usr/bin/env bash
# The unpacking of the bundles that travel to a bare GPU machine in chunks of one device command each
# (scripts/vllm_bundle.sh, verl_bundle.sh, te_bundle.sh): sourced by gpu_vllm_env.sh and gpu_te_env.sh
# (gpu_verl_env.sh uses gpu_vllm_env.sh's).

# _bundle_unpack NAME DEST [stash|overlay]: unpack the bundle whose chunks are .NAME1/, .NAME2/ (or the stash
# folder /tmp/NAME_parts/) into DEST, unless DEST already holds that sha256, and put DEST on PYTHONPATH; with
# `stash`, only copy the chunks that are here to /tmp/NAME_parts/; with `overlay`, unpack on top of what DEST
# holds (an add-on; its own marker, DEST/.bundle_sha256.NAME). Messages start with gpu_NAME_env.
_bundle_unpack() {
  local name=$1 dest=$2 mode=${3:-} tag="gpu_$1_env" stash=/tmp/$1_parts manifest="" d sha parts=() part found
  local dirs=(".${name}1" ".${name}2" "$stash") marker=$2/.bundle_sha256
  if [ "$mode" = overlay ]; then marker=$dest/.bundle_sha256.$name; fi
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
  if [ "$(cat "$marker" 2>/dev/null)" != "$sha" ]; then
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
    if [ "$mode" != overlay ]; then rm -rf "$dest"; fi
    mkdir -p "$dest"
    if command -v xz >/dev/null; then
      cat "${parts[@]}" | tar -xJf - -C "$dest" || return 1
    else
      cat "${parts[@]}" | python3 -c 'import sys, tarfile; tarfile.open(fileobj=sys.stdin.buffer, mode="r|xz").extractall(sys.argv[1], filter="data")' "$dest" || return 1
    fi
    echo "$sha" >"$marker"
    echo "$tag: unpacked ${#parts[@]} part(s) into $dest ($(du -sm "$dest" | cut -f1) MiB)"
  fi
  case ":${PYTHONPATH:-}:" in
    *":$dest:"*) ;;
    *) export PYTHONPATH="${PYTHONPATH:+$PYTHONPATH:}$dest" ;;
  esac
}
