#!/usr/bin/env bash
# Stops the cluster tools/slurm/start_local_cluster.sh started in DIR: its daemons by the pids
# they wrote (never by name: another cluster, or the machine's own, is left alone), and its
# /etc/hosts line. DIR itself (logs, state) is left for reading.
set -uo pipefail
dir=$(realpath -m "${1:?usage: stop_local_cluster.sh DIR}")
pids=()
for f in "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid" "$dir/run/munged.pid"; do
    [ -s "$f" ] && pids+=("$(cat "$f")")
done
for pid in "${pids[@]}"; do kill "$pid" 2>/dev/null; done
for _ in $(seq 50); do
    alive=0
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && break
    sleep 0.2
done
for pid in "${pids[@]}"; do kill -9 "$pid" 2>/dev/null; done
if [ -w /etc/hosts ]; then
    sed -i "\|# tunix_train local SLURM $dir\$|d" /etc/hosts
fi
echo "SLURM cluster in $dir stopped"
