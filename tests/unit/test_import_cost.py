"""What each kind of process imports: the suite starts hundreds of them (a driver, a torchrun and
its ranks for every stage), and starting torch costs seconds of CPU, transformers, megatron-core,
DeepSpeed, verl and Ray seconds more each (issue 46). A process that starts no rank imports none of
them; a rank imports its own stage's and no other's."""

from __future__ import annotations

import json
import subprocess
import sys

from tests.conftest import REPO, hpcr1_env

FRAMEWORKS = ("torch", "transformers", "megatron.core", "deepspeed", "verl", "ray")

PROBE = """
import json, sys
def loaded():
    return sorted(m for m in {frameworks!r} if m in sys.modules)
snapshots = []
{code}
print(json.dumps(snapshots))
"""

# `hpcr1 run`'s driver through a stage's decisions (its ranks stood in for by a launcher that fails),
# then `hpcr1 status` on that run and `hpcr1 submit --dry-run`. The base model is an HF directory: the
# driver only links it (a tiny model is built, with torch, on a run directory's first start).
DRIVER = """
from pathlib import Path
from core.config import load_config
from core.rundir import RunDir
from pipeline.cli import main
from pipeline.driver import StageFailed, run_pipeline

config, root = Path("configs/tiny-cpu.yaml"), Path(sys.argv[1])
overrides = [
    "model.source=hf", "model.path=models/llama-3.2-1b", "data.arithmetic.sft_size=64",
    "data.arithmetic.prompts_size=16", "data.arithmetic.validation_size=16", "data.arithmetic.eval_size=16",
]
run, failing_ranks = RunDir(root / "run"), lambda *args, **kwargs: 1
try:
    run_pipeline(load_config(config, overrides), run, config.parent, ["stage1_sft"], launcher=failing_ranks)
except StageFailed:
    pass
else:
    sys.exit("the ranks failed and the driver did not say so")
assert main(["status", str(run.root)]) == 0
submit = ["submit", str(config), "--cluster", "local", "--dry-run", "--run-dir", str(root / "submitted")]
assert main([*submit, *overrides]) == 0
snapshots.append(loaded())
"""


def frameworks_loaded(code: str, *args: str) -> subprocess.Popen:
    """A fresh interpreter that runs `code`, which appends `loaded()` (the frameworks imported so
    far) to `snapshots` where it wants them read."""
    probe = PROBE.format(frameworks=FRAMEWORKS, code=code)
    return subprocess.Popen(
        [sys.executable, "-c", probe, *args],
        cwd=REPO,
        env=hpcr1_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def snapshots_of(proc: subprocess.Popen) -> list[list[str]]:
    out, err = proc.communicate()
    assert proc.returncode == 0, err
    return json.loads(out.splitlines()[-1])


def test_a_process_that_starts_no_rank_imports_no_framework(tmp_path):
    assert snapshots_of(frameworks_loaded(DRIVER, str(tmp_path))) == [[]]


def test_each_rank_imports_its_own_stages_frameworks_only():
    # Evaluation and synthesis generate with transformers' models; SFT trains on megatron-core and
    # DeepSpeed; GRPO's batches are verl's (which imports Ray). Two interpreters, run side by side.
    sft = frameworks_loaded(
        "import stages.eval, stages.synth; snapshots.append(loaded()); import stages.sft; "
        "snapshots.append(loaded())"
    )
    grpo = frameworks_loaded("import stages.grpo.trainer; snapshots.append(loaded())")
    assert snapshots_of(sft) == [
        ["torch", "transformers"],
        ["deepspeed", "megatron.core", "torch", "transformers"],
    ]
    assert snapshots_of(grpo) == [["ray", "torch", "transformers", "verl"]]
