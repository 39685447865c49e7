#!/usr/bin/env bash
# Prepare a bare GPU machine (torch preinstalled, no network) to run mlite from this checkout:
# install the wheels carried in .whl/ (pydantic, invoke, megatron-core, ...) into /tmp/site and put the
# checkout on PYTHONPATH. Source it: `. scripts/gpu_env.sh`.
set -euo pipefail
if compgen -G ".whl/*.whl" >/dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
fi
export PYTHONPATH="$PWD:/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false HF_HUB_OFFLINE=1
export PYTORCH_CUDA_ALLOC_CONF=${PYTORCH_CUDA_ALLOC_CONF:-expandable_segments:True}
python3 -c "import torch, mlite; print('torch', torch.__version__, 'cuda', torch.version.cuda, 'gpus', torch.cuda.device_count(), torch.cuda.get_device_name() if torch.cuda.is_available() else '')"
set +euo pipefail
