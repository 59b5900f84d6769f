"""Supervised fine-tuning (stage1_sft, stage3_sft): loss on response tokens only, on the
megatron-core + DeepSpeed engine, resumable from its newest valid step checkpoint."""
from __future__ import annotations

import time

from transformers import AutoTokenizer

from stages.checkpoint import CheckpointDir, agreed_resume_step
from stages.context import StageContext
from stages.data.examples import read_examples
from stages.data.sft_batches import GlobalBatchOrder, count_loss_tokens, micro_batches, tokenize_examples
from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine
from stages.handoff import checkpoint_boundary, finish
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
        ctx.begin_step(step + 1)
        started, started_wall = time.perf_counter(), time.time()
        batch = [samples[i] for i in order.indices(step)]
        local = batch[engine.dp_rank::engine.dp_size]
        loss_tokens = count_loss_tokens(batch)
        stats = engine.train_step(micro_batches(local, tokenizer.pad_token_id, stage.micro_batch_size), loss_tokens)
        step += 1
        elapsed = time.perf_counter() - started
        tokens = sum(len(s.input_ids) - 1 for s in batch)
        metrics.log_step(step, {**stats, "loss_tokens": loss_tokens}, started_wall, elapsed,
                         {"tokens": tokens, "samples": len(batch)})
        bar.set_postfix(loss=f"{stats['loss']:.4f}", lr=f"{stats['lr']:.2e}", refresh=False)
        bar.update()
        checkpoint_boundary(ctx, engine, ckpts, step)
    bar.close()
    metrics.close()
    ctx.log.info("training done at step %d", step)
    finish(ctx, engine, init_dir)

