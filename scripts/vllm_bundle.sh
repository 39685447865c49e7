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
# With --v4 it also builds the DeepSeek-V4 add-on bundle `vllmv4` into .vllmv41/ (and .vllmv42/ if needed),
# which gpu_vllm_env.sh unpacks on top of the main one (same /tmp/vllm_site) when it is carried:
#   - from the vLLM wheel: DeepGEMM (vllm/third_party/deep_gemm, its include/ headers for the JIT, the
#     cp312 _C only) and FlashMLA (_flashmla_C, _flashmla_extension_C), which V4's sparse MLA, indexer and
#     o_proj need; _C_stable_libtorch and _moe_C_stable_libtorch again (replacing the main bundle's), cut
#     to their sm_90 cubins plus the compute_80 PTX of the Marlin kernels that V4's MXFP4 experts run on
#     on Hopper (the wheel has no sm_90 cubin of them; the driver JIT-compiles the PTX); a patched
#     fused_indexer_q_cutedsl.py that takes FA4's cute/utils.py from a private copy (the original imports
#     it through vllm.vllm_flash_attn, whose __init__ raises without the stripped FA2/FA3 extensions);
#   - V4_DEPS below: tilelang (mHC kernels) with apache-tvm-ffi, z3-solver and torch-c-dlpack-ext, and the
#     CuTe DSL (nvidia-cutlass-dsl, its cu13 libs) with quack-kernels (compressor at head 512, indexer q,
#     K-cache gather). tilelang's ROCm headers (composable_kernel) and torch-c-dlpack-ext's prebuilt
#     addons (torch <= 2.9 only; torch 2.11 has the DLPack exchange API itself) are left out.
# The main bundle is the same with or without --v4. The add-on is about 84 MiB (xz, x86 BCJ filter), so two
# chunks; a V4 rollout travels in two device commands: the first carries .vllmv41 and runs
# `bash scripts/gpu_vllm_env.sh stash`, the second (while the machine is warm) carries .vllmv42, .vllm1 and
# .whl (about 55 MiB with the checkout) and sources gpu_env.sh and gpu_vllm_env.sh.
#
# Usage: bash scripts/vllm_bundle.sh [--v4]  (network: PyPI; one core: about 2 minutes, with --v4 about 8;
# --v4 needs zstd, to read the kernel names in the PTX)
set -euo pipefail

V4=0
case "${1:-}" in
  "") ;;
  --v4) V4=1 ;;
  *) echo "usage: bash scripts/vllm_bundle.sh [--v4]" >&2; exit 2 ;;
esac
if [ "$V4" = 1 ] && ! command -v zstd >/dev/null; then
  echo "vllm_bundle: --v4 needs zstd (nvcc 13 compresses the PTX in the fat binaries with it)" >&2
  exit 1
fi

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
# the image's pin (docker/stacks, the one source of truth); the patches below are checked against 0.25.1
VLLM_VERSION=$(cd "$REPO" && python3 -c 'from mlite.images.stacks import load_stack; print(load_stack().wheels["vllm"])')
WHEEL_DIR=${VLLM_WHEEL_DIR:-/tmp/vl}
WHEEL=$WHEEL_DIR/vllm-$VLLM_VERSION-cp38-abi3-manylinux_2_28_x86_64.whl
CHUNK_MAX=$((55 * 1024 * 1024))
PART_SIZE=$((54 * 1024 * 1024))

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
# --v4 only: what vLLM 0.25.1's DeepSeek-V4 path imports (vllm's own pins where it has them). The GPU
# machine already has their other needs: numpy, typing-extensions, cloudpickle, ml-dtypes, psutil, tqdm,
# einops, cuda-bindings (cuda.bindings.driver), torch.
V4_DEPS=(
  tilelang==0.1.9             # vllm.model_executor.kernels.mhc.tilelang_kernels (V4's mHC)
  apache-tvm-ffi==0.1.9       # tilelang, quack
  z3-solver==4.15.4.0         # tilelang (libtvm.so links libz3; tilelang wants >=4.13,<4.15.5)
  torch-c-dlpack-ext==0.1.5   # tilelang, quack (declared; torch 2.11 does not need its addons)
  nvidia-cutlass-dsl==4.5.2   # CuTe DSL: vllm.models.deepseek_v4.nvidia.ops.*_cutedsl, vllm.cute_utils
  nvidia-cutlass-dsl-libs-cu13==4.5.2  # the DSL for CUDA 13 (libs-base holds the same files for CUDA 12)
  quack-kernels==0.5.0        # quack.compile_utils in the cutedsl ops; the newest that takes cutlass-dsl 4.5.2
  compressed-tensors==0.17.0  # vllm's pin: quantization/__init__.py imports it to verify any quantization_config
  loguru==0.7.3               # compressed-tensors
)
PIP_TARGET_FLAGS=(--only-binary=:all: --python-version 3.12 --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)

WORK=$(mktemp -d /tmp/vllm_bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SITE=$WORK/site
mkdir -p "$SITE" "$WORK/deps"
V4_SITE=$WORK/v4site

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

if [ "$V4" = 1 ]; then
  echo "vllm_bundle: downloading ${#V4_DEPS[@]} DeepSeek-V4 wheels"
  mkdir -p "$WORK/v4deps"
  python3 -m pip download -q --no-deps "${PIP_TARGET_FLAGS[@]}" -d "$WORK/v4deps" "${V4_DEPS[@]}"
  # ... nor a second copy of what .whl/ or the main bundle bring
  python3 - "$REPO/.whl" "$WORK/deps" "$WORK"/v4deps/*.whl <<'PY'
import pathlib, re, sys
norm = lambda p: re.sub(r"[-_.]+", "-", pathlib.Path(p).name.split("-")[0]).lower()
carried = {norm(p) for d in sys.argv[1:3] for p in pathlib.Path(d).glob("*.whl")}
dup = sorted({norm(p) for p in sys.argv[3:]} & carried)
if dup:
    sys.exit(f"vllm_bundle: {dup} already travel in .whl/ or the main bundle")
PY
fi

# strip_wheel.py WHEEL SITE main|v4 SCRIPTS: the main bundle's part of the vLLM wheel, or (v4) the V4 add-on's
# part; SCRIPTS: the folder of fatbin.py.
cat >"$WORK/strip_wheel.py" <<'PY'
import re, sys, zipfile
from pathlib import Path

sys.path.insert(0, sys.argv[4])  # scripts/: the fat-binary cutter
from fatbin import prune  # noqa: E402

wheel, site = sys.argv[1], Path(sys.argv[2])
V4 = sys.argv[3] == "v4"
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
# --v4: what the V4 path needs of the DROP list above (and the files it overrides in the main bundle)
V4_KEEP = [
    r"vllm/third_party/deep_gemm/(?!_C\.cpython-3(?:10|11|13|14)-)",  # Python 3.12's _C only; include/ for the JIT
    r"vllm/_flashmla(_extension)?_C\.abi3\.so",
    r"vllm/_(moe_)?C_stable_libtorch\.abi3\.so$",  # pruned again below, keeping the PTX of Marlin & co.
    r"vllm/vllm_flash_attn/cute/utils\.py$",          # moved below
    r"vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl\.py$",  # patched below
]
drop = re.compile("|".join(f"(?:{d})" for d in DROP))
keep = re.compile("|".join(f"(?:{d})" for d in V4_KEEP))
n = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.is_dir() or (not keep.match(info.filename) if V4 else drop.match(info.filename)):
            continue
        z.extract(info, site)
        n += 1
print(f"vllm_bundle: kept {n} files of the wheel")

# --- keep only sm_90 cubins in the CUDA fat binaries (scripts/fatbin.py) ---------------------------
# --v4: V4's routed experts are MXFP4; on Hopper they run on Marlin (MARLIN, the first MXFP4 MoE backend
# there that takes V4's SiLU), whose kernels the wheel has only as compute_80 PTX (and sm_80/sm_120 cubins).
# Kept: the MoE Marlin kernels for bf16 activations x float4_e2m1f weights (template arguments: vllm
# ScalarType ids, bfloat16 1125899906909960, float4_e2m1f 562949953487106) with their helper kernels, and
# _C's weight repacking kernels (gptq_marlin_repack & co.). Not kept: Marlin for the other types and
# the dense Marlin GEMM (about 17 MiB of compressed PTX).
V4_PTX = {
    "_C_stable_libtorch.abi3.so": rb"marlin_repack_kernel|marlin_int4_fp8_preprocess|MarlinDefault|permute_cols",
    "_moe_C_stable_libtorch.abi3.so": rb"^_ZN16marlin_moe_wna16(?:6MarlinILl1125899906909960ELl562949953487106E"
                                      rb"|13MarlinDefault|19permute_cols)",
}
kept_ptx = []
for so in ("_C_stable_libtorch.abi3.so", "_moe_C_stable_libtorch.abi3.so"):
    kept_ptx += prune(site / "vllm" / so, keep_ptx=re.compile(V4_PTX[so]) if V4 else None)
if V4:
    print(f"vllm_bundle: kept the PTX of {len(kept_ptx)} kernel groups: {' '.join(kept_ptx)}")
    if not any(k.startswith("_moe_C") for k in kept_ptx) or not any(k.startswith("_C") for k in kept_ptx):
        sys.exit("vllm_bundle: no Marlin PTX matched (did the wheel's kernel names change?)")


# --- source patches --------------------------------------------------------------------------------
def patch(rel, old, new):
    p = site / rel
    s = p.read_text()
    if s.count(old) != 1:
        sys.exit(f"vllm_bundle: patch target not found once in {rel}")
    p.write_text(s.replace(old, new))


if V4:
    # V4's fused indexer-q CuTe kernel imports FA4's cute/utils.py (cutlass, quack and the standard library
    # only) through the vllm.vllm_flash_attn package, whose __init__ raises ImportError without FA2/FA3.
    ops = Path("vllm/models/deepseek_v4/nvidia/ops")
    (site / "vllm/vllm_flash_attn/cute/utils.py").rename(site / ops / "_fa_cute_utils.py")
    (site / "vllm/vllm_flash_attn/cute").rmdir()
    (site / "vllm/vllm_flash_attn").rmdir()
    patch(ops / "fused_indexer_q_cutedsl.py",
          "from vllm.vllm_flash_attn.cute import utils as cute_utils\n",
          "# mlite bundle: FA4's cute/utils.py, copied (vllm.vllm_flash_attn needs the stripped FA2/FA3)\n"
          "from vllm.models.deepseek_v4.nvidia.ops import _fa_cute_utils as cute_utils\n")
    sys.exit(0)

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
echo "vllm_bundle: unpacking and stripping $(basename "$WHEEL")"
python3 "$WORK/strip_wheel.py" "$WHEEL" "$SITE" main "$REPO/scripts"

echo "vllm_bundle: installing dependency wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location \
  "${PIP_TARGET_FLAGS[@]}" --target "$SITE" "$WORK"/deps/*.whl
rm -rf "${SITE:?}/bin"
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
{
  echo "vllm $VLLM_VERSION bundle built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for d in "${DEPS[@]}"; do echo "dep ${d%% *}"; done
} >"$SITE/vllm_bundle_stamp.txt"

# write_bundle NAME SITE [XZ_FILTER]: tar + xz -9e SITE and write it as .NAME1/ (+ .NAME2/ if over one chunk)
# with a MANIFEST (sha256 of the whole, then its parts), as gpu_vllm_env.sh's _bundle_unpack reads them.
write_bundle() {
  local name=$1 site=$2 bundle=$1-bundle.tar.xz size sha p t0=$SECONDS xzargs=(-9e)
  if [ -n "${3:-}" ]; then xzargs=("$3" --lzma2=preset=9e); fi
  echo "vllm_bundle: compressing $name: $(du -sm "$site" | cut -f1) MiB (xz ${xzargs[*]}, one thread)"
  tar -C "$site" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . |
    xz "${xzargs[@]}" -T1 >"$WORK/$bundle"
  size=$(stat -c %s "$WORK/$bundle")
  sha=$(sha256sum "$WORK/$bundle" | cut -d' ' -f1)

  rm -rf "$REPO/.${name}1" "$REPO/.${name}2"
  mkdir -p "$REPO/.${name}1"
  if [ "$size" -le "$CHUNK_MAX" ]; then
    mv "$WORK/$bundle" "$REPO/.${name}1/$bundle.part-aa"
  else
    mkdir -p "$REPO/.${name}2"
    split -b "$PART_SIZE" -a 2 "$WORK/$bundle" "$WORK/$bundle.part-"
    rm -f "$WORK/$bundle"
    mv "$WORK/$bundle.part-aa" "$REPO/.${name}1/"
    mv "$WORK/$bundle".part-a[b-z] "$REPO/.${name}2/"
  fi
  {
    echo "sha256 $sha"
    for p in "$REPO/.${name}1/$bundle".part-* "$REPO/.${name}2/$bundle".part-*; do
      if [ -f "$p" ]; then echo "part $(basename "$p")"; fi
    done
  } >"$REPO/.${name}1/MANIFEST"
  if [ -d "$REPO/.${name}2" ]; then cp "$REPO/.${name}1/MANIFEST" "$REPO/.${name}2/MANIFEST"; fi
  echo "vllm_bundle: $bundle $((size / 1024 / 1024)) MiB ($size bytes), sha256 $sha, xz $((SECONDS - t0)) s"
  du -b "$REPO/.${name}"[12] 2>/dev/null | sed 's/^/vllm_bundle: chunk bytes /'
}

write_bundle vllm "$SITE"
if [ "$V4" = 0 ]; then exit 0; fi

echo "vllm_bundle: DeepSeek-V4 add-on: DeepGEMM, FlashMLA, PTX-keeping _C/_moe_C from $(basename "$WHEEL")"
mkdir -p "$V4_SITE"
python3 "$WORK/strip_wheel.py" "$WHEEL" "$V4_SITE" v4 "$REPO/scripts"
echo "vllm_bundle: installing the DeepSeek-V4 wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location \
  "${PIP_TARGET_FLAGS[@]}" --target "$V4_SITE" "$WORK"/v4deps/*.whl
rm -rf "${V4_SITE:?}/bin"
# tilelang: the ROCm headers (an empty include/ keeps its import quiet) and TVM's C++ sources (its headers
# stay); torch-c-dlpack-ext: the addons built for torch 2.4 to 2.9 (torch >= 2.10 brings the DLPack exchange
# API, tvm_ffi then skips the package) and its stray top-level build_backend.py
rm -rf "$V4_SITE/tilelang/3rdparty/composable_kernel"
mkdir -p "$V4_SITE/tilelang/3rdparty/composable_kernel/include"
find "$V4_SITE/tilelang/3rdparty/tvm/src" -type f \( -name '*.cc' -o -name '*.mm' \) -delete
rm -f "$V4_SITE"/torch_c_dlpack_ext/libtorch_c_dlpack_addon_torch*.so "$V4_SITE/build_backend.py"
find "$V4_SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
# The add-on lands on top of the main bundle: it may replace only the files it means to.
python3 - "$SITE" "$V4_SITE" <<'PY'
import sys
from pathlib import Path
main, v4 = Path(sys.argv[1]), Path(sys.argv[2])
both = sorted(str(p.relative_to(v4)) for p in v4.rglob("*") if not p.is_dir() and (main / p.relative_to(v4)).exists())
meant = ["vllm/_C_stable_libtorch.abi3.so", "vllm/_moe_C_stable_libtorch.abi3.so",
         "vllm/models/deepseek_v4/nvidia/ops/fused_indexer_q_cutedsl.py"]
if both != meant:
    sys.exit(f"vllm_bundle: the V4 add-on would replace {sorted(set(both) - set(meant))} of the main bundle")
PY
{
  echo "vllm $VLLM_VERSION DeepSeek-V4 add-on built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  for d in "${V4_DEPS[@]}"; do echo "dep ${d%% *}"; done
} >"$V4_SITE/vllmv4_bundle_stamp.txt"
# Identical files become hard links, which tar stores once: the CUTLASS headers that DeepGEMM and tilelang
# both carry (24 MiB, too far apart in the archive for xz to match), z3's libz3.so and libz3.so.4.15.
python3 - "$V4_SITE" <<'PY'
import hashlib, os, sys
from pathlib import Path
first, saved = {}, 0
for p in sorted(Path(sys.argv[1]).rglob("*")):
    if p.is_symlink() or not p.is_file() or p.stat().st_size < 512:
        continue
    key = (p.stat().st_size, p.stat().st_mode, hashlib.sha256(p.read_bytes()).digest())
    if key in first:
        p.unlink()
        os.link(first[key], p)
        saved += key[0]
    else:
        first[key] = p
print(f"vllm_bundle: {saved / 2**20:.1f} MiB of duplicate files hard-linked")
PY
# mostly x86-64 machine code (the CuTe DSL's MLIR/LLVM, TVM, z3): the x86 BCJ filter saves about a fifth
write_bundle vllmv4 "$V4_SITE" --x86
