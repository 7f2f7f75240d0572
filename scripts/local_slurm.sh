#!/usr/bin/env bash
# A SLURM cluster on this (Debian, root, no systemd) machine, for the tests marked `slurm`:
# munge, MariaDB + slurmdbd (accounting, so that sacct and submitit see a cancelled job's state),
# slurmctld and slurmd. Idempotent: a second run finds it up and returns.
#
#   bash scripts/local_slurm.sh           install (Debian packages) if needed, configure, start
#   bash scripts/local_slurm.sh nodes [N] also N (default 3) more compute nodes, partition `nodes`
#   bash scripts/local_slurm.sh revive tnodeI   start a node's slurmd again (a test stopped it) and resume it
#   bash scripts/local_slurm.sh stop      stop the daemons, remove the nodes' namespaces
#
# The one-node cluster (partition `debug`, this host) is what most tests use. `nodes` adds the
# multi-node case (tests marked `multinode`): node tnodeI is a slurmd in its own network, UTS and
# mount namespaces, with the address 10.77.0.(10+I) on a veth pair to a bridge `tnbr0`
# (10.77.0.1) that the script creates. Inside a node's namespace this host's name resolves to
# the bridge (/etc/netns/tnodeI/hosts, mounted over /etc/hosts there), so the node
# reaches the controller and every other node over that private network; its own spool and pid
# dirs are mounted over the shared paths. munge's socket is a file, so every node shares the one
# munged. Only addresses and namespaces the script made; `stop` removes them all.
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

node_idle() { sinfo -h -N -p debug -o '%T' | grep -qE '^(idle|mixed|allocated)'; }

BRIDGE=tnbr0
SUBNET=10.77.0
NODES_CONF=$ETC/nodes.conf
MARK="# titan_exp local_slurm nodes"

node_names() { ls /var/run/netns 2>/dev/null | grep -E '^tnode[0-9]+$' || true; }

stop_nodes() {
    local ns pid
    for ns in $(node_names); do
        for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
        ip netns del "$ns"
        rm -rf "/etc/netns/$ns"
    done
    ip link del "$BRIDGE" 2>/dev/null || true
    sed -i "/$MARK/d" /etc/hosts
    [[ -f "$NODES_CONF" ]] && : >"$NODES_CONF"
    return 0
}

up_nodes() {  # up_nodes N: tnode1..tnodeN, on the running controller
    local n=$1 i ns addr hosts
    ip link show "$BRIDGE" >/dev/null 2>&1 || ip link add "$BRIDGE" type bridge
    ip addr replace "$SUBNET.1/24" dev "$BRIDGE"
    ip link set "$BRIDGE" up
    hosts="127.0.0.1 localhost\n$SUBNET.1 $NODE"
    for i in $(seq "$n"); do hosts="$hosts\n$SUBNET.$((10 + i)) tnode$i"; done
    sed -i "/$MARK/d" /etc/hosts
    for i in $(seq "$n"); do echo "$SUBNET.$((10 + i)) tnode$i $MARK" >>/etc/hosts; done
    {
        echo "$MARK"
        for i in $(seq "$n"); do
            echo "NodeName=tnode$i NodeAddr=$SUBNET.$((10 + i)) NodeHostname=tnode$i CPUs=$(nproc) RealMemory=4096 State=UNKNOWN"
        done
        echo "PartitionName=nodes Nodes=tnode[1-$n] MaxTime=INFINITE State=UP"
    } >"$NODES_CONF"
    for i in $(seq "$n"); do
        ns=tnode$i addr=$SUBNET.$((10 + i))
        if ! node_names | grep -qx "$ns"; then
            ip netns add "$ns"
            ip link add "v$ns" type veth peer name eth0 netns "$ns"
            ip link set "v$ns" master "$BRIDGE" up
            ip -n "$ns" addr add "$addr/24" dev eth0
            ip -n "$ns" link set lo up
            ip -n "$ns" link set eth0 up
            ip -n "$ns" route add default via "$SUBNET.1"
        fi
        mkdir -p "/etc/netns/$ns" "/var/spool/slurmd-$ns" "/run/slurmd-$ns"
        echo -e "$hosts" >"/etc/netns/$ns/hosts"
        # No name server inside: a lookup that misses the hosts file fails at once rather than
        # waiting 10 s for this host's resolver (torch's TCPStore looks up every client).
        echo "# titan_exp node $ns: no name server" >"/etc/netns/$ns/resolv.conf"
    done
    # The controller learns new nodes at a restart (22.05 cannot add them by reconfigure).
    pkill -x slurmctld || true
    for _ in $(seq 120); do pgrep -x slurmctld >/dev/null || break; sleep 0.25; done
    detach "$LOGS/slurmctld.out" slurmctld -D
    wait_for 30 slurmctld bash -c "scontrol ping | grep -q UP"
    for i in $(seq "$n"); do start_slurmd "tnode$i"; done
    scontrol reconfigure  # this host's slurmd reads the new node list too
    wait_for 60 "nodes tnode[1-$n]" nodes_up "$n"
    scontrol update NodeName="tnode[1-$n]" State=RESUME >/dev/null 2>&1 || true
    log "nodes up: $(sinfo -h -p nodes -o '%P %D %C %t %N')"
}

start_slurmd() {  # start_slurmd tnodeI: its slurmd, in its namespaces, unless one runs there
    local ns=$1
    ip netns pids "$ns" | xargs -r ps -o comm= -p | grep -qx slurmd && return 0
    # Not `ip netns exec`: it remounts /sys, hiding the cgroup mounts slurmd needs.
    detach "$LOGS/slurmd-$ns.out" unshare --uts --mount --propagation private \
        nsenter --net="/var/run/netns/$ns" sh -c "hostname $ns \
         && mount --bind /etc/netns/$ns/hosts /etc/hosts \
         && mount --bind /etc/netns/$ns/resolv.conf /etc/resolv.conf \
         && mount --bind /var/spool/slurmd-$ns /var/spool/slurmd \
         && mount --bind /run/slurmd-$ns /run/slurmd && exec slurmd -D -N $ns -L $LOGS/slurmd-$ns.log"
}

node_back() {  # node_back tnodeI: answering and in service again
    [[ $(sinfo -h -n "$1" -o '%T' 2>/dev/null) =~ ^(idle|mixed|allocated)$ ]]
}

resume_node() {  # resume_node tnodeI: once its slurmd answers, back in service
    scontrol update NodeName="$1" State=RESUME >/dev/null 2>&1 || true
    node_back "$1"
}

nodes_up() {  # nodes_up N: N nodes in the nodes partition, every one answering
    [[ $(node_names | wc -l) -eq $1 ]] \
        && [[ $(sinfo -h -N -p nodes -o '%T' 2>/dev/null | grep -cE '^(idle|mixed|allocated)') -eq $1 ]]
}

if [[ "${1:-}" == "stop" ]]; then stop; stop_nodes; exit 0; fi
if [[ "${1:-}" == "revive" ]]; then  # a node whose slurmd a test stopped (a lost node): back in service
    node_names | grep -qx "${2:-}" || { log "no node ${2:-} (bash scripts/local_slurm.sh nodes makes them)"; exit 1; }
    start_slurmd "$2"
    wait_for 60 "node $2" resume_node "$2"
    log "node $2 back: $(sinfo -h -n "$2" -o '%T')"
    exit 0
fi

if [[ "${1:-}" == "nodes" ]] && ! grep -qx "Include $NODES_CONF" "$ETC/slurm.conf" 2>/dev/null; then
    stop  # a controller configured before nodes existed: configure it again below
fi
if command -v sinfo >/dev/null && scontrol ping 2>/dev/null | grep -q UP && node_idle 2>/dev/null \
        && sacct -n -X -S now >/dev/null 2>&1; then
    if [[ "${1:-}" != "nodes" ]]; then log "already up"; exit 0; fi
    if nodes_up "${2:-3}"; then log "nodes already up"; exit 0; fi
    up_nodes "${2:-3}"
    exit 0
fi

packages=(slurmctld slurmd slurm-client munge slurmdbd mariadb-server)
if ! dpkg -s "${packages[@]}" >/dev/null 2>&1; then
    log "installing ${packages[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get install -y -q "${packages[@]}" >/dev/null || { apt-get update -q >/dev/null; apt-get install -y -q "${packages[@]}" >/dev/null; }
fi

getent hosts "$NODE" >/dev/null || echo "127.0.0.1 $NODE" >>/etc/hosts
mkdir -p "$LOGS" /var/spool/slurmctld /var/spool/slurmd /run/slurmd /run/munge /run/mysqld "$ETC"
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
SlurmdPidFile=/run/slurmd/slurmd.pid
SlurmctldLogFile=$LOGS/slurmctld.log
SlurmdLogFile=$LOGS/slurmd.log
KillWait=30
$node_line State=UNKNOWN
PartitionName=debug Nodes=$NODE Default=YES MaxTime=INFINITE State=UP
Include $NODES_CONF
EOF
[[ -f "$NODES_CONF" ]] || : >"$NODES_CONF"

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
if [[ "${1:-}" == "nodes" ]]; then up_nodes "${2:-3}"; fi
