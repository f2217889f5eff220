#!/usr/bin/env bash
# A SLURM cluster on this machine, for trying the SLURM recipes of docs/multi_node.md and for the
# tests (tests/test_schedulers.py): munge and slurmctld, and NODES slurmd daemons (each a node of its
# own name, all at 127.0.0.1), everything under DIR (configuration, state, logs, pids).
#
#   bash tools/slurm/start_local_cluster.sh DIR [NODES] [CPUS]   # then: export SLURM_CONF=DIR/slurm.conf
#   bash tools/slurm/stop_local_cluster.sh DIR                   # stops what this started
#
# Needs Debian's slurm-wlm and munge (installed here with apt-get when missing and run as root).
# The node names are node1..nodeN; JAX's SLURM detection connects to the first node by name,
# so a line "127.0.0.1 node1 ... nodeN" is added to /etc/hosts (removed by the stop script).
set -euo pipefail
dir=$(realpath -m "${1:?usage: start_local_cluster.sh DIR [NODES] [CPUS]}")
nodes=${2:-1}
cpus=${3:-4}
if ! command -v slurmctld >/dev/null || ! command -v munged >/dev/null; then
    if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null; then
        echo "error: slurmctld or munged not found; install Debian's slurm-wlm and munge packages" >&2
        exit 2
    fi
    echo "installing slurm-wlm and munge with apt-get"
    apt-get install -y -q slurm-wlm munge >/dev/null
fi
if [ -e "$dir/slurm.conf" ]; then
    echo "error: $dir already holds a cluster; stop it with tools/slurm/stop_local_cluster.sh $dir" >&2
    exit 2
fi
mkdir -p "$dir"/{state,log,run,munge}
for i in $(seq "$nodes"); do mkdir -p "$dir/spool/node$i"; done
chmod 700 "$dir/munge"
user=$(id -un)
# Ports from this directory's name, so that two clusters on one machine do not collide.
base=$(( 20000 + $(echo -n "$dir" | cksum | cut -d' ' -f1) % 20000 ))

mungekey --create --keyfile "$dir/munge/munge.key" 2>/dev/null \
    || dd if=/dev/urandom of="$dir/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$dir/munge/munge.key"
munged --force --key-file "$dir/munge/munge.key" --socket "$dir/munge/munge.socket" \
    --pid-file "$dir/run/munged.pid" --log-file "$dir/log/munged.log" \
    --seed-file "$dir/munge/munged.seed"

names=$(seq -f "node%g" -s ' ' "$nodes")
if ! grep -q "# tunix_train local SLURM $dir\$" /etc/hosts 2>/dev/null; then
    echo "127.0.0.1 $names  # tunix_train local SLURM $dir" >> /etc/hosts
fi

{
    echo "ClusterName=local"
    echo "SlurmctldHost=$(hostname -s)(127.0.0.1)"
    echo "SlurmctldPort=$base"
    echo "SlurmUser=$user"
    echo "SlurmdUser=$user"
    echo "AuthType=auth/munge"
    echo "AuthInfo=socket=$dir/munge/munge.socket"
    echo "CredType=cred/munge"
    echo "StateSaveLocation=$dir/state"
    echo "SlurmdSpoolDir=$dir/spool/%n"
    echo "SlurmctldPidFile=$dir/run/slurmctld.pid"
    echo "SlurmdPidFile=$dir/run/slurmd-%n.pid"
    echo "SlurmctldLogFile=$dir/log/slurmctld.log"
    echo "SlurmdLogFile=$dir/log/slurmd-%n.log"
    echo "ProctrackType=proctrack/linuxproc"
    echo "TaskPlugin=task/none"
    echo "SelectType=select/cons_tres"
    echo "SelectTypeParameters=CR_CPU"
    echo "SchedulerType=sched/backfill"
    # Schedule every 1-2 s, not SLURM's 30/60 s: a requeued job starts when its start time comes.
    echo "SchedulerParameters=bf_interval=1,sched_interval=2"
    echo "MpiDefault=none"
    # Nodes may declare more CPUs than the machine has (tests run 2 tasks per node on 2 cores).
    echo "SlurmdParameters=config_overrides"
    echo "ReturnToService=2"
    echo "JobRequeue=1"
    echo "KillWait=10"
    echo "SlurmctldTimeout=30"
    echo "SlurmdTimeout=30"
    echo "InactiveLimit=0"
    echo "MinJobAge=300"
    echo "JobAcctGatherType=jobacct_gather/none"
    echo "AccountingStorageType=accounting_storage/none"
    # Each node declares $cpus GPUs with no device files behind them, so that the GPU options
    # of docs/multi_node.md's batch script (--gpus-per-task) are accepted; JAX on the CPU
    # ignores the CUDA_VISIBLE_DEVICES that SLURM then sets.
    echo "GresTypes=gpu"
    for i in $(seq "$nodes"); do
        echo "NodeName=node$i NodeAddr=127.0.0.1 Port=$((base + i)) CPUs=$cpus Gres=gpu:$cpus State=UNKNOWN"
    done
    echo "PartitionName=local Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
} > "$dir/slurm.conf"
mkdir -p "$dir/dev"
for g in $(seq 0 $((cpus - 1))); do touch "$dir/dev/gpu$g"; done  # SLURM drops file-less GPUs
echo "NodeName=node[1-$nodes] Name=gpu File=$dir/dev/gpu[0-$((cpus - 1))]" > "$dir/gres.conf"
echo "$base" > "$dir/run/port"

export SLURM_CONF="$dir/slurm.conf"
slurmctld -f "$SLURM_CONF"
for i in $(seq "$nodes"); do slurmd -f "$SLURM_CONF" -N "node$i"; done

# Until every node is idle (the daemons fork; slurmctld takes a few seconds to hear the nodes).
for _ in $(seq 60); do
    idle=$(sinfo -h -N -t idle -o %N 2>/dev/null | wc -l)
    [ "$idle" -ge "$nodes" ] && { echo "SLURM cluster up: $nodes node(s) idle; export SLURM_CONF=$SLURM_CONF"; exit 0; }
    if sinfo -h -N -o %t 2>/dev/null | grep -q -E "inval|drain"; then
        echo "error: slurmctld refused a node: $(sinfo -h -N -R -o '%N: %E' | head -1); see $dir/log" >&2
        exit 1
    fi
    echo "waiting for $nodes SLURM node(s) to be idle ($idle so far)"
    sleep 1
done
echo "error: the nodes did not become idle in 60 s; see $dir/log" >&2
exit 1
