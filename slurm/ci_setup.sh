#!/usr/bin/env bash
# A one-node SLURM cluster on localhost for the tests in tests/slurm/ (CI runs this as root).
#
#   bash slurm/ci_setup.sh          install (Debian packages), start munge, slurmctld, slurmd
#   bash slurm/ci_setup.sh stop     stop the daemons this script started
#
# Everything lives in one scratch folder, $MEGATRON_REMBERT_SLURM_DIR (default
# /tmp/megatron_rembert_slurm): slurm.conf, state, spool, logs, pid files. Nothing is exported;
# the tests find slurm.conf there (or use $SLURM_CONF when it is set). Safe to run twice: a
# running cluster is left alone.
set -euo pipefail

STATE=${MEGATRON_REMBERT_SLURM_DIR:-/tmp/megatron_rembert_slurm}
CONF=$STATE/slurm.conf

die() { echo "ci_setup.sh: $*" >&2; exit 1; }

# A pid file only counts if its process is alive: a crashed daemon leaves a stale one behind.
alive() { [[ -f $1 ]] && kill -0 "$(cat "$1")" 2>/dev/null; }

stop() {
    local daemon pidfile
    for daemon in slurmd slurmctld; do
        pidfile=$STATE/$daemon.pid
        if alive "$pidfile"; then
            kill "$(cat "$pidfile")"
            echo "stopped $daemon"
        fi
    done
}

if [[ ${1:-} == stop ]]; then
    stop
    exit 0
fi
[[ $# -eq 0 ]] || die "unknown argument '$1'; usage: bash slurm/ci_setup.sh [stop]"
# Without root or the packages there is no cluster: say so and let tests/slurm skip.
skip() { echo "ci_setup.sh: $*; the tests in tests/slurm will skip" >&2; exit 0; }
[[ $(id -u) -eq 0 ]] || skip "not root (installs packages, runs munged and slurmd as root)"

if ! command -v sbatch >/dev/null || ! command -v slurmctld >/dev/null \
        || ! command -v slurmd >/dev/null || ! command -v munged >/dev/null \
        || ! command -v pkill >/dev/null; then
    command -v apt-get >/dev/null || skip "no apt-get to install Debian's SLURM packages"
    { apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q \
        slurmctld slurmd slurm-client munge procps; } || skip "installing the SLURM packages failed"
fi

# munge authenticates every SLURM message; one key shared by all daemons on this host.
if ! pgrep -x munged >/dev/null; then
    if [[ ! -f /etc/munge/munge.key ]]; then
        mkdir -p /etc/munge
        dd if=/dev/urandom bs=1 count=1024 of=/etc/munge/munge.key status=none
        chmod 400 /etc/munge/munge.key
    fi
    chown -R munge:munge /etc/munge
    mkdir -p /run/munge
    chown munge:munge /run/munge
    # --force: the packaged log folder's ownership would otherwise make munged refuse to start.
    /usr/sbin/munged --force
fi

mkdir -p "$STATE/state" "$STATE/spool"
host=$(hostname -s)
# slurmd drains a node whose real CPUs or memory are below the configured ones, so take them
# from the machine itself, with 1 GiB of memory left for the daemons and the OS.
cpus=$(nproc)
mem=$(( $(awk '/MemTotal/ {print int($2 / 1024)}' /proc/meminfo) - 1024 ))
cat > "$CONF.new" <<EOF
# Written by slurm/ci_setup.sh: a one-node test cluster on this host.
ClusterName=local
SlurmctldHost=$host
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
StateSaveLocation=$STATE/state
SlurmdSpoolDir=$STATE/spool
SlurmctldPidFile=$STATE/slurmctld.pid
SlurmdPidFile=$STATE/slurmd.pid
SlurmctldLogFile=$STATE/slurmctld.log
SlurmdLogFile=$STATE/slurmd.log
SlurmUser=root
SlurmdUser=root
ReturnToService=2
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
# The tests requeue jobs; a requeued job may start again at once.
JobRequeue=1
NodeName=$host CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF
# A different configuration (another host name, CPU count) needs restarted daemons.
if [[ -f $CONF ]] && ! cmp -s "$CONF" "$CONF.new"; then
    stop
fi
mv "$CONF.new" "$CONF"

export SLURM_CONF=$CONF
alive "$STATE/slurmctld.pid" || slurmctld -f "$CONF"
alive "$STATE/slurmd.pid" || slurmd -f "$CONF"

# Ready means the node accepts jobs: idle (or already running some).
for _ in $(seq 60); do
    state=$(sinfo -h -n "$host" -o %t 2>/dev/null || true)
    if [[ $state == idle || $state == mix || $state == alloc ]]; then
        echo "SLURM_CONF=$CONF"
        exit 0
    fi
    sleep 1
done
die "node $host is not idle after 60 s (state '${state:-unknown}'); see $STATE/slurmctld.log \
and $STATE/slurmd.log"
