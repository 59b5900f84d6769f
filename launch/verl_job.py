"""A verl GRPO stage inside its Slurm allocation, once slurm/templates/verl_grpo.sbatch has Ray
up on every node: check the config against verl again, write verl's data, run
`verl.trainer.main_ppo` (it joins the running Ray cluster through RAY_ADDRESS), then hand its
results over in our formats: final/ (merged from verl's last checkpoint), profile/ events from its
torch-profiler traces, and eval.json from its validation of the last step's policy.

`hpcr1 stage` calls `run_verl_stage` in place of the srun launcher, so the manifest treats the
stage like any other: done only when final/ and eval.json are there.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from core.atomic import atomic_write_text
from core.config import load_resolved
from core.rundir import RunDir
from launch.local import repo_env
from runtime.preemption import PREEMPTED_EXIT
from runtime.rank_failure import record_exception
from stages.data.examples import DataError, read_examples
from stages.engines.verl_io import (
    check_prompt_lengths,
    held_out_result,
    latest_step,
    merge_to_final,
    traces_to_events,
    verl_rows,
    write_metrics,
    write_parquet,
)
from stages.engines.verl_trainer import DATA_SOURCE, check_verl_stage, verl_paths


def run_verl_stage(run_dir: Path, sid: str, pass_fds: tuple[int, ...] = ()) -> int:
    """Returns main_ppo's exit code (PREEMPTED_EXIT when stopped by the job's USR1 signal), or 1
    with the exception recorded where the driver looks for a failed rank's (logs/rank-00000.*).
    `pass_fds`: descriptors main_ppo inherits (the run directory's lock)."""
    run = RunDir(run_dir)
    try:
        cfg = load_resolved(run)
        if "RAY_ADDRESS" not in os.environ:
            raise RuntimeError(
                "RAY_ADDRESS is not set: a verl stage runs from verl_grpo.sbatch, after it has "
                "started Ray on the allocation"
            )
        nnodes, gpus_per_node = int(os.environ["SLURM_NNODES"]), int(os.environ["HPCR1_GPUS_PER_NODE"])
        overrides = check_verl_stage(cfg, run, sid, nnodes, gpus_per_node)
        write_verl_data(cfg, run, sid)
        rc = _run_main_ppo(run, sid, overrides, pass_fds)
        if rc == 0:
            finish_verl_stage(cfg, run, sid)
        return rc
    except Exception as e:
        record_exception(run.logs(sid), 0, e)
        traceback.print_exc()
        return 1


def write_verl_data(cfg, run: RunDir, sid: str) -> None:
    from transformers import AutoTokenizer

    stage, paths = getattr(cfg, sid), verl_paths(run, sid)
    prompts = read_examples(run.task_file("prompts"))
    held_out = read_examples(run.task_file("eval"))[: cfg.eval.num_examples]
    if len(prompts) < stage.prompts_per_step:  # verl's loader drops the last partial batch: no step at all
        raise DataError(
            run.task_file("prompts"),
            None,
            f"{len(prompts)} prompts, fewer than {sid}.prompts_per_step ({stage.prompts_per_step})",
        )
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir(stage.init_from))
    check_prompt_lengths(
        prompts + held_out, tokenizer, stage.verl.max_prompt_length, f"{sid}.verl.max_prompt_length"
    )
    write_parquet(paths["train"], verl_rows(prompts, "train", DATA_SOURCE))
    write_parquet(paths["val"], verl_rows(held_out, "eval", DATA_SOURCE))


def _run_main_ppo(run: RunDir, sid: str, overrides: list[str], pass_fds: tuple[int, ...]) -> int:
    """main_ppo's output goes to logs/rank-00000.log, where a failure's traceback is looked for.
    On USR1 (the job nears its time limit) it is stopped: the requeued job resumes from verl's
    newest checkpoint (trainer.resume_mode=auto), losing the steps since then."""
    env = repo_env()
    env["VERL_FILE_LOGGER_PATH"] = str(verl_paths(run, sid)["metrics"])
    env.setdefault("WANDB_DIR", str(run.stage(sid).resolve()))
    run.logs(sid).mkdir(parents=True, exist_ok=True)
    with open(run.logs(sid) / "rank-00000.log", "a") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "verl.trainer.main_ppo", *overrides],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
        )
        stopped = []
        signal.signal(signal.SIGUSR1, lambda signum, frame: (stopped.append(signum), proc.terminate()))
        rc = proc.wait()
    return PREEMPTED_EXIT if stopped else rc


def finish_verl_stage(cfg, run: RunDir, sid: str) -> None:
    stage, paths = getattr(cfg, sid), verl_paths(run, sid)
    step = latest_step(paths["ckpt"])
    if step != stage.steps:
        raise RuntimeError(f"verl exited cleanly but its newest checkpoint is step {step}, not {stage.steps}")
    merge_to_final(paths["ckpt"], step, stage.verl.backend, run.model_dir(stage.init_from), run.final(sid))
    if paths["traces"].is_dir():
        n = traces_to_events(paths["traces"], run.profile(sid), sid)
        print(f"{sid}: {n} communication events from verl's torch-profiler traces", flush=True)
    write_metrics(paths["metrics"], run.metrics(sid))
    n_eval = min(cfg.eval.num_examples, len(read_examples(run.task_file("eval"))))
    atomic_write_text(
        run.eval_result(sid), json.dumps(held_out_result(paths["metrics"], DATA_SOURCE, n_eval))
    )
