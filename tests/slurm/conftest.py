"""Fixtures of the Slurm tests: the multi-node local cluster, started for the module that asks for it
and always stopped after it (namespaces, veths and bridge deleted)."""

from __future__ import annotations

import pytest

from tests.slurm.multinode import START_BUDGET_S, start_multinode, stop_multinode


@pytest.fixture(scope="module")
def multinode_env():
    try:
        env, took = start_multinode(2)
        assert took < START_BUDGET_S, f"the 2-node cluster took {took:.1f} s to start"
        yield env
    finally:
        stop_multinode()
