#!/usr/bin/env bash
# A real Slurm cluster on this one machine, for tests and for trying `cluster=slurm` without a cluster:
# slurmctld + two slurmd "nodes" (n1 = 127.0.1.1, n2 = 127.0.1.2) + munge + slurmdbd/MariaDB (so `sacct` works,
# which submitit polls for job state). Debian 12 slurm-wlm 22.05. Everything stays on loopback.
#
#   launchers/local_slurm.sh start    # apt-install if missing, write configs, start daemons, wait for idle nodes
#   launchers/local_slurm.sh stop     # SIGTERM the daemons by saved PID (SIGKILL after 15 s)
#   launchers/local_slurm.sh status   # daemon PIDs + sinfo
#   launchers/local_slurm.sh purge    # stop, then delete the state dir (job ids restart at 1)
#
# `start` is idempotent: on a running cluster with the same config it returns at once.
set -euo pipefail

D=/tmp/molt-slurm                     # state, spool, logs, pid files, MariaDB datadir
NODES=(n1 n2)
CPUS=$(nproc)                         # per fake node; the nodes share the real cores
PART=debug
TIMEOUT_S=60
HOST=$(hostname -s)
PIDS=$D/pids
LOG=$D/log
MYSQL_SOCK=/run/mysqld/mysqld.sock    # libmariadb's compiled-in default, which slurmdbd uses

say() { printf '[local_slurm %s] %s\n' "$(date +%T)" "$*" >&2; }
alive() { [ -s "$PIDS/$1.pid" ] && kill -0 "$(cat "$PIDS/$1.pid")" 2>/dev/null; }

wait_until() { # wait_until <what> <cmd...>
  local what=$1; shift
  for _ in $(seq 1 $((TIMEOUT_S * 5))); do
    if "$@" >/dev/null 2>&1; then return 0; fi
    sleep 0.2
  done
  say "timed out after ${TIMEOUT_S}s waiting for $what"; return 1
}

daemon() { # daemon <name> <cmd...>: a foreground-mode daemon in the background, so $! is the daemon itself
  local name=$1; shift
  alive "$name" && return 0
  nohup "$@" </dev/null >"$LOG/$name.out" 2>&1 &
  echo $! >"$PIDS/$name.pid"
}

install() {
  local need=()
  command -v slurmctld >/dev/null || need+=(slurmctld)
  command -v slurmd >/dev/null || need+=(slurmd)
  command -v sinfo >/dev/null || need+=(slurm-client)
  command -v munged >/dev/null || need+=(munge)
  command -v slurmdbd >/dev/null || need+=(slurmdbd)
  command -v mariadbd >/dev/null || need+=(mariadb-server)
  if [ ${#need[@]} -gt 0 ]; then
    say "apt-get install ${need[*]}"
    apt-get update -qq
    # Package postinsts must not start munge/mariadb/slurm with their default dirs: we start them ourselves.
    local own_policy=0
    if [ ! -e /usr/sbin/policy-rc.d ]; then
      printf '#!/bin/sh\nexit 101\n' >/usr/sbin/policy-rc.d; chmod +x /usr/sbin/policy-rc.d; own_policy=1
    fi
    local rc=0
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >"$D/apt.log" 2>&1 || rc=$?
    [ $own_policy = 1 ] && rm -f /usr/sbin/policy-rc.d
    [ $rc = 0 ] || { cat "$D/apt.log" >&2; exit 1; }
  fi
  if [ ! -s /etc/munge/munge.key ]; then
    mkdir -p /etc/munge
    mungekey -c -f -k /etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key; chmod 600 /etc/munge/munge.key
  fi
}

slurm_conf() {
  local mem i
  mem=$(awk '/MemTotal/{printf "%d", $2/1024*0.8}' /proc/meminfo)
  cat <<EOF
# written by molt_hydra launchers/local_slurm.sh
ClusterName=moltci
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$D/state
SlurmdSpoolDir=$D/spool/%n
SlurmctldPidFile=$D/run/slurmctld.pid
SlurmdPidFile=$D/run/slurmd-%n.pid
SlurmctldLogFile=$LOG/slurmctld.log
SlurmdLogFile=$LOG/slurmd-%n.log
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
# per-core allocation: two 1-node sweep points run at once
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
# no cgroups: job processes are tracked by parent PID and stay in the caller's cgroup
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
# a requeued job may restart only after cred_expire (default 120 s), and only on a scheduler pass (default 60 s)
AuthInfo=cred_expire=10
SchedulerParameters=sched_interval=5,bf_interval=5
# SIGTERM -> SIGKILL after 5 s at job end (default 30 s)
KillWait=5
# reject impossible requests at submit instead of leaving them PENDING forever
EnforcePartLimits=ALL
JobAcctGatherType=jobacct_gather/linux
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=127.0.0.1
EOF
  # 127.0.1.N, not 127.0.0.1: Ray rewrites 127.0.0.1 to the eth0 address but keeps other loopback addresses.
  # Own ports because every slurmd binds all interfaces.
  for i in "${!NODES[@]}"; do
    echo "NodeName=${NODES[$i]} NodeHostname=${NODES[$i]} NodeAddr=127.0.1.$((i + 1)) Port=$((17001 + i))" \
      "CPUs=$CPUS Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1 RealMemory=$mem State=UNKNOWN"
  done
  echo "PartitionName=$PART Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

dbd_conf() {
  cat <<EOF
AuthType=auth/munge
DbdHost=localhost
DbdAddr=127.0.0.1
SlurmUser=root
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=root
StorageLoc=slurm_acct_db
PidFile=$D/run/slurmdbd.pid
LogFile=$LOG/slurmdbd.log
EOF
}

stop() {
  # All daemons are signalled at once (each takes 1-4 s to exit), then waited for.
  local f name pid pids=()
  for f in "$PIDS"/slurmd-*.pid "$PIDS"/slurmctld.pid "$PIDS"/slurmdbd.pid "$PIDS"/mariadb.pid "$PIDS"/munged.pid; do
    [ -s "$f" ] || continue
    pid=$(cat "$f"); rm -f "$f"
    if kill -0 "$pid" 2>/dev/null; then kill "$pid" 2>/dev/null || true; pids+=("$pid"); fi
  done
  [ ${#pids[@]} -gt 0 ] || return 0
  for _ in $(seq 1 150); do
    local left=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && left=1; done
    [ $left = 0 ] && break
    sleep 0.1
  done
  for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && kill -9 "$pid" 2>/dev/null || true; done
  say "stopped"
}

all_nodes_up() {
  [ "$(sinfo -h -N -o '%N %T' 2>/dev/null | awk '$2 ~ /^(idle|mixed|allocated)$/ {print $1}' | sort -u | wc -l)" \
    -eq ${#NODES[@]} ]
}

start() {
  mkdir -p "$D"/{state,spool,run,log,pids}
  install
  local conf; conf=$(slurm_conf)
  if [ -f /etc/slurm/slurm.conf ] && [ "$conf" = "$(cat /etc/slurm/slurm.conf)" ] && alive slurmctld && all_nodes_up; then
    return 0
  fi
  if [ ! -f /etc/slurm/slurm.conf ] || [ "$conf" != "$(cat /etc/slurm/slurm.conf)" ]; then
    stop   # daemons must all read the same slurm.conf
    mkdir -p /etc/slurm
    printf '%s\n' "$conf" >/etc/slurm/slurm.conf
  fi
  local n
  for n in "${NODES[@]}"; do mkdir -p "$D/spool/$n"; done

  mkdir -p /run/munge; chown munge:munge /run/munge
  # setpriv execs (no fork): the saved PID is munged's own
  daemon munged setpriv --reuid=munge --regid=munge --init-groups /usr/sbin/munged -F
  wait_until munged bash -c 'munge -n | unmunge'

  mkdir -p /run/mysqld "$D/mysql" "$D/mysql-run"
  chown mysql:mysql /run/mysqld "$D/mysql" "$D/mysql-run"
  if [ ! -d "$D/mysql/mysql" ]; then
    mariadb-install-db --no-defaults --user=mysql --datadir="$D/mysql" \
      --auth-root-authentication-method=socket --skip-test-db >"$LOG/mariadb-install.log" 2>&1
  fi
  # unix socket only; the two innodb values are the ones slurmdbd asks for
  daemon mariadb /usr/sbin/mariadbd --no-defaults --user=mysql --datadir="$D/mysql" --socket=$MYSQL_SOCK \
    --skip-networking --pid-file="$D/mysql-run/mariadbd.pid" --log-error="$D/mysql-run/mariadbd.err" \
    --innodb-buffer-pool-size=1024M --innodb-lock-wait-timeout=900
  wait_until mariadb mariadb-admin --socket=$MYSQL_SOCK ping
  dbd_conf >/etc/slurm/slurmdbd.conf
  chmod 600 /etc/slurm/slurmdbd.conf   # slurmdbd refuses a readable one
  daemon slurmdbd /usr/sbin/slurmdbd -D
  wait_until slurmdbd sacctmgr -n show cluster

  daemon slurmctld /usr/sbin/slurmctld -D
  wait_until slurmctld scontrol ping
  for n in "${NODES[@]}"; do daemon "slurmd-$n" /usr/sbin/slurmd -D -N "$n"; done
  if ! wait_until "idle nodes" all_nodes_up; then
    # left DOWN/DRAIN by an earlier run
    scontrol update NodeName="$(IFS=,; echo "${NODES[*]}")" State=RESUME || true
    wait_until "idle nodes after RESUME" all_nodes_up || { sinfo -N -l; tail -n 30 "$LOG"/*.log; exit 1; }
  fi
  # recovered state can read "idle" before the slurmds registered: a real job step proves it
  wait_until "srun -N${#NODES[@]} true" timeout 30 srun -N ${#NODES[@]} --immediate=20 -t 1 -J smoke true \
    || { tail -n 30 "$LOG"/*.log; exit 1; }
  say "up: $(sinfo -h -o '%P %a %D %T %N' | tr '\n' ' ')"
}

status() {
  local f
  for f in "$PIDS"/*.pid; do
    [ -e "$f" ] || continue
    local n; n=$(basename "$f" .pid)
    if alive "$n"; then echo "$n: running pid $(cat "$f")"; else echo "$n: dead"; fi
  done
  sinfo 2>&1 || true
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  purge) stop; rm -rf "$D" ;;
  *) echo "usage: $0 start|stop|status|purge" >&2; exit 2 ;;
esac
