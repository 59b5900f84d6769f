"""The stages on 2 ranks of the emulated accelerator (tests/fakegpu), as they would run on GPUs: every
tensor that meets the model or a collective must be on the rank's device, and the group refuses CPU
tensors as nccl does. SFT (micro-batches, loss sum, the preemption flag at every step boundary, the
sharded eval's model and counts; PP=2's stages exchanging activations), GRPO (balance widths,
log-prob passes, reward, rollout) and commbench's buffers run end to end; their results equal the
same run's on the CPU, since the device computes with the same kernels."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import torch
import torch.distributed.checkpoint as dcp

from tests import fakegpu
from tests.conftest import REPO, hpcr1_env, hpcr1_run, run_once

pytestmark = pytest.mark.dist
SHORT_SFT = ["stage1_sft.steps=4", "stage1_sft.checkpoint_every=2"]
SHORT_GRPO = [
    "--only",
    "stage1_sft,stage2_grpo",
    "stage2_grpo.steps=2",
    "stage2_grpo.checkpoint_every=2",
    "stage2_grpo.prompts_per_step=4",
    "stage2_grpo.group_size=4",
    "stage2_grpo.max_new_tokens=16",
]


# A task stage 1 learns the format of in 60 steps (about 0.8 of its answers well-formed, none right),
# and a GRPO stage that rewards the format alone: what it learns within 6 steps shows in the reward.
EASY_TASK = ["data.arithmetic.num_operands=2", "data.arithmetic.digits=2", "stage1_sft.steps=60"]
BF16_GRPO = [
    *("--only", "stage1_sft,stage2_grpo", "stage2_grpo.dtype=bf16", "stage2_grpo.steps=6"),
    *("stage2_grpo.checkpoint_every=6", "stage2_grpo.prompts_per_step=4", "stage2_grpo.group_size=8"),
    *("stage2_grpo.max_new_tokens=32", "stage2_grpo.lr=3e-4", "stage2_grpo.format_reward=1.0"),
]


def on_device() -> dict[str, str]:
    return fakegpu.child_env(hpcr1_env())


def metrics(run_dir, stage_id: str) -> list[dict]:
    lines = (run_dir / stage_id / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def rank_log(run_dir, stage_id: str) -> str:
    return (run_dir / stage_id / "logs" / "rank-00000.log").read_text()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    get = run_once(tmp_path_factory.mktemp("fakegpu"))
    return lambda name, *overrides, device: get(name, *overrides, env=on_device() if device else None)


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_stages_run_on_the_device_and_compute_what_the_cpu_computes(runs, kind):
    overrides = SHORT_SFT + (SHORT_GRPO if kind == "grpo" else ["--only", "stage1_sft"])
    device, cpu = (
        runs(f"{kind}-device", *overrides, device=True),
        runs(f"{kind}-cpu", *overrides, device=False),
    )
    assert "on fakegpu:0" in rank_log(device, "stage1_sft"), "the ranks did not run on the emulated device"
    for stage_id in ("stage1_sft", "stage2_grpo") if kind == "grpo" else ("stage1_sft",):
        ours, reference = metrics(device, stage_id), metrics(cpu, stage_id)
        key = "loss" if stage_id == "stage1_sft" else "reward/mean"
        assert [m[key] for m in ours] == pytest.approx([m[key] for m in reference], rel=1e-5)
        on_gpu, on_cpu = (json.loads((d / stage_id / "eval.json").read_text()) for d in (device, cpu))
        assert (on_gpu["device"], on_gpu["dtype"], on_gpu["n"]) == ("fakegpu", "float32", 16)
        # greedy and sampled (mean@k: the same seeded draws on either device) alike
        keys = ("accuracy", "format_rate", "mean_at_k", "format_rate_at_k")
        assert {k: on_gpu[k] for k in keys} == {k: on_cpu[k] for k in keys}
        assert {k: on_gpu["validation"][k] for k in keys} == {k: on_cpu["validation"][k] for k in keys}
    if kind == "grpo":  # bench/gpu_acceptance.py's check of the phase split, on device-timed phases
        sys.path.insert(0, str(REPO / "bench"))
        from gpu_acceptance import grpo_split

        assert grpo_split(device / "stage2_grpo")[1] == []


def test_pipeline_stages_on_the_device_train_as_one_stage_does(runs):
    """PP=2 over the 2 ranks: megatron's 1F1B schedule sends activations and their gradients between
    the emulated devices (send/recv completing when waited for, as NCCL's), and every step's loss
    equals that of PP=1, whose ranks split the batch instead."""
    overrides = SHORT_SFT + ["--only", "stage1_sft"]
    one = metrics(runs("sft-device", *overrides, device=True), "stage1_sft")
    two = metrics(runs("sft-pp2-device", *overrides, "stage1_sft.parallel.pp=2", device=True), "stage1_sft")
    sent = ["phase_time/pipeline_p2p" in m for m in one + two]
    assert sent == [False] * len(one) + [True] * len(two)  # only PP=2 has stages to send between
    assert [m["loss"] for m in two] == pytest.approx([m["loss"] for m in one], rel=0, abs=1e-5)


def test_commbench_runs_on_the_device_with_its_backend(tmp_path):
    out = tmp_path / "commbench.json"
    argv = [sys.executable, "-m", "launch.commbench", "--nproc", "2", "--sizes", "1K,64K", "--iters", "2"]
    proc = subprocess.run(
        [*argv, "--warmup", "1", "--out", str(out)],
        cwd=REPO,
        env=on_device(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    bench = json.loads(out.read_text())
    assert bench["backend"] == "fakeccl" and bench["world_size"] == 2
    assert all(r["latency_us"] > 0 for rows in bench["results"].values() for r in rows)


def test_sft_runs_where_each_rank_sees_only_its_own_device(tmp_path):
    """`srun --gpus-per-task=1` binds one GPU to each task: every rank sees one device, index 0."""
    env = {**on_device(), "HPCR1_FAKEGPU_DEVICES": "1"}
    run_dir = tmp_path / "bound"
    hpcr1_run(run_dir, *SHORT_SFT, "--only", "stage1_sft", env=env)
    assert "rank 1 of 2 on fakegpu:0" in (run_dir / "stage1_sft" / "logs" / "rank-00001.log").read_text()


@pytest.mark.slow
def test_a_bf16_grpo_stage_trains_on_the_device_over_fp32_master_weights(tmp_path):
    """Stage 1 on the CPU, then stage 2 in bf16 on the device: the reward rises, the step
    checkpoint's weights and AdamW states are fp32 (the master copy), final/ is bf16 and is
    evaluated in bf16 on the device. (That the actor computes in bf16 over them: the unit test
    tests/unit/test_grpo_precision.py.)"""
    run_dir = tmp_path / "bf16"
    hpcr1_run(run_dir, *EASY_TASK, "--only", "stage1_sft")
    hpcr1_run(run_dir, *EASY_TASK, *BF16_GRPO, env=on_device())
    rewards = [m["reward/mean"] for m in metrics(run_dir, "stage2_grpo")]
    assert sum(rewards[-3:]) / 3 > rewards[0] + 0.05, rewards
    saved = dcp.FileSystemReader(run_dir / "stage2_grpo" / "ckpt" / "step-000006").read_metadata()
    tensors = {k: v.properties.dtype for k, v in saved.state_dict_metadata.items() if hasattr(v, "properties")}
    assert any(k.startswith("optim.") for k in tensors) and set(tensors.values()) == {torch.float32}
    final = json.loads((run_dir / "stage2_grpo" / "final" / "config.json").read_text())
    evaluated = json.loads((run_dir / "stage2_grpo" / "eval.json").read_text())
    assert (final["dtype"], evaluated["device"], evaluated["dtype"]) == ("bfloat16", "fakegpu", "bfloat16")
