#!/usr/bin/env bash
# One node's process in a Slurm job step (started by slurm/lib/job.sh through srun, one task per node):
# takes the node's place from Slurm, sends its output to the node's log, runs the launcher, and leaves
# its exit status where the batch script reads it to say which node failed first.
#
#   node.sh sft|grpo     (everything else comes from the environment job.sh exported)
set -euo pipefail

ROLE=$1
NODE_NAME=${SLURMD_NODENAME:-$(hostname -s)}
export NODE_RANK=${NODE_RANK:-$SLURM_NODEID}   # the step's own node index: 0 on the first node
mkdir -p "$LOG_DIR"
exec >> "$LOG_DIR/node-$NODE_NAME.log" 2>&1
echo "$$" > "$LOG_DIR/node-$NODE_NAME.pid"

# A heartbeat file the batch script watches: a node whose processes vanish (no exit status) is noticed
# within HEARTBEAT_TIMEOUT_S even when srun itself never hears of it.
touch "$LOG_DIR/node-$NODE_NAME.alive"
(trap '' USR1; while sleep "${HEARTBEAT_S:-5}"; do touch "$LOG_DIR/node-$NODE_NAME.alive"; done) &
heartbeat=$!

# shellcheck disable=SC2329  # called by the EXIT trap
report_exit() {
  local rc=$?
  kill "$heartbeat" 2>/dev/null || true
  echo "$rc $(date +%s)" > "$LOG_DIR/node-$NODE_NAME.exit"
  echo "node.sh: $NODE_NAME (node rank $NODE_RANK) exits with status $rc at $(date -u +%H:%M:%SZ)"
}
trap report_exit EXIT
# Slurm signals every process of the step; the launcher below forwards to the ranks, this shell stays
trap 'echo "node.sh: $NODE_NAME got SIGUSR1 (preemption notice)"' USR1

echo "node.sh: $NODE_NAME node rank $NODE_RANK of $NNODES, job $SLURM_JOB_ID restart $RESTART, $(date -u +%FT%TZ)"
rc=0
"$MLITE_ROOT/launchers/$ROLE.sh" &
launcher=$!
while true; do
  wait "$launcher" && rc=0 || rc=$?
  kill -0 "$launcher" 2>/dev/null || break
done
exit "$rc"
