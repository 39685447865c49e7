#!/usr/bin/env bash
# Set up a bare GPU machine to run mlite from this checkout (source it).
# Prepare a bare GPU machine (torch preinstalled, no network) to run mlite from this checkout:
# install the wheels carried in .whl/ (pydantic, invoke, megatron-core, ...) that the machine lacks into
# /tmp/site (what it has already, numpy or transformers say, stays: a carried copy would shadow it) and put
# the checkout on PYTHONPATH. Source it: `. scripts/gpu_env.sh`.
set -euo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  missing=$(python3 - .whl/*.whl <<'PY'
import importlib.metadata as md, re, sys
for wheel in sys.argv[1:]:
    name = re.sub(r"[-_.]+", "-", wheel.rsplit("/", 1)[-1].split("-")[0]).lower()
    if name == "transformer-engine-torch":  # TE's extension: scripts/gpu_te_env.sh puts it into TE's folder
        continue
    try:
        md.version(name)
    except md.PackageNotFoundError:
        print(wheel)
PY
)
  if [ -n "$missing" ]; then
    echo "gpu_env: installing carried wheels: $(echo "$missing" | xargs -n1 basename | tr '\n' ' ')"
    # shellcheck disable=SC2086  # one wheel path per word
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site $missing
  fi
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
python3 -c "import torch, mlite; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
set +euo pipefail
