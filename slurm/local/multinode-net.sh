# The network of the multi-node local cluster (sourced by start-multinode.sh and stop-multinode.sh):
# a bridge on the host holding the controller's address, and per node a network namespace joined
# to it by a veth pair. The names and addresses are the cluster's own, so teardown removes only them.
# shellcheck shell=bash
BRIDGE=hpcr1br0
BRIDGE_ADDR=10.213.17.1
MAX_NODES=4

node_name() { echo "mnode$1"; }
node_addr() { echo "10.213.17.$((10 + $1))"; }
netns_name() { echo "hpcr1-mnode$1"; }
veth_name() { echo "hpcr1v$1"; }

# The bridge and the first N nodes' namespaces, each step skipped where it is already done.
net_up() {
  local k ns
  if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    ip link add "$BRIDGE" type bridge
    ip addr add "$BRIDGE_ADDR/24" dev "$BRIDGE"
  fi
  ip link set "$BRIDGE" up
  for ((k = 1; k <= $1; k++)); do
    ns=$(netns_name "$k")
    [ -e "/run/netns/$ns" ] && continue
    ip netns add "$ns"
    ip link add "$(veth_name "$k")" type veth peer name eth0 netns "$ns"
    ip link set "$(veth_name "$k")" master "$BRIDGE" up
    ip -n "$ns" addr add "$(node_addr "$k")/24" dev eth0
    ip -n "$ns" link set eth0 up
    ip -n "$ns" link set lo up
  done
}

# Every node namespace, veth and the bridge, up to MAX_NODES (a bigger cluster may have run before).
net_down() {
  local k ns
  for ((k = 1; k <= MAX_NODES; k++)); do
    ns=$(netns_name "$k")
    ip link del "$(veth_name "$k")" 2>/dev/null || true
    [ -e "/run/netns/$ns" ] && ip netns del "$ns"
  done
  ip link del "$BRIDGE" 2>/dev/null || true
}
