# shellcheck shell=bash
# The work behind every sbatch template: logs, container mode, planner check, the launch on every node
# (torchrun, or a Ray cluster for GRPO), fail-fast when a node dies, checkpoint-and-requeue on preemption.
#
# A template sets its knobs, checks that MLITE_ROOT is a checkout only its user or root can change (nothing
# from a planted folder may run), then:   source "$MLITE_ROOT/slurm/lib/job.sh"; run_job sft|grpo
#
# Knobs read here (each with a default):
CONTAINER=${CONTAINER:-none}              # none (bare venv) | pyxis (enroot) | apptainer
IMAGE=${IMAGE:-}                          # container image: pyxis URI/squashfs, or apptainer .sif
MOUNTS=${MOUNTS:-}                        # comma-separated src:dst mounts (the repo and OUTPUT_ROOT at least)
VENV=${VENV:-}                            # bare mode: venv to activate on every node (empty: the current python)
OUTPUT_ROOT=${OUTPUT_ROOT:-$MLITE_ROOT/runs}  # checkpoints in $OUTPUT_ROOT/$RUN_NAME, logs in .../logs/
RUN_NAME=${RUN_NAME:-}                    # empty: <job name>-<job id>, stable across requeues (resume finds it)
RESUME=${RESUME:-auto}                    # requeued runs continue from the newest good checkpoint
GPUS_PER_NODE=${GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}  # ranks per node; empty: Slurm's GPUs per node (CPU profile: 1)
MASTER_PORT=${MASTER_PORT:-}              # torchrun rendezvous; empty: 20000 + job id % 20000 (jobs sharing a node never clash)
FAIL_GRACE_S=${FAIL_GRACE_S:-10}          # after the first node fails: how long the others get to stop
export HEARTBEAT_S=${HEARTBEAT_S:-5}      # each node touches logs/node-NAME.alive this often
HEARTBEAT_TIMEOUT_S=${HEARTBEAT_TIMEOUT_S:-30}  # a node silent this long (and no exit status) has died
REQUEUE_ON_PREEMPT=${REQUEUE_ON_PREEMPT:-1}  # 1: after a SIGUSR1 checkpoint, `scontrol requeue` this job
RAY=${RAY:-0}                             # 1: start a Ray cluster over the job's nodes (GRPO on Ray)
RAY_PORT=${RAY_PORT:-}                    # Ray head (GCS) port; empty: 40000 + job id % 20000
RAY_READY_TIMEOUT_S=${RAY_READY_TIMEOUT_S:-180}  # every node must join Ray within this, or the job fails
DRY_RUN=${DRY_RUN:-0}                     # 1: print the srun commands and the resolved launch, start nothing

export OUTPUT_ROOT RESUME
# the launch environment (NCCL, allocator, Ray health checks and auth): Ray's daemons start here, not in a launcher
# shellcheck source=launchers/env.sh
source "$MLITE_ROOT/launchers/env.sh"

log() { echo "[mlite $(date -u +%H:%M:%S)] $*"; }
fail() { echo "[mlite $(date -u +%H:%M:%S)] error: $*" >&2; exit 1; }
# An empty file only this user can read or write, made anew (an older one would keep its mode).
private_file() { rm -f "$1"; (umask 077 && : > "$1"); }

# ------------------------------------------------------------------------------------------ the job's place
job_init() {
  if [[ -z ${SLURM_JOB_ID:-} ]]; then
    [[ $DRY_RUN == 1 ]] || fail "not inside a Slurm job; submit with sbatch, or DRY_RUN=1 to print the launch"
    dry_run_allocation
  fi
  export GPUS_PER_NODE=${GPUS_PER_NODE:-8}
  export RUN_NAME=${RUN_NAME:-$SLURM_JOB_NAME-$SLURM_JOB_ID}
  export MASTER_PORT=${MASTER_PORT:-$((20000 + SLURM_JOB_ID % 20000))}
  RAY_PORT=${RAY_PORT:-$((40000 + SLURM_JOB_ID % 20000))}
  export RESTART=${SLURM_RESTART_COUNT:-0}
  export LOG_DIR=$OUTPUT_ROOT/$RUN_NAME/logs/job-$SLURM_JOB_ID-restart-$RESTART
  mkdir -p "$LOG_DIR"
  if [[ $DRY_RUN != 1 ]]; then mapfile -t NODES < <(scontrol show hostnames "$SLURM_JOB_NODELIST"); fi
  export NNODES=${#NODES[@]}
  HEAD_NODE=${NODES[0]}
  # the head's address as Slurm knows it (NodeAddr), which node names need not resolve to
  if [[ $DRY_RUN != 1 ]]; then MASTER_ADDR=$(scontrol show node "$HEAD_NODE" | sed -n 's/.*NodeAddr=\([^ ]*\).*/\1/p'); fi
  export MASTER_ADDR=${MASTER_ADDR:-$HEAD_NODE}
  export MLITE_ROOT
  log "job $SLURM_JOB_ID ($SLURM_JOB_NAME) restart $RESTART: $NNODES nodes (${NODES[*]}), head $HEAD_NODE ($MASTER_ADDR)"
  log "logs: $LOG_DIR"
  if [[ $DRY_RUN != 1 ]]; then scontrol show job "$SLURM_JOB_ID" > "$LOG_DIR/slurm-job.txt" 2>&1 || true; fi
}

# DRY_RUN=1 outside Slurm: the allocation the template's #SBATCH header asks for, with placeholder nodes.
dry_run_allocation() {
  local script=$0 nodes gpus
  nodes=$(sed -n 's/^#SBATCH --nodes=\([0-9]*\).*/\1/p' "$script" | head -n1)
  gpus=$(sed -n 's/^#SBATCH --gpus-per-node=\([0-9]*\).*/\1/p' "$script" | head -n1)
  SLURM_JOB_ID=0
  SLURM_JOB_NAME=$(sed -n 's/^#SBATCH --job-name=\([^ ]*\).*/\1/p' "$script" | head -n1)
  SLURM_JOB_NAME=${SLURM_JOB_NAME:-dry-run}
  RUN_NAME=${RUN_NAME:-$SLURM_JOB_NAME-dry-run}
  GPUS_PER_NODE=${GPUS_PER_NODE:-${gpus:-8}}
  mapfile -t NODES < <(seq -f 'node%g' 1 "${nodes:-1}")
  export SLURM_JOB_ID SLURM_JOB_NAME
  log "DRY_RUN=1 outside Slurm: a ${nodes:-1}-node allocation of ${GPUS_PER_NODE} GPUs each from the #SBATCH header"
}

# ------------------------------------------------------------------------------------------ container mode
# srun options and the command prefix that run a step in the chosen container (or the bare venv).
container_setup() {
  SRUN_CONTAINER=()
  RUN_PREFIX=()
  if [[ $CONTAINER != none && -z $IMAGE && $DRY_RUN == 1 ]]; then
    log "warning: IMAGE is empty; the commands below show <IMAGE> where the container image goes"
    IMAGE='<IMAGE>'
  fi
  case $CONTAINER in
    none)
      if [[ -n $VENV ]]; then
        [[ -x $VENV/bin/python ]] || fail "VENV=$VENV has no bin/python; set VENV to the venv with mlite installed"
        export PATH=$VENV/bin:$PATH VIRTUAL_ENV=$VENV
      fi
      export PYTHON=${PYTHON:-$(command -v python)} ;;
    pyxis)
      [[ -n $IMAGE ]] || fail "CONTAINER=pyxis needs IMAGE (e.g. IMAGE=nvcr.io#nvidia/pytorch:26.05-py3 or a .sqsh)"
      # a per-job, per-restart name: every step of this run shares one container, no later job reuses it
      SRUN_CONTAINER=(--container-image="$IMAGE" --container-name="mlite-$SLURM_JOB_ID-$RESTART"
                      --no-container-mount-home --container-workdir="$MLITE_ROOT")
      if [[ -n $MOUNTS ]]; then SRUN_CONTAINER+=(--container-mounts="$MOUNTS"); fi
      export PYTHON=${PYTHON:-python} ;;
    apptainer)
      [[ -n $IMAGE ]] || fail "CONTAINER=apptainer needs IMAGE (a .sif file)"
      RUN_PREFIX=(apptainer exec --nv --pwd "$MLITE_ROOT")  # the job's environment (knobs) passes through
      if [[ -n $MOUNTS ]]; then RUN_PREFIX+=(--bind "$MOUNTS"); fi
      RUN_PREFIX+=("$IMAGE")
      export PYTHON=${PYTHON:-python} ;;
    *) fail "CONTAINER=$CONTAINER; use none, pyxis or apptainer" ;;
  esac
}

# srun ... in the container: step_srun [srun options] -- command...   (DRY_RUN=1: print it)
step_srun() {
  srun_command "$@"
  if [[ $DRY_RUN == 1 ]]; then printf '%q ' "${SRUN_CMD[@]}"; echo; return 0; fi
  "${SRUN_CMD[@]}"
}

# The same in the background; BG_PID is srun's own pid, so a signal sent there reaches srun, which passes
# it to every process of the step on every node.
step_srun_bg() {
  srun_command "$@"
  "${SRUN_CMD[@]}" &
  BG_PID=$!
}

srun_command() {
  local opts=()
  while [[ $1 != -- ]]; do opts+=("$1"); shift; done
  shift
  SRUN_CMD=(srun "${opts[@]}" "${SRUN_CONTAINER[@]}" "${RUN_PREFIX[@]}" "$@")
}

# ------------------------------------------------------------------------------------------ planner check
# Once per job, on the head node, before any training step: the launcher validates the resolved layout
# (exit 2 within seconds when it is invalid) and writes the planner's report and the command to LOG_DIR.
validate_launch() {
  local role=$1 rc=0
  log "checking the layout with the planner (launchers/$role.sh, DRY_RUN=1)"
  private_file "$LOG_DIR/launch.txt"  # the resolved command and its environment (secrets redacted)
  if [[ $DRY_RUN == 1 ]]; then  # outside an allocation: here, with this machine's mlite
    NODE_RANK=0 VALIDATE=1 PYTHON=${PYTHON_HERE:-python} "$MLITE_ROOT/launchers/$role.sh" > "$LOG_DIR/launch.txt" 2>&1 || rc=$?
  else
    step_srun --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" -- \
      env DRY_RUN=1 VALIDATE=1 NODE_RANK=0 "$MLITE_ROOT/launchers/$role.sh" > "$LOG_DIR/launch.txt" 2>&1 || rc=$?
  fi
  if ((rc != 0)); then  # keep the planner's status: 2 invalid, 3 does not fit
    cat "$LOG_DIR/launch.txt" >&2
    echo "[mlite $(date -u +%H:%M:%S)] error: the launch was refused before starting (exit $rc): see the line above" >&2
    exit "$rc"
  fi
  cat "$LOG_DIR/launch.txt"
}

# ------------------------------------------------------------------------------------------ preemption
PREEMPTED=0
STEP_PIDS=()
on_preempt() {
  PREEMPTED=1
  log "SIGUSR1: preemption notice; asking every rank to checkpoint at its next step"
  local pid
  # srun passes the signal to every process of its step on every node
  for pid in "${STEP_PIDS[@]}"; do kill -USR1 "$pid" 2>/dev/null || true; done
}

maybe_requeue() {
  ((PREEMPTED == 1)) || return 0
  if [[ $REQUEUE_ON_PREEMPT == 1 ]]; then
    log "checkpoint written; requeueing job $SLURM_JOB_ID (it resumes with RESUME=$RESUME)"
    scontrol requeue "$SLURM_JOB_ID" || fail "scontrol requeue $SLURM_JOB_ID failed; resubmit by hand (RESUME=auto continues)"
  else
    log "checkpoint written; REQUEUE_ON_PREEMPT=0, not requeueing"
  fi
  exit 0
}

# ------------------------------------------------------------------------------------------ fail fast
# Each node's node.sh leaves "status epoch" in node-NAME.exit. A node without one died with its processes.
node_report() {
  local node file rc when line
  for node in "${NODES[@]}"; do
    file=$LOG_DIR/node-$node.exit
    if [[ -s $file ]]; then
      read -r rc when < "$file"
      line="$node: exit status $rc at $(date -u -d "@$when" +%H:%M:%SZ)"
    elif [[ -f $LOG_DIR/node-$node.alive ]] && (($(date +%s) - $(stat -c %Y "$LOG_DIR/node-$node.alive") <= 2 * HEARTBEAT_S)); then
      line="$node: still running, stopped with the job"
    else
      line="$node: no exit status (the node or its processes died: killed, out of memory, hardware)"
    fi
    echo "  $line; log $LOG_DIR/node-$node.log"
  done
}

# The node to blame once the step is over: one that left no exit status, else the earliest non-zero exit.
# With --exited: among the nodes that have exited so far (while the others may still be stopping).
first_failed_node() {
  local node file rc when best="" best_when=""
  for node in "${NODES[@]}"; do
    file=$LOG_DIR/node-$node.exit
    if [[ ! -s $file ]]; then
      [[ ${1:-} == --exited ]] && continue
      echo "$node (died without an exit status)"
      return
    fi
    read -r rc when < "$file"
    if ((rc != 0)) && { [[ -z $best_when ]] || ((when < best_when)); }; then best=$node; best_when=$when; fi
  done
  [[ -z $best ]] || echo "$best (exit status $(cut -d' ' -f1 "$LOG_DIR/node-$best.exit"))"
}

# Nodes whose heartbeat is older than $1 seconds (default HEARTBEAT_TIMEOUT_S) and that left no exit status:
# their processes died with no word to srun.
silent_nodes() {
  local node alive now limit=${1:-$HEARTBEAT_TIMEOUT_S}
  now=$(date +%s)
  for node in "${NODES[@]}"; do
    alive=$LOG_DIR/node-$node.alive
    [[ -f $alive && ! -s $LOG_DIR/node-$node.exit ]] || continue
    if ((now - $(stat -c %Y "$alive") > limit)); then echo "$node"; fi
  done
}

any_node_failed() {
  local file rc _when
  for file in "$LOG_DIR"/node-*.exit; do
    [[ -s $file ]] || continue
    read -r rc _when < "$file"
    ((rc == 0)) || return 0
  done
  return 1
}

BLAME=""  # the node the first failure was seen on, as watch_step saw it

# Waits for the step while watching the nodes: once any node has failed, the rest get FAIL_GRACE_S to
# stop (srun --kill-on-bad-exit stops them); a step that outlives that (a node that vanished never
# reports) is killed, and the job fails with the node named. Extra pids (Ray) must stay alive too.
watch_step() {
  local step_pid=$1; shift
  local guards=("$@") failed_at="" pid rc=0 silent
  while kill -0 "$step_pid" 2>/dev/null; do
    if [[ -z $failed_at ]] && any_node_failed; then
      failed_at=$SECONDS
      BLAME=$(first_failed_node --exited)
      log "node $BLAME failed; stopping the job (the others get ${FAIL_GRACE_S}s)"
    fi
    silent=$(silent_nodes)
    if [[ -z $failed_at && -n $silent ]]; then
      failed_at=$SECONDS
      BLAME="${silent//$'\n'/, } (died: no heartbeat for ${HEARTBEAT_TIMEOUT_S}s and no exit status)"
      log "node $BLAME; stopping the job"
    fi
    for pid in "${guards[@]}"; do
      if [[ -z $failed_at ]] && ! kill -0 "$pid" 2>/dev/null; then
        failed_at=$SECONDS
        log "a Ray process of this job ended (${GUARD_NAMES[$pid]:-srun $pid}); stopping the job"
      fi
    done
    if [[ -n $failed_at ]] && ((SECONDS - failed_at > FAIL_GRACE_S)); then
      log "the step did not stop within ${FAIL_GRACE_S}s; killing it"
      kill -KILL "$step_pid" 2>/dev/null || true
      break
    fi
    sleep 1
  done
  { wait "$step_pid"; } 2>/dev/null && rc=0 || rc=$?  # (no "Killed" line from bash for the srun we killed)
  if [[ -n $failed_at ]] && ((rc == 0)); then rc=1; fi
  return "$rc"
}

finish() {
  local rc=$1 what=$2
  if ((rc == 0)); then
    maybe_requeue
    log "$what finished on all $NNODES nodes"
    return 0
  fi
  # a node that died silently is the cause even when a survivor's error was seen first
  local dead culprit
  dead=$(silent_nodes $((2 * HEARTBEAT_S)))
  if [[ -n $dead ]]; then
    culprit="${dead//$'\n'/, } (died: its heartbeat stopped and it left no exit status)"
  else
    culprit=${BLAME:-$(first_failed_node)}
  fi
  {
    echo "[mlite $(date -u +%H:%M:%S)] error: $what failed${culprit:+ first on node $culprit} (step exit $rc); per node:"
    node_report
  } >&2
  exit 1
}

# ------------------------------------------------------------------------------------------ torchrun jobs
run_on_all_nodes() {
  local role=$1 step_pid rc=0
  log "starting launchers/$role.sh on $NNODES nodes (torchrun rendezvous $MASTER_ADDR:$MASTER_PORT)"
  if [[ $DRY_RUN == 1 ]]; then
    step_srun --nodes="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 -- "$MLITE_ROOT/slurm/lib/node.sh" "$role"
    return 0
  fi
  step_srun_bg --nodes="$NNODES" --ntasks="$NNODES" --ntasks-per-node=1 --kill-on-bad-exit=1 -- \
    "$MLITE_ROOT/slurm/lib/node.sh" "$role"
  step_pid=$BG_PID
  STEP_PIDS=("$step_pid")
  watch_step "$step_pid" || rc=$?
  finish "$rc" "launchers/$role.sh"
}

# ------------------------------------------------------------------------------------------ Ray jobs
declare -A GUARD_NAMES=()

# Ray's token authentication (https://docs.ray.io/en/latest/ray-security/token-auth.html): a new random token per
# job and restart, in a folder of the shared run folder that only this user can open, so every node reads the
# same one. Only its path travels (RAY_AUTH_TOKEN_PATH): the value is in no environment, command line or log.
ray_auth_setup() {
  if [[ $RAY_AUTH_MODE != token ]]; then
    log "warning: RAY_AUTH_MODE=$RAY_AUTH_MODE: anyone who reaches this job's Ray ports can run code as $(id -un)"
    return 0
  fi
  RAY_AUTH_DIR=$OUTPUT_ROOT/$RUN_NAME/ray-auth-$SLURM_JOB_ID-$RESTART
  (umask 077 && mkdir -p "$RAY_AUTH_DIR")
  [[ -O $RAY_AUTH_DIR ]] || fail "$RAY_AUTH_DIR belongs to another user; remove it or set RUN_NAME"
  chmod 700 "$RAY_AUTH_DIR"
  private_file "$RAY_AUTH_DIR/token"
  head -c 32 /dev/urandom | od -An -tx1 | tr -d ' \n' > "$RAY_AUTH_DIR/token"  # 256 bits, as Ray's own
  unset RAY_AUTH_TOKEN  # Ray would take a token from the environment before the file
  export RAY_AUTH_TOKEN_PATH=$RAY_AUTH_DIR/token
  [[ $DRY_RUN == 1 ]] || trap 'rm -rf "$RAY_AUTH_DIR"' EXIT  # a refused launch leaves none; stop_ray takes over
  log "Ray: token authentication; this job's token is $RAY_AUTH_TOKEN_PATH (mode 0600, only $(id -un) reads it)"
}

# CPUs Slurm gave this job on each node; Ray's own count would see the whole machine or a cgroup.
ray_cpus() { echo "${SLURM_CPUS_ON_NODE:-$(nproc)}"; }

ray_ready() {
  local status nodes
  status=$("$PYTHON" -m ray.scripts.scripts status --address "$MASTER_ADDR:$RAY_PORT" 2>/dev/null) || return 1
  nodes=$(sed -n '/^Active:/,/^Pending:/p' <<< "$status" | grep -c 'node_' || true)
  RAY_STATUS_LINE="$nodes/$NNODES nodes"
  ((nodes >= NNODES)) || return 1
  local want_gpus=$((NNODES * GPUS_PER_NODE)) gpus
  if [[ ${DEVICE:-} == cpu ]]; then
    RAY_STATUS_LINE+=", $(grep -Eo '[0-9.]+/[0-9.]+ CPU' <<< "$status" | head -n1)"
    return 0
  fi
  gpus=$(grep -Eo '/[0-9.]+ GPU' <<< "$status" | head -n1 | tr -dc '0-9.' | cut -d. -f1)
  RAY_STATUS_LINE+=", ${gpus:-0}/$want_gpus GPUs"
  ((${gpus:-0} >= want_gpus))
}

start_ray() {
  local cpus gpus=$GPUS_PER_NODE workers=$((NNODES - 1))
  cpus=$(ray_cpus)
  [[ ${DEVICE:-} != cpu ]] || gpus=0
  local ray_common=(--block --num-cpus="$cpus" --num-gpus="$gpus" --disable-usage-stats)
  # the head listens on the job's address (its client server too), its dashboard on this node only
  local ray_head=(--head --node-ip-address="$MASTER_ADDR" --port="$RAY_PORT" --dashboard-host=127.0.0.1)
  log "Ray: head on $HEAD_NODE ($MASTER_ADDR:$RAY_PORT), then $workers workers in one srun; $cpus CPUs and $gpus GPUs per node"
  if [[ $DRY_RUN == 1 ]]; then
    step_srun --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" -- "$PYTHON" -m ray.scripts.scripts start \
      "${ray_head[@]}" "${ray_common[@]}"
    ((workers == 0)) || step_srun --nodes="$workers" --ntasks="$workers" --ntasks-per-node=1 --overlap \
      --exclude="$HEAD_NODE" -- "$PYTHON" -m ray.scripts.scripts start --address="$MASTER_ADDR:$RAY_PORT" "${ray_common[@]}"
    return 0
  fi
  step_srun_bg --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" --output="$LOG_DIR/ray-head-$HEAD_NODE.log" -- \
    "$PYTHON" -m ray.scripts.scripts start "${ray_head[@]}" "${ray_common[@]}"
  RAY_HEAD_PID=$BG_PID
  GUARD_NAMES[$RAY_HEAD_PID]="Ray head on $HEAD_NODE, log $LOG_DIR/ray-head-$HEAD_NODE.log"
  RAY_PIDS=("$RAY_HEAD_PID")
  wait_for_ray 1 || true  # the head must answer before workers try to join it
  if ((workers > 0)); then
    step_srun_bg --nodes="$workers" --ntasks="$workers" --ntasks-per-node=1 --overlap --exclude="$HEAD_NODE" \
      --output="$LOG_DIR/ray-worker-%N.log" -- \
      "$PYTHON" -m ray.scripts.scripts start --address="$MASTER_ADDR:$RAY_PORT" "${ray_common[@]}"
    RAY_WORKERS_PID=$BG_PID
    GUARD_NAMES[$RAY_WORKERS_PID]="Ray workers srun, logs $LOG_DIR/ray-worker-*.log"
    RAY_PIDS+=("$RAY_WORKERS_PID")
  fi
  wait_for_ray "$NNODES" || fail "Ray not ready after ${RAY_READY_TIMEOUT_S}s: ${RAY_STATUS_LINE:-head not answering}; see $LOG_DIR/ray-*.log"
  log "Ray ready: $RAY_STATUS_LINE"
}

# Polls `ray status` until it lists the nodes (and GPUs) wanted; fails at once when a Ray srun dies.
wait_for_ray() {
  local want=$1 deadline=$((SECONDS + RAY_READY_TIMEOUT_S)) pid
  RAY_STATUS_LINE=""
  while ((SECONDS < deadline)); do
    for pid in "${RAY_PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || fail "${GUARD_NAMES[$pid]} exited before Ray was ready; the job stops"
    done
    if ((want == 1)); then
      "$PYTHON" -m ray.scripts.scripts status --address "$MASTER_ADDR:$RAY_PORT" >/dev/null 2>&1 && return 0
    elif NNODES=$want ray_ready; then
      return 0
    fi
    sleep 2
  done
  return 1
}

stop_ray() {
  local pid
  for pid in "${RAY_PIDS[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for pid in "${RAY_PIDS[@]}"; do wait "$pid" 2>/dev/null || true; done
  rm -rf "${RAY_AUTH_DIR:-}"  # the token opens nothing once the daemons are gone
}

run_on_ray() {
  local role=$1 step_pid rc=0 pid
  RAY_PIDS=()
  [[ $DRY_RUN == 1 ]] || trap stop_ray EXIT  # before the head starts: a failed bring-up must not leave it running
  start_ray
  if [[ $DRY_RUN == 1 ]]; then
    step_srun --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" -- "$MLITE_ROOT/slurm/lib/node.sh" "$role"
    return 0
  fi
  log "driver: launchers/$role.sh on $HEAD_NODE through Ray (LAUNCHER=${LAUNCHER:-ray})"
  # the driver runs on the head only; node.sh's node rank is 0 there
  step_srun_bg --nodes=1 --ntasks=1 --overlap -w "$HEAD_NODE" --kill-on-bad-exit=1 -- \
    "$MLITE_ROOT/slurm/lib/node.sh" "$role"
  step_pid=$BG_PID
  STEP_PIDS=("$step_pid")
  NODES_SAVED=("${NODES[@]}")
  NODES=("$HEAD_NODE")  # only the driver's node reports an exit status
  watch_step "$step_pid" "${RAY_PIDS[@]}" || rc=$?
  NODES=("${NODES_SAVED[@]}")
  if ((rc != 0)); then
    for pid in "${RAY_PIDS[@]}"; do
      kill -0 "$pid" 2>/dev/null || log "stopped: ${GUARD_NAMES[$pid]}"
    done
  fi
  NODES=("$HEAD_NODE")
  finish "$rc" "launchers/$role.sh on Ray"
}

# ------------------------------------------------------------------------------------------ entry point
run_job() {
  local role=$1
  [[ $role == sft || $role == grpo ]] || fail "run_job sft|grpo (got '$role')"
  job_init
  container_setup
  if [[ $RAY == 1 ]]; then ray_auth_setup; fi  # before the planner check: its command file shows the mode
  trap on_preempt USR1
  validate_launch "$role"
  export VALIDATE=0  # checked once above; the nodes start straight away
  if [[ $RAY == 1 ]]; then run_on_ray "$role"; else run_on_all_nodes "$role"; fi
}
