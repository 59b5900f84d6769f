"""Supervised fine-tuning (stage1_sft, stage3_sft): loss on response tokens only, on the
megatron-core + DeepSpeed engine, resumable from its newest valid step checkpoint."""

from __future__ import annotations

import json
from dataclasses import asdict

from core.atomic import atomic_write_text
from runtime.context import StageContext
from stages.data.examples import read_examples
from stages.data.sft_batches import (
    GlobalBatchOrder,
    Truncation,
    count_loss_tokens,
    micro_batches,
    tokenize_examples,
)
from stages.data.tokenizer import load_tokenizer
from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine
from stages.training_loop import train


def training_file(ctx: StageContext):
    """The curated SFT set, or the dataset a synthesis stage wrote."""
    source = ctx.stage.data
    return ctx.run.task_file("sft") if source == "curated" else ctx.run.synthetic_data(source)


def report_truncation(ctx: StageContext, t: Truncation) -> bool:
    """Log what max_seq_len cut and record it for the manifest (with the refusal, if any); warn on
    the terminal when it truncated most examples. False when the stage refuses to train."""
    field = f"{ctx.stage_id}.max_seq_len"
    ctx.log.info(
        "%d examples, %d longer than %s=%d truncated: %d tokens cut, %d of them response tokens; "
        "%d left without a response token are left out",
        *(t.examples, t.truncated, field, t.max_seq_len, t.tokens_cut, t.response_tokens_cut, t.left_out),
    )
    refusal, warning = t.refusal(field), t.warning(field)
    if warning:
        ctx.log.warning(warning)
        if ctx.is_main:
            print(f"{ctx.stage_id}: warning: {warning}", file=ctx.terminal)
    if ctx.is_main:
        record = {**asdict(t), **({"refused": {"field": field, "message": refusal}} if refusal else {})}
        atomic_write_text(ctx.run.training_data(ctx.stage_id), json.dumps(record, indent=1))
    return refusal is None


def run(ctx: StageContext) -> None:
    stage = ctx.stage
    init_dir = ctx.run.model_dir(stage.init_from)
    tokenizer = load_tokenizer(init_dir)
    samples, truncation = tokenize_examples(tokenizer, read_examples(training_file(ctx)), stage.max_seq_len)
    if not report_truncation(ctx, truncation):
        return  # refused, before any collective: every rank decides alike; the driver says why
    order = GlobalBatchOrder(len(samples), stage.global_batch_size, ctx.cfg.seed)
    engine = MegatronDeepSpeedEngine(init_dir, stage, ctx.cfg.seed)

    def train_step(step: int):
        batch = [samples[i] for i in order.indices(step)]
        local = batch[engine.dp_rank :: engine.dp_size]
        loss_tokens = count_loss_tokens(batch)
        stats = engine.train_step(
            micro_batches(local, tokenizer.pad_token_id, stage.micro_batch_size, one_shape=engine.pipelined),
            loss_tokens,
        )
        tokens = sum(len(s.input_ids) - 1 for s in batch)
        return {**stats, "loss_tokens": loss_tokens}, {"tokens": tokens, "samples": len(batch)}

    train(
        ctx,
        engine,
        init_dir,
        train_step,
        lambda stats: {"loss": f"{stats['loss']:.4f}", "lr": f"{stats['lr']:.2e}"},
    )
