"""stage3_synth on 2 real ranks: the dataset holds only correct, well-formed, distinct answers
(checked by recomputing each sum, not with the stage's own scorer), at most N per prompt; every
line's provenance names the stage 2 model and its checksum; ranks share the work dynamically."""
from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest

from core.atomic import file_sha256, tree_checksums
from core.config import load_config
from pipeline.driver import prepare_run
from core.rundir import RunDir
from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "grpo_synth_stage.py"
MAX_PER_PROMPT = 2


@pytest.fixture(scope="module")
def synth_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("synth")
    config = root / "cfg.yaml"
    config.write_text("name: synth\nseed: 5\nwandb: {mode: disabled}\n"
                      "data: {arithmetic: {sft_size: 16, prompts_size: 40, eval_size: 8}}\n"
                      "stage2_grpo: {init_from: base}\n"
                      f"stage3_synth: {{num_prompts: 36, samples_per_prompt: 4, max_per_prompt: {MAX_PER_PROMPT},"
                      " batch_size: 3}\n")
    run = RunDir(root / "run")
    prepare_run(load_config(config), run, root)
    shutil.copytree(run.base_model, run.final("stage2_grpo"))  # stands in for the stage 2 model
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
        assert row["model"] == {"path": "stage2_grpo/final", "sha256": file_sha256(stage2_model / "model.safetensors")}
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

    examples = read_examples(synth_run.synthetic_data("stage3_synth"))
    assert all(ex.response and ex.answer for ex in examples)
