# shellcheck shell=bash
# Functions shared by the launchers: first those of launchers/sft.sh and launchers/grpo.sh (mlite's
# trainers), at the end those of launchers/verl_sft.sh and launchers/verl_grpo.sh (verl's trainers with the
# mlite engine). Sourced after the launcher's knobs are set.

die() { echo "$(basename "$0"): error: $*" >&2; exit 2; }

# add KEY VALUE: one key=value override in OVERRIDES when VALUE is set; an empty knob keeps the config's.
add() { [[ -z $2 ]] || OVERRIDES+=("$1=$2"); }

# The overrides for `mlite plan` / `mlite sft|grpo` from the knobs shared by every launcher.
collect_overrides() {
  OVERRIDES=()

  [[ -z $MODEL_NAME || -z $MODEL_PATH ]] \
    || die "MODEL_NAME=$MODEL_NAME and MODEL_PATH=$MODEL_PATH: set one (a catalog preset or an HF checkpoint dir)"
  if [[ -n $MODEL_PATH ]]; then OVERRIDES+=("model.name=null"); fi
  add model.path "$MODEL_PATH"
  if [[ -n $MODEL_NAME ]]; then OVERRIDES+=("model.path=null"); fi
  add model.name "$MODEL_NAME"
  [[ -z $TRAIN_FILES ]] || add data.train_files "[$TRAIN_FILES]"
  [[ -z $VAL_FILES ]] || add data.val_files "[$VAL_FILES]"
  add data.tokenizer "$TOKENIZER"
  add cluster.nodes "$NNODES"
  add cluster.gpus_per_node "$GPUS_PER_NODE"
  add cluster.gpu "$GPU"
  add parallel.tp "$TP"
  add parallel.pp "$PP"
  add parallel.vpp "$VPP"
  add parallel.cp "$CP"
  add parallel.ep "$EP"
  add parallel.etp "$ETP"
  add parallel.pp_first_stage_layers "$PP_FIRST_STAGE_LAYERS"
  add parallel.pp_last_stage_layers "$PP_LAST_STAGE_LAYERS"
  add optimizer.backend "$OPTIMIZER"
  add parallel.fsdp_unit_layers "${FSDP_UNIT_LAYERS:-}"
  add optimizer.lr "$LR"
  add recompute.granularity "$RECOMPUTE"
  add precision.compute "$PRECISION"
  add precision.optimizer_state "${OPTIMIZER_STATE:-}"
  add offload.params "$OFFLOAD_PARAMS"
  add offload.grads "$OFFLOAD_GRADS"
  add offload.optimizer "$OFFLOAD_OPTIMIZER"
  add offload.optimizer_fraction "$OFFLOAD_FRACTION"
  add data.seq_len "$SEQ_LEN"
  add data.micro_batch_size "$MICRO_BATCH"
  add data.global_batch_size "$GLOBAL_BATCH"
  add data.max_tokens_per_micro_batch "$MAX_TOKENS"
  add trainer.steps "$STEPS"
  add trainer.save_every "$SAVE_EVERY"
  add trainer.device "$DEVICE"
  add trainer.resume "$RESUME"
  [[ -z $OUTPUT_ROOT ]] || add trainer.output_dir "$OUTPUT_ROOT/$RUN_NAME"
  local extra
  # EXTRA_OVERRIDES is a space-separated list of key=value (values without spaces)
  for extra in $EXTRA_OVERRIDES; do OVERRIDES+=("$extra"); done
}

# Fills NNODES and GPUS_PER_NODE from the job config (after overrides) when no knob set them.
resolve_cluster_size() {
  [[ -n $NNODES && -n $GPUS_PER_NODE ]] && return 0
  local sizes
  sizes=$("$PYTHON" - "$CONFIG" "${OVERRIDES[@]}" <<'PY'
import sys
from mlite.config import load_job
from mlite.errors import MliteError
try:
    cluster = load_job(sys.argv[1], sys.argv[2:]).cluster
except MliteError as err:
    sys.exit(f"{err}")
print(cluster.nodes, cluster.gpus_per_node)
PY
  ) || die "cannot read the cluster size from $CONFIG (message above)"
  NNODES=${NNODES:-${sizes% *}}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${sizes#* }}
}

# torchrun_command ROLE NODE_RANK MASTER_ADDR: TORCHRUN is the torchrun command that runs `mlite ROLE` with the
# job config and the overrides on this node's ranks (LAUNCHER=ray: NODE_RANK and MASTER_ADDR are the
# placeholders {node_rank} and {master_addr}, which launchers/ray_nodes.py fills in per node).
# shellcheck disable=SC2034  # TORCHRUN is the launcher's
torchrun_command() {
  local role=$1 rank=$2 addr=$3 set_args=() item
  for item in "${OVERRIDES[@]}"; do set_args+=(--set "$item"); done
  TORCHRUN=(
    "$PYTHON" -m torch.distributed.run
    --nnodes "$NNODES" --node-rank "$rank" --nproc-per-node "$GPUS_PER_NODE"
    --master-addr "$addr" --master-port "$MASTER_PORT" --rdzv-conf "timeout=$RDZV_TIMEOUT_S"
    -m mlite "$role" "$CONFIG" "${set_args[@]}"
  )
}

# The planner checks the resolved layout before anything starts: exit 2 (invalid) or 3 (does not fit)
# stops the launch within seconds, with the planner's own one-line reason. Its report goes to plan.txt.
validate_with_planner() {
  local args=() item rc=0
  for item in "${OVERRIDES[@]}"; do args+=(--set "$item"); done
  mkdir -p "$LOG_DIR"
  "$PYTHON" -m mlite plan "$CONFIG" "${args[@]}" > "$LOG_DIR/plan.txt" 2> "$LOG_DIR/plan.err" || rc=$?
  case $rc in
    0) echo "planner: layout valid and fits; report in $LOG_DIR/plan.txt" >&2 ;;
    3) if [[ $ALLOW_NO_FIT == 1 ]]; then
         echo "planner: layout does not fit (ALLOW_NO_FIT=1: launching anyway); see $LOG_DIR/plan.txt" >&2
       else
         tail -n 1 "$LOG_DIR/plan.txt" >&2
         die "the planner says this layout does not fit in memory (report: $LOG_DIR/plan.txt); change the layout or set ALLOW_NO_FIT=1"
       fi ;;
    *) cat "$LOG_DIR/plan.err" >&2
       die "the planner rejected the job config (exit $rc); fix the knob or config key named above" ;;
  esac
}

# A variable whose name says it may hold a secret (*TOKEN*, *KEY*, *SECRET*, *PASSWORD*, any case): its value
# is never printed or written, only NAME=<redacted>. TOKENIZERS_PARALLELISM, env.sh's own switch, is no secret.
is_secret_name() { [[ $1 != TOKENIZERS_PARALLELISM && ${1^^} =~ TOKEN|KEY|SECRET|PASSWORD ]]; }

# Writes the resolved command (environment included, secrets redacted) to a file a person can read and rerun.
# The file is the user's alone (0600) all the same: it is created anew, under umask 077.
write_command_file() {
  local file=$1; shift
  mkdir -p "$(dirname "$file")"
  rm -f "$file"  # an older file would keep its mode
  (
    umask 077
    {
      echo "#!/usr/bin/env bash"
      echo "# resolved by $(basename "$0") on $(hostname) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
      local name
      for name in $(compgen -e | grep -E '^(CUDA_|NCCL_|TORCH_NCCL_|TORCH_FR_|PYTORCH_|PYTHON[A-Z]|RAY_|OMP_|TOKENIZERS_)' | sort); do
        if is_secret_name "$name"; then
          echo "# export $name=<redacted> (may be a secret: set it in the environment to rerun)"
        else
          printf 'export %s=%q\n' "$name" "${!name}"
        fi
      done
      printf '%q ' "$@"
      echo
    } > "$file"
  )
}

# Runs the command in the background and forwards SIGUSR1/SIGTERM to its child processes, the training
# ranks: the trainer checkpoints at the next step and exits cleanly. torchrun neither handles nor forwards
# SIGUSR1 (it would die of it), so it starts with SIGUSR1 ignored; the ranks install their own handler.
# Under Slurm the step's signal reaches every process anyway. Returns the command's exit status.
run_forwarding_signals() {
  (trap '' USR1; exec "$@") &
  local pid=$! rc=0
  # shellcheck disable=SC2064  # the pid is fixed now, on purpose
  trap "echo 'launcher: SIGUSR1: asking the ranks to checkpoint and stop' >&2; pkill -USR1 -P $pid" USR1
  # shellcheck disable=SC2064
  trap "echo 'launcher: SIGTERM: asking the ranks to checkpoint and stop' >&2; pkill -TERM -P $pid" TERM
  # `wait` returns early when a trapped signal arrives; keep waiting until the command is gone
  while true; do
    wait "$pid" && rc=0 || rc=$?
    kill -0 "$pid" 2>/dev/null || break
  done
  trap - USR1 TERM
  return "$rc"
}

# Writes the resolved command to $LOG_DIR/command.node$NODE_RANK.sh; DRY_RUN=1 prints that file and the
# planner's verdict, otherwise the command runs with signal forwarding.
launch() {
  local file=$LOG_DIR/command.node$NODE_RANK.sh
  write_command_file "$file" "$@"
  if [[ $DRY_RUN == 1 ]]; then
    if [[ -s $LOG_DIR/plan.txt ]]; then echo "# planner: $(tail -n 1 "$LOG_DIR/plan.txt")"; fi
    cat "$file"
    return 0
  fi
  echo "launcher: node $NODE_RANK/$NNODES: $file" >&2
  run_forwarding_signals "$@"
}

# ----------------------------------------------------------------------------- verl_sft.sh, verl_grpo.sh
# check_verl_knobs WHAT: MODEL_PATH and TRAIN_FILES (parquet files WHAT) are set unless DRY_RUN=1, and DEVICE
# is cuda or cpu.
check_verl_knobs() {
  [[ $DRY_RUN == 1 || -n $MODEL_PATH ]] || die "set MODEL_PATH to an HF checkpoint dir"
  [[ $DRY_RUN == 1 || -n $TRAIN_FILES ]] || die "set TRAIN_FILES to parquet files $1"
  [[ $DEVICE == cuda || $DEVICE == cpu ]] || die "DEVICE=$DEVICE; use cuda or cpu"
}

# verl_entry MODULE: ENTRY is verl's trainer module verl.trainer.MODULE, or on the CPU mlite's
# mlite.integrations.verl.MODULE with VERL_PLATFORM=cpu exported: verl's own entry joins
# "cpu:gloo,<device>:<backend>", which torch refuses for the CPU; ours joins gloo.
# shellcheck disable=SC2034  # ENTRY is the launcher's
verl_entry() {
  ENTRY=verl.trainer.$1
  if [[ $DEVICE == cpu ]]; then
    export VERL_PLATFORM=cpu
    ENTRY=mlite.integrations.verl.$1
  fi
}

# run_verl COMMAND...: DRY_RUN=1 prints the command (VERL_PLATFORM=cpu first on the CPU) and exits, otherwise
# the command replaces this shell.
run_verl() {
  if [[ $DRY_RUN == 1 ]]; then
    [[ $DEVICE != cpu ]] || echo "VERL_PLATFORM=cpu \\"
    printf '%q ' "$@"
    echo
    exit 0
  fi
  exec "$@"
}
