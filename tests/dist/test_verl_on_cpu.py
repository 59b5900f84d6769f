"""verl's own code on the CPU platform, through the project's launch code against a Ray started apart
(as verl_stage.sbatch starts it on a cluster; its environment knows nothing of the stage):
- generation on verl's rollout replicas (the HF rollout, 2 replicas) answers greedily exactly what
  Hugging Face's own greedy decoding of the same model answers;
- a Ray worker (an FSDP rank of verl's trainer) killed mid-step fails the stage in bounded time,
  naming it, after the stage's file logger and wandb (offline, as the config says) had started.
The whole GRPO path, requeues and kills included, runs on the local Slurm (tests/slurm/test_slurm_verl.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from core.config import load_config
from core.manifest import Manifest
from core.rundir import RunDir
from launch.ray_cluster import auth_env
from pipeline.driver import check_run, write_run
from tests.conftest import REPO
from tests.ray_head import ray_head_apart

pytestmark = [pytest.mark.slow, pytest.mark.dist]
import verl  # noqa: E402, F401  (pinned: a broken install must fail, not skip)

GPUS = 2  # Ray's fake GPUs: the ranks of the CPU platform
SMALL = [
    "data.arithmetic={num_operands: 2, digits: 2, sft_size: 64, prompts_size: 16, eval_size: 8, "
    "validation_size: 1}",
    "eval={num_examples: 8, max_new_tokens: 12, batch_size: 8}",
    "wandb.mode=offline",
    "stage2_grpo.init_from=base",
    "stage2_grpo.engine=verl",
    "stage2_grpo.steps=20",
    "stage2_grpo.prompts_per_step=4",
    "stage2_grpo.group_size=2",
    "stage2_grpo.max_new_tokens=12",
    "stage2_grpo.checkpoint_every=1",
    "stage2_grpo.verl.rollout_tp=1",
    "stage2_grpo.verl.micro_batch_size_per_gpu=2",
    "stage2_grpo.verl.max_prompt_length=64",
    "eval.verl.rollout_tp=1",
    "eval.verl.max_prompt_length=64",
]


@pytest.fixture(scope="module")
def verl_env(tmp_path_factory):
    """The environment of a verl job: a Ray head of its own with 2 fake GPUs, under a temporary home;
    neither WANDB_MODE nor anything of the stage in Ray's environment, as on a GPU cluster."""
    home = tmp_path_factory.mktemp("home")
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", **auth_env()}
    for name in ("WANDB_MODE", "WANDB_DIR", "RAY_ADDRESS", "VERL_FILE_LOGGER_PATH"):
        env.pop(name, None)
    with ray_head_apart(env, num_cpus=3 * GPUS + 8, num_gpus=GPUS) as address:
        yield {**env, "RAY_ADDRESS": address, "SLURM_NNODES": "1", "HPCR1_GPUS_PER_NODE": str(GPUS),
               "HPCR1_VERL_PLATFORM": "cpu"}  # fmt: skip


def prepared_run(tmp_path: Path, *extra: str) -> tuple:
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [*SMALL, *extra])
    for sid in ("stage1_sft", "stage3_synth", "stage3_sft", "stage4_grpo"):
        setattr(cfg, sid, None)
    run = RunDir(tmp_path / "run")
    write_run(cfg, run, check_run(cfg, REPO / "configs"), REPO / "configs")
    return cfg, run


def test_greedy_answers_from_verls_replicas_are_hugging_faces_greedy_answers(verl_env, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from stages.data.examples import read_examples

    cfg, run = prepared_run(tmp_path, "eval.verl.requests_in_flight=4")  # 8 answers: 2 replicas
    examples = read_examples(run.task_file("eval"))[:8]
    script = (
        "import json, sys; from pathlib import Path; from core.config import load_resolved; "
        "from core.rundir import RunDir; from launch.verl_job import _generate_on_verl; "
        "from stages.data.examples import read_examples; run = RunDir(Path(sys.argv[1])); "
        "cfg = load_resolved(run); ex = read_examples(run.task_file('eval'))[:8]; "
        "answers = _generate_on_verl(cfg, run, 'stage2_grpo', run.base_model, ex, (1, 2), ()); "
        "print('ANSWERS', json.dumps(answers['responses']))"
    )
    out = subprocess.run([sys.executable, "-c", script, str(run.root)], env=verl_env, cwd=REPO,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    log = (run.logs("stage2_grpo") / "rank-00000.log").read_text() if run.logs("stage2_grpo").exists() else ""
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:] + log[-5000:]
    answers = json.loads(out.stdout.split("ANSWERS ", 1)[1])

    tokenizer = AutoTokenizer.from_pretrained(run.base_model)
    model = AutoModelForCausalLM.from_pretrained(run.base_model).eval()
    expected = []
    for ex in examples:
        ids = tokenizer.apply_chat_template(
            [{"role": "user", "content": ex.prompt}],
            add_generation_prompt=True,
            tokenize=True,
            return_tensors="pt",
        )
        ids = ids["input_ids"] if hasattr(ids, "keys") else ids
        out_ids = model.generate(ids, max_new_tokens=12, do_sample=False, pad_token_id=tokenizer.pad_token_id)
        expected.append([tokenizer.decode(out_ids[0, ids.shape[1] :], skip_special_tokens=True)])
    assert answers == expected


def rank_pid(log: Path, rank: int) -> int | None:
    """The pid of verl's FSDP rank `rank`, from its own log line (Ray prefixes it with the pid)."""
    text = log.read_text() if log.exists() else ""
    found = re.findall(rf"\(WorkerDict pid=(\d+)[^)]*\).*\[Rank {rank}\] Saved model", text)
    return int(found[0]) if found else None


def test_a_ray_worker_killed_mid_step_fails_the_stage_naming_it(verl_env, tmp_path):
    cfg, run = prepared_run(tmp_path)
    sid = "stage2_grpo"
    stage = subprocess.Popen(
        [sys.executable, "-m", "pipeline.cli", "stage", str(run.root), sid],
        env=verl_env, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 600
        log, metrics = run.logs(sid) / "rank-00000.log", run.stage(sid) / "verl_metrics" / "attempt-001.jsonl"
        # step 1 done: checkpointed (verl's log names each rank's pid) and logged by the file logger
        while not (metrics.exists() and metrics.read_text().strip()) or rank_pid(log, 0) is None:
            assert stage.poll() is None and time.monotonic() < deadline, stage.stdout.read()[-5000:]
            time.sleep(0.5)
        # the file logger and wandb of this stage started, from the stage's config, in verl's actors
        assert json.loads(metrics.read_text().splitlines()[0])["step"] == 1
        assert list((run.stage(sid) / "wandb").glob("offline-run-*")), (
            "wandb did not run offline in the stage"
        )
        pid = rank_pid(log, 0)
        assert "WorkerDict" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace")
        killed = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        stage.wait(timeout=180)
        took = time.monotonic() - killed
        print(f"the stage failed {took:.1f} s after its rank was killed")
    finally:
        if stage.poll() is None:  # the stage driver and main_ppo under it
            os.killpg(stage.pid, signal.SIGKILL)
            stage.wait()
    entry = Manifest(run.root).stage(sid)
    assert entry["state"] == "failed" and took < 180
    # what `hpcr1 status` shows: Ray's word for the death, and which of verl's workers died
    assert entry["error"]["exception"] == "ActorDiedError" and "WorkerDict" in entry["error"]["message"], (
        entry
    )
    assert not run.final(sid).exists()
