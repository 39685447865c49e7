#!/usr/bin/env bash
# One node's share of an mlite GRPO job. TRAINER=mlite runs mlite's GRPO through torchrun on every node
# (LAUNCHER=torchrun) or from node 0 through a running Ray cluster (LAUNCHER=ray: Ray places one torchrun per
# node); TRAINER=verl hands over to launchers/verl_grpo.sh (verl's main_ppo with the mlite engine, on Ray).
#
#   CONFIG=deepseek_v4_flash_grpo MODEL_PATH=/ckpt/dsv4 TRAIN_FILES=/data/prompts.parquet launchers/grpo.sh
#   DRY_RUN=1 launchers/grpo.sh                 # validate and print the command, start nothing
#
# Knobs as in launchers/sft.sh, plus the GRPO ones. The planner checks the layout first (exit 2 in seconds).
set -euo pipefail

# --- the job
CONFIG=${CONFIG:-deepseek_v4_flash_grpo}                # job YAML file or packaged preset (mlite plan --help)
MODEL_PATH=${MODEL_PATH:-}                # HF checkpoint dir; replaces the config's model
MODEL_NAME=${MODEL_NAME:-}                # catalog preset (mlite/config/catalog.py); replaces the config's model
TRAIN_FILES=${TRAIN_FILES:-}              # comma-separated prompt files (parquet/JSONL)
VAL_FILES=${VAL_FILES:-}                  # comma-separated validation files
TOKENIZER=${TOKENIZER:-}                  # tokenizer dir; default: the model path
# --- parallel layout (empty: the config's)
TP=${TP:-}                                # tensor parallel
PP=${PP:-}                                # pipeline stages
VPP=${VPP:-}                              # virtual stages per pipeline rank
CP=${CP:-}                                # context parallel
EP=${EP:-}                                # expert parallel
ETP=${ETP:-}                              # expert tensor parallel
PP_FIRST_STAGE_LAYERS=${PP_FIRST_STAGE_LAYERS:-}  # layers on the first pipeline stage; null: an even split
PP_LAST_STAGE_LAYERS=${PP_LAST_STAGE_LAYERS:-}    # layers on the last pipeline stage; null: an even split
OPTIMIZER=${OPTIMIZER:-}                  # dist_opt | fsdp2
RECOMPUTE=${RECOMPUTE:-}                  # none | selective | full
PRECISION=${PRECISION:-}                  # bf16 | fp16 | fp32: dtype of matmuls and activations
OPTIMIZER_STATE=${OPTIMIZER_STATE:-}      # master | fp8: Adam's moments in the master dtype or e4m3
FSDP_UNIT_LAYERS=${FSDP_UNIT_LAYERS:-}    # layers one FSDP2 unit gathers at once (fsdp2; 2 for small dense models)
OFFLOAD_PARAMS=${OFFLOAD_PARAMS:-}        # true | false: parameters on the host between uses (fsdp2)
OFFLOAD_GRADS=${OFFLOAD_GRADS:-}          # true | false: gradients on the host
OFFLOAD_OPTIMIZER=${OFFLOAD_OPTIMIZER:-}  # true | false: optimizer state on the host
OFFLOAD_FRACTION=${OFFLOAD_FRACTION:-}    # share of optimizer state on the host (0-1]
# --- batch, length, schedule
SEQ_LEN=${SEQ_LEN:-}                      # longest sample in tokens
MICRO_BATCH=${MICRO_BATCH:-}              # sequences per micro-batch
GLOBAL_BATCH=${GLOBAL_BATCH:-}            # sequences per optimizer step
MAX_TOKENS=${MAX_TOKENS:-}                # tokens per packed micro-batch (dynamic batching)
STEPS=${STEPS:-}                          # optimizer steps
LR=${LR:-}                                # peak learning rate
SAVE_EVERY=${SAVE_EVERY:-}                # steps between checkpoints (0: end and signal only)
DEVICE=${DEVICE:-}                        # cpu for the CPU profile (gloo); empty: the config's
EXTRA_OVERRIDES=${EXTRA_OVERRIDES:-}      # more key=value overrides, space-separated
# --- GRPO (empty: the config's)
TRAINER=${TRAINER:-mlite}                 # mlite: mlite's GRPO | verl: verl's main_ppo with the mlite engine
LAUNCHER=${LAUNCHER:-torchrun}            # torchrun: this node's ranks | ray: node rank 0 drives every node through Ray
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-}        # builtin | vllm
ROLLOUT_N=${ROLLOUT_N:-}                  # responses per prompt (the group)
ROLLOUT_TP=${ROLLOUT_TP:-}                # rollout engine tensor parallel
ROLLOUT_GPU_MEMORY=${ROLLOUT_GPU_MEMORY:-} # vLLM: its share of each GPU while it rolls out (0..1)
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-}    # prompts per optimizer step
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-}        # tokens
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-}    # tokens
REWARD=${REWARD:-}                        # arithmetic | gsm8k | module:function
RAY_CPUS_PER_NODE=${RAY_CPUS_PER_NODE:-1} # CPUs each node's share reserves in Ray (LAUNCHER=ray)
# --- where and how
OUTPUT_ROOT=${OUTPUT_ROOT:-runs}          # checkpoints go to $OUTPUT_ROOT/$RUN_NAME
RUN_NAME=${RUN_NAME:-grpo-$(date +%Y%m%d-%H%M%S)}  # stable across requeues under Slurm (the job id)
RESUME=${RESUME:-auto}                    # auto: continue from the newest good checkpoint | never | <dir>
LOG_DIR=${LOG_DIR:-$OUTPUT_ROOT/$RUN_NAME/logs}  # plan report and resolved command
# --- this node's place in the job (Slurm's lib sets these)
NNODES=${NNODES:-}                        # nodes in the job (empty: the config's cluster.nodes)
NODE_RANK=${NODE_RANK:-0}                 # this node, 0..NNODES-1
GPUS_PER_NODE=${GPUS_PER_NODE:-}          # ranks on this node (empty: cluster.gpus_per_node)
GPU=${GPU:-}                              # GPU type for the planner (h100, h200, ..., cpu)
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}     # the first node's address: the rendezvous
MASTER_PORT=${MASTER_PORT:-29500}         # rendezvous port on the first node
# --- launcher behaviour
PYTHON=${PYTHON:-python}                  # interpreter with mlite installed (the venv or the container's)
VALIDATE=${VALIDATE:-1}                   # 1: run the planner first (Slurm runs it once per job, then 0)
ALLOW_NO_FIT=${ALLOW_NO_FIT:-0}           # 1: launch even when the planner's memory estimate does not fit
DRY_RUN=${DRY_RUN:-0}                     # 1: print the resolved command, start nothing

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
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
add rollout.prompts_per_step "$PROMPTS_PER_STEP"
add rollout.max_prompt_length "$MAX_PROMPT_LEN"
add rollout.max_response_length "$MAX_RESPONSE_LEN"
add grpo.reward "$REWARD"
resolve_cluster_size
if [[ $VALIDATE == 1 ]]; then validate_with_planner; fi

SET_ARGS=()
for item in "${OVERRIDES[@]}"; do SET_ARGS+=(--set "$item"); done
case $LAUNCHER in
  torchrun)
    COMMAND=(
      "$PYTHON" -m torch.distributed.run
      --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
      --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT_S"
      -m mlite grpo "$CONFIG" "${SET_ARGS[@]}"
    ) ;;
  ray)
    # one driver (node rank 0) asks Ray to run each node's torchrun; the others have nothing to start
    [[ $NODE_RANK == 0 ]] || { echo "grpo.sh: node rank $NODE_RANK: LAUNCHER=ray drives from node 0" >&2; exit 0; }
    GPUS_FOR_RAY=$GPUS_PER_NODE
    [[ $DEVICE != cpu ]] || GPUS_FOR_RAY=0
    COMMAND=(
      "$PYTHON" "$HERE/ray_nodes.py" --nodes "$NNODES" --cpus-per-node "$RAY_CPUS_PER_NODE"
      --gpus-per-node "$GPUS_FOR_RAY" --log-dir "$LOG_DIR" --
      "$PYTHON" -m torch.distributed.run
      --nnodes "$NNODES" --node-rank "{node_rank}" --nproc-per-node "$GPUS_PER_NODE"
      --master-addr "{master_addr}" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT_S"
      -m mlite grpo "$CONFIG" "${SET_ARGS[@]}"
    ) ;;
  *) die "LAUNCHER=$LAUNCHER; use torchrun or ray" ;;
esac
launch "${COMMAND[@]}"
