#!/usr/bin/env bash
# Makes sure a munged answers (Slurm's authentication), starting one with its pid file under DIR if
# none does; DIR/run/munged.ours then tells the matching stop script that it may stop it.
# Shared by start.sh and start-multinode.sh: one munged serves every local cluster (a socket path).
set -euo pipefail
dir=$1
if [ ! -s /etc/munge/munge.key ]; then
  mkdir -p /etc/munge
  dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
  chown munge:munge /etc/munge/munge.key && chmod 400 /etc/munge/munge.key
fi
mkdir -p /run/munge && chown munge:munge /run/munge
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
  mkdir -p "$dir/munge" "$dir/run" && chown munge:munge "$dir/munge"
  runuser -u munge -- /usr/sbin/munged --pid-file="$dir/munge/munged.pid"
  touch "$dir/run/munged.ours"
fi
