"""Which network NCCL used, read from its own NCCL_DEBUG=INFO lines, and whether inter-node traffic
went over plain TCP sockets (a silent failure: MB/s where GB/s were expected).

NCCL names the network once per communicator ("Using network IB", "NET/OFI Selected Provider is
cxi") and the transport of every ring/tree channel ("Channel 00/0 : 0[0] -> 1[1] via NET/Socket/0",
"... via P2P/IPC", "... via SHM/direct/direct"). A channel through NET/ crosses nodes. The
"NET/<plugin> : Using" lines are not evidence: NCCL 2.28 prints "NET/IB : Using [RO]" right before
"Failed to initialize NET plugin IB".
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

NETWORK_ALIASES = {"socket": "Socket", "ib": "IB", "ofi": "OFI", "aws libfabric": "OFI", "libfabric": "OFI"}
USING_NETWORK = re.compile(r"NCCL INFO Using network (.+?)\s*$")
OFI_PROVIDER = re.compile(
    r"NCCL INFO NET/OFI (?:Selected Provider is|Using Libfabric|Selected provider is) ?(\S*)"
)
CHANNEL = re.compile(
    r"NCCL INFO Channel \d+/\d+ : .* via (.+?)\s*$"
)  # "NET/AWS Libfabric/0/GDRDMA", "P2P/IPC"
NODES = re.compile(r"nNodes (\d+)")

SOCKET_WARNING = (
    "inter-node traffic went over plain TCP sockets (NET/Socket): expect MB/s, not GB/s. "
    "Load the fabric's NCCL plugin (aws-ofi-nccl for Slingshot/EFA, or IB) and check NCCL_NET."
)


@dataclass
class Transport:
    networks: set[str] = field(default_factory=set)  # the network NCCL chose: Socket, IB, OFI
    inter_node: set[str] = field(default_factory=set)  # transports of channels that cross nodes
    intra_node: set[str] = field(default_factory=set)  # P2P, SHM, ... inside a node
    nodes: int = 1
    ofi_provider: str | None = None

    @property
    def sockets_between_nodes(self) -> bool:
        return "Socket" in self.inter_node or (
            self.nodes > 1 and "Socket" in self.networks and not self.inter_node
        )

    @property
    def warning(self) -> str | None:
        return SOCKET_WARNING if self.sockets_between_nodes else None


def canonical(name: str) -> str:
    return NETWORK_ALIASES.get(name.strip().lower(), name.strip())


def detect_transport(lines: Iterable[str]) -> Transport:
    found = Transport()
    for line in lines:
        if "NCCL INFO" not in line:
            continue
        if m := USING_NETWORK.search(line):
            found.networks.add(canonical(m.group(1)))
        elif m := OFI_PROVIDER.search(line):
            found.networks.add("OFI")
            found.ofi_provider = m.group(1) or found.ofi_provider
        elif m := CHANNEL.search(line):
            path = m.group(1).split("/")
            if path[0] == "NET":
                found.inter_node.add(canonical(path[1]))
            else:
                found.intra_node.add(path[0])
        if m := NODES.search(line):
            found.nodes = max(found.nodes, int(m.group(1)))
    return found


def detect_in_logs(log_dir: Path) -> Transport | None:
    """The transport seen in a stage's per-rank logs, None when they hold no NCCL INFO lines."""
    lines = [
        line
        for path in sorted(Path(log_dir).glob("*.log"))
        for line in path.read_text(errors="replace").splitlines()
        if "NCCL INFO" in line
    ]
    return detect_transport(lines) if lines else None
