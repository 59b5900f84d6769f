"""The multi-node local cluster itself: two nodes with their own hostnames and addresses, a job
across both (plain and under pmix), and nothing left behind by the stop."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.slurm.multinode import START_BUDGET_S, start_multinode, stop_multinode

pytestmark = [pytest.mark.slurm, pytest.mark.slow]


def srun(env, *cmd: str) -> list[str]:
    out = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", *cmd], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stdout + out.stderr
    return sorted(out.stdout.splitlines())


def test_the_cluster_starts_within_its_budget(multinode_cluster):
    """The session's cold start (the fixture's): every module using the cluster pays for one."""
    _, took = multinode_cluster
    assert took < START_BUDGET_S, f"the 2-node cluster took {took:.1f} s to start"


def test_a_step_runs_on_two_nodes_with_their_own_names_and_addresses(multinode_env):
    lines = srun(multinode_env, "--mpi=none", "bash", "-c", 'echo "$(hostname) $(hostname -I) $SLURM_PROCID"')
    assert [line.split() for line in lines] == [
        ["mnode1", "10.213.17.11", "0"],
        ["mnode2", "10.213.17.12", "1"],
    ]


def test_node_names_resolve_on_every_node(multinode_env):
    lines = srun(multinode_env, "--mpi=none", "getent", "hosts", "mnode1", "mnode2")
    found = sorted({" ".join(line.split()) for line in lines})
    assert found == ["10.213.17.11 mnode1", "10.213.17.12 mnode2"]


def test_pmix_steps_span_the_nodes(multinode_env):
    lines = srun(multinode_env, "--mpi=pmix", "bash", "-c", 'echo "$(hostname) $PMIX_RANK"')
    assert lines == ["mnode1 0", "mnode2 1"]


@pytest.mark.dist
def test_mpi_rendezvous_across_nodes_finds_rank_world_and_master(multinode_env):
    """srun --mpi=pmix with no MASTER_ADDR: rank 0's host name, resolved on its node, is the master."""
    env = {k: v for k, v in multinode_env.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    code = (
        "import os, socket; from runtime.dist import rendezvous; i = rendezvous(); "
        "print(socket.gethostname(), i.rank, i.world_size, i.local_rank, i.source, os.environ['MASTER_ADDR'])"
    )
    lines = srun(env, "--mpi=pmix", sys.executable, "-c", code)
    assert lines == ["mnode1 0 2 0 mpi 10.213.17.11", "mnode2 1 2 0 mpi 10.213.17.11"]


def test_stop_leaves_no_namespace_link_or_daemon_and_start_is_idempotent():
    """Last in the module: it stops the module's cluster too (the fixture's stop then finds nothing)."""
    start_multinode(2)
    _, again = start_multinode(2)
    assert again < 5, f"a second start of a running cluster took {again:.1f} s"
    stop_multinode()
    stop_multinode()
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    daemons = subprocess.run(["pgrep", "-af", "hpcr1-slurm-multinode"], capture_output=True, text=True).stdout
    assert "hpcr1-mnode" not in netns and "hpcr1br0" not in links and "hpcr1v" not in links
    assert daemons == ""
