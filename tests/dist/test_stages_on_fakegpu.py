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
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from tests import fakegpu
from tests.conftest import EVAL_IN_FULL, REPO, hpcr1_env

pytestmark = pytest.mark.dist
SHORT_SFT = ("stage1_sft.steps=4", "stage1_sft.checkpoint_every=2", *EVAL_IN_FULL)
SHORT_GRPO = (
    "stage2_grpo.steps=2",
    "stage2_grpo.checkpoint_every=2",
    "stage2_grpo.prompts_per_step=4",
    "stage2_grpo.group_size=4",
    "stage2_grpo.max_new_tokens=16",
)

# What a GRPO step computed (its times aside): the rollout's, the reward's and the update's.
GRPO_RESULTS = (
    "reward/mean",
    "response_length/mean",
    "entropy",
    "actor/kl",
    "actor/pg_loss",
    "actor/grad_norm",
)


def on_device(bound: bool = False) -> dict[str, str]:
    """The emulated device's environment; `bound`: each rank sees only its own device, index 0, as
    `srun --gpus-per-task=1` binds one GPU to each task (else a rank sees the node's 2)."""
    return fakegpu.child_env(hpcr1_env()) | ({fakegpu.COUNT_VAR: "1"} if bound else {})


def metrics(run_dir, stage_id: str) -> list[dict]:
    lines = (run_dir / stage_id / "metrics.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines]


def rank_log(run_dir, stage_id: str, rank: int = 0) -> str:
    return (run_dir / stage_id / "logs" / f"rank-{rank:05d}.log").read_text()


def stage1(trained_runs, *overrides: str, device: bool, bound: bool = True):
    """The session's shared stage-1 run of SHORT_SFT (and `overrides`), on the CPU or on the device
    (`bound`: each rank to its own)."""
    return trained_runs.get(*SHORT_SFT, *overrides, env=on_device(bound) if device else None)


@pytest.fixture(scope="module")
def grpo_runs(tmp_path_factory, trained_runs):
    """{device: run directory}: stage 2 (SHORT_GRPO) on the device and on the CPU, each on a copy
    of the stage-1 run of its own device (the [sft] case's)."""
    root = tmp_path_factory.mktemp("fakegpu-grpo")
    runs = {}
    for device in (True, False):
        env = on_device() if device else None
        run_dir = root / ("device" if device else "cpu")
        stage1(trained_runs, device=device).continue_into(
            run_dir, *SHORT_GRPO, stages=("stage2_grpo",), env=env
        )
        runs[device] = run_dir
    return runs


@pytest.mark.parametrize("kind", ["sft", "grpo"])
def test_stages_run_on_the_device_and_compute_what_the_cpu_computes(trained_runs, request, kind):
    if kind == "grpo":
        runs = request.getfixturevalue("grpo_runs")
        device, cpu, stages = runs[True], runs[False], ("stage2_grpo",)
    else:
        device, cpu = (stage1(trained_runs, device=on).path for on in (True, False))
        stages = ("stage1_sft",)
        # each rank bound to its own device sees it as index 0
        assert "rank 1 of 2 on fakegpu:0" in rank_log(device, "stage1_sft", rank=1)
    for stage_id in stages:
        assert "on fakegpu:0" in rank_log(device, stage_id), "the ranks did not run on the emulated device"
        ours, reference = metrics(device, stage_id), metrics(cpu, stage_id)
        for key in ("loss",) if stage_id == "stage1_sft" else GRPO_RESULTS:
            assert [m[key] for m in ours] == pytest.approx([m[key] for m in reference], rel=1e-5), key
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


def test_pipeline_stages_on_the_device_train_as_one_stage_does(trained_runs):
    """PP=2 over the 2 ranks: megatron's 1F1B schedule sends activations and their gradients between
    the emulated devices (send/recv completing when waited for, as NCCL's), and every step's loss
    equals that of PP=1, whose ranks split the batch instead."""
    one = metrics(stage1(trained_runs, device=True).path, "stage1_sft")
    # its eval is not what this test checks (the [sft] case's is): greedy answers only
    no_sampled_eval = ("eval.samples=0", "eval.validation_examples=0")
    pipelined = stage1(
        trained_runs, "stage1_sft.parallel.pp=2", *no_sampled_eval, device=True, bound=False
    ).path
    assert "rank 1 of 2 on fakegpu:1" in rank_log(pipelined, "stage1_sft", rank=1)  # the node's second
    two = metrics(pipelined, "stage1_sft")
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


# A task stage 1 learns the format of in 60 steps (about 0.8 of its answers well-formed), and a GRPO
# stage that rewards the format alone: its groups' rewards differ, so its step has a gradient. Its
# one step is two AdamW updates (mini_batches 2) at GRPO's usual learning rate, 1e-6: Adam moves a
# weight by about lr an update (|m|/sqrt(v) <= ~1 in its first updates; 3 lr bounds it), so about
# 2e-6 in all, under half a bf16 ulp (2^-18) of any weight above 2^-10 in magnitude (nearly all):
# a bf16 copy updated in place would lose it.
EASY_TASK = ("data.arithmetic.num_operands=2", "data.arithmetic.digits=2", "stage1_sft.steps=60")
LR, UPDATES = 1e-6, 2
BF16_GRPO = (
    *("stage2_grpo.dtype=bf16", "stage2_grpo.steps=1", "stage2_grpo.checkpoint_every=1"),
    *("stage2_grpo.prompts_per_step=8", "stage2_grpo.group_size=8", "stage2_grpo.max_new_tokens=32"),
    *(f"stage2_grpo.lr={LR}", f"stage2_grpo.mini_batches={UPDATES}", "stage2_grpo.format_reward=1.0"),
)


def master_weights(checkpoint) -> tuple[dict[str, torch.Tensor], dict]:
    """The model's and the optimizer's state in a step checkpoint (DCP, read whole in this process)."""
    whole = checkpoint.parent / f"{checkpoint.name}.pt"
    dcp_to_torch_save(checkpoint, whole)
    state = torch.load(whole, weights_only=False)
    return state["model"], state["optim"]


@pytest.mark.slow
def test_a_bf16_grpo_stage_trains_on_the_device_over_fp32_master_weights(trained_runs, tmp_path):
    """Stage 1 on the CPU (shared), then stage 2 in bf16 on the device. Its step checkpoint's weights
    and AdamW states are fp32 (the master copy), and the step moved the masters by AdamW's updates
    alone (no more than 3 lr each: not rounded through bf16), most of them, and mostly by amounts a
    bf16 copy cannot hold: most changed weights keep their bf16 rounding, so a bf16 model updated in
    place would not have changed at all. final/ is the masters rounded to bf16, and is evaluated in
    bf16 on the device. (That the actor computes in bf16 over them: tests/unit/test_grpo_precision.py.)"""
    run_dir = tmp_path / "bf16"
    trained_runs.get(*EASY_TASK).continue_into(run_dir, *BF16_GRPO, stages=("stage2_grpo",), env=on_device())
    assert "on fakegpu:0" in rank_log(run_dir, "stage2_grpo")
    masters, optim = master_weights(run_dir / "stage2_grpo" / "ckpt" / "step-000001")
    optim_tensors = [t for state in optim["state"].values() for t in state.values() if t.dim() > 0]
    assert optim_tensors and {t.dtype for t in [*masters.values(), *optim_tensors]} == {torch.float32}

    start = load_file(run_dir / "stage1_sft" / "final" / "model.safetensors")  # the fp32 masters' start
    final = load_file(run_dir / "stage2_grpo" / "final" / "model.safetensors")
    assert masters.keys() == start.keys() == final.keys()
    moved = kept_in_bf16 = total = 0
    for name, after in masters.items():
        before = start[name]
        changed = after != before
        assert (after - before).abs().max() <= 3 * LR * UPDATES, name
        moved += int(changed.sum())
        total += after.numel()
        kept_in_bf16 += int((changed & (after.bfloat16() == before.bfloat16())).sum())
        assert final[name].dtype == torch.bfloat16 and torch.equal(final[name], after.bfloat16()), name
    print(f"the step moved {moved} of {total} master weights, {kept_in_bf16} by less than bf16 resolves")
    assert moved > 0.5 * total, f"the step moved {moved} of {total} master weights"
    assert kept_in_bf16 > 0.8 * moved, f"{kept_in_bf16} of {moved} updates were below bf16's resolution"
    evaluated = json.loads((run_dir / "stage2_grpo" / "eval.json").read_text())
    config = json.loads((run_dir / "stage2_grpo" / "final" / "config.json").read_text())
    assert (config["dtype"], evaluated["device"], evaluated["dtype"]) == ("bfloat16", "fakegpu", "bfloat16")
