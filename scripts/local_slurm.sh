#!/usr/bin/env bash
# A single-node SLURM cluster on this (Debian, root, no systemd) machine, for the tests marked
# `slurm`: munge, MariaDB + slurmdbd (accounting, so that sacct and submitit see a cancelled
# job's state), slurmctld and slurmd. Idempotent: a second run finds it up and returns.
#
#   bash scripts/local_slurm.sh          install (Debian packages) if needed, configure, start
#   bash scripts/local_slurm.sh stop     stop the daemons
#
# The daemons are fully detached (new session, stdio to log files, every other inherited
# descriptor closed), so a CI runner that waits on its pipes is not kept waiting by them.
set -euo pipefail

CLUSTER=titan_exp
ETC=/etc/slurm
LOGS=/var/log/slurm
NODE=$(hostname -s)
DB_PASS=titan_exp_local

log() { echo "local_slurm: $*" >&2; }

stop() {
    local daemon
    for daemon in slurmd slurmctld slurmdbd munged mariadbd; do
        pkill -x "$daemon" || continue
        for _ in $(seq 120); do pgrep -x "$daemon" >/dev/null || break; sleep 0.25; done
    done
}

# Start a daemon in its own session with stdio redirected and no other inherited descriptor.
detach() {
    local logfile=$1; shift
    python3 - "$logfile" "$@" <<'EOF'
import subprocess, sys
with open(sys.argv[1], "ab") as out:
    subprocess.Popen(sys.argv[2:], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT,
                     start_new_session=True, close_fds=True)
EOF
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds=$1 what=$2; shift 2
    for _ in $(seq $((seconds * 4))); do
        if "$@" >/dev/null 2>&1; then return 0; fi
        sleep 0.25
    done
    log "$what did not come up in ${seconds}s; logs in $LOGS"
    tail -n 20 "$LOGS"/*.log >&2 || true
    exit 1
}

node_idle() { sinfo -h -N -o '%T' | grep -qE '^(idle|mixed|allocated)'; }

if [[ "${1:-}" == "stop" ]]; then stop; exit 0; fi

if command -v sinfo >/dev/null && scontrol ping 2>/dev/null | grep -q UP && node_idle 2>/dev/null \
        && sacct -n -X -S now >/dev/null 2>&1; then
    log "already up"; exit 0
fi

packages=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    log "installing ${packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${packages[@]}" >/dev/null || { apt-get update -q >/dev/null; apt-get install -y -q "${packages[@]}" >/dev/null; }
fi

getent hosts "$NODE" >/dev/null || echo "127.0.0.1 $NODE" >>/etc/hosts
mkdir -p "$LOGS" /var/spool/slurmctld /var/spool/slurmd /run/munge /run/mysqld "$ETC"
chown munge:munge /run/munge
chown mysql:mysql /run/mysqld

# Node line from slurmd -C, memory lowered to ~90 % so that slurmd's own check passes.
node_line=$(slurmd -C | head -n 1)
memory=$(sed -E 's/.*RealMemory=([0-9]+).*/\1/' <<<"$node_line")
node_line=$(sed -E "s/RealMemory=[0-9]+/RealMemory=$((memory * 9 / 10))/; s/NodeName=[^ ]+/NodeName=$NODE/" <<<"$node_line")

cat >"$ETC/slurm.conf" <<EOF
ClusterName=$CLUSTER
SlurmctldHost=$NODE
SlurmUser=root
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/slurmdbd
AccountingStorageHost=localhost
JobCompType=jobcomp/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_Core_Memory
MpiDefault=none
ReturnToService=2
StateSaveLocation=/var/spool/slurmctld
SlurmdSpoolDir=/var/spool/slurmd
SlurmctldPidFile=/run/slurmctld.pid
SlurmdPidFile=/run/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
KillWait=30
$node_line State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF

cat >"$ETC/slurmdbd.conf" <<EOF
AuthType=auth/munge
DbdHost=localhost
SlurmUser=root
LogFile=$LOGS/slurmdbd.log
PidFile=/run/slurmdbd.pid
StorageType=accounting_storage/mysql
StorageHost=localhost
StorageUser=slurm
StoragePass=$DB_PASS
StorageLoc=slurm_acct_db
EOF
chmod 600 "$ETC/slurmdbd.conf"

if ! pgrep -x munged >/dev/null; then
    detach "$LOGS/munged.log" runuser -u munge -- munged --foreground
fi
wait_for 20 munged munge -n

if ! pgrep -x mariadbd >/dev/null; then
    detach "$LOGS/mariadb.log" mariadbd --user=mysql --skip-networking --socket=/run/mysqld/mysqld.sock
fi
wait_for 30 mariadb mariadb -e "select 1"
mariadb -e "CREATE DATABASE IF NOT EXISTS slurm_acct_db;
            CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$DB_PASS';
            GRANT ALL ON slurm_acct_db.* TO 'slurm'@'localhost';"

if ! pgrep -x slurmdbd >/dev/null; then
    detach "$LOGS/slurmdbd.out" slurmdbd -D
fi
wait_for 30 slurmdbd sacctmgr -n list cluster
sacctmgr -i -Q add cluster "$CLUSTER" >/dev/null 2>&1 || true

if ! pgrep -x slurmctld >/dev/null; then
    detach "$LOGS/slurmctld.out" slurmctld -D
fi
wait_for 30 slurmctld bash -c "scontrol ping | grep -q UP"

if ! pgrep -x slurmd >/dev/null; then
    detach "$LOGS/slurmd.out" slurmd -D
fi
wait_for 30 "node $NODE" node_idle
scontrol update NodeName="$NODE" State=RESUME >/dev/null 2>&1 || true
wait_for 30 sacct sacct -n -X -S now
log "up: $(sinfo -h -o '%P %D %C %t')"
