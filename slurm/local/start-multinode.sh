#!/usr/bin/env bash
# Starts a Slurm cluster of N nodes (default 2, at most 4) on this one machine, so that multi-node
# launches (srun across nodes, a rendezvous on the first node's address, MPI) run for real in tests.
# Each node is a network namespace joined to a bridge, with its own hostname and an address in
# 10.213.17.0/24 (a range that exists only on that bridge); one slurmd runs in each, slurmctld on the
# host beside them, and the filesystem is shared as on a real cluster (it is the same machine).
# Everything is its own: state under $HPCR1_MN_DIR, ports 6917/6918, ClusterName hpcr1multi, so the
# single-node cluster of start.sh (6817/6818) is left alone; munged is shared (one socket path).
# Idempotent: an identical config already up is left running; a different one is torn down first.
# Prints the SLURM_CONF clients must use; waits (bounded) for every node to be idle.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
nodes=${1:-2}
if ! [[ $nodes =~ ^[1-4]$ ]]; then
  echo "usage: $0 [NODES]  (1 to 4, default 2)" >&2
  exit 2
fi
dir=${HPCR1_MN_DIR:-/var/tmp/hpcr1-slurm-multinode}
# shellcheck source=slurm/local/multinode-net.sh
. "$here/multinode-net.sh"
"$here/install.sh"
mkdir -p "$dir"/{etc,state,log,run}
conf=$dir/etc/slurm.conf
export SLURM_CONF=$conf

node_names() { local k; for ((k = 1; k <= nodes; k++)); do printf '%s\n' "$(node_name "$k")"; done; }

write_conf() {
  local k list
  list=$(node_names | paste -sd,)
  cat <<CONF
ClusterName=hpcr1multi
SlurmctldHost=$(hostname -s)($BRIDGE_ADDR)
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/run/slurmctld.pid
SlurmdPidFile=$dir/run/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
# Per node, as on a real cluster: pmix makes a per-step directory there that two nodes (or the other
# local cluster's job of the same id) would otherwise both claim in /tmp.
TmpFS=$dir/tmp/%n
SlurmctldPort=6917
SlurmdPort=6918
AuthType=auth/munge
# A requeued job may start again cred_expire + 1 s after it ends: 121 s by default. 15 s still
# covers a step's launch (credential to tasks running) on two loaded cores, which takes ~1 s.
AuthInfo=cred_expire=15
# A node that stops answering (slurmd killed, link cut) is DOWN after this, not 300 s: its job step
# then ends (the job survives: --no-kill) and the stage driver records the failure. The controller's
# ping of a dead slurmd fails only after MessageTimeout, so both set how soon: measured with a
# killed slurmd, not responding after 17 s and DOWN after 30 s at (10, 10); 12 s and 20 s at (10, 5);
# ~34 s to DOWN at (20, 10). Round trips here stay on one host (milliseconds, even on loaded cores).
SlurmdTimeout=10
MessageTimeout=5
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
SlurmdParameters=config_overrides
MinJobAge=3600
ReturnToService=2
SchedulerParameters=defer=false,sched_interval=5
CONF
  # Every node may use every core (they are the machine's), twice over: a one-node job (a test's
  # reference run) then runs beside a job across all nodes instead of waiting for its cores, as it
  # would on separate machines. config_overrides keeps slurmd from draining a node for having more
  # CPUs configured than it finds. Memory is not enforced; 1 GiB avoids a drain for "low RealMemory".
  for ((k = 1; k <= nodes; k++)); do
    echo "NodeName=$(node_name "$k") NodeAddr=$(node_addr "$k") CPUs=$((2 * $(nproc))) RealMemory=1024 State=UNKNOWN"
  done
  echo "PartitionName=debug Nodes=$list Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES"
}

# A node's /etc/hosts, bind-mounted in its slurmd's own mount namespace (jobs inherit it): the
# nodes' names resolve there, for the rendezvous and gloo, and the host's /etc/hosts is untouched.
write_hosts() {
  local k
  printf '127.0.0.1 localhost\n%s %s\n' "$BRIDGE_ADDR" "$(hostname -s)"
  for ((k = 1; k <= nodes; k++)); do printf '%s %s\n' "$(node_addr "$k")" "$(node_name "$k")"; done
}

alive() { [ -s "$1" ] && kill -0 "$(cat "$1")" 2>/dev/null; }

write_conf > "$conf.new"
write_hosts > "$dir/etc/hosts.new"
if ! cmp -s "$conf.new" "$conf" || ! cmp -s "$dir/etc/hosts.new" "$dir/etc/hosts"; then
  # Daemons started under an older config keep it; nodes of a bigger cluster would stay behind.
  "$here/stop-multinode.sh"
  mkdir -p "$dir"/{etc,state,log,run}
  mv "$conf.new" "$conf"
  mv "$dir/etc/hosts.new" "$dir/etc/hosts"
else
  rm "$conf.new" "$dir/etc/hosts.new"
fi

# One munged for every local cluster: started only if none answers.
"$here/munge.sh" "$dir"
net_up "$nodes"
alive "$dir/run/slurmctld.pid" || slurmctld -f "$conf"

for ((k = 1; k <= nodes; k++)); do
  name=$(node_name "$k")
  alive "$dir/run/slurmd-$name.pid" && continue
  mkdir -p "$dir/spool/$name" "$dir/tmp/$name"
  # nsenter --net, not `ip netns exec`: that remounts /sys and slurmd then finds no cgroup mounts.
  # unshare: the node's own hostname (uts) and /etc/hosts (mount, private: nothing leaks out).
  # shellcheck disable=SC2016 # the inner sh expands its own arguments
  nsenter --net="/run/netns/$(netns_name "$k")" unshare --uts --mount --propagation private \
    sh -c 'hostname "$1" && mount --bind "$2" /etc/hosts && exec slurmd -f "$3" -N "$1"' \
    sh "$name" "$dir/etc/hosts" "$conf"
done

deadline=$((SECONDS + 30))
until [ "$(sinfo -h -N -o %T 2>/dev/null | grep -cE '^(idle|mixed|allocated)$')" -eq "$nodes" ]; do
  if ((SECONDS > deadline)); then
    echo "the $nodes-node slurm did not come up in 30 s; see $dir/log/" >&2
    sinfo -h -N -o '%N %T %E' >&2 || true
    exit 1
  fi
  scontrol update nodename="$(node_names | paste -sd,)" state=resume 2>/dev/null || true
  sleep 0.2
done
echo "SLURM_CONF=$conf"
