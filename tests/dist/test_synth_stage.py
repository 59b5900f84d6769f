"""stage3_synth on 2 real ranks: the dataset holds only correct, well-formed, distinct answers
(checked by recomputing each sum, not with the stage's own scorer), at most N per prompt; every
line's provenance names the stage 2 model and its checksum; ranks share the work dynamically; a
USR1 stops the stage with its sampled batches kept, and the next attempt samples only the others,
to the same dataset."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from core.atomic import file_sha256, tree_checksums
from core.config import load_config
from core.rundir import RunDir
from pipeline.driver import prepare_run
from runtime.preemption import PREEMPTED_EXIT
from tests.conftest import REPO, free_port, run_torchrun
from tests.dist.test_rank_failure import wait_until

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "grpo_synth_stage.py"
PREEMPTIBLE = REPO / "tests" / "dist" / "workers" / "synth_preemptible.py"
MAX_PER_PROMPT = 2


def prepared_synth_run(root: Path) -> RunDir:
    """A run directory of stage3_synth (12 batches of 3 prompts) with the base model as stage 2's."""
    config = root / "cfg.yaml"
    config.write_text(
        "name: synth\nseed: 5\nwandb: {mode: disabled}\n"
        "data: {arithmetic: {sft_size: 16, prompts_size: 40, eval_size: 8}}\n"
        "stage2_grpo: {init_from: base}\n"
        f"stage3_synth: {{num_prompts: 36, samples_per_prompt: 4, max_per_prompt: {MAX_PER_PROMPT},"
        " batch_size: 3}\n"
    )
    run = RunDir(root / "run")
    prepare_run(load_config(config), run, root)
    shutil.copytree(run.base_model, run.final("stage2_grpo"))  # stands in for the stage 2 model
    return run


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory):
    run = prepared_synth_run(tmp_path_factory.mktemp("synth"))
    run_torchrun(WORKER, 2, str(run.root), timeout=300)
    return run


def test_synthetic_data_is_correct_distinct_capped_and_traced_to_stage2(synth_run):
    run = synth_run
    rows = [json.loads(line) for line in run.synthetic_data("stage3_synth").read_text().splitlines()]
    assert rows, "the stub answers correctly often enough that something must be kept"
    stage2_model = run.final("stage2_grpo")
    for row in rows:
        truth = sum(int(x) for x in row["prompt"].rstrip("=").split("+"))
        assert re.fullmatch(rf"<think>[ab]</think><answer>{truth}</answer>", row["response"]), row
        assert row["answer"] == str(truth) and row["id"].startswith(row["prompt_id"])
        assert row["model"] == {
            "path": "stage2_grpo/final",
            "sha256": file_sha256(stage2_model / "model.safetensors"),
        }
    assert max(Counter(r["prompt_id"] for r in rows).values()) <= MAX_PER_PROMPT
    assert len({(r["prompt_id"], r["response"]) for r in rows}) == len(rows), "duplicates were kept"

    final = run.final("stage3_synth")
    assert tree_checksums(final)["synthetic.jsonl"] == file_sha256(run.synthetic_data("stage3_synth"))
    summary = json.loads((final / "provenance.json").read_text())
    evaluation = json.loads(run.eval_result("stage3_synth").read_text())
    assert evaluation["n"] == 36 * 4 and evaluation["accuracy"] == summary["accepted"] / (36 * 4)
    # Rank 0 sleeps in every batch: the queue must have handed rank 1 more of the 12 batches.
    batches = summary["batches_per_rank"]
    assert sum(batches) == 12 and batches[1] > batches[0], batches


def test_synthetic_data_reads_back_as_examples(synth_run):
    from stages.data.examples import read_examples

    path = synth_run.synthetic_data("stage3_synth")
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    examples = read_examples(path)
    assert rows, "nothing kept: nothing to read back"
    fields = ("id", "prompt", "answer", "response")
    assert [tuple(getattr(ex, f) for f in fields) for ex in examples] == [
        tuple(r[f] for f in fields) for r in rows
    ]


def start_preemptible(run: RunDir) -> subprocess.Popen:
    """The stage's ranks under launch.torchrun, as `hpcr1 run` starts them (it passes USR1 on)."""
    failures = run.logs("stage3_synth") / "torchrun-failures.json"
    cmd = [
        sys.executable,
        "-m",
        "launch.torchrun",
        str(failures),
        "--nproc-per-node=2",
        f"--master-port={free_port()}",
        str(PREEMPTIBLE),
        str(run.root),
        "stage3_synth",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)


def test_usr1_keeps_sampled_batches_and_the_next_attempt_samples_only_the_rest(synth_run, tmp_path):
    run = prepared_synth_run(tmp_path)
    records = run.synthesis_batches("stage3_synth")
    proc = start_preemptible(run)
    wait_until(lambda: len(list(records.glob("batch-*.json"))) >= 2, proc, "2 sampled batches")
    proc.send_signal(signal.SIGUSR1)
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == PREEMPTED_EXIT, output[-3000:]
    kept = {p.name: file_sha256(p) for p in records.glob("batch-*.json")}
    assert 2 <= len(kept) < 12, "the stop must come from the signal, with batches left"
    assert not run.final("stage3_synth").exists()

    proc = start_preemptible(run)
    output = proc.communicate(timeout=300)[0].decode()
    assert proc.returncode == 0, output[-3000:]
    logs = "".join(p.read_text() for p in run.logs("stage3_synth").glob("rank-*.log"))
    sampled = [int(b) for b in re.findall(r"sampled batch (\d+):", logs)]
    assert sorted(sampled) == list(range(12)), "each batch sampled once over both attempts"
    assert {name: file_sha256(records / name) for name in kept} == kept, "kept records rewritten"
    summary = json.loads((run.final("stage3_synth") / "provenance.json").read_text())
    assert summary["batches_kept_from_earlier_attempts"] == len(kept)
    # The same dataset as the uninterrupted run's: each batch's samples depend on the batch alone.
    expected = synth_run.synthetic_data("stage3_synth").read_bytes()
    assert run.synthetic_data("stage3_synth").read_bytes() == expected
