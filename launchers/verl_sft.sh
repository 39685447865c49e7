#!/usr/bin/env bash
# SFT with verl's trainer (verl.trainer.sft_trainer) and mlite as its training engine (engine=mlite).
# One node's share: torchrun starts this node's ranks; run it on every node (Slurm: one task per node).
# Knobs: the environment variables below; those shared with verl_grpo.sh are in launchers/verl_knobs.sh.
#
#   MODEL_PATH=/ckpt/qwen3-8b TRAIN_FILES=/data/sft.parquet launchers/verl_sft.sh
#   DRY_RUN=1 launchers/verl_sft.sh                       # print the resolved command, start nothing
#   DEVICE=cpu NPROC=2 ... launchers/verl_sft.sh          # gloo on CPU (verl gets mlite's cpu platform)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# --- model and data
MODEL_PATH=${MODEL_PATH:-}                # HF checkpoint dir (config, tokenizer, safetensors)
TRAIN_FILES=${TRAIN_FILES:-}              # comma-separated parquet files with a messages column
VAL_FILES=${VAL_FILES:-}                  # comma-separated validation files (empty: none)
MESSAGES_KEY=${MESSAGES_KEY:-messages}    # column holding the conversation
MAX_LENGTH=${MAX_LENGTH:-4096}            # longest sample in tokens
# --- batch and optimizer
GLOBAL_BATCH=${GLOBAL_BATCH:-256}         # sequences per optimizer step
MICRO_BATCH=${MICRO_BATCH:-4}             # sequences per micro-batch (when DYNAMIC_BSZ=false)
DYNAMIC_BSZ=${DYNAMIC_BSZ:-true}          # pack micro-batches by tokens
MAX_TOKENS=${MAX_TOKENS:-8192}            # tokens per micro-batch per GPU (dynamic batching)
LR=${LR:-1e-5}                            # peak learning rate
WARMUP_RATIO=${WARMUP_RATIO:-0.0}         # share of steps spent warming up
SCHEDULE=${SCHEDULE:-cosine}              # constant | cosine
CLIP_GRAD=${CLIP_GRAD:-1.0}               # gradient-norm clip
EPOCHS=${EPOCHS:-1}                       # passes over the data
STEPS=${STEPS:-}                          # optimizer steps (empty: EPOCHS x steps per epoch)
# --- where and how
OUTPUT_DIR=${OUTPUT_DIR:-runs/verl-sft}   # verl's checkpoints
PROJECT=${PROJECT:-mlite-verl-sft}        # logger project name
LOGGER=${LOGGER:-console}                 # verl loggers, e.g. console or [console,tensorboard]
DEVICE=${DEVICE:-cuda}                    # cuda | cpu (cpu: gloo and verl's platform from mlite)
NNODES=${NNODES:-1}                       # nodes in the job
NODE_RANK=${NODE_RANK:-0}                 # this node, 0..NNODES-1
NPROC=${NPROC:-8}                         # ranks on this node
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}     # the first node's address
MASTER_PORT=${MASTER_PORT:-29500}         # rendezvous port on the first node
# --- layout (TP, PP, CP, EP, DTYPE, offload) and launcher behaviour (PYTHON, EXTRA_ARGS, DRY_RUN),
# shared with verl_grpo.sh: launchers/verl_knobs.sh
# shellcheck source=launchers/verl_knobs.sh
source "$HERE/verl_knobs.sh"

# shellcheck source=launchers/env.sh
source "$HERE/env.sh"
# shellcheck source=launchers/lib.sh
source "$HERE/lib.sh"

check_verl_knobs "with a '$MESSAGES_KEY' column"
verl_entry sft_trainer

ARGS=(
  "hydra.searchpath=[pkg://mlite.integrations.verl.config]" engine=mlite
  "model.path=$MODEL_PATH"
  "data.train_files=[$TRAIN_FILES]" "data.messages_key=$MESSAGES_KEY" "data.max_length=$MAX_LENGTH"
  "data.train_batch_size=$GLOBAL_BATCH" "data.micro_batch_size_per_gpu=$MICRO_BATCH"
  "data.use_dynamic_bsz=$DYNAMIC_BSZ" "data.max_token_len_per_gpu=$MAX_TOKENS"
  "engine.tensor_parallel_size=$TP" "engine.pipeline_parallel_size=$PP" "engine.context_parallel_size=$CP"
  "engine.expert_parallel_size=$EP" "engine.dtype=$DTYPE" "engine.device=$DEVICE"
  "engine.param_offload=$OFFLOAD_PARAMS" "engine.optimizer_offload=$OFFLOAD_OPTIMIZER"
  "optim.lr=$LR" "optim.lr_warmup_steps_ratio=$WARMUP_RATIO" "optim.lr_scheduler_type=$SCHEDULE"
  "optim.clip_grad=$CLIP_GRAD"
  "trainer.total_epochs=$EPOCHS" "trainer.default_local_dir=$OUTPUT_DIR" "trainer.project_name=$PROJECT"
  "trainer.logger=$LOGGER" "trainer.device=$DEVICE" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$NPROC"
)
if [[ -n $VAL_FILES ]]; then ARGS+=("data.val_files=[$VAL_FILES]"); fi
if [[ -n $STEPS ]]; then ARGS+=("trainer.total_training_steps=$STEPS"); fi
read -r -a EXTRA <<<"$EXTRA_ARGS"
ARGS+=("${EXTRA[@]}")

COMMAND=(
  "$PYTHON" -m torch.distributed.run --nnodes "$NNODES" --node-rank "$NODE_RANK" --nproc-per-node "$NPROC"
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT"
  -m "$ENTRY" "${ARGS[@]}"
)
run_verl "${COMMAND[@]}"
