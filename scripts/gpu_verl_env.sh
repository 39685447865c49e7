#!/usr/bin/env bash
# Unpack the verl bundle on a bare GPU machine and set verl's environment (source it).
# On the GPU machine, after `. scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh`: unpack the verl bundle that
# scripts/verl_bundle.sh wrote (.verl1/: ray, verl and their dependencies) into /tmp/verl_site with
# gpu_vllm_env.sh's _bundle_unpack (an unpacked bundle with the same sha256 is reused), put it on PYTHONPATH
# and its bin/ (the `ray` command) on PATH, and set the environment for verl's PPO trainer with vLLM's server
# rollout:
#   . scripts/gpu_env.sh; . scripts/gpu_vllm_env.sh; . scripts/gpu_verl_env.sh
#   python3 scripts/verl_probe.py          # imports of the main_ppo + vLLM path, and a local Ray cluster
# Carry .vllm1, .verl1, mlite.egg-info and the .whl/ wheels gpu_env.sh installs (pydantic, pydantic-core,
# annotated-types, typing-inspection): together they fit one command's 64 MiB.
# `. scripts/gpu_verl_env.sh stash` copies .verl1 to /tmp/verl_parts/ instead, for a later command that does
# not carry it (as gpu_vllm_env.sh does for .vllm1).

_verl_env_main() {
  local dest=/tmp/verl_site
  if ! declare -F _bundle_unpack >/dev/null; then
    echo "gpu_verl_env: source scripts/gpu_vllm_env.sh first (it unpacks vLLM and defines _bundle_unpack)" >&2
    return 1
  fi
  _bundle_unpack verl "$dest" "$@" || return 1
  if [ "${1:-}" = stash ]; then return 0; fi
  case ":$PATH:" in
    *":$dest/bin:"*) ;;
    *) export PATH="$dest/bin:$PATH" ;;
  esac
  # gpu_vllm_env.sh sets VLLM_ENABLE_V1_MULTIPROCESSING=0 for mlite's own in-process LLM engine. verl's
  # replicas run vLLM's AsyncLLM behind its OpenAI server instead: the EngineCore always in a process of
  # its own, the model workers under distributed_executor_backend="mp". Ray workers inherit this shell's
  # environment, so drop the in-process switch and let them run with vLLM's default (1), the setting
  # verl's vLLM rollout is written and tested for.
  unset VLLM_ENABLE_V1_MULTIPROCESSING
  # verl finds engine=mlite through our `verl.plugins` entry point, which only installed metadata declares:
  # `pip install -e .` writes it to mlite.egg-info/, and carried with the checkout (on PYTHONPATH) it serves
  if [ ! -f mlite.egg-info/entry_points.txt ]; then
    echo "gpu_verl_env: mlite.egg-info/ is missing: carry it (pip install -e . writes it here), or verl will" \
      "not find model_engine=mlite" >&2
    return 1
  fi
  # offline: Ray must not try to report usage statistics
  export RAY_USAGE_STATS_ENABLED=0
  python3 -c 'import ray, verl, hydra, omegaconf, tensordict, transfer_queue
print("ray", ray.__version__, "verl", verl.__version__, "hydra", hydra.__version__, "omegaconf", omegaconf.__version__,
      "tensordict", tensordict.__version__, "transfer_queue", transfer_queue.__version__, "from", verl.__path__[0])'
}

if [ "${BASH_SOURCE[0]}" = "$0" ]; then
  echo "gpu_verl_env: source it (. scripts/gpu_verl_env.sh), after scripts/gpu_env.sh and scripts/gpu_vllm_env.sh" >&2
  exit 1
fi
_verl_env_main "$@"
