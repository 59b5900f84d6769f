"""Fixtures of the Slurm tests: the multi-node local cluster, started once for the session (the
modules that use it share it: a start and a stop cost ~20 s) and always stopped after it
(namespaces, veths and bridge deleted). How long its start took is a test's to judge
(test_multinode_cluster), not the fixture's: a slow start fails that test, not every module."""

from __future__ import annotations

import subprocess

import pytest

from tests.conftest import REPO, hpcr1_env
from tests.slurm.multinode import start_multinode, stop_multinode


@pytest.fixture(scope="session")
def multinode_cluster():
    """The clients' environment and the seconds the session's (cold) start took."""
    try:
        yield start_multinode(2)
    finally:
        stop_multinode()


@pytest.fixture(scope="module")
def multinode_env(multinode_cluster):
    """The session's cluster, up again where a module before stopped it (test_multinode_cluster's
    stop test does); a start of a running cluster only checks it."""
    env, _ = start_multinode(2)
    return env


@pytest.fixture(scope="module")
def slurm_env():
    """The single-node local Slurm (slurm/local/start.sh: started if it is not running), shared by
    the modules that submit to it and left running (it is cheap to keep, slow to start)."""
    out = subprocess.run(
        ["bash", str(REPO / "slurm" / "local" / "start.sh")], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    conf = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    return {**hpcr1_env(), "SLURM_CONF": conf}
