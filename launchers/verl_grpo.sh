#!/usr/bin/env bash
# GRPO with verl's PPO trainer (verl.trainer.main_ppo) and mlite as the training engine of the actor and the
# reference policy (model_engine=mlite). verl's driver runs here and places every rank through Ray: start a
# Ray cluster over the nodes first (or let verl start a local one), then run this once, on the head node.
# Knobs: the environment variables below; those shared with verl_sft.sh are in launchers/verl_knobs.sh.
#
#   MODEL_PATH=/ckpt/qwen3-8b TRAIN_FILES=/data/gsm8k.parquet launchers/verl_grpo.sh
#   DRY_RUN=1 launchers/verl_grpo.sh                      # print the resolved command, start nothing
#   DEVICE=cpu GPUS_PER_NODE=1 ... launchers/verl_grpo.sh # gloo on CPU (verl gets mlite's cpu platform)
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# --- model and data
MODEL_PATH=${MODEL_PATH:-}                # HF checkpoint dir (config, tokenizer, safetensors)
TRAIN_FILES=${TRAIN_FILES:-}              # comma-separated parquet files in verl's RL format (prompt, reward_model, data_source)
VAL_FILES=${VAL_FILES:-}                  # comma-separated validation files (empty: the train files)
PROMPT_KEY=${PROMPT_KEY:-prompt}          # column holding the chat messages
MAX_PROMPT_LEN=${MAX_PROMPT_LEN:-1024}    # tokens
MAX_RESPONSE_LEN=${MAX_RESPONSE_LEN:-1024}  # tokens
REWARD_FILE=${REWARD_FILE:-}              # verl custom reward file (empty: mlite's, data_source names the reward)
REWARD_NAME=${REWARD_NAME:-compute_score} # function in REWARD_FILE
# --- rollout
ROLLOUT_ENGINE=${ROLLOUT_ENGINE:-builtin} # builtin (mlite's sampler, rollout.name=mlite) | vllm | sglang
ROLLOUT_N=${ROLLOUT_N:-8}                 # responses per prompt (the group)
ROLLOUT_TP=${ROLLOUT_TP:-1}               # rollout tensor parallel (builtin: 1)
ROLLOUT_GPU_MEMORY=${ROLLOUT_GPU_MEMORY:-}  # vllm/sglang: the server's share of each GPU it shares with training (0..1; empty: verl's 0.5)
TEMPERATURE=${TEMPERATURE:-1.0}           # sampling temperature
# --- batch and optimizer
PROMPTS_PER_STEP=${PROMPTS_PER_STEP:-64}  # prompts per step (verl's data.train_batch_size)
MINI_BATCH=${MINI_BATCH:-$PROMPTS_PER_STEP}  # prompts per optimizer update (PPO mini-batch)
MICRO_BATCH=${MICRO_BATCH:-4}             # sequences per micro-batch per rank
LR=${LR:-1e-6}                            # learning rate
CLIP_GRAD=${CLIP_GRAD:-1.0}               # gradient-norm clip
KL_COEF=${KL_COEF:-0.001}                 # KL loss to the reference policy (0: no reference model)
STEPS=${STEPS:-}                          # training steps (empty: EPOCHS over the data)
EPOCHS=${EPOCHS:-1}                       # passes over the data
SAVE_EVERY=${SAVE_EVERY:--1}              # steps between checkpoints (-1: none)
# --- where and how
OUTPUT_DIR=${OUTPUT_DIR:-runs/verl-grpo}  # verl's checkpoints
PROJECT=${PROJECT:-mlite-verl-grpo}       # logger project name
EXPERIMENT=${EXPERIMENT:-grpo}            # logger experiment name
LOGGER=${LOGGER:-console}                 # verl loggers, e.g. console or [console,tensorboard]
DEVICE=${DEVICE:-cuda}                    # cuda | cpu (cpu: gloo, mlite's entry point and cpu platform)
NNODES=${NNODES:-1}                       # nodes in the Ray cluster
GPUS_PER_NODE=${GPUS_PER_NODE:-8}         # training ranks per node
# --- layout (TP, PP, CP, EP, DTYPE, offload) and launcher behaviour (PYTHON, EXTRA_ARGS, DRY_RUN),
# shared with verl_sft.sh: launchers/verl_knobs.sh
# shellcheck source=launchers/verl_knobs.sh
source "$HERE/verl_knobs.sh"

# shellcheck source=launchers/env.sh
source "$HERE/env.sh"
# shellcheck source=launchers/lib.sh
source "$HERE/lib.sh"

check_verl_knobs "in verl's RL format"
case $ROLLOUT_ENGINE in
  builtin) ROLLOUT_NAME=mlite
    [[ $ROLLOUT_TP == 1 ]] || die "ROLLOUT_TP=$ROLLOUT_TP with ROLLOUT_ENGINE=builtin: the built-in rollout decodes a whole model per rank; set ROLLOUT_TP=1 or ROLLOUT_ENGINE=vllm" ;;
  vllm | sglang) ROLLOUT_NAME=$ROLLOUT_ENGINE
    [[ $DEVICE == cuda ]] || die "ROLLOUT_ENGINE=$ROLLOUT_ENGINE with DEVICE=$DEVICE: $ROLLOUT_ENGINE serves on GPUs; set ROLLOUT_ENGINE=builtin on the CPU" ;;
  *) die "ROLLOUT_ENGINE=$ROLLOUT_ENGINE; use builtin, vllm or sglang" ;;
esac
if [[ -z $REWARD_FILE ]]; then
  # mlite's reward functions (arithmetic, gsm8k, module:function by data_source); found without importing verl
  REWARD_FILE=$("$PYTHON" -c 'import importlib.util as u; print(u.find_spec("mlite").submodule_search_locations[0])')/integrations/verl/reward.py
fi
VAL_FILES=${VAL_FILES:-$TRAIN_FILES}
USE_KL=true
[[ $KL_COEF != 0 && $KL_COEF != 0.0 ]] || USE_KL=false

verl_entry main_ppo

ARGS=(
  "hydra.searchpath=[pkg://mlite.integrations.verl.config]" model_engine=mlite algorithm.adv_estimator=grpo
  "actor_rollout_ref.model.path=$MODEL_PATH"
  "data.train_files=[$TRAIN_FILES]" "data.val_files=[$VAL_FILES]" "data.prompt_key=$PROMPT_KEY"
  "data.max_prompt_length=$MAX_PROMPT_LEN" "data.max_response_length=$MAX_RESPONSE_LEN"
  "data.train_batch_size=$PROMPTS_PER_STEP"
  "actor_rollout_ref.actor.mlite.tensor_parallel_size=$TP" "actor_rollout_ref.actor.mlite.pipeline_parallel_size=$PP"
  "actor_rollout_ref.actor.mlite.context_parallel_size=$CP" "actor_rollout_ref.actor.mlite.expert_parallel_size=$EP"
  "actor_rollout_ref.actor.mlite.dtype=$DTYPE" "actor_rollout_ref.actor.mlite.device=$DEVICE"
  "actor_rollout_ref.actor.mlite.param_offload=$OFFLOAD_PARAMS"
  "actor_rollout_ref.actor.mlite.optimizer_offload=$OFFLOAD_OPTIMIZER"
  "actor_rollout_ref.actor.optim.lr=$LR" "actor_rollout_ref.actor.optim.clip_grad=$CLIP_GRAD"
  "actor_rollout_ref.actor.ppo_mini_batch_size=$MINI_BATCH"
  "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=$MICRO_BATCH" actor_rollout_ref.actor.use_dynamic_bsz=false
  "actor_rollout_ref.actor.use_kl_loss=$USE_KL" "actor_rollout_ref.actor.kl_loss_coef=$KL_COEF"
  "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH"
  "actor_rollout_ref.rollout.name=$ROLLOUT_NAME" "actor_rollout_ref.rollout.n=$ROLLOUT_N"
  "actor_rollout_ref.rollout.tensor_model_parallel_size=$ROLLOUT_TP"
  "actor_rollout_ref.rollout.temperature=$TEMPERATURE"
  "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=$MICRO_BATCH"
  "reward.custom_reward_function.path=$REWARD_FILE" "reward.custom_reward_function.name=$REWARD_NAME"
  "trainer.total_epochs=$EPOCHS" "trainer.save_freq=$SAVE_EVERY" "trainer.default_local_dir=$OUTPUT_DIR"
  "trainer.project_name=$PROJECT" "trainer.experiment_name=$EXPERIMENT" "trainer.logger=$LOGGER"
  "trainer.device=$DEVICE" "trainer.nnodes=$NNODES" "trainer.n_gpus_per_node=$GPUS_PER_NODE"
)
# the built-in rollout returns no per-token log-probs (verl recomputes them with the actor)
if [[ $ROLLOUT_NAME == mlite ]]; then ARGS+=(actor_rollout_ref.rollout.calculate_log_probs=false); fi
if [[ -n $STEPS ]]; then ARGS+=("trainer.total_training_steps=$STEPS"); fi
if [[ -n $ROLLOUT_GPU_MEMORY ]]; then
  [[ $ROLLOUT_NAME != mlite ]] || die "ROLLOUT_GPU_MEMORY is vLLM's and SGLang's share of the GPU; the built-in rollout takes what it needs: unset it or set ROLLOUT_ENGINE=vllm"
  ARGS+=("actor_rollout_ref.rollout.gpu_memory_utilization=$ROLLOUT_GPU_MEMORY")
fi
# on the CPU each training rank takes one "GPU" slot the local Ray cluster declares (platform_cpu.py)
if [[ $DEVICE == cpu ]]; then ARGS+=("+ray_kwargs.ray_init.num_gpus=$((NNODES * GPUS_PER_NODE))"); fi
read -r -a EXTRA <<<"$EXTRA_ARGS"
ARGS+=("${EXTRA[@]}")

COMMAND=("$PYTHON" -m "$ENTRY" "${ARGS[@]}")
run_verl "${COMMAND[@]}"
