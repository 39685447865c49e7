#!/usr/bin/env bash
# One node's share of an mlite GRPO job. TRAINER=mlite runs mlite's GRPO through torchrun on every node
# (LAUNCHER=torchrun) or from node 0 through a running Ray cluster (LAUNCHER=ray: Ray places one torchrun per
# node); TRAINER=verl hands over to launchers/verl_grpo.sh (verl's main_ppo with the mlite engine, on Ray).
#
#   CONFIG=deepseek_v4_flash_grpo MODEL_PATH=/ckpt/dsv4 TRAIN_FILES=/data/prompts.parquet launchers/grpo.sh
#   DRY_RUN=1 launchers/grpo.sh                 # validate and print the command, start nothing
#
# Knobs: CONFIG, RUN_NAME and the GRPO ones below, every other one in launchers/knobs.sh (shared with
# launchers/sft.sh). The planner checks the layout first (exit 2 in seconds).
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# --- this launcher's knobs
CONFIG=${CONFIG:-deepseek_v4_flash_grpo}  # job YAML file or packaged preset (mlite plan --help)
RUN_NAME=${RUN_NAME:-grpo-$(date +%Y%m%d-%H%M%S)}  # stable across requeues under Slurm (the job id)
# --- GRPO (empty: the config's)
TRAINER=${TRAINER:-mlite}                 # mlite: mlite's GRPO | verl: verl's main_ppo with the mlite engine
LAUNCHER=${LAUNCHER:-torchrun}            # torchrun: this node's ranks | ray: node rank 0 drives every node through Ray
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-}        # builtin | vllm
ROLLOUT_N=${ROLLOUT_N:-}                  # responses per prompt (the group)
ROLLOUT_TP=${ROLLOUT_TP:-}                # rollout engine tensor parallel
ROLLOUT_GPU_MEMORY=${ROLLOUT_GPU_MEMORY:-} # vLLM: its share of each GPU while it rolls out (0..1)
ROLLOUT_OFFLOAD=${ROLLOUT_OFFLOAD:-}      # vLLM: the trainer waits on the host while vLLM is awake (auto|true|false)
ROLLOUT_SPAN_NODES=${ROLLOUT_SPAN_NODES:-} # vLLM: true allows an engine (ROLLOUT_TP) larger than a node
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-}    # prompts per optimizer step
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-}        # tokens
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-}    # tokens
REWARD=${REWARD:-}                        # arithmetic | gsm8k | module:function
RAY_CPUS_PER_NODE=${RAY_CPUS_PER_NODE:-1} # CPUs each node's share reserves in Ray (LAUNCHER=ray)
# --- every other knob (model, data, layout, batch, run folder, node, launcher behaviour), shared with sft.sh
# shellcheck source=launchers/knobs.sh
source "$HERE/knobs.sh"
# shellcheck source=launchers/env.sh
source "$HERE/env.sh"
# shellcheck source=launchers/lib.sh
source "$HERE/lib.sh"

if [[ $TRAINER == verl ]]; then
  # verl's command line (main_ppo, engine=mlite) is built by launchers/verl_grpo.sh, next to the verl plug-in
  [[ -x $HERE/verl_grpo.sh ]] || die "TRAINER=verl needs launchers/verl_grpo.sh (verl's main_ppo with the mlite engine); use TRAINER=mlite"
  [[ $NODE_RANK == 0 ]] || { echo "grpo.sh: node rank $NODE_RANK: verl's driver runs on node 0 only" >&2; exit 0; }
  exec "$HERE/verl_grpo.sh"
fi
[[ $TRAINER == mlite ]] || die "TRAINER=$TRAINER; use mlite or verl"

collect_overrides
add rollout.engine "$ROLLOUT_ENGINE"
add rollout.n "$ROLLOUT_N"
add rollout.tp "$ROLLOUT_TP"
add rollout.gpu_memory_utilization "$ROLLOUT_GPU_MEMORY"
add rollout.offload_trainer "$ROLLOUT_OFFLOAD"
add rollout.span_nodes "$ROLLOUT_SPAN_NODES"
add rollout.prompts_per_step "$PROMPTS_PER_STEP"
add rollout.max_prompt_length "$MAX_PROMPT_LEN"
add rollout.max_response_length "$MAX_RESPONSE_LEN"
add grpo.reward "$REWARD"
resolve_cluster_size
if [[ $VALIDATE == 1 ]]; then validate_with_planner; fi

case $LAUNCHER in
  torchrun)
    torchrun_command grpo "$NODE_RANK" "$MASTER_ADDR"
    COMMAND=("${TORCHRUN[@]}") ;;
  ray)
    # one driver (node rank 0) asks Ray to run each node's torchrun; the others have nothing to start
    [[ $NODE_RANK == 0 ]] || { echo "grpo.sh: node rank $NODE_RANK: LAUNCHER=ray drives from node 0" >&2; exit 0; }
    GPUS_FOR_RAY=$GPUS_PER_NODE
    [[ $DEVICE != cpu ]] || GPUS_FOR_RAY=0
    torchrun_command grpo "{node_rank}" "{master_addr}"
    COMMAND=(
      "$PYTHON" "$HERE/ray_nodes.py" --nodes "$NNODES" --cpus-per-node "$RAY_CPUS_PER_NODE"
      --gpus-per-node "$GPUS_FOR_RAY" --log-dir "$LOG_DIR" -- "${TORCHRUN[@]}"
    ) ;;
  *) die "LAUNCHER=$LAUNCHER; use torchrun or ray" ;;
esac
launch "${COMMAND[@]}"
