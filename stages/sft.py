"""Supervised fine-tuning (stage1_sft, stage3_sft): loss on response tokens only, on the
megatron-core + DeepSpeed engine, resumable from its newest valid step checkpoint."""
from __future__ import annotations

import json
import shutil
import time

import torch.distributed as dist
from transformers import AutoTokenizer

from launch.preemption import PREEMPTED_EXIT, stop_requested
from pipeline.atomic import atomic_write_text
from stages.checkpoint import CheckpointDir, agreed_resume_step
from stages.context import StageContext
from stages.data.examples import read_examples
from stages.data.sft_batches import GlobalBatchOrder, count_loss_tokens, micro_batches, tokenize_examples
from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine
from stages.eval import evaluate_model_dir
from stages.metrics import MetricsLogger


def training_file(ctx: StageContext):
    """The curated SFT set, or the dataset a synthesis stage wrote."""
    source = ctx.stage.data
    return ctx.run.task_file("sft") if source == "curated" else ctx.run.synthetic_data(source)


def run(ctx: StageContext) -> None:
    stage, run = ctx.stage, ctx.run
    init_dir = run.model_dir(stage.init_from)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    samples = tokenize_examples(tokenizer, read_examples(training_file(ctx)), stage.max_seq_len)
    order = GlobalBatchOrder(len(samples), stage.global_batch_size, ctx.cfg.seed)

    engine = MegatronDeepSpeedEngine(init_dir, stage, ctx.cfg.seed)
    ckpts = CheckpointDir(run.ckpt(ctx.stage_id), keep=stage.keep_checkpoints)
    step = 0
    resume = agreed_resume_step(ckpts)
    if resume is not None:
        step = engine.load(ckpts.root / f"step-{resume:06d}")["step"]
        ctx.log.info("resumed from step %d", step)
    metrics = MetricsLogger(run.metrics(ctx.stage_id), ctx.is_main, step, ctx.cfg.wandb.mode, ctx.cfg.wandb.project,
                            f"{run.root.name}/{ctx.stage_id}", ctx.cfg.model_dump(mode="json"))
    bar = ctx.progress(stage.steps, initial=step)
    while step < stage.steps:
        started = time.perf_counter()
        batch = [samples[i] for i in order.indices(step)]
        local = batch[engine.dp_rank::engine.dp_size]
        stats = engine.train_step(micro_batches(local, tokenizer.pad_token_id, stage.micro_batch_size),
                                  count_loss_tokens(batch))
        step += 1
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.input_ids) - 1 for s in batch)
        metrics.log(step, {**stats, "step_time_s": elapsed, "tokens_per_s": tokens / elapsed})
        bar.update()
        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}")
        if step % stage.checkpoint_every == 0 or step == stage.steps:
            save_checkpoint(engine, ckpts, step)
        elif stop_requested():
            save_checkpoint(engine, ckpts, step)
            ctx.log.info("stopping at step %d on request; the next attempt resumes here", step)
            raise SystemExit(PREEMPTED_EXIT)
    bar.close()
    metrics.close()
    finish(ctx, engine, init_dir)


def save_checkpoint(engine: MegatronDeepSpeedEngine, ckpts: CheckpointDir, step: int) -> None:
    engine.save(ckpts.staging(step), {"step": step})
    if dist.get_rank() == 0:
        ckpts.seal(step)
    dist.barrier()


def finish(ctx: StageContext, engine: MegatronDeepSpeedEngine, init_dir) -> None:
    """Export final/ (written aside and renamed, so a half-written final/ never exists) and score it."""
    final = ctx.run.final(ctx.stage_id)
    staging = final.with_name("final.tmp")
    engine.export_hf(staging, tokenizer_dir=init_dir)
    if ctx.is_main:
        if final.exists():
            shutil.rmtree(final)
        staging.rename(final)
    dist.barrier()
    engine.close()
    cfg = ctx.cfg
    examples = read_examples(ctx.run.task_file("eval"))[: cfg.eval.num_examples]
    result = evaluate_model_dir(final, examples, cfg.eval.max_new_tokens, cfg.eval.batch_size)
    if ctx.is_main:
        atomic_write_text(ctx.run.eval_result(ctx.stage_id), json.dumps(result))
        ctx.log.info("held-out accuracy %.3f on %d examples", result["accuracy"], result["n"])
