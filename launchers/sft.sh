#!/usr/bin/env bash
# One node's share of an mlite SFT job: torchrun on this node, ranks joining the first node's address.
#
#   CONFIG=deepseek_v4_flash_sft MODEL_PATH=/ckpt/dsv4 TRAIN_FILES=/data/a.parquet launchers/sft.sh
#   DRY_RUN=1 CONFIG=demo_sft launchers/sft.sh       # validate and print the command, start nothing
#
# Every knob is an environment variable; an empty one keeps the job config's value. CONFIG and RUN_NAME are
# below, every other knob is in launchers/knobs.sh (shared with grpo.sh). The planner checks the resolved
# layout first (invalid: exit 2 within seconds). The resolved command goes to
# $LOG_DIR/command.node$NODE_RANK.sh. Under Slurm, slurm/lib/job.sh sets the node knobs.
set -euo pipefail

HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)

# --- this launcher's knobs
CONFIG=${CONFIG:-demo_sft}                # job YAML file or packaged preset (mlite plan --help)
RUN_NAME=${RUN_NAME:-sft-$(date +%Y%m%d-%H%M%S)}  # stable across requeues under Slurm (the job id)
# --- every other knob (model, data, layout, batch, run folder, node, launcher behaviour), shared with grpo.sh
# shellcheck source=launchers/knobs.sh
source "$HERE/knobs.sh"
# shellcheck source=launchers/env.sh
source "$HERE/env.sh"
# shellcheck source=launchers/lib.sh
source "$HERE/lib.sh"

collect_overrides
resolve_cluster_size
if [[ $VALIDATE == 1 ]]; then validate_with_planner; fi

torchrun_command sft "$NODE_RANK" "$MASTER_ADDR"
launch "${TORCHRUN[@]}"
