"""A GRPO stage on verl's megatron backend on the CPU platform, run as a Slurm job runs it: a Ray
head started apart with 2 fake GPUs, then `hpcr1 stage` (launch/verl_job.py: main_ppo, then the
hand-over to final/). Used by tests/twin/test_verl_megatron.py, and runnable alone:

    PYTHONPATH=. .venv-twin/bin/python -m tests.twin.megatron_run RUN_DIR --tp 2 --pp 1 --steps 3
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from core.config import load_config
from core.rundir import RunDir
from pipeline.driver import check_run, write_run
from tests.conftest import REPO, tiny_base_built_here
from tests.ray_head import ray_head_apart
from tests.twin.format_base import teach_format

GPUS = 2
SID = "stage2_grpo"


def overrides(tp: int, pp: int, steps: int, backend: str = "megatron") -> list[str]:
    return [
        "model.tiny={hidden_size: 64, num_layers: 2, num_heads: 4, num_kv_heads: 2, ffn_hidden_size: 176}",
        "data.arithmetic={num_operands: 2, digits: 2, sft_size: 64, prompts_size: 16, eval_size: 8, "
        "validation_size: 1}",
        "eval={num_examples: 8, max_new_tokens: 12, batch_size: 8}",
        "wandb.mode=disabled",
        f"{SID}.init_from=base",
        f"{SID}.engine=verl",
        f"{SID}.steps={steps}",
        f"{SID}.prompts_per_step=4",
        f"{SID}.group_size=2",
        f"{SID}.mini_batches=1",
        f"{SID}.max_new_tokens=12",
        f"{SID}.checkpoint_every=1",
        f"{SID}.keep_checkpoints=5",
        f"{SID}.verl.backend={backend}",
        f"{SID}.verl.megatron_tp={tp}",
        f"{SID}.verl.megatron_pp={pp}",
        f"{SID}.verl.rollout_tp=1",
        f"{SID}.verl.micro_batch_size_per_gpu=2",
        f"{SID}.verl.max_prompt_length=64",
        "eval.verl.rollout_tp=1",
        "eval.verl.max_prompt_length=64",
    ]


def prepare(root: Path, tp: int, pp: int, steps: int, backend: str = "megatron") -> RunDir:
    """The run directory, its base model the tiny one taught the answer format (format_base.py)."""
    config, extra = REPO / "configs" / "tiny-cpu.yaml", overrides(tp, pp, steps, backend)
    base = root.with_name(f"{root.name}-base")
    if not base.exists():
        hf = tiny_base_built_here(config, base, extra)
        print(f"format taught to the base model: loss {teach_format(base):.3f}", flush=True)
    else:
        hf = ["model.source=hf", f"model.path={base}"]
    cfg = load_config(config, [*extra, *hf])
    for sid in ("stage1_sft", "stage3_synth", "stage3_sft", "stage4_grpo"):
        setattr(cfg, sid, None)
    run = RunDir(root)
    write_run(cfg, run, check_run(cfg, REPO / "configs"), REPO / "configs")
    return run


def job_env(home: Path) -> dict[str, str]:
    env = {**os.environ, "HOME": str(home), "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1",
           "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0"}  # fmt: skip
    for name in ("WANDB_MODE", "WANDB_DIR", "RAY_ADDRESS", "VERL_FILE_LOGGER_PATH", "RAY_AUTH_TOKEN"):
        env.pop(name, None)
    return env


@contextlib.contextmanager
def ray_for_verl(home: Path):
    """The environment of a verl stage job on the CPU platform, with its Ray head (stopped after)."""
    env = job_env(home)
    with ray_head_apart(env, num_cpus=3 * GPUS + 8, num_gpus=GPUS) as address:
        yield {**env, "RAY_ADDRESS": address, "SLURM_NNODES": "1", "HPCR1_GPUS_PER_NODE": str(GPUS),
               "HPCR1_VERL_PLATFORM": "cpu"}  # fmt: skip


def run_stage(
    run: RunDir, env: dict[str, str], stop_after_checkpoint: int | None = None, timeout: float = 900.0
):
    """`hpcr1 stage RUN stage2_grpo`: its exit code, or None when it was killed (its whole process
    group) once verl had sealed the checkpoint of step `stop_after_checkpoint`."""
    proc = subprocess.Popen([sys.executable, "-m", "pipeline.cli", "stage", str(run.root), SID], env=env,
                            cwd=REPO, start_new_session=True)  # fmt: skip
    marker = run.ckpt(SID) / "latest_checkpointed_iteration.txt"
    deadline = time.monotonic() + timeout
    try:
        while proc.poll() is None:
            if stop_after_checkpoint is not None and marker.exists():
                if marker.read_text().strip() == str(stop_after_checkpoint):
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    return None
            if time.monotonic() > deadline:
                raise TimeoutError(f"hpcr1 stage ran past {timeout} s")
            time.sleep(0.5)
        return proc.returncode
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--stop-after", type=int, default=None)
    parser.add_argument("--backend", default="megatron", choices=["megatron", "fsdp"])
    args = parser.parse_args()
    run = RunDir(args.run_dir)
    if not args.run_dir.exists():
        run = prepare(args.run_dir, args.tp, args.pp, args.steps, args.backend)
    with tempfile.TemporaryDirectory(prefix="home-") as home, ray_for_verl(Path(home)) as env:
        t0 = time.monotonic()
        rc = run_stage(run, env, args.stop_after)
        print(f"hpcr1 stage: rc {rc}, {time.monotonic() - t0:.0f} s", flush=True)
    return 0 if rc in (0, None) else 1


if __name__ == "__main__":
    sys.exit(main())
