"""`hpcr1 doctor` on the local single-node Slurm: one probe job on the node the config needs, a
table of PASS lines (the run directory's room, the node's Python and GPUs against the `local`
profile) and exit 0; the probe's findings stay in the run directory's doctor/."""

from __future__ import annotations

import json

import pytest

from tests.conftest import REPO
from tests.slurm.test_slurm_pipeline import hpcr1

pytestmark = pytest.mark.slurm


def test_doctor_probes_the_local_node_and_passes(slurm_env, tmp_path):
    out = hpcr1(slurm_env, "doctor", str(REPO / "configs" / "tiny-cpu.yaml"), "--cluster", "local",
                "--run-dir", str(tmp_path / "run"))  # fmt: skip
    lines = out.stdout.splitlines()
    assert lines[0] == "probing 1 node(s) of local (one short job)...", out.stdout
    verdicts = [line.split()[0] for line in lines[1:-1]]
    assert verdicts and set(verdicts) == {"PASS"}, out.stdout
    assert lines[-1] == f"{len(verdicts)} checks: 0 failed", out.stdout
    [node] = (tmp_path / "run" / "doctor").glob("node-*.json")
    facts = json.loads(node.read_text())
    assert facts["nvidia_smi"] is None and facts["torch_cuda"] is None and "torch" in facts["packages"]
    assert not list((tmp_path / "run").glob("stage*")), "the doctor runs no stage"
