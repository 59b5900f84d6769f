"""The transport check reads NCCL's own INFO lines: it names sockets, IB and OFI, tells intra-node
P2P/SHM from inter-node NET channels, and warns only when inter-node traffic used sockets."""

from __future__ import annotations

from pathlib import Path

from analysis.nccl_transport import SOCKET_WARNING, detect_transport

FIXTURES = Path(__file__).parent / "fixtures"

SOCKETS_TWO_NODES = """\
nid001234:12345:12345 [0] NCCL INFO NET/Plugin: Could not find: libnccl-net.so
nid001234:12345:12345 [0] NCCL INFO NET/IB : No device found.
nid001234:12345:12345 [0] NCCL INFO NET/Socket : Using [0]hsn0:10.0.0.1<0> [1]hsn1:10.0.0.2<0>
nid001234:12345:12345 [0] NCCL INFO Using network Socket
nid001234:12345:12345 [0] NCCL INFO comm 0x5581 rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0 MNNVL 0
nid001234:12345:12399 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/IPC
nid001234:12345:12399 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/Socket/0
nid001234:12345:12399 [0] NCCL INFO Channel 00/0 : 7[3] -> 0[0] [receive] via NET/Socket/1
"""

IB_TWO_NODES = """\
gpu-a01:2211:2211 [0] NCCL INFO NET/IB : Using [0]mlx5_0:1/IB [1]mlx5_1:1/IB ; OOB ib0:10.1.0.5<0>
gpu-a01:2211:2211 [0] NCCL INFO Using network IB
gpu-a01:2211:2211 [0] NCCL INFO comm 0x7f01 rank 0 nRanks 16 nNodes 2 localRanks 8 localRank 0 MNNVL 0
gpu-a01:2211:2290 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via SHM/direct/direct
gpu-a01:2211:2290 [7] NCCL INFO Channel 00/0 : 7[7] -> 8[0] [send] via NET/IB/0/GDRDMA
"""

OFI_SLINGSHOT = """\
nid004001:8812:8812 [0] NCCL INFO NET/Plugin: Plugin name set by env to libnccl-net-ofi.so
nid004001:8812:8812 [0] NCCL INFO NET/OFI Initializing aws-ofi-nccl 1.9.2-aws
nid004001:8812:8812 [0] NCCL INFO NET/OFI Selected Provider is cxi (found 4 nics)
nid004001:8812:8812 [0] NCCL INFO Using network AWS Libfabric
nid004001:8812:8812 [0] NCCL INFO comm 0x4a20 rank 0 nRanks 8 nNodes 2 localRanks 4 localRank 0 MNNVL 0
nid004001:8812:8870 [0] NCCL INFO Channel 00/0 : 0[0] -> 1[1] via P2P/CUMEM/read
nid004001:8812:8870 [3] NCCL INFO Channel 00/0 : 3[3] -> 4[0] [send] via NET/AWS Libfabric/0/GDRDMA
"""


def test_sockets_between_nodes_are_named_and_warned():
    found = detect_transport(SOCKETS_TWO_NODES.splitlines())
    assert found.networks == {"Socket"} and found.inter_node == {"Socket"} and found.intra_node == {"P2P"}
    assert found.nodes == 2 and found.warning == SOCKET_WARNING


def test_ib_is_named_without_warning():
    found = detect_transport(IB_TWO_NODES.splitlines())
    assert found.networks == {"IB"} and found.inter_node == {"IB"} and found.intra_node == {"SHM"}
    assert found.warning is None


def test_ofi_libfabric_is_named_with_its_provider_without_warning():
    found = detect_transport(OFI_SLINGSHOT.splitlines())
    assert found.networks == {"OFI"} and found.inter_node == {"OFI"} and found.ofi_provider == "cxi"
    assert found.warning is None


def test_real_single_node_socket_log_from_nccl_2_28_does_not_warn():
    """Recorded on an H100 (NCCL 2.28.9): sockets chosen, but one node, so nothing crossed nodes."""
    found = detect_transport((FIXTURES / "nccl_info_socket_1node_h100.log").read_text().splitlines())
    assert found.networks == {"Socket"} and found.nodes == 1 and found.warning is None
