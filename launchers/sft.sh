#!/usr/bin/env bash
# One node's share of an mlite SFT job: torchrun on this node, ranks joining the first node's address.
#
#   CONFIG=deepseek_v4_flash_sft MODEL_PATH=/ckpt/dsv4 TRAIN_FILES=/data/a.parquet launchers/sft.sh
#   DRY_RUN=1 CONFIG=demo_sft launchers/sft.sh       # validate and print the command, start nothing
#
# Every knob is an environment variable; an empty one keeps the job config's value. The planner checks
# the resolved layout first (invalid: exit 2 within seconds). The resolved command goes to
# $LOG_DIR/command.node$NODE_RANK.sh. Under Slurm, slurm/lib/job.sh sets the node knobs.
set -euo pipefail

# --- the job
CONFIG=${CONFIG:-demo_sft}                # job YAML file or packaged preset (mlite plan --help)
MODEL_PATH=${MODEL_PATH:-}                # HF checkpoint dir; replaces the config's model
MODEL_NAME=${MODEL_NAME:-}                # catalog preset (mlite/config/catalog.py); replaces the config's model
TRAIN_FILES=${TRAIN_FILES:-}              # comma-separated parquet/JSONL files (messages format)
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
# --- where and how
OUTPUT_ROOT=${OUTPUT_ROOT:-runs}          # checkpoints go to $OUTPUT_ROOT/$RUN_NAME
RUN_NAME=${RUN_NAME:-sft-$(date +%Y%m%d-%H%M%S)}  # stable across requeues under Slurm (the job id)
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

collect_overrides
resolve_cluster_size
if [[ $VALIDATE == 1 ]]; then validate_with_planner; fi

SET_ARGS=()
for item in "${OVERRIDES[@]}"; do SET_ARGS+=(--set "$item"); done
COMMAND=(
  "$PYTHON" -m torch.distributed.run
  --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$GPUS_PER_NODE"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT_S"
  -m mlite sft "$CONFIG" "${SET_ARGS[@]}"
)
launch "${COMMAND[@]}"
