#!/usr/bin/env bash
# Starts a single-node Slurm on this machine without systemd: munged, slurmctld and slurmd with a
# config, state and logs under $HPCR1_SLURM_DIR (default /var/tmp/hpcr1-slurm). Idempotent: what is
# already running is left alone, unless the config changed: then slurmctld and slurmd restart.
# Prints the SLURM_CONF clients must use; waits (bounded) until the node is idle instead of sleeping.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
dir=${HPCR1_SLURM_DIR:-/var/tmp/hpcr1-slurm}
"$here/install.sh"
mkdir -p "$dir"/{etc,state,spool,log,run}
conf=$dir/etc/slurm.conf
export SLURM_CONF=$conf

node=$(hostname -s)
cpus=$(nproc)
# A little under what slurmd measures, or the node is drained for "low RealMemory".
memory=$(( $(slurmd -C | sed -n 's/.*RealMemory=\([0-9]*\).*/\1/p') * 9 / 10 ))
cat > "$conf.new" <<CONF
ClusterName=hpcr1local
SlurmctldHost=$node(127.0.0.1)
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd.log
SlurmctldPort=${HPCR1_SLURMCTLD_PORT:-6817}
SlurmdPort=${HPCR1_SLURMD_PORT:-6818}
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after it ends: 121 s by default. 15 s still
# covers a step's launch (credential to tasks running) on two loaded cores, which takes ~1 s.
AuthInfo=cred_expire=15
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
MpiDefault=pmix
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/filetxt
JobCompLoc=$dir/log/jobcomp.txt
JobAcctGatherType=jobacct_gather/none
DependencyParameters=kill_invalid_depend
MinJobAge=3600
ReturnToService=2
# The main loop also runs on every submit and job end; every 5 s (not 60) so a requeued job waits no longer.
SchedulerParameters=defer=false,sched_interval=5
NodeName=$node NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$memory State=UNKNOWN
PartitionName=debug Nodes=$node Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
CONF
alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }
if ! cmp -s "$conf.new" "$conf"; then
  # Daemons started under an older config would keep it (AuthInfo is read only at start).
  if alive "$dir/run/slurmctld.pid" || alive "$dir/run/slurmd.pid"; then "$here/stop.sh"; fi
  mv "$conf.new" "$conf"
else
  rm "$conf.new"
fi

# One munged for every local cluster: started only if none answers.
"$here/munge.sh" "$dir"

alive "$dir/run/slurmctld.pid" || slurmctld -f "$conf"
alive "$dir/run/slurmd.pid" || slurmd -f "$conf"

deadline=$((SECONDS + 60))
until sinfo -h -o %T 2>/dev/null | grep -qE '^(idle|mixed|allocated)'; do
  if ((SECONDS > deadline)); then
    echo "slurm did not come up in 60 s; see $dir/log/" >&2
    sinfo -h -o '%T %E' >&2 || true
    exit 1
  fi
  scontrol update nodename="$node" state=resume 2>/dev/null || true
  sleep 0.2
done
echo "SLURM_CONF=$conf"
