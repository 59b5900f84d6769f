#!/usr/bin/env bash
# Stops what start-multinode.sh started, and only that: its slurmds and slurmctld (by their pid
# files under $HPCR1_MN_DIR), what its jobs left running in the node namespaces, munged if it was
# the one to start it; then deletes the namespaces, veths and bridge. Safe to run any number of times.
set -uo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${HPCR1_MN_DIR:-/var/tmp/hpcr1-slurm-multinode}
# shellcheck source=slurm/local/multinode-net.sh
. "$here/multinode-net.sh"

# TERM to every pid at once, then wait (each daemon takes ~2 s to exit: one after the other, the
# four took 8 s); what is still there after 5 s is killed.
stop_pids() {
  local pid
  kill "$@" 2>/dev/null
  for _ in $(seq 50); do
    for pid in "$@"; do kill -0 "$pid" 2>/dev/null && break; done
    kill -0 "$pid" 2>/dev/null || return 0
    sleep 0.1
  done
  kill -9 "$@" 2>/dev/null || true
}
# The pids of these pid files (the live ones), which are then removed.
take_pids() {
  local f
  for f in "$@"; do
    [ -s "$f" ] && kill -0 "$(cat "$f")" 2>/dev/null && cat "$f"
    rm -f "$f"
  done
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
mapfile -t daemons < <(take_pids "$dir"/run/slurmd-*.pid "$dir/run/slurmctld.pid")
((${#daemons[@]})) && stop_pids "${daemons[@]}"
# A job's processes (ranks, stepds) outlive their slurmd; all in these namespaces are the cluster's.
for ((k = 1; k <= MAX_NODES; k++)); do
  ns=$(netns_name "$k")
  [ -e "/run/netns/$ns" ] || continue
  for pid in $(ip netns pids "$ns"); do kill -9 "$pid" 2>/dev/null || true; done
done
if [ -e "$dir/run/munged.ours" ]; then
  mapfile -t daemons < <(take_pids "$dir/munge/munged.pid")
  ((${#daemons[@]})) && stop_pids "${daemons[@]}"
  rm -f "$dir/run/munged.ours"
fi
net_down
