#!/usr/bin/env bash
# Ray on a Slurm allocation: start the Ray head on this (the batch) node, one Ray worker per other
# node (srun --overlap), wait until every node has joined, run the given command with RAY_ADDRESS
# set, then stop Ray everywhere, whatever the command's outcome. Exit status: the command's.
#
# SIGUSR1 and SIGTERM sent to this script (Slurm's `--signal=B:USR1@N`, `scancel --batch --signal=...`) are
# forwarded to the command. With REQUEUE_AFTER_SIGNAL=1, a command that exits 0 after such a signal and has
# written its stop notice to the file named by MEGATRON_RL_STOPPED_EARLY_FILE (the driver writes it when it stopped with steps left;
# a signal during the last step leaves a finished run, nothing to requeue) gets the job requeued
# (`scontrol requeue`, once Ray is stopped), so it starts again and resumes.
#
# Addresses: a one-node job keeps Ray on 127.0.0.1: Ray's cluster mode is turned off
# (RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0, exported to the command too, whose Ray client would otherwise replace
# 127.0.0.1 by the node's outward address), so its processes listen on loopback only. On several nodes each
# node's Ray takes the IPv4 address of NETWORK_INTERFACE on that node (train.sbatch sets it from the recipe's
# cluster.network_interface; `ip -4 addr` reads it), else the node's first address (`hostname -I`). Ray 2.60
# listens on every interface of a node whose address is not 127.0.0.1; its token authentication guards it.
#
# Usage (inside an allocation, from the repository root): slurm/ray_cluster.sh COMMAND [ARGS...]
# Environment: MEGATRON_RL_ROOT (default: $SLURM_SUBMIT_DIR), RAY_PORT (default 6379),
#              RAY_JOIN_TIMEOUT_S (default 300), RAY_AUTH_TOKEN (default: a fresh token per job),
#              NETWORK_INTERFACE (default: none), REQUEUE_AFTER_SIGNAL (default 0).
set -euo pipefail
[ $# -gt 0 ] || { echo "usage: slurm/ray_cluster.sh COMMAND [ARGS...]" >&2; exit 2; }
: "${SLURM_JOB_ID:?run inside a Slurm allocation (sbatch or salloc)}"
root="${MEGATRON_RL_ROOT:-${SLURM_SUBMIT_DIR:-$(pwd)}}"
ray_bin="$root/.venv/bin/ray"
[ -x "$ray_bin" ] || { echo "error: $ray_bin not found; run ./launch/setup.sh on the shared file system first" >&2; exit 2; }

port="${RAY_PORT:-6379}"
join_timeout="${RAY_JOIN_TIMEOUT_S:-300}"
num_nodes="${SLURM_JOB_NUM_NODES:-1}"
head_node="$(hostname -s)"
node_address() {  # the IPv4 address of interface $1 on this node ('' when it has none)
    ip -4 -o addr show dev "$1" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}'
}
if [ "$num_nodes" -eq 1 ]; then
    head_ip=127.0.0.1
    export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0
elif [ -n "${NETWORK_INTERFACE:-}" ]; then
    head_ip="$(node_address "$NETWORK_INTERFACE")"
    [ -n "$head_ip" ] || { echo "error: $head_node has no IPv4 address on interface $NETWORK_INTERFACE (cluster.network_interface)" >&2; exit 2; }
else
    head_ip="$(hostname -I | awk '{print $1}')"
fi
num_cpus="${SLURM_CPUS_ON_NODE:-$(nproc)}"
num_gpus="${SLURM_GPUS_ON_NODE:-$( (nvidia-smi -L 2>/dev/null || true) | wc -l)}"
temp_dir="/tmp/ray_${SLURM_JOB_ID}"
export RAY_ADDRESS="$head_ip:$port"
# Ray 2.60 enables token authentication; one token per job, inherited by srun'd workers and the command.
export RAY_AUTH_MODE=token
export RAY_AUTH_TOKEN="${RAY_AUTH_TOKEN:-$("$root/.venv/bin/python" -c 'import secrets; print(secrets.token_hex(32))')}"

stop_ray() {
    [ "$num_nodes" -gt 1 ] && srun --overlap --nodes="$((num_nodes - 1))" --ntasks-per-node=1 \
        --exclude="$head_node" "$ray_bin" stop --force >/dev/null 2>&1 || true
    "$ray_bin" stop --force >/dev/null 2>&1 || true
}
trap stop_ray EXIT

echo "[ray_cluster] head on $head_node ($RAY_ADDRESS), $num_nodes node(s), $num_cpus CPUs and $num_gpus GPUs per node"
"$ray_bin" start --head --node-ip-address="$head_ip" --port="$port" --num-cpus="$num_cpus" --num-gpus="$num_gpus" \
    --temp-dir="$temp_dir" --include-dashboard=false --disable-usage-stats >/dev/null
start_worker() {  # on a worker node: join the head, at this node's address on NETWORK_INTERFACE when set
    local address_args=()
    if [ -n "${NETWORK_INTERFACE:-}" ]; then
        local address
        address="$(node_address "$NETWORK_INTERFACE")"
        [ -n "$address" ] || { echo "error: $(hostname -s) has no IPv4 address on $NETWORK_INTERFACE" >&2; return 2; }
        address_args=(--node-ip-address="$address")
    fi
    exec "$ray_bin" start --address="$RAY_ADDRESS" "${address_args[@]}" "$@"
}
if [ "$num_nodes" -gt 1 ]; then
    export -f node_address start_worker
    export ray_bin
    srun --overlap --nodes="$((num_nodes - 1))" --ntasks-per-node=1 --exclude="$head_node" \
        bash -c 'start_worker "$@"' start_worker --num-cpus="$num_cpus" --num-gpus="$num_gpus" --block \
        --disable-usage-stats >/dev/null 2>&1 &
fi

deadline=$((SECONDS + join_timeout))
until [ "$("$root/.venv/bin/python" -c 'import ray; ray.init(logging_level="ERROR"); print(len([n for n in ray.nodes() if n["Alive"]]))' 2>/dev/null)" = "$num_nodes" ]; do
    if [ "$SECONDS" -ge "$deadline" ]; then
        echo "error: only part of the $num_nodes nodes joined Ray within ${join_timeout} s" >&2
        exit 1
    fi
    sleep 2
done
echo "[ray_cluster] all $num_nodes node(s) joined; running: $*"
MEGATRON_RL_STOPPED_EARLY_FILE="$(mktemp "${TMPDIR:-/tmp}/megatron-rl-stopped-early.XXXXXX")"
export MEGATRON_RL_STOPPED_EARLY_FILE
source "$(dirname "${BASH_SOURCE[0]}")/forward_signals.sh"
run_forwarding_signals "$@"
stopped_early=0
[ -s "$MEGATRON_RL_STOPPED_EARLY_FILE" ] && stopped_early=1
rm -f "$MEGATRON_RL_STOPPED_EARLY_FILE"
if [ -n "$signalled" ] && [ "$status" = 0 ] && [ "${REQUEUE_AFTER_SIGNAL:-0}" = 1 ]; then
    stop_ray
    if [ "$stopped_early" = 1 ]; then
        echo "[ray_cluster] the command stopped after SIG$signalled; requeueing job $SLURM_JOB_ID"
        scontrol requeue "$SLURM_JOB_ID"
    else
        echo "[ray_cluster] the command finished its work despite SIG$signalled; not requeueing job $SLURM_JOB_ID"
    fi
fi
exit "$status"
