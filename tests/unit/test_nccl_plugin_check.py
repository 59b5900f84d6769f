"""A Slingshot profile sets NCCL_NET="AWS Libfabric": without NCCL's aws-ofi-nccl plugin on a node's
library path every rank then fails at its first collective, after the job waited in the queue. The
stage job looks for the plugin as NCCL does (dlopen) before it starts a rank, and fails the stage
naming the fix."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest

from core.config import load_config
from core.manifest import Manifest
from core.rundir import RunDir
from pipeline.driver import StageFailed, check_run, run_stage, write_run
from pipeline.submit import _launch_if_nccl_can_start
from tests.conftest import REPO

ASK = "from launch.slurm_launch import nccl_plugin_problem; print(repr(nccl_plugin_problem()))"
SHARED_OBJECT = "/usr/lib/x86_64-linux-gnu/libz.so.1"  # stands in for the plugin: any library loads


def problem_on_a_node(tmp_path, **env) -> str:
    """nccl_plugin_problem() in a process started with `env` (the loader reads its path at start)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith("NCCL_") and k != "LD_LIBRARY_PATH"}
    out = subprocess.run([sys.executable, "-c", ASK], env={**base, "PYTHONPATH": str(REPO), **env},
                         capture_output=True, text=True, check=True, cwd=tmp_path)  # fmt: skip
    return out.stdout.strip()


def test_the_plugin_is_looked_for_where_nccl_looks_for_it(tmp_path):
    lib = tmp_path / "aws-ofi-nccl" / "lib"
    lib.mkdir(parents=True)
    assert problem_on_a_node(tmp_path) == "None"  # NCCL chooses its own transport
    missing = problem_on_a_node(tmp_path, NCCL_NET="AWS Libfabric", LD_LIBRARY_PATH=str(lib))
    assert "aws-ofi-nccl plugin" in missing and "setup" in missing
    shutil.copy(SHARED_OBJECT, lib / "libnccl-net-ofi.so")
    assert problem_on_a_node(tmp_path, NCCL_NET="AWS Libfabric", LD_LIBRARY_PATH=str(lib)) == "None"
    named = problem_on_a_node(
        tmp_path, NCCL_NET="AWS Libfabric", NCCL_NET_PLUGIN="cxi", LD_LIBRARY_PATH=str(lib)
    )
    assert "libnccl-net-cxi.so" in named


def test_a_stage_whose_node_lacks_the_plugin_fails_naming_it_without_starting_a_rank(tmp_path, monkeypatch):
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["data.arithmetic.sft_size=8"])
    run = RunDir(tmp_path / "run")
    write_run(cfg, run, check_run(cfg, REPO / "configs"), REPO / "configs")
    monkeypatch.setenv("NCCL_NET", "AWS Libfabric")
    monkeypatch.delenv("NCCL_NET_PLUGIN", raising=False)
    started = []
    ranks = lambda: started.append(1) or 0  # noqa: E731
    with pytest.raises(StageFailed, match="aws-ofi-nccl plugin"):
        run_stage(
            cfg,
            run,
            Manifest(run.root),
            "stage1_sft",
            lambda: _launch_if_nccl_can_start(run, "stage1_sft", ranks),
        )
    entry = Manifest(run.root).stage("stage1_sft")
    assert not started and entry["state"] == "failed"
    assert "aws-ofi-nccl plugin" in json.dumps(entry["error"]), entry["error"]
