"""`hpcr1 submit` checks each stage as configured against the profile's GPUs and nodes with the
planner's footprint (its micro-batches' activations and the rollout's KV cache included), before
anything is written or queued: a FAIL refuses naming the field the planner would change and the
figures, the dry run prints it, --skip-checks submits anyway; the shipped configs pass.
`hpcr1 config --cluster` runs the same check on the config laid out as submit lays it out."""

from __future__ import annotations

import json

import pytest
import yaml

from pipeline.cli import main
from tests.conftest import REPO

CONFIG_8B, CONFIG_70B = (
    REPO / "configs" / name for name in ("llama-3.1-8b.yaml", "llama-3.3-70b-perlmutter.yaml")
)


@pytest.fixture
def data_files(tmp_path):
    row = {"question": "What is 1 plus 1?", "answer": "1 plus 1 is 2.\n#### 2"}
    (tmp_path / "data.jsonl").write_text(json.dumps(row) + "\n")
    return [f"data.{name}_file={tmp_path / 'data.jsonl'}" for name in ("sft", "prompts", "eval")]


def submit(tmp_path, data_files, *args, config=CONFIG_8B, cluster="perlmutter", nodes=4):
    model = REPO / "configs" / "models" / config.stem.removesuffix("-perlmutter")
    argv = ["submit", str(config), "--cluster", cluster, "--nodes", str(nodes)]
    return main([*argv, "--run-dir", str(tmp_path / "run"), f"model.path={model}", *data_files, *args])


def memory_lines(out: str) -> list[str]:
    return [line for line in out.splitlines() if line.startswith("FAIL") and " memory: " in line]


# One per stage kind and engine: only a batch or a cache is changed from the shipped 8B config.
TOO_LARGE = [
    # SFT: 64 sequences of 2048 tokens a micro-batch
    (("stage1_sft.micro_batch_size=64", "stage1_sft.global_batch_size=512"), "stage1_sft.micro_batch_size"),
    # verl GRPO: vLLM's KV cache reserves 95% of each GPU beside the FSDP actor
    (("stage2_grpo.verl.gpu_memory_utilization=0.95",), "stage2_grpo.verl.gpu_memory_utilization"),
    # verl generation: 20% of a GPU cannot hold vLLM's weights, let alone a KV cache
    (("stage3_synth.verl.gpu_memory_utilization=0.2",), "stage3_synth.verl.gpu_memory_utilization"),
    # native generation: a whole bf16 copy a rank and its batch's KV cache, at any GPU count
    (("stage3_synth.engine=native",), "nproc"),
]


@pytest.mark.parametrize("overrides, field", TOO_LARGE, ids=lambda v: v if isinstance(v, str) else v[0])
def test_a_batch_or_cache_beyond_the_gpu_is_refused_before_anything_is_written(
    tmp_path, data_files, capsys, monkeypatch, overrides, field
):
    monkeypatch.setenv("PATH", "/nonexistent")  # no sbatch: nothing could be queued however it went
    assert submit(tmp_path, data_files, *overrides) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and not (tmp_path / "run").exists()
    assert f"hpcr1: error: {field}: " in err and " memory FAIL: " in err and "--skip-checks" in err, err
    assert "usable of one A100-SXM4-40GB" in err or "exceed gmu·M" in err, err


def test_the_dry_run_prints_the_fail_and_skip_checks_submits_without_it(tmp_path, data_files, capsys):
    overrides = ("stage1_sft.micro_batch_size=64", "stage1_sft.global_batch_size=512")
    assert submit(tmp_path, data_files, "--dry-run", *overrides) == 0
    (line,) = memory_lines(capsys.readouterr().out)
    # the footprint in `hpcr1 plan`'s GB, the usable share of the GPU, and the planner's change
    assert line.startswith("FAIL  stage1_sft memory: ") and "GB a GPU (peak: training)" in line
    assert "GPU above the 38.65 GB usable" in line and "fits it with stage1_sft.micro_batch_size=1" in line
    assert submit(tmp_path, data_files, "--dry-run", "--skip-checks", *overrides) == 0
    assert not memory_lines(capsys.readouterr().out)


@pytest.mark.parametrize(
    "config, cluster, nodes", [(CONFIG_8B, "perlmutter", 4), (CONFIG_70B, "perlmutter-80g", 32)]
)
def test_the_shipped_configs_fit_their_profiles(tmp_path, data_files, capsys, config, cluster, nodes):
    assert submit(tmp_path, data_files, "--dry-run", config=config, cluster=cluster, nodes=nodes) == 0
    out = capsys.readouterr().out
    assert not memory_lines(out), out


def test_config_on_a_cluster_refuses_what_submit_refuses_and_prints_the_laid_out_config(data_files, capsys):
    model = f"model.path={REPO / 'configs' / 'models' / 'llama-3.1-8b'}"
    argv = ["config", str(CONFIG_8B), "--cluster", "perlmutter", model, *data_files]
    too_large = ("stage1_sft.micro_batch_size=64", "stage1_sft.global_batch_size=512")
    assert main([*argv, *too_large]) == 2
    out, err = capsys.readouterr()
    assert not out and "hpcr1: error: stage1_sft.micro_batch_size: stage1_sft memory FAIL: " in err, err
    assert main(argv) == 0
    out, err = capsys.readouterr()
    resolved = yaml.safe_load(out)
    assert resolved["stage1_sft"]["micro_batch_size"] == 1 and "Traceback" not in err
    assert resolved["eval"]["verl"]["rollout_tp"] == 1  # 'auto', laid out as submit lays it out
