#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for tests and for trying the templates.
#
#   slurm/local/cluster.sh install   apt-get Debian's slurmd, slurmctld, slurm-client and munge (if missing)
#   slurm/local/cluster.sh start     install if needed, write the config, start munged, slurmctld and
#                                    two slurmd daemons (n1, n2: Slurm's multiple-slurmd mode); idempotent
#   slurm/local/cluster.sh status    daemons, sinfo
#   slurm/local/cluster.sh stop      stop the daemons by their pid files (jobs are cancelled first)
#
# Needs root (CI has it). Debian 12 ships Slurm 22.05, built with multiple-slurmd support: each node is a
# `slurmd -N NAME` with its own port, spool and pid file, all on 127.0.0.1.
set -euo pipefail

STATE_DIR=${STATE_DIR:-/var/lib/mlite-slurm}      # spool, logs and pid files of the local cluster
SLURM_CONF_PATH=${SLURM_CONF_PATH:-/etc/slurm/slurm.conf}  # where sbatch/srun look for the config
CLUSTER_NAME=${CLUSTER_NAME:-mlite}               # Slurm cluster name
PARTITION=${PARTITION:-debug}                     # the one partition over both nodes
NODE_CPUS=${NODE_CPUS:-$(nproc)}                  # CPUs each node offers (no more than the machine has)
NODE_MEMORY_MB=${NODE_MEMORY_MB:-4096}            # RealMemory of each node (not enforced)
SLURMCTLD_PORT=${SLURMCTLD_PORT:-16817}           # controller port
NODE_PORT_BASE=${NODE_PORT_BASE:-17000}           # node nK listens on NODE_PORT_BASE + K
START_TIMEOUT_S=${START_TIMEOUT_S:-60}            # how long `start` waits for both nodes to be idle

NODES=(n1 n2)
OURS_MARK="# written by mlite slurm/local/cluster.sh"

die() { echo "cluster.sh: error: $*" >&2; exit 2; }

need_root() {
  [[ $(id -u) -eq 0 ]] || die "needs root (it installs packages and starts system daemons); run it with sudo"
}

install_packages() {
  need_root
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v sbatch >/dev/null \
     && command -v munged >/dev/null; then
    return 0
  fi
  echo "cluster.sh: installing slurmd slurmctld slurm-client munge (Debian packages)"
  # Debian's post-install scripts try to start the services; we start our own daemons instead.
  printf '#!/bin/sh\nexit 101\n' > /usr/sbin/policy-rc.d && chmod +x /usr/sbin/policy-rc.d
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null \
    || { apt-get update >/dev/null && apt-get install -y --no-install-recommends slurmd slurmctld slurm-client munge >/dev/null; } \
    || die "apt-get install of slurmd slurmctld slurm-client munge failed; check the network to the Debian mirror"
  rm -f /usr/sbin/policy-rc.d
}

write_config() {
  if [[ -f $SLURM_CONF_PATH ]] && ! grep -qxF "$OURS_MARK" "$SLURM_CONF_PATH"; then
    die "$SLURM_CONF_PATH exists and was not written by this script; move it away or set SLURM_CONF_PATH"
  fi
  mkdir -p "$(dirname "$SLURM_CONF_PATH")" "$STATE_DIR/ctld" "$STATE_DIR/log"
  local host nodes_csv node port i
  host=$(hostname -s)
  nodes_csv=$(IFS=,; echo "${NODES[*]}")
  {
    echo "$OURS_MARK"
    cat <<EOF
ClusterName=$CLUSTER_NAME
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$SLURMCTLD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
# a requeued job may start again after cred_expire seconds (default 120): short for a local cluster
AuthInfo=cred_expire=10
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
ReturnToService=2
StateSaveLocation=$STATE_DIR/ctld
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdSpoolDir=$STATE_DIR/%n/spool
SlurmdPidFile=$STATE_DIR/%n/slurmd.pid
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
MinJobAge=30
KillWait=10
UnkillableStepTimeout=30
JobRequeue=1
SchedulerType=sched/backfill
SchedulerParameters=sched_interval=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
EOF
    i=0
    for node in "${NODES[@]}"; do
      i=$((i + 1))
      port=$((NODE_PORT_BASE + i))
      mkdir -p "$STATE_DIR/$node/spool"
      echo "NodeName=$node NodeHostname=$host NodeAddr=127.0.0.1 Port=$port CPUs=$NODE_CPUS RealMemory=$NODE_MEMORY_MB State=UNKNOWN"
    done
    echo "PartitionName=$PARTITION Nodes=$nodes_csv Default=YES MaxTime=INFINITE State=UP"
  } > "$SLURM_CONF_PATH"
  # Slurm 22.05 refuses to start without a cgroup.conf only when cgroup plugins are used; we use none.
}

pid_alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

# A new munge key at $1, created under umask 077: no one but its owner can read it, not even for an instant
# (an older file, say an empty one, would keep its mode: it goes first).
new_munge_key() {
  rm -f "$1"
  (umask 077 && dd if=/dev/urandom of="$1" bs=1 count=1024 status=none)
}

start_munge() {
  local key=/etc/munge/munge.key pidfile=/run/munge/munged.pid
  if [[ ! -s $key ]]; then
    mkdir -p /etc/munge
    new_munge_key "$key"
  fi
  chown munge:munge "$key" && chmod 400 "$key"
  mkdir -p /run/munge /var/log/munge /var/lib/munge
  chown munge:munge /run/munge /var/log/munge /var/lib/munge
  if pid_alive "$pidfile"; then return 0; fi
  runuser -u munge -- /usr/sbin/munged --force
  munge -n | unmunge >/dev/null || die "munged started but a credential round trip failed; see /var/log/munge"
}

start_daemons() {
  if ! pid_alive "$STATE_DIR/slurmctld.pid"; then
    slurmctld -f "$SLURM_CONF_PATH"
  fi
  local node
  for node in "${NODES[@]}"; do
    if ! pid_alive "$STATE_DIR/$node/slurmd.pid"; then
      slurmd -f "$SLURM_CONF_PATH" -N "$node"
    fi
  done
}

wait_idle() {
  local deadline=$((SECONDS + START_TIMEOUT_S)) node state
  for node in "${NODES[@]}"; do
    while true; do
      state=$(sinfo -h -n "$node" -o %T 2>/dev/null || true)
      case $state in
        idle | mixed | allocated | completing) break ;;
        down* | drain* | fail*) scontrol update NodeName="$node" State=RESUME >/dev/null 2>&1 || true ;;
      esac
      ((SECONDS < deadline)) || die "node $node is '${state:-unreachable}' after ${START_TIMEOUT_S}s; see $STATE_DIR/log/slurmd-$node.log"
      sleep 1
    done
  done
}

cmd_start() {
  install_packages
  write_config
  start_munge
  start_daemons
  wait_idle
  cmd_status
}

daemon_pidfiles() {
  local node
  for node in "${NODES[@]}"; do echo "$STATE_DIR/$node/slurmd.pid"; done
  echo "$STATE_DIR/slurmctld.pid"
}

cmd_stop() {
  need_root
  if pid_alive "$STATE_DIR/slurmctld.pid"; then
    scancel --full --quiet --partition "$PARTITION" >/dev/null 2>&1 || true
  fi
  local pidfile
  while read -r pidfile; do
    if pid_alive "$pidfile"; then kill "$(cat "$pidfile")"; fi
  done < <(daemon_pidfiles)
  # wait until each is gone, so a following start never finds a half-dead daemon
  while read -r pidfile; do
    for _ in $(seq 50); do pid_alive "$pidfile" || break; sleep 0.2; done
    if pid_alive "$pidfile"; then kill -9 "$(cat "$pidfile")" 2>/dev/null || true; fi
    rm -f "$pidfile"
  done < <(daemon_pidfiles)
  echo "cluster.sh: stopped"
}

cmd_status() {
  local name pidfile
  for name in slurmctld "${NODES[@]}"; do
    pidfile=$STATE_DIR/slurmctld.pid
    [[ $name == slurmctld ]] || pidfile=$STATE_DIR/$name/slurmd.pid
    if pid_alive "$pidfile"; then echo "$name: running (pid $(cat "$pidfile"))"; else echo "$name: stopped"; fi
  done
  sinfo -N -o '%N %T %c %P' 2>/dev/null || echo "sinfo: controller not reachable"
}

# sourced (tests), it only defines the functions above
[[ ${BASH_SOURCE[0]} == "$0" ]] || return 0
case ${1:-} in
  install) install_packages ;;
  start) need_root; cmd_start ;;
  stop) cmd_stop ;;
  status) cmd_status ;;
  restart) cmd_stop; need_root; cmd_start ;;
  *) echo "usage: $0 install|start|status|stop|restart" >&2; exit 2 ;;
esac
