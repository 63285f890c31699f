#!/usr/bin/env bash
# A real two-node Slurm cluster on this one machine, for the `slurm` tests and for trying
# `hosts.job: slurm` without a cluster. Everything lives in one private folder: the config
# (SLURM_CONF points there), munge's key and socket, the daemons' state, spool and logs.
# Nothing is written to /etc.
#
#   bash scripts/slurm_cluster.sh start    install slurm-wlm + munge if missing (root only, apt-get),
#                                          start munged, slurmctld and two slurmd (n1, n2), wait until idle
#   bash scripts/slurm_cluster.sh stop     cancel every job, stop the daemons and their job processes
#   bash scripts/slurm_cluster.sh env      print the `export SLURM_CONF=...` line for a shell
#
# FORGE_SLURM_DIR sets the folder (default /tmp/forge-slurm); FORGE_SLURM_PORT the first of the
# four ports it uses (default 17000: slurmctld, then one per slurmd).
set -euo pipefail

dir="${FORGE_SLURM_DIR:-/tmp/forge-slurm}"
base="${FORGE_SLURM_PORT:-17000}"
conf="$dir/etc/slurm.conf"
export SLURM_CONF="$conf"

log() { echo "[slurm_cluster] $*" >&2; }

install_packages() {
    if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
        return
    fi
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        log "slurm-wlm and munge are missing; install them (Debian/Ubuntu: apt-get install slurm-wlm munge) or run as root"
        exit 1
    fi
    log "installing slurm-wlm and munge from the distribution's packages"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends slurm-wlm munge >/dev/null; }
}

write_config() {
    mkdir -p "$dir"/{etc,munge,state,log,run,spool}
    chmod 700 "$dir/munge"
    [ -s "$dir/munge/munge.key" ] || { head -c 1024 /dev/urandom > "$dir/munge/munge.key"; chmod 400 "$dir/munge/munge.key"; }
    local host cpus mem user
    host="$(hostname -s)"
    cpus="$(nproc)"
    mem=$(( $(awk '/MemTotal/ {print $2}' /proc/meminfo) / 1024 / 2 ))
    user="$(id -un)"
    # Two nodes on one machine: each slurmd has its own name, port, spool, pid and log file (%n).
    cat > "$conf" <<EOF
ClusterName=forge
SlurmctldHost=$host(127.0.0.1)
SlurmctldPort=$base
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$dir/munge/munge.socket.2
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
ReturnToService=2
SlurmdTimeout=300
InactiveLimit=0
MinJobAge=300
KillWait=5
SchedulerType=sched/backfill
NodeName=n[1-2] NodeHostname=$host NodeAddr=127.0.0.1 Port=$((base + 1))-$((base + 2)) CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=n[1-2] Default=YES MaxTime=INFINITE State=UP
PartitionName=one Nodes=n[1-2] MaxNodes=1 MaxTime=INFINITE State=UP
EOF
}

pid_alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

start() {
    install_packages
    write_config
    if ! pid_alive "$dir/munge/munged.pid"; then
        munged --force --socket="$dir/munge/munge.socket.2" --key-file="$dir/munge/munge.key" \
            --pid-file="$dir/munge/munged.pid" --log-file="$dir/munge/munged.log" --seed-file="$dir/munge/munged.seed"
    fi
    pid_alive "$dir/run/slurmctld.pid" || slurmctld
    for n in n1 n2; do
        pid_alive "$dir/run/slurmd-$n.pid" || slurmd -N "$n"
    done
    # The nodes register with slurmctld within a few seconds; a job can start once both are idle.
    for _ in $(seq 1 60); do
        if [ "$(sinfo -h -p debug -t idle -o '%D' 2>/dev/null)" = 2 ]; then
            log "two idle nodes (n1, n2); export SLURM_CONF=$conf"
            return
        fi
        sleep 0.5
    done
    log "the nodes did not become idle within 30 s:"
    sinfo -N -l >&2 || true
    log "logs: $dir/log"
    exit 1
}

# This cluster's job processes: its slurmstepd daemons and what its jobs started (workers and
# their role processes), told by this cluster's config in their environment. A shell that only
# exported SLURM_CONF (the caller's) has no SLURM_JOB_ID and is not one of them.
job_processes() {
    local p env
    for p in /proc/[0-9]*; do
        env="$(tr '\0' '\n' 2>/dev/null < "$p/environ")" || continue
        grep -qx "SLURM_CONF=$conf" <<< "$env" || continue
        if grep -q "^SLURM_JOB_ID=" <<< "$env" || [ "$(cat "$p/comm" 2>/dev/null)" = slurmstepd ]; then
            echo "${p#/proc/}"
        fi
    done
}

stop_pidfile() {
    local file="$1"
    if pid_alive "$file"; then
        kill "$(cat "$file")" 2>/dev/null || true
        for _ in $(seq 1 50); do pid_alive "$file" || break; sleep 0.1; done
        pid_alive "$file" && kill -9 "$(cat "$file")" 2>/dev/null || true
    fi
    rm -f "$file"
}

stop() {
    [ -f "$conf" ] || return 0
    scancel --full --quiet --user="$(id -un)" 2>/dev/null || true
    for _ in $(seq 1 50); do [ -z "$(squeue -h 2>/dev/null)" ] && break; sleep 0.2; done
    for n in n1 n2; do stop_pidfile "$dir/run/slurmd-$n.pid"; done
    stop_pidfile "$dir/run/slurmctld.pid"
    stop_pidfile "$dir/munge/munged.pid"
    local pids
    pids="$(job_processes | tr '\n' ' ')"
    # shellcheck disable=SC2086
    [ -z "$pids" ] || kill -9 $pids 2>/dev/null || true
    # Jobs of this cluster never outlive it: the next start begins with an empty queue.
    rm -rf "$dir/state" "$dir/spool"
    log "stopped"
}

case "${1:-}" in
    start) start ;;
    stop) stop ;;
    env) echo "export SLURM_CONF=$conf" ;;
    *) echo "usage: $0 start|stop|env" >&2; exit 2 ;;
esac
