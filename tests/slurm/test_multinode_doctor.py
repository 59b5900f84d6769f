"""`hpcr1 doctor` on 2 nodes of the multi-node local Slurm: its probe job reports both nodes and times
an all_reduce between them, every check passes and it exits 0; with node 2's link shaped far below
the profile's expected bus bandwidth (tc tbf on its veth), the network check fails naming the
measured and the expected figure, and it exits 1."""

from __future__ import annotations

import subprocess

import pytest

from core.cluster import load_profile
from tests.conftest import REPO
from tests.slurm.test_slurm_pipeline import hpcr1

pytestmark = [pytest.mark.slurm, pytest.mark.slow]
CONFIG = str(REPO / "configs" / "tiny-cpu.yaml")


def doctor(env, run_dir, check=True):
    return hpcr1(
        env, "doctor", CONFIG, "--cluster", "local-multinode", "--run-dir", str(run_dir), check=check
    )


def test_doctor_passes_on_two_nodes_and_fails_a_shaped_link_naming_both_figures(multinode_env, tmp_path):
    env = {k: v for k, v in multinode_env.items() if k != "SLURM_CONF"}  # the profile names it
    out = doctor(env, tmp_path / "run")
    assert out.returncode == 0, out.stdout + out.stderr
    lines = out.stdout.splitlines()
    assert [line for line in lines if line.startswith("PASS  Python on mnode")], out.stdout
    assert len([line for line in lines if line.startswith("PASS  Python on ")]) == 2, out.stdout
    assert any(line.startswith("PASS  all_reduce across 2 nodes: ") for line in lines), out.stdout

    expected = load_profile("local-multinode").expected_bus_gbs
    # 100 Mbit/s into node 2: 0.0125 GB/s at most, far below the expectation
    shape = [
        "tc",
        "qdisc",
        "add",
        "dev",
        "hpcr1v2",
        "root",
        "tbf",
        "rate",
        "100mbit",
        "burst",
        "64kb",
        "latency",
        "50ms",
    ]
    subprocess.run(shape, check=True)
    try:
        shaped = doctor(env, tmp_path / "run", check=False)
    finally:
        subprocess.run(["tc", "qdisc", "del", "dev", "hpcr1v2", "root"], check=True)
    assert shaped.returncode == 1, shaped.stdout + shaped.stderr
    [line] = [
        line for line in shaped.stdout.splitlines() if line.startswith("FAIL  all_reduce across 2 nodes")
    ]
    assert f"the profile expects at least {expected} GB/s (expected_bus_gbs)" in line, line
    measured = float(line.split(": ", 1)[1].split(" GB/s")[0])
    assert measured < 0.0125 * 1.1 < expected, line
