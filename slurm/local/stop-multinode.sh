#!/usr/bin/env bash
# Stops what start-multinode.sh started, and only that: its slurmds and slurmctld (by their pid
# files under $HPCR1_MN_DIR), what its jobs left running in the node namespaces, munged if it was
# the one to start it; then deletes the namespaces, veths and bridge. Safe to run any number of times.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${HPCR1_MN_DIR:-/var/tmp/hpcr1-slurm-multinode}
# shellcheck source=slurm/local/multinode-net.sh
. "$here/multinode-net.sh"

# TERM to the live daemons of these pid files at once, then wait (each takes ~2 s to exit: one after
# the other, the four took 8 s); what is still there after 5 s is killed. The pid files are removed.
stop_pidfiles() {
  local f pids=()
  for f in "$@"; do
    [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && pids+=("$(cat "$f")")
    rm -f "$f"
  done
  ((${#pids[@]})) || return 0
  kill "${pids[@]}" 2>/dev/null
  for _ in $(seq 50); do
    any_alive "${pids[@]}" || return 0
    sleep 0.1
  done
  kill -9 "${pids[@]}" 2>/dev/null || true
}
any_alive() {
  local pid
  for pid in "$@"; do kill -0 "$pid" 2>/dev/null && return 0; done
  return 1
}

# Jobs still queued or running would be recovered by the next start as running, holding the nodes
# until slurmctld finds their batch shell gone (about 2 min), then requeued beside the next jobs.
if [ -s "$dir/run/slurmctld.pid" ] && kill -0 "$(cat "$dir/run/slurmctld.pid")" 2>/dev/null; then
  export SLURM_CONF=$dir/etc/slurm.conf
  mapfile -t jobs < <(squeue -h -o %i 2>/dev/null)
  if ((${#jobs[@]})); then
    scancel "${jobs[@]}" 2>/dev/null
    for _ in $(seq 50); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 0.1; done
  fi
fi
stop_pidfiles "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid"
# A job's processes (ranks, stepds) outlive their slurmd; all in these namespaces are the cluster's.
for ((k = 1; k <= MAX_NODES; k++)); do
  ns=$(netns_name "$k")
  [ -e "/run/netns/$ns" ] || continue
  for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
done
if [ -e "$dir/run/munged.ours" ]; then
  stop_pidfiles "$dir/munge/munged.pid"
  rm -f "$dir/run/munged.ours"
fi
net_down
