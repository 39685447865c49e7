#!/usr/bin/env bash
# Build the stripped vLLM bundle that travels to a bare, offline GPU machine.
# Build a stripped vLLM bundle (the image's pin, 0.25.1) for the bare, offline GPU machine (H100/H200, torch 2.11+cu130,
# Python 3.12), small enough to travel with a device command: .vllm1/ (and .vllm2/ only if one chunk of
# 55 MiB cannot hold it). On the GPU machine, `. scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh` unpacks it.
#
# What the bundle holds: vllm (offline LLM path) with
#   - the flash-attn extensions (_vllm_fa2_C, _vllm_fa3_C, FA4 cute/) removed: attention falls back to
#     TRITON_ATTN (the backend selector treats the ImportError as "backend invalid");
#   - vllm-rs, DeepGEMM, fmha_sm100, FlashMLA, QuTLASS, the Rust tool parser, spinloop, fs_io and the
#     Swagger static files removed (each is optional or off the offline path);
#   - the CUDA fat binaries of _C_stable_libtorch and _moe_C_stable_libtorch cut to their sm_90 cubins;
#   - three small source patches (see patch_sources below) so that missing flash-attn / xgrammar /
#     llguidance do not break imports;
# plus the pure-Python (and small binary) dependencies that the offline import path needs and the GPU
# machine lacks. pydantic & co. are NOT included: they travel in .whl/ (scripts/gpu_env.sh installs them).
#
# Usage: bash scripts/vllm_bundle.sh        (network: PyPI; about 2 minutes, one core)
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the image's pin (docker/stacks, the one source of truth); the patches below are checked against 0.25.1
VLLM_VERSION=$(cd "$REPO" && python3 -c 'from mlite.images.stacks import load_stack; print(load_stack().wheels["vllm"])')
WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/vl}
WHEEL=$WHEEL_DIR/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
CHUNK_MAX=$((55 * 1024 * 1024))
PART_SIZE=$((54 * 1024 * 1024))
BUNDLE=vllm-bundle.tar.xz

# Not on the GPU machine, imported at module level on the offline path (or declared by openai and cheap).
DEPS=(
  cbor2==6.3.0                # vllm.utils.hashing
  pyzmq==27.3.0               # vllm.utils.network_utils
  msgspec==0.22.0             # vllm.sampling_params
  cachetools==8.0.1           # vllm.utils.cache
  pybase64==1.5.1             # vllm.multimodal.media
  partial-json-parser==0.2.1.1.post7  # vllm.tool_parsers.utils
  fastapi==0.136.3            # vllm.entrypoints.pooling.factories
  starlette==1.10.0           # fastapi
  openai==2.54.0              # vllm.entrypoints.chat_utils, vllm.entrypoints.mcp.tool
  distro==1.9.0               # openai
  sniffio==1.3.1              # openai
  jiter==0.19.0               # openai (lazily)
  openai-harmony==0.0.8       # vllm.entrypoints.mcp.tool_server, vllm.entrypoints.chat_utils
)
PIP_TARGET_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)

WORK=$(mktemp -d /tmp/vllm_bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site
mkdir -p "$SITE" "$WORK/deps"

if [ ! -f "$WHEEL" ]; then
  echo "vllm_bundle: downloading vllm==$VLLM_VERSION into $WHEEL_DIR"
  mkdir -p "$WHEEL_DIR"
  python3 -m pip download -q --no-deps "${PIP_TARGET_FLAGS[@]}" -d "$WHEEL_DIR" "vllm==$VLLM_VERSION"
fi

echo "vllm_bundle: downloading ${#DEPS[@]} dependency wheels"
python3 -m pip download -q --no-deps "${PIP_TARGET_FLAGS[@]}" -d "$WORK/deps" "${DEPS[@]}"

# Never carry a second copy of what .whl/ already brings (gpu_env.sh installs those).
python3 - "$REPO/.whl" "$WORK"/deps/*.whl <<'PY'
import pathlib, re, sys
norm = lambda p: re.sub(r"[-_.]+", "-", pathlib.Path(p).name.split("-")[0]).lower()
carried = {norm(p) for p in pathlib.Path(sys.argv[1]).glob("*.whl")}
dup = sorted({norm(p) for p in sys.argv[2:]} & carried)
if dup:
    sys.exit(f"vllm_bundle: {dup} already travel in .whl/")
PY

echo "vllm_bundle: unpacking and stripping $(basename "$WHEEL")"
python3 - "$WHEEL" "$SITE" <<'PY'
import re, struct, sys, zipfile
from pathlib import Path

wheel, site = sys.argv[1], Path(sys.argv[2])
DROP = [
    r"vllm/vllm_flash_attn/_vllm_fa[23]_C\.abi3\.so",  # 190 + 153 MB; FA is optional (selector falls back)
    r"vllm/vllm_flash_attn/cute/",      # FA4 (CuTe DSL, absent here); its presence would mark FA4 available
    r"vllm/vllm-rs",                    # Rust API-server frontend, only with VLLM_USE_RUST_FRONTEND=1
    r"vllm/third_party/deep_gemm/",     # FP8 block GEMM; has_deep_gemm() is then False
    r"vllm/third_party/fmha_sm100/",    # Blackwell sparse MLA (DeepSeek-V4/MiniMax-M3 only)
    r"vllm/_flashmla(_extension)?_C\.abi3\.so",  # MLA models only, imported in try/except
    r"vllm/_qutlass_C\.abi3\.so",       # Blackwell NVFP4, imported under contextlib.suppress(ImportError)
    r"vllm/_rust_tool_parser\.abi3\.so",  # server tool-call parsing, imported lazily
    r"vllm/spinloop\.abi3\.so",         # only with VLLM_USE_SPINLOOP_EXT, try/except
    r"vllm/fs_io_C\.abi3\.so",          # KV offload to files, try/except
    r"vllm/entrypoints/serve/instrumentator/static/",  # Swagger UI assets of the HTTP server
    r"vllm-[^/]*\.dist-info/RECORD",    # not needed to import; keeps METADATA (platform detection reads it)
]
drop = re.compile("|".join(f"(?:{d})" for d in DROP))
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.is_dir() or drop.match(info.filename):
            continue
        z.extract(info, site)
        n += 1
print(f"vllm_bundle: kept {n} files of the wheel")

# --- keep only sm_90 cubins in the CUDA fat binaries ---------------------------------------------
FATBIN_MAGIC, KIND_ELF, ARCH = 0xBA55ED50, 2, 90


def nv_fatbin_section(data):
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", data, 0x3A)
    hdrs = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * shentsize) for i in range(shnum)]
    stroff = hdrs[shstrndx][4]
    for h in hdrs:
        if data[stroff + h[0]:data.index(b"\0", stroff + h[0])] == b".nv_fatbin":
            return h[4], h[5]
    sys.exit("vllm_bundle: no .nv_fatbin section")


def containers(data, off, size):
    p, end = off, off + size
    while p + 16 <= end:
        magic, _ver, hsz, fsz = struct.unpack_from("<IHHQ", data, p)
        if magic != FATBIN_MAGIC:
            p += 8
            continue
        q, cend, ents = p + hsz, p + hsz + fsz, []
        while q < cend:
            kind, _u, ehs, psz = struct.unpack_from("<HHIQ", data, q)
            arch, = struct.unpack_from("<I", data, q + 28)
            ents.append((q, kind, ehs + psz, arch))
            q += ehs + psz
        if q != cend:
            sys.exit(f"vllm_bundle: malformed fatbin container at {p:#x}")
        yield p, hsz, fsz, ents
        p = cend


def prune(path):
    """Each container (one per .cu file) keeps its sm_90/sm_90a cubins. One without any (kernels built
    only for other GPUs or only as PTX: Marlin, sm_89/100/120 CUTLASS, NVFP4, ...) gets the smallest
    cubin of another architecture instead: well-formed, and still without an image for sm_90, exactly
    as before on an H100/H200 (its PTX is dropped, so those kernels can't be JIT-compiled: none of them
    serves an unquantized bf16 model). Freed bytes are zeroed; the file keeps its size and layout."""
    data = bytearray(path.read_bytes())
    conts = list(containers(data, *nv_fatbin_section(data)))
    others = [e for *_x, ents in conts for e in ents if e[1] == KIND_ELF and e[3] != ARCH]
    f = min(others, key=lambda e: e[2])
    filler = bytes(data[f[0]:f[0] + f[2]])
    before = after = 0
    for p, hsz, fsz, ents in conts:
        keep = [bytes(data[e[0]:e[0] + e[2]]) for e in ents if e[1] == KIND_ELF and e[3] == ARCH]
        blob = b"".join(keep) if keep else filler
        assert len(blob) <= fsz
        data[p + hsz:p + hsz + fsz] = blob + bytes(fsz - len(blob))
        struct.pack_into("<Q", data, p + 8, len(blob))
        before, after = before + fsz, after + len(blob)
    path.write_bytes(data)
    print(f"vllm_bundle: {path.name}: CUDA fatbin {before / 2**20:.1f} MiB -> {after / 2**20:.1f} MiB")


for so in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"):
    prune(site / "vllm" / so)


# --- source patches --------------------------------------------------------------------------------
def patch(rel, old, new):
    p = site / rel
    s = p.read_text()
    if s.count(old) != 1:
        sys.exit(f"vllm_bundle: patch target not found once in {rel}")
    p.write_text(s.replace(old, new))


# 1) fa_utils imports vllm.vllm_flash_attn at module level on CUDA, which raises ImportError without
#    the FA extensions; mm_encoder_attention (imported by every model through the attention layer
#    package) imports fa_utils at module level. FA-less means "no FA version".
patch("vllm/model_executor/layers/attention/mm_encoder_attention.py",
      "from vllm.v1.attention.backends.fa_utils import get_flash_attn_version\n",
      "try:\n"
      "    from vllm.v1.attention.backends.fa_utils import get_flash_attn_version\n"
      "except ImportError:  # mlite bundle: flash-attn extensions stripped\n\n"
      "    def get_flash_attn_version(*args, **kwargs):\n"
      "        return None\n\n\n")
# 2) The structured-output backends annotate dataclass fields with xgr.* / llguidance.* types, which
#    are evaluated at class creation and import those packages (LazyLoader). Postponed annotations
#    keep them lazy: only a request with structured outputs needs xgrammar / llguidance.
for rel in ("vllm/v1/structured_output/backend_xgrammar.py",
            "vllm/v1/structured_output/backend_guidance.py"):
    patch(rel, "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n",
          "# SPDX-FileCopyrightText: Copyright contributors to the vLLM project\n"
          "from __future__ import annotations  # mlite bundle: xgrammar/llguidance stay lazy\n")
PY

echo "vllm_bundle: installing dependency wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location \
  "${PIP_TARGET_FLAGS[@]}" --target "$SITE" "$WORK"/deps/*.whl
rm -rf "${SITE:?}/bin"
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
{
  echo "vllm $VLLM_VERSION bundle built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for d in "${DEPS[@]}"; do echo "dep ${d%% *}"; done
} >"$SITE/vllm_bundle_stamp.txt"

echo "vllm_bundle: compressing $(du -sm "$SITE" | cut -f1) MiB (xz -9e, one thread)"
tar -C "$SITE" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . |
  xz -9e -T1 >"$WORK/$BUNDLE"
size=$(stat -c %s "$WORK/$BUNDLE")
sha=$(sha256sum "$WORK/$BUNDLE" | cut -d' ' -f1)

rm -rf "$REPO/.vllm1" "$REPO/.vllm2"
mkdir -p "$REPO/.vllm1"
if [ "$size" -le "$CHUNK_MAX" ]; then
  mv "$WORK/$BUNDLE" "$REPO/.vllm1/$BUNDLE.part-aa"
else
  mkdir -p "$REPO/.vllm2"
  split -b "$PART_SIZE" -a 2 "$WORK/$BUNDLE" "$WORK/$BUNDLE.part-"
  mv "$WORK/$BUNDLE.part-aa" "$REPO/.vllm1/"
  mv "$WORK/$BUNDLE".part-a[b-z] "$REPO/.vllm2/"
fi
{
  echo "sha256 $sha"
  for p in "$REPO"/.vllm1/"$BUNDLE".part-* "$REPO"/.vllm2/"$BUNDLE".part-*; do
    if [ -f "$p" ]; then echo "part $(basename "$p")"; fi
  done
} >"$REPO/.vllm1/MANIFEST"
if [ -d "$REPO/.vllm2" ]; then cp "$REPO/.vllm1/MANIFEST" "$REPO/.vllm2/MANIFEST"; fi
echo "vllm_bundle: $BUNDLE $((size / 1024 / 1024)) MiB ($size bytes), sha256 $sha"
du -b "$REPO"/.vllm[12] 2>/dev/null | sed 's/^/vllm_bundle: chunk bytes /'
