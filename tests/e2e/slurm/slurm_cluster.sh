#!/usr/bin/env bash
# Throw-away one-node SLURM cluster on 127.0.0.1 for tests and CI.
#
#   tests/e2e/slurm/slurm_cluster.sh start DIR   # install (if needed) + start munged, slurmctld, slurmd
#   tests/e2e/slurm/slurm_cluster.sh stop DIR    # cancel jobs, stop the daemons started from DIR
#   tests/e2e/slurm/slurm_cluster.sh status DIR  # sinfo/squeue against the cluster in DIR
#
# Everything (slurm.conf, munge key + socket, state, spool, logs, pid files) lives
# in DIR; nothing under /etc is touched. After `start`, point the clients at it:
#
#   source DIR/env.sh        # exports SLURM_CONF=DIR/slurm.conf
#
# `stop` only kills the daemons whose PIDs were recorded in DIR (never by name).
#
# Known-good combination (Debian 12, Slurm 22.05, munge 0.5.15): select/cons_tres,
# proctrack/linuxproc, task/none, accounting off, munged with its own key and
# a socket directory of mode 0755, NodeName == `hostname -s`, AuthInfo=socket=...
# so that every Slurm component finds that munged. Jobs that ask for more tasks
# than the node has CPUs stay PENDING unless submitted with --overcommit.
#
# Environment knobs:
#   SLURM_TEST_PORT_BASE   first TCP port to try for slurmctld (default 6817);
#                          slurmd gets the next free one after it.
#   SLURM_TEST_NO_INSTALL  set to 1 to never call apt-get.
#   SLURM_TEST_TIMEOUT     seconds to wait for the node to become idle (default 90).
#   SLURM_TEST_MIN_JOB_AGE MinJobAge (default 16 s). `sbatch --wait` polls after 2, 8, 32, 32 ... s
#                          but never longer than MinJobAge/2 allows (22.05 sbatch.c _job_wait), so a
#                          small value makes --wait return within ~8 s of the job's end; finished
#                          jobs stay visible to `scontrol show job` for at least that long.
#   SLURM_TEST_CRED_EXPIRE AuthInfo cred_expire (default 10 s, Slurm's minimum is 5): a requeued job
#                          (`scontrol requeue`, submit_pm.sh after a preemption) is not eligible to
#                          start again before this many seconds (Slurm's default, 120 s, would make
#                          every requeue test wait two minutes).
set -euo pipefail

die() { echo "slurm_cluster.sh: error: $*" >&2; exit 1; }
log() { echo "slurm_cluster.sh: $*" >&2; }

usage() {
    echo "usage: $0 {start|stop|status} DIR" >&2
    exit 2
}

PACKAGES=(slurmctld slurmd slurm-client munge)
NEEDED_CMDS=(slurmctld slurmd sbatch srun sinfo scontrol scancel munged munge unmunge)

missing_cmds() {
    local c missing=()
    for c in "${NEEDED_CMDS[@]}"; do
        command -v "$c" >/dev/null 2>&1 || [[ -x /usr/sbin/$c ]] || missing+=("$c")
    done
    echo "${missing[*]}"
}

ensure_packages() {
    local missing
    missing=$(missing_cmds)
    [[ -z "$missing" ]] && return 0
    if [[ "${SLURM_TEST_NO_INSTALL:-0}" == 1 ]]; then
        die "missing commands ($missing) and SLURM_TEST_NO_INSTALL=1"
    fi
    if [[ $(id -u) -ne 0 ]]; then
        die "missing commands ($missing); installing packages ${PACKAGES[*]} needs root" \
            "(run: sudo apt-get install -y --no-install-recommends ${PACKAGES[*]})"
    fi
    command -v apt-get >/dev/null 2>&1 || die "missing commands ($missing) and no apt-get to install ${PACKAGES[*]}"
    log "installing ${PACKAGES[*]} ..."
    local t0=$SECONDS
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >&2 || die "apt-get update failed"
    apt-get install -y -qq --no-install-recommends "${PACKAGES[@]}" >&2 || die "apt-get install ${PACKAGES[*]} failed"
    log "installed in $((SECONDS - t0)) s"
    missing=$(missing_cmds)
    [[ -z "$missing" ]] || die "still missing after install: $missing"
}

# true when something listens on 127.0.0.1:$1
port_in_use() {
    (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null
}

free_port_from() {
    local p=$1
    while port_in_use "$p"; do
        p=$((p + 1))
        ((p < 65000)) || die "no free TCP port found"
    done
    echo "$p"
}

# pid from a pid file, if that process is still alive
live_pid() {
    local f=$1 pid
    [[ -s "$f" ]] || return 1
    pid=$(tr -dc '0-9' <"$f")
    [[ -n "$pid" ]] && kill -0 "$pid" 2>/dev/null || return 1
    echo "$pid"
}

dump_logs() {
    local f
    for f in "$DIR"/log/*.log; do
        [[ -f "$f" ]] || continue
        echo "----- $f (last 40 lines) -----" >&2
        tail -n 40 "$f" >&2 || true
    done
}

wait_for_pidfile() {
    local f=$1 what=$2 i
    for ((i = 0; i < 100; i++)); do
        live_pid "$f" >/dev/null && return 0
        sleep 0.1
    done
    dump_logs
    die "$what did not start (no live pid in $f)"
}

cmd_start() {
    [[ -e "$DIR/slurm.conf" ]] && live_pid "$DIR/run/slurmctld.pid" >/dev/null &&
        die "a cluster from $DIR is already running; stop it first"
    ensure_packages
    local t0=$SECONDS

    mkdir -p "$DIR"/{munge,state,spool,log,run}
    # munged refuses sockets in group/world-writable dirs, and clients must be able to traverse it.
    chmod 0755 "$DIR" "$DIR/munge"
    chmod 0700 "$DIR/state" "$DIR/spool"

    # ---- munge -------------------------------------------------------------
    local key=$DIR/munge/munge.key sock=$DIR/munge/munge.socket
    if [[ ! -s "$key" ]]; then
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile="$key" --force >/dev/null
        else
            dd if=/dev/urandom of="$key" bs=1024 count=1 status=none
        fi
    fi
    chmod 0600 "$key"
    rm -f "$sock" "$sock.lock"
    munged --socket="$sock" --key-file="$key" --pid-file="$DIR/run/munged.pid" \
        --log-file="$DIR/log/munged.log" --seed-file="$DIR/munge/munged.seed" ||
        { dump_logs; die "munged failed to start"; }
    wait_for_pidfile "$DIR/run/munged.pid" munged
    munge -n -S "$sock" | unmunge -S "$sock" >/dev/null || { dump_logs; die "munge/unmunge round trip failed"; }

    # ---- slurm.conf ----------------------------------------------------------
    local host ncpu mem_mb ctld_port slurmd_port
    host=$(hostname -s)
    ncpu=$(env -u OMP_NUM_THREADS -u OMP_THREAD_LIMIT nproc)  # the CPUs slurmd finds: GNU nproc honours OMP_*
    mem_mb=$(awk '/^MemTotal:/ {printf "%d", $2 / 1024 * 0.9}' /proc/meminfo)
    ctld_port=$(free_port_from "${SLURM_TEST_PORT_BASE:-6817}")
    slurmd_port=$(free_port_from $((ctld_port + 1)))

    cat >"$DIR/slurm.conf" <<EOF
# Generated by tests/e2e/slurm/slurm_cluster.sh -- single-node throw-away cluster.
ClusterName=citest
SlurmctldHost=${host}(127.0.0.1)
SlurmctldPort=${ctld_port}
SlurmdPort=${slurmd_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=${sock},cred_expire=${SLURM_TEST_CRED_EXPIRE:-10}
MpiDefault=none
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SwitchType=switch/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/backfill
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
ReturnToService=2
StateSaveLocation=${DIR}/state
SlurmdSpoolDir=${DIR}/spool
SlurmctldPidFile=${DIR}/run/slurmctld.pid
SlurmdPidFile=${DIR}/run/slurmd.pid
SlurmctldLogFile=${DIR}/log/slurmctld.log
SlurmdLogFile=${DIR}/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
MailProg=/bin/true
InactiveLimit=0
KillWait=5
# batch jobs may be requeued (the default; submit_pm.sh also asks for --requeue)
JobRequeue=1
MinJobAge=${SLURM_TEST_MIN_JOB_AGE:-16}
MessageTimeout=30
SlurmctldTimeout=60
SlurmdTimeout=120
NodeName=${host} NodeAddr=127.0.0.1 CPUs=${ncpu} RealMemory=${mem_mb} State=UNKNOWN
PartitionName=debug Nodes=${host} Default=YES MaxTime=INFINITE State=UP
EOF
    printf 'export SLURM_CONF=%q\n' "$DIR/slurm.conf" >"$DIR/env.sh"
    export SLURM_CONF=$DIR/slurm.conf

    # ---- daemons -------------------------------------------------------------
    slurmctld -c -f "$SLURM_CONF" || { dump_logs; die "slurmctld failed to start"; }
    wait_for_pidfile "$DIR/run/slurmctld.pid" slurmctld
    slurmd -f "$SLURM_CONF" || { dump_logs; die "slurmd failed to start"; }
    wait_for_pidfile "$DIR/run/slurmd.pid" slurmd

    local state="" deadline=$((SECONDS + ${SLURM_TEST_TIMEOUT:-90}))
    while ((SECONDS < deadline)); do
        state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
        [[ "$state" == idle ]] && break
        sleep 0.5
    done
    if [[ "$state" != idle ]]; then
        dump_logs
        sinfo -N -l >&2 || true
        die "node $host not idle after ${SLURM_TEST_TIMEOUT:-90}s (state: '${state}')"
    fi
    log "cluster up in $((SECONDS - t0)) s: node $host idle, ${ncpu} CPUs, SLURM_CONF=$SLURM_CONF"
}

stop_pid() {
    local f=$1 what=$2 pid i
    pid=$(live_pid "$f") || return 0
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 100; i++)); do
        kill -0 "$pid" 2>/dev/null || { log "stopped $what (pid $pid)"; return 0; }
        sleep 0.1
    done
    kill -KILL "$pid" 2>/dev/null || true
    log "killed $what (pid $pid)"
}

cmd_stop() {
    if [[ -f "$DIR/slurm.conf" ]] && live_pid "$DIR/run/slurmctld.pid" >/dev/null; then
        # Cancel whatever still runs on this (private) cluster, so no job steps outlive it.
        SLURM_CONF=$DIR/slurm.conf timeout 20 scancel --quiet --user="$(id -un)" 2>/dev/null || true
        local i
        for ((i = 0; i < 50; i++)); do
            [[ -z "$(SLURM_CONF=$DIR/slurm.conf timeout 10 squeue -h -o %i 2>/dev/null)" ]] && break
            sleep 0.2
        done
    fi
    stop_pid "$DIR/run/slurmd.pid" slurmd
    stop_pid "$DIR/run/slurmctld.pid" slurmctld
    stop_pid "$DIR/run/munged.pid" munged
}

cmd_status() {
    export SLURM_CONF=$DIR/slurm.conf
    sinfo -N -l
    squeue
}

[[ $# -eq 2 ]] || usage
ACTION=$1
mkdir -p "$2"
DIR=$(cd "$2" && pwd -P)

case "$ACTION" in
    start) cmd_start ;;
    stop) cmd_stop ;;
    status) cmd_status ;;
    *) usage ;;
esac
