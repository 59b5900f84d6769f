"""verl's megatron backend (`verl.backend: megatron`: Megatron-Bridge and megatron-core) executing
GRPO on the CPU platform, 2 gloo ranks, at the GPU lock's versions (the twin venv, `make
setup-twin`), as a Slurm job runs a stage: a Ray head started apart with 2 fake GPUs, then `hpcr1
stage` (verl's v1 `main_ppo` with the project's overrides, the HF rollout fed by verl's weight
sync, then the hand-over to final/).

- TP=2: killed once verl has sealed step 2's checkpoint, rerun: it resumes from that checkpoint
  (model, optimizer, RNG) and finishes; final/ loads in transformers and gives the logits of the
  megatron model verl's checkpoint holds (built as verl builds it, from what verl reloads).
- PP=2: straight through, the same hand-over.

Each `hpcr1 stage` is ~2-3 minutes on 2 cores, most of it Ray and process start.
Run with `.venv-twin/bin/python -m pytest tests/twin`; skipped in a venv without Megatron-Bridge."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys

import pytest
import torch

from stages.engines.verl_io import megatron_hf_dir, verl_metric_rows
from tests.conftest import REPO
from tests.twin.megatron_run import SID, prepare, ray_for_verl, run_stage

pytestmark = [
    pytest.mark.twin,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("megatron.bridge") is None,
        reason="needs the twin venv (make setup-twin): Megatron-Bridge and megatron-core",
    ),
]

PROMPTS = ("12+34=", "99+01=", "50+50=")


@pytest.fixture(scope="module")
def verl_job_env(tmp_path_factory):
    """A Ray head with 2 fake GPUs under a temporary home, stopped with all it started."""
    with ray_for_verl(tmp_path_factory.mktemp("home")) as env:
        yield env


def stage_log(run) -> str:
    log = run.logs(SID) / "rank-00000.log"
    return log.read_text(errors="replace") if log.exists() else ""


def check_steps(run, steps: int) -> list[dict]:
    rows = verl_metric_rows(run.stage(SID) / "verl_metrics")
    assert [row["step"] for row in rows] == list(range(1, steps + 1))
    for row in rows:
        data = row["data"]
        assert all(math.isfinite(data[k]) for k in ("actor/pg_loss", "actor/grad_norm", "actor/kl_loss"))
        print(f"step {row['step']}: grad_norm {data['actor/grad_norm']:.4g}, pg_loss "
              f"{data['actor/pg_loss']:.4g}, kl_loss {data['actor/kl_loss']:.3g}, score "
              f"{data['critic/score/mean']:.3f}, {data['timing_s/step']:.1f} s")  # fmt: skip
    # the base model answers in the format half the time (format_base.py): rewards differ in a group
    assert any(row["data"]["actor/grad_norm"] > 0 for row in rows)
    return rows


def check_final_is_the_checkpoint(run, steps: int) -> None:
    """final/ loads in transformers, with the tokenizer, and its logits are those of the megatron
    model (fp32, one rank) built as verl builds it, from the Hugging Face files of verl's last
    checkpoint, which is what verl itself reloads on resume."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.data.tokenizer import encode_prompt

    final = run.final(SID)
    tokenizer = AutoTokenizer.from_pretrained(final)
    model = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM"
    ids = torch.tensor([encode_prompt(tokenizer, p) for p in PROMPTS])  # same length: no padding
    with torch.no_grad():
        expected = model(input_ids=ids).logits
    actor = run.ckpt(SID) / f"global_step_{steps}" / "actor"
    out = final.parent / "megatron_logits.pt"
    done = subprocess.run(
        [sys.executable, "-m", "tests.twin.megatron_logits", str(megatron_hf_dir(actor)), str(out),
         json.dumps(ids.tolist())],
        cwd=REPO, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-5000:]
    logits = torch.load(out)[..., : expected.shape[-1]]
    diff = (logits - expected).abs().max().item()
    print(f"final/ vs the megatron model of global_step_{steps}: max |logit diff| {diff:.3g}")
    assert diff < 1e-4


def test_tp2_trains_resumes_from_its_checkpoint_and_hands_over(verl_job_env, tmp_path):
    run = prepare(tmp_path / "run", tp=2, pp=1, steps=3)
    assert run_stage(run, verl_job_env, stop_after_checkpoint=2) is None, stage_log(run)[-5000:]
    assert not run.final(SID).exists()
    rc = run_stage(run, verl_job_env)
    assert rc == 0, stage_log(run)[-8000:]
    log = stage_log(run)
    assert f"Resuming from {run.ckpt(SID).resolve()}/global_step_2" in log
    assert "Loaded optimizer checkpoint" in log and "Loaded RNG states" in log
    # the second attempt trained step 3 only: it started from step 2's checkpoint
    attempts = sorted((run.stage(SID) / "verl_metrics").glob("attempt-*.jsonl"))
    assert [json.loads(line)["step"] for line in attempts[-1].read_text().splitlines()] == [3]
    check_steps(run, 3)
    check_final_is_the_checkpoint(run, 3)


def test_pp2_trains_and_hands_over(verl_job_env, tmp_path):
    run = prepare(tmp_path / "run", tp=1, pp=2, steps=2)
    rc = run_stage(run, verl_job_env)
    assert rc == 0, stage_log(run)[-8000:]
    check_steps(run, 2)
    check_final_is_the_checkpoint(run, 2)
