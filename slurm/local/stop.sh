#!/usr/bin/env bash
# Stops exactly what start.sh started: the daemons whose pid files live in $HPCR1_SLURM_DIR, and
# munged only if start.sh was the one that launched it.
set -uo pipefail
dir=${HPCR1_SLURM_DIR:-/var/tmp/hpcr1-slurm}
stop_pidfile() {
  local pidfile=$1
  [ -s "$pidfile" ] || return 0
  local pid; pid=$(cat "$pidfile")
  if kill -0 "$pid" 2>/dev/null; then
    kill "$pid"
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null || true
  fi
  rm -f "$pidfile"
}
stop_pidfile "$dir/run/slurmd.pid"
stop_pidfile "$dir/run/slurmctld.pid"
if [ -e "$dir/run/munged.ours" ]; then
  stop_pidfile "$dir/munge/munged.pid"
  rm -f "$dir/run/munged.ours"
fi
