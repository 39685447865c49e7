# shellcheck shell=bash
# shellcheck disable=SC2034  # every knob is read by the launcher that sources this file or by launchers/lib.sh
# The knobs launchers/sft.sh and launchers/grpo.sh share. Sourced by them after their own (CONFIG, RUN_NAME
# and grpo.sh's GRPO knobs), never run. Every knob is an environment variable: a value set in the
# environment wins, an empty one keeps the job config's value.

# --- the job
MODEL_PATH=${MODEL_PATH:-}                # HF checkpoint dir; replaces the config's model
MODEL_NAME=${MODEL_NAME:-}                # catalog preset (mlite/config/catalog.py); replaces the config's model
TRAIN_FILES=${TRAIN_FILES:-}              # comma-separated parquet/JSONL files (SFT: messages format; GRPO: prompts)
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
# --- where and how (RUN_NAME: the launcher's, sft-<date> or grpo-<date> unless set)
OUTPUT_ROOT=${OUTPUT_ROOT:-runs}          # checkpoints go to $OUTPUT_ROOT/$RUN_NAME
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
