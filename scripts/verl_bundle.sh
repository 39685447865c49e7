#!/usr/bin/env bash
# Build the verl + Ray bundle that travels to a bare, offline GPU machine.
# Build the verl bundle for the bare, offline GPU machine (H100/H200, torch 2.11+cu130, Python 3.12): what
# `python3 -m verl.trainer.main_ppo model_engine=mlite actor_rollout_ref.rollout.name=vllm ...` (verl's PPO trainer on
# Ray, vLLM's OpenAI server as the rollout, verl's agent loop) needs beyond the machine's own packages, the
# wheels in .whl/ and the vLLM bundle (.vllm1/, scripts/vllm_bundle.sh). It is small enough to travel with a
# device command next to .vllm1: .verl1/ (a MANIFEST and one xz tar part). On the GPU machine,
# `. scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh; . scripts/gpu_verl_env.sh` unpacks it.
#
# What the bundle holds:
#   - ray at the image's pin, cut to its core (see RAY_DROP below): what ray.init() of a local cluster, actors,
#     placement groups, ray.util.collective and the state API (verl imports ray.util.state) need. Raylet,
#     gcs_server, _raylet.so and the dashboard's Python modules stay (ray.init() starts the dashboard process,
#     the dashboard agent and the runtime-env agent; without aiohttp_cors/opencensus/... they run in Ray's
#     "minimal" mode: no HTTP server, no dashboard modules); the Java jars, the dashboard's web frontend and
#     the libraries (rllib, tune, train, data, serve, llm, air, workflow) go;
#   - verl and the packages its import path needs (DEPS below; each says who imports it);
#   - bin/ray, a console script that runs on whatever python3 comes first on PATH.
# Nothing that .whl/ or the vLLM bundle carries is carried twice (checked below). About 19 MiB (145 unpacked).
#
# Usage: bash scripts/verl_bundle.sh        (network: PyPI; about 2 minutes, one core)
#        VERL_BUNDLE_PYTHON=3.11 bash scripts/verl_bundle.sh --site DIR
#            only unpack the (stripped) site into DIR, for another Python: a local import check, e.g. with
#            this checkout's .venv (Python 3.11) and the DIR first on PYTHONPATH
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PYVER=${VERL_BUNDLE_PYTHON:-3.12}
SITE_ONLY=""
if [ "${1:-}" = --site ]; then SITE_ONLY=${2:?--site needs a directory}; fi
# the image's pins (docker/stacks, the one source of truth)
read -r RAY_VERSION VERL_VERSION < <(cd "$REPO" && python3 -c \
  'from mlite.images.stacks import load_stack; w = load_stack().wheels; print(w["ray"], w["verl"])')
PY_TAG=cp${PYVER/./}
WHEEL_DIR=${VERL_WHEEL_DIR:-/tmp/vl}
RAY_WHEEL=$WHEEL_DIR/ray-$RAY_VERSION-$PY_TAG-$PY_TAG-manylinux2014_x86_64.whl
CHUNK_MAX=$((44 * 1024 * 1024))  # .verl1 + .vllm1 (16 MiB) + the checkout fit a 64 MiB carry
BUNDLE=verl-bundle.tar.xz

# Not on the GPU machine, not in .whl/ or the vLLM bundle; imported at module level on the main_ppo + vLLM
# server rollout + agent loop path (ray's worker, the TaskRunner, the ActorRolloutRef workers, the replicas).
DEPS=(
  "verl==$VERL_VERSION"          # mlite.integrations.verl
  jsonschema==4.26.0             # ray.runtime_env (ray._private.runtime_env.plugin_schema_manager)
  jsonschema-specifications==2025.9.1  # jsonschema
  referencing==0.37.0            # jsonschema
  rpds-py==2026.9.1              # referencing
  hydra-core==1.3.8              # verl.trainer.main_ppo (@hydra.main), verl.utils.config
  omegaconf==2.3.1               # verl (configs everywhere), hydra
  antlr4-python3-runtime==4.9.3  # omegaconf's and hydra's grammar parsers (sdist only: built here)
  tensordict==0.10.0             # verl.protocol, verl.utils.tensordict_utils, transfer_queue (_C: pybind only)
  pyvers==0.1.0                  # tensordict.utils
  codetiming==1.4.0              # verl.utils.profiler.performance
  datasets==5.2.0                # verl.utils.dataset.rl_dataset
  dill==0.4.1                    # datasets
  multiprocess==0.70.19          # datasets.arrow_dataset
  torchdata==0.11.0              # verl.trainer.ppo.v1.trainer_base (StatefulDataLoader)
  transferqueue==0.1.11          # verl.protocol via verl.utils.transferqueue_utils (import transfer_queue)
  orjson==3.13.0                 # verl.utils.tracking (and tensordict's JSON backend when present)
  uvicorn==0.54.0                # verl.workers.rollout.utils (the replicas' HTTP servers), vllm's api_server
  # vLLM's OpenAI server (verl's replicas serve AsyncLLM through it); mlite's offline path never imports
  # these, so the vLLM bundle does not carry them
  watchfiles==1.3.0              # vllm.entrypoints.serve.utils.ssl (via vllm.entrypoints.launcher)
  model-hosting-container-standards==0.1.16  # vllm.entrypoints.serve.sagemaker.api_router (api_server)
  prometheus-fastapi-instrumentator==8.1.0  # vllm.entrypoints.serve.instrumentator.metrics (build_app)
  jmespath==1.1.0                # model_hosting_container_standards.common
)
# Ray's parts that a local cluster with actors does not load (regexes on the wheel's paths).
RAY_DROP=(
  "ray/jars/"                    # Java workers (32 MB)
  "ray/dashboard/client/"        # the dashboard's web frontend (React build, source maps)
  "ray/(rllib|tune|train|data|serve|llm|air|workflow)/"  # Ray's libraries: imported only by the CLI's
                                 # `serve` group and inside the dashboard's data/serve/train head modules,
                                 # which minimal mode does not load
  "ray/setup-dev\.py"
  "ray-[^/]*\.dist-info/(RECORD|entry_points\.txt)"  # files removed; console scripts: bin/ray below
)
PIP_TARGET_FLAGS=(--only-binary=:all: --python-version "$PYVER" --implementation cp
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux_2_5_x86_64
  --platform manylinux1_x86_64)

WORK=$(mktemp -d /tmp/verl_bundle.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
SITE=${SITE_ONLY:-$WORK/site}
mkdir -p "$SITE" "$WORK/deps"

if [ ! -f "$RAY_WHEEL" ]; then
  echo "verl_bundle: downloading ray==$RAY_VERSION ($PY_TAG) into $WHEEL_DIR"
  mkdir -p "$WHEEL_DIR"
  python3 -m pip download -q --no-deps "${PIP_TARGET_FLAGS[@]}" \
    -d "$WHEEL_DIR" "ray==$RAY_VERSION"
fi

echo "verl_bundle: downloading ${#DEPS[@]} dependency wheels"
binary=() sdist=()
for d in "${DEPS[@]}"; do
  case $d in antlr4-python3-runtime==*) sdist+=("$d") ;; *) binary+=("$d") ;; esac
done
python3 -m pip download -q --no-deps "${PIP_TARGET_FLAGS[@]}" -d "$WORK/deps" "${binary[@]}"
# pure Python, published as an sdist only: build the wheel here
python3 -m pip wheel -q --no-deps -w "$WORK/deps" "${sdist[@]}"

# Never carry a second copy of what .whl/ (gpu_env.sh installs it) or the vLLM bundle already brings.
python3 - "$REPO" "$WORK"/deps/*.whl <<'PY'
import pathlib, re, sys
repo = pathlib.Path(sys.argv[1])
norm = lambda n: re.sub(r"[-_.]+", "-", n).lower()
whl = {norm(p.name.split("-")[0]) for p in (repo / ".whl").glob("*.whl")}
src = (repo / "scripts/vllm_bundle.sh").read_text()
vllm = {norm(m) for m in re.findall(r"^\s+([A-Za-z0-9_.-]+)==", src.split("\nDEPS=(", 1)[1].split("\n)", 1)[0], re.M)}
ours = {norm(pathlib.Path(p).name.split("-")[0]) for p in sys.argv[2:]} | {"ray"}
for name, carried in ((".whl/", whl), ("the vLLM bundle", vllm | {"vllm"})):
    if ours & carried:
        sys.exit(f"verl_bundle: {sorted(ours & carried)} already travel in {name}")
PY

echo "verl_bundle: unpacking and stripping $(basename "$RAY_WHEEL")"
python3 - "$RAY_WHEEL" "$SITE" "${RAY_DROP[@]}" <<'PY'
import os, re, sys, zipfile

wheel, site, *drops = sys.argv[1:]
drop = re.compile("|".join(f"(?:{d})" for d in drops))
kept = dropped = 0
with zipfile.ZipFile(wheel) as z:
    for info in z.infolist():
        if info.is_dir():
            continue
        if drop.match(info.filename):
            dropped += info.file_size
            continue
        os.chmod(z.extract(info, site), (info.external_attr >> 16) & 0o777 or 0o644)  # raylet, gcs_server: 755
        kept += info.file_size
print(f"verl_bundle: ray: kept {kept / 2**20:.1f} MiB, dropped {dropped / 2**20:.1f} MiB")
PY

echo "verl_bundle: installing dependency wheels"
python3 -m pip install -q --no-index --no-deps --no-compile --no-warn-script-location --root-user-action=ignore \
  "${PIP_TARGET_FLAGS[@]}" --target "$SITE" "$WORK"/deps/*.whl
# stray top-level packages of verl's and transferqueue's wheels (their tests, examples and tools): off the
# import path, and names that would shadow the checkout's own scripts/ and tests/
rm -rf "${SITE:?}/bin" "$SITE/tests" "$SITE/tutorial" "$SITE/scripts" "$SITE/recipe"
mkdir -p "$SITE/bin"
cat >"$SITE/bin/ray" <<'PY'
#!/usr/bin/env python3
import sys

from ray.scripts.scripts import main

sys.exit(main())
PY
chmod +x "$SITE/bin/ray"
find "$SITE" -name __pycache__ -type d -prune -exec rm -rf {} +
{
  echo "verl $VERL_VERSION + ray $RAY_VERSION bundle built $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "dep ray==$RAY_VERSION"
  for d in "${DEPS[@]}"; do echo "dep ${d%% *}"; done
} >"$SITE/verl_bundle_stamp.txt"
if [ -n "$SITE_ONLY" ]; then
  echo "verl_bundle: site in $SITE ($(du -sm "$SITE" | cut -f1) MiB, $PY_TAG)"
  exit 0
fi

echo "verl_bundle: compressing $(du -sm "$SITE" | cut -f1) MiB (xz -9e, one thread)"
tar -C "$SITE" --sort=name --owner=0 --group=0 --numeric-owner --mtime=@0 -cf - . |
  xz -9e -T1 >"$WORK/$BUNDLE"
size=$(stat -c %s "$WORK/$BUNDLE")
sha=$(sha256sum "$WORK/$BUNDLE" | cut -d' ' -f1)
if [ "$size" -gt "$CHUNK_MAX" ]; then
  echo "verl_bundle: $BUNDLE is $size bytes, over the $CHUNK_MAX that .verl1 may hold" >&2
  exit 1
fi

rm -rf "$REPO/.verl1"
mkdir -p "$REPO/.verl1"
mv "$WORK/$BUNDLE" "$REPO/.verl1/$BUNDLE.part-aa"
printf 'sha256 %s\npart %s\n' "$sha" "$BUNDLE.part-aa" >"$REPO/.verl1/MANIFEST"
echo "verl_bundle: $BUNDLE $((size / 1024 / 1024)) MiB ($size bytes), sha256 $sha"
