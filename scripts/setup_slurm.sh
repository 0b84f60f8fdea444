#!/usr/bin/env bash
# Idempotent: a one-node Slurm for the Slurm backend's tests and benchmark, run by
# scripts/setup.sh. Debian's slurmctld/slurmd 22.05 and munge, started directly (no
# systemd): the node is this machine (`hostname -s`) with four stand-in GPUs
# (character devices like /dev/null under $SLURM_STATE/dev), and fifty simulated nodes
# (sim01..sim50, four GPUs each, in partition "sim") that no slurmd answers for: they
# take reservations (the benchmark's) but never run a job. Each has a loopback address
# and a port nothing listens on: slurmctld resolves every node when it starts, and an
# unresolvable name costs it ten seconds (fifty names, minutes on a fresh machine).
# The daemons must run under the names slurmctld/slurmd: Slurm applies a node's Gres=
# only in processes of those names (Debian's real binaries are *-wlm).
set -euo pipefail

SLURM_STATE=/var/lib/gpuresa-slurm
SLURM_CONF=/etc/slurm/slurm.conf
GRES_CONF=/etc/slurm/gres.conf
NODE=$(hostname -s)

say() { printf 'setup: %s\n' "$*"; }
die() { printf 'setup: error: %s\n' "$*" >&2; exit 1; }

for binary in slurmctld slurmd scontrol sbatch munged; do
    command -v "$binary" >/dev/null 2>&1 || PATH=$PATH:/usr/sbin
done
if ! command -v slurmctld >/dev/null 2>&1 || ! command -v munged >/dev/null 2>&1; then
    [ "$(id -u)" = 0 ] || die "need root to install Slurm (run: sudo make setup)"
    say "installing Debian packages: slurmctld slurmd slurm-client munge"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq slurmctld slurmd slurm-client munge >/dev/null
fi

mkdir -p "$SLURM_STATE"/ctld "$SLURM_STATE"/d "$SLURM_STATE"/dev /etc/slurm
for index in 0 1 2 3; do
    [ -c "$SLURM_STATE/dev/nvidia$index" ] || mknod -m 0666 "$SLURM_STATE/dev/nvidia$index" c 1 3
done

# --- munge: one key, made once ----------------------------------------------
if [ ! -s /etc/munge/munge.key ]; then
    say "making the munge key"
    mungekey --create --keyfile=/etc/munge/munge.key
    chown munge:munge /etc/munge/munge.key
    chmod 0400 /etc/munge/munge.key
fi
mkdir -p /run/munge
chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    say "starting munged"
    runuser -u munge -- /usr/sbin/munged
    for _ in $(seq 20); do munge -n 2>/dev/null | unmunge >/dev/null 2>&1 && break; sleep 0.5; done
fi
munge -n | unmunge >/dev/null || die "munged does not answer"

# --- configuration (rewritten only when it changes, then the daemons restarted) --
wanted=$(cat <<CONF
# made by gpuresa's scripts/setup_slurm.sh for its tests: one real node, fifty simulated
ClusterName=gpuresa
SlurmctldHost=$NODE
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation=$SLURM_STATE/ctld
SlurmdSpoolDir=$SLURM_STATE/d
SlurmctldPidFile=$SLURM_STATE/slurmctld.pid
SlurmdPidFile=$SLURM_STATE/slurmd.pid
SlurmctldLogFile=$SLURM_STATE/slurmctld.log
SlurmdLogFile=$SLURM_STATE/slurmd.log
GresTypes=gpu
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
SchedulerType=sched/backfill
SchedulerParameters=bf_interval=5,sched_min_interval=100000
ResvOverRun=0
KillWait=5
ReturnToService=2
SlurmdTimeout=300
SlurmdParameters=config_overrides
MaxJobCount=100000
NodeName=$NODE CPUs=16 RealMemory=4000 Gres=gpu:4 State=UNKNOWN
NodeName=sim[01-50] NodeAddr=127.0.1.[1-50] Port=6899 CPUs=16 RealMemory=4000 Gres=gpu:4 State=UNKNOWN
PartitionName=gpu Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
PartitionName=sim Nodes=sim[01-50] MaxTime=INFINITE State=UP
CONF
)
wanted_gres=$(cat <<CONF
AutoDetect=off
NodeName=$NODE Name=gpu File=$SLURM_STATE/dev/nvidia[0-3]
NodeName=sim[01-50] Name=gpu Count=4
CONF
)
changed=0
if [ "$(cat "$SLURM_CONF" 2>/dev/null || true)" != "$wanted" ]; then
    printf '%s\n' "$wanted" >"$SLURM_CONF"; changed=1
fi
if [ "$(cat "$GRES_CONF" 2>/dev/null || true)" != "$wanted_gres" ]; then
    printf '%s\n' "$wanted_gres" >"$GRES_CONF"; changed=1
fi

running() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if [ "$changed" = 1 ]; then
    say "$SLURM_CONF changed: (re)starting slurmctld and slurmd"
    for pidfile in "$SLURM_STATE/slurmd.pid" "$SLURM_STATE/slurmctld.pid"; do
        running "$pidfile" || continue
        pid=$(cat "$pidfile")
        kill "$pid" 2>/dev/null || true  # it may have ended since
        # a daemon busy starting reads its signal late: wait for it to go, then kill it
        for _ in $(seq 30); do kill -0 "$pid" 2>/dev/null || break; sleep 1; done
        if kill -0 "$pid" 2>/dev/null; then kill -9 "$pid" 2>/dev/null || true; sleep 1; fi
    done
fi
if ! running "$SLURM_STATE/slurmctld.pid"; then
    say "starting slurmctld (log: $SLURM_STATE/slurmctld.log)"
    # -i: a changed node list must not stop it from reading its saved state
    env -C / /usr/sbin/slurmctld -i
fi
if ! running "$SLURM_STATE/slurmd.pid"; then
    say "starting slurmd (log: $SLURM_STATE/slurmd.log)"
    env -C / /usr/sbin/slurmd
fi
for _ in $(seq 60); do
    state=$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null || true)
    case "$state" in idle*|mix*|alloc*) break ;; esac
    sleep 1
done
case "$state" in
    idle*|mix*|alloc*) ;;
    *)
        # a node drained by an earlier start (e.g. before the GRES were right) is resumed
        scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
        sleep 2
        state=$(sinfo -h -n "$NODE" -o '%t' 2>/dev/null || true)
        case "$state" in idle*|mix*|alloc*) ;; *)
            tail -n 20 "$SLURM_STATE/slurmctld.log" "$SLURM_STATE/slurmd.log" >&2 || true
            die "Slurm node $NODE is '$state', not idle (the logs are above)" ;;
        esac ;;
esac
gres=$(scontrol show node "$NODE" | grep -o 'Gres=[^ ]*')
[ "$gres" = "Gres=gpu:4" ] || die "Slurm node $NODE shows $gres, not gpu:4"
say "Slurm answers: node $NODE with 4 stand-in GPUs, 50 simulated nodes in partition sim"
