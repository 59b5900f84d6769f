"""The end of a training step and of a training stage, for any engine with `save(dir, state)`,
`export_hf(dir, tokenizer_dir)` and `close()`: step checkpoints (periodic, or on a preemption
signal), and the final/ export with its held-out evaluation."""
from __future__ import annotations

import json
import shutil

import torch.distributed as dist

from launch.phases import phase
from launch.preemption import leave_for_requeue, stop_requested
from pipeline.atomic import atomic_write_text
from stages.checkpoint import CheckpointDir
from stages.context import StageContext
from stages.data.examples import read_examples
from stages.eval import evaluate_model_dir


def save_checkpoint(engine, ckpts: CheckpointDir, step: int) -> None:
    with phase("checkpoint"), ckpts.writing(step) as staging:
        engine.save(staging, {"step": step})
        if dist.get_rank() == 0:
            ckpts.seal(step)
        dist.barrier()


def checkpoint_boundary(ctx: StageContext, engine, ckpts: CheckpointDir, step: int) -> None:
    """After `step`: checkpoint every `checkpoint_every` steps and at the end; on a preemption
    signal, checkpoint and leave with the exit code that makes the driver start the stage again."""
    if step % ctx.stage.checkpoint_every == 0 or step == ctx.stage.steps:
        save_checkpoint(engine, ckpts, step)
    elif stop_requested():
        save_checkpoint(engine, ckpts, step)
        ctx.log.info("stopping at step %d on request; the next attempt resumes here", step)
        leave_for_requeue()


def finish(ctx: StageContext, engine, init_dir) -> None:
    """Export final/ (written aside and renamed, so a half-written final/ never exists) and score it."""
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
    cfg = ctx.cfg
    examples = read_examples(ctx.run.task_file("eval"))[: cfg.eval.num_examples]
    ctx.begin_step(ctx.stage.steps + 1)  # the evaluation's own step in the profile
    with phase("eval"):
        result = evaluate_model_dir(final, examples, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    if ctx.is_main:
        atomic_write_text(ctx.run.eval_result(ctx.stage_id), json.dumps(result))
        ctx.log.info("held-out accuracy %.3f on %d examples", result["accuracy"], result["n"])
