#!/usr/bin/env bash
# Installs the Debian packages of a single-node Slurm (munge, slurmctld, slurmd, clients) and
# Open MPI, idempotently. Open MPI goes first: installing it under a running slurmd left the node
# hung in COMPLETING.
set -euo pipefail
need=()
command -v mpirun >/dev/null || need+=(openmpi-bin libopenmpi-dev)
# The multi-node cluster (start-multinode.sh): network namespaces, veths and a bridge.
command -v ip >/dev/null || need+=(iproute2)
command -v nsenter >/dev/null || need+=(util-linux)
for pkg in munge slurmctld slurmd slurm-client; do
  dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed" || need+=("$pkg")
done
if ((${#need[@]})); then
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq
  apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null
fi
# The packages' own services are not wanted: start.sh runs the daemons under its own config.
for svc in slurmctld slurmd munge; do
  if command -v systemctl >/dev/null && systemctl is-active --quiet "$svc" 2>/dev/null; then systemctl stop "$svc"; fi
done
