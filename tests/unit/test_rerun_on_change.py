"""A changed input reruns the stage it feeds and the stages downstream of it, and only those; the
manifest says which input changed. The stage graph's decisions are under test here, not training:
each stage is a stand-in that writes a final/ determined by the stage's recorded inputs, as a
seeded training run would."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import yaml

from core.config import load_config
from core.rundir import RunDir
from pipeline.driver import run_pipeline
from stages.checkpoint import CheckpointDir
from stages.data.arithmetic import generate_arithmetic
from stages.data.examples import write_examples
from tests.conftest import REPO

ALL = ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]


def stand_in_stage(run_dir: Path, sid: str, nproc: int, pass_fds=()) -> int:
    """Writes final/ (content: the stage's input fingerprint) and eval.json, as the ranks would."""
    run = RunDir(run_dir)
    FINAL_AT_LAUNCH[sid] = run.final(sid).exists()
    inputs = json.loads((run.root / "manifest.json").read_text())["stages"][sid]["input_hash"]
    run.final(sid).mkdir(parents=True, exist_ok=True)
    (run.final(sid) / "model.txt").write_text(inputs)
    run.eval_result(sid).write_text(json.dumps({"accuracy": 0.5, "n": 4}))
    LAUNCHED.append(sid)
    return 0


LAUNCHED: list[str] = []
FINAL_AT_LAUNCH: dict[str, bool] = {}  # whether the stage's final/ was there when its ranks started


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Data files, a config reading them (the embedded default's five stages, tiny sizes), and a
    run directory in which every stage is done."""
    root = tmp_path_factory.mktemp("rerun")
    for name, split, n in (("sft", "train", 32), ("prompts", "prompts", 16), ("eval", "eval", 8)):
        write_examples(root / f"{name}.jsonl", generate_arithmetic(1, n, split, 2, 2))
    config = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
    config["data"] = {
        "task": "files",
        "sft_file": "sft.jsonl",
        "prompts_file": "prompts.jsonl",
        "eval_file": "eval.jsonl",
    }
    config["model"]["tiny"] = {
        "hidden_size": 32,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "ffn_hidden_size": 64,
    }
    (root / "run.yaml").write_text(yaml.safe_dump(config))
    run = RunDir(root / "run")
    assert rerun(root) == ALL
    return root, run


def rerun(root: Path, *overrides: str) -> list[str]:
    """`hpcr1 run` on the workspace's config; returns the stages it launched."""
    LAUNCHED.clear()
    cfg = load_config(root / "run.yaml", list(overrides))
    run_pipeline(cfg, RunDir(root / "run"), root, echo=lambda _: None, launcher=stand_in_stage)
    return list(LAUNCHED)


def reasons(run: RunDir) -> dict[str, str]:
    stages = json.loads((run.root / "manifest.json").read_text())["stages"]
    return {sid: entry.get("rerun_reason") for sid, entry in stages.items()}


def test_nothing_changed_nothing_reruns(workspace):
    root, _ = workspace
    assert rerun(root) == []


def test_a_second_invocation_does_not_read_final(workspace):
    """final/ whose files keep their recorded size and modification time is trusted: its bytes,
    changed here behind the stat's back, are not read (today's 70B final/ is 140 GB)."""
    root, run = workspace
    model = run.final("stage2_grpo") / "model.txt"
    original, st = model.read_bytes(), model.stat()
    model.write_bytes(bytes(len(original)))
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    try:
        assert rerun(root) == []
    finally:
        model.write_bytes(original)
        os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_manifest_without_stats_reads_final_once_and_records_them(workspace):
    root, run = workspace
    data = json.loads((run.root / "manifest.json").read_text())
    for entry in data["stages"].values():
        entry.pop("final_stats")
    (run.root / "manifest.json").write_text(json.dumps(data))
    assert rerun(root) == []
    stages = json.loads((run.root / "manifest.json").read_text())["stages"]
    assert all("final_stats" in entry for entry in stages.values())


def test_a_copied_run_directory_skips_its_done_stages(workspace, tmp_path):
    """`cp -r` gives every file a new modification time: the base model is recognised by content."""
    root, _ = workspace
    rerun(root)  # whatever an earlier test left changed
    copy = tmp_path / "copy"
    subprocess.run(["cp", "-r", str(root), str(copy)], check=True)
    assert (copy / "run" / "inputs" / "model").stat().st_mtime_ns != (
        root / "run" / "inputs" / "model"
    ).stat().st_mtime_ns
    assert rerun(copy) == []
    assert rerun(copy, "model.tiny.hidden_size=16")[:1] == ["stage1_sft"], "a real change still reruns"


def test_edited_stage_config_reruns_it_and_its_dependants_only(workspace):
    root, run = workspace
    assert rerun(root, "stage3_sft.lr=5.0e-5") == ["stage3_sft", "stage4_grpo"]
    why = reasons(run)
    assert "config of stage3_sft" in why["stage3_sft"] and "output of stage3_sft" in why["stage4_grpo"], why
    assert rerun(root, "stage3_sft.lr=5.0e-5") == [], "the new config is now the done one"
    assert rerun(root, "stage3_sft.lr=5.0e-5", "stage2_grpo.kl_coef=0.05") == ALL[1:]
    assert rerun(root) == ALL[1:], "going back is a change too"


def test_edited_input_data_reruns_the_stages_that_read_it(workspace):
    root, run = workspace
    prompts = root / "prompts.jsonl"
    lines = prompts.read_text().splitlines()
    prompts.write_text("\n".join(lines[:-1]) + "\n")  # one prompt fewer
    # stage1_sft reads the SFT data only; stage3_sft reads the prompts through stage3_synth's output.
    assert rerun(root) == ALL[1:]
    assert "prompts data" in reasons(run)["stage2_grpo"]
    assert "output of stage2_grpo" in reasons(run)["stage3_synth"]


def test_changed_final_is_recomputed_alone(workspace):
    root, run = workspace
    (run.final("stage2_grpo") / "model.txt").write_text("tampered")
    # Recomputing restores the same final/ (same inputs): nothing downstream needs to change.
    assert rerun(root) == ["stage2_grpo"]
    assert "no longer matches" in reasons(run)["stage2_grpo"]
    # removed before the ranks start: they would take it for one exported by an earlier attempt
    assert FINAL_AT_LAUNCH["stage2_grpo"] is False


def test_corrupt_newest_checkpoint_is_reported_and_the_previous_recorded_as_resume_point(workspace):
    root, run = workspace
    ckpts = CheckpointDir(run.ckpt("stage4_grpo"), keep=3)
    for step in (5, 10):
        ckpts.staging(step).mkdir(parents=True)
        (ckpts.staging(step) / "model.pt").write_bytes(bytes(100))
        ckpts.seal(step)
    (ckpts.root / "step-000010" / "model.pt").write_bytes(bytes(50))  # truncated
    (run.final("stage4_grpo") / "model.txt").write_text("tampered")  # running again, same inputs
    said: list[str] = []
    run_pipeline(load_config(root / "run.yaml"), run, root, echo=said.append, launcher=stand_in_stage)
    entry = json.loads((run.root / "manifest.json").read_text())["stages"]["stage4_grpo"]
    assert entry["resume_from"] == 5 and list(entry["skipped_checkpoints"]) == ["step-000010"], entry
    assert any("step-000010 is unusable (checksum mismatch in model.pt)" in line for line in said), said
    assert sorted(entry["checkpoints"]) == ["step-000005", "step-000010"]


def test_the_eval_batch_size_reruns_stages_only_where_answers_are_sampled(workspace):
    """Greedy answers do not depend on how they are batched; sampled ones (mean@k) draw their
    tokens batch by batch, so their accuracy is another measurement."""
    root, run = workspace
    assert rerun(root, "eval.samples=0") == ALL
    assert rerun(root, "eval.samples=0", "eval.batch_size=7") == []
    assert rerun(root, "eval.batch_size=7") == ALL
    assert "held-out set" in reasons(run)["stage1_sft"]
    assert rerun(root) == ALL  # the config the other tests start from
