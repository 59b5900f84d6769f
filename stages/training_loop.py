"""The loop every training stage runs, for any engine with `load(dir)`, `save(dir, state)`,
`export_hf(dir, tokenizer_dir)` and `close()`: resume from the newest checkpoint all ranks agree on,
train step by step with metrics and a progress bar, checkpoint (periodically, or on a preemption
signal), then export final/ and evaluate it on the validation and held-out sets. A preemption signal
during export or evaluation stops the stage too: the next attempt resumes from the last step's
checkpoint without training, and evaluates the final/ this one exported, if it did."""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable

import torch.distributed as dist

from core.atomic import atomic_write_text
from core.manifest import describe_eval
from runtime.context import StageContext
from runtime.dist import release_cached_memory
from runtime.phases import phase
from runtime.preemption import leave_for_requeue, leave_if_requested, stop_requested
from stages.checkpoint import CheckpointDir, agreed_resume_step, step_name
from stages.data.examples import read_examples
from stages.eval import evaluate_model_dir
from stages.inputs import validation_examples
from stages.metrics import MetricsLogger

# step -> (the step's metrics, its counts for throughput: {"samples": n, ...})
StepFn = Callable[[int], tuple[dict[str, float], dict[str, float]]]


def train(ctx: StageContext, engine, init_dir, train_step: StepFn, postfix: Callable[[dict], dict]) -> None:
    """Run `train_step(step)` (0-based) from the resumed step to `stage.steps`, then finish."""
    stage, run, cfg = ctx.stage, ctx.run, ctx.cfg
    ckpts = CheckpointDir(run.ckpt(ctx.stage_id), keep=stage.keep_checkpoints)
    step = resume(ctx, engine, ckpts)
    trains = step < stage.steps
    metrics = MetricsLogger(
        run.metrics(ctx.stage_id),
        ctx.is_main,
        step,
        cfg.wandb.mode,
        cfg.wandb.project,
        run.wandb_run(ctx.stage_id),
        cfg.model_dump(mode="json"),
    )
    bar = ctx.progress(stage.steps, initial=step)
    while step < stage.steps:
        ctx.begin_step(step + 1)
        started, started_wall = time.perf_counter(), time.time()
        stats, counts = train_step(step)
        step += 1
        metrics.log_step(step, stats, started_wall, time.perf_counter() - started, counts)
        bar.set_postfix(postfix(stats), refresh=False)
        bar.update()
        checkpoint_boundary(ctx, engine, ckpts, step)
    bar.close()
    metrics.close()
    ctx.log.info("training done at step %d", step)
    finish(ctx, engine, init_dir, exported=not trains and ctx.run.final(ctx.stage_id).is_dir())


def resume(ctx: StageContext, engine, ckpts: CheckpointDir) -> int:
    """The step to continue from: that of the newest checkpoint every rank verified, else 0."""
    step = agreed_resume_step(ckpts)
    if step is None:
        return 0
    step = engine.load(ckpts.root / step_name(step))["step"]
    ctx.log.info("resumed from step %d", step)
    return step


def save_checkpoint(engine, ckpts: CheckpointDir, step: int) -> None:
    with phase("checkpoint"), ckpts.writing(step) as staging:
        engine.save(staging, {"step": step})
        ckpts.seal(step)  # every rank digests its share


def checkpoint_boundary(ctx: StageContext, engine, ckpts: CheckpointDir, step: int) -> None:
    """After `step`: checkpoint every `checkpoint_every` steps and at the end; on a preemption
    signal, checkpoint and leave with the exit code that makes the driver start the stage again."""
    if step % ctx.stage.checkpoint_every == 0 or step == ctx.stage.steps:
        save_checkpoint(engine, ckpts, step)
    elif stop_requested():
        save_checkpoint(engine, ckpts, step)
        ctx.log.info("stopping at step %d on request; the next attempt resumes here", step)
        leave_for_requeue()


def finish(ctx: StageContext, engine, init_dir, exported: bool) -> None:
    """Export final/ (unless an earlier attempt that trained no further did: `exported`) and score it,
    stopping before each part, and between eval's batches, if a preemption signal came."""
    final = ctx.run.final(ctx.stage_id)
    with phase("export"):  # its collectives (stop check, gathers) are the stage's, not the last step's
        leave_if_requested(ctx.log, "before exporting final/")
        if exported:
            engine.close()
            ctx.log.info("%s was exported by an earlier attempt from this last step; it is evaluated", final)
        else:
            export_final(ctx, engine, init_dir)
    release_cached_memory()
    cfg = ctx.cfg
    if cfg.eval.engine == "verl":  # the job's verl generation server scores final/ once the ranks exit
        return
    examples = read_examples(ctx.run.task_file("eval"))[: cfg.eval.num_examples]
    validation = validation_examples(ctx.run, cfg.eval.validation_count)
    ctx.begin_step(ctx.stage.steps + 1)  # the evaluation's own step in the profile
    with phase("eval"):
        leave_if_requested(ctx.log, "before evaluating final/")
        result = evaluate_model_dir(final, examples, cfg.eval, cfg.seed, validation)
    if ctx.is_main:
        atomic_write_text(ctx.run.eval_result(ctx.stage_id), json.dumps(result))
        ctx.log.info("accuracy of final/: %s", describe_eval(result))


def export_final(ctx: StageContext, engine, init_dir) -> None:
    """final/ written aside and renamed, so a half-written final/ never exists; the engine closed."""
    final = ctx.run.final(ctx.stage_id)
    staging = final.with_name("final.tmp")
    if ctx.is_main:
        # Left by an attempt that died while exporting: its files must not mix with these.
        shutil.rmtree(staging, ignore_errors=True)
    dist.barrier()
    engine.export_hf(staging, tokenizer_dir=init_dir)
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    dist.barrier()
    engine.close()
    ctx.log.info("exported %s", final)
