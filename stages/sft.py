"""Supervised fine-tuning (stage1_sft, stage3_sft): loss on response tokens only, on the
megatron-core + DeepSpeed engine, resumable from its newest valid step checkpoint."""

from __future__ import annotations

from transformers import AutoTokenizer

from runtime.context import StageContext
from stages.data.examples import read_examples
from stages.data.sft_batches import GlobalBatchOrder, count_loss_tokens, micro_batches, tokenize_examples
from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine
from stages.training_loop import train


def training_file(ctx: StageContext):
    """The curated SFT set, or the dataset a synthesis stage wrote."""
    source = ctx.stage.data
    return ctx.run.task_file("sft") if source == "curated" else ctx.run.synthetic_data(source)


def run(ctx: StageContext) -> None:
    stage = ctx.stage
    init_dir = ctx.run.model_dir(stage.init_from)
    tokenizer = AutoTokenizer.from_pretrained(init_dir)
    samples = tokenize_examples(tokenizer, read_examples(training_file(ctx)), stage.max_seq_len)
    order = GlobalBatchOrder(len(samples), stage.global_batch_size, ctx.cfg.seed)
    engine = MegatronDeepSpeedEngine(init_dir, stage, ctx.cfg.seed)

    def train_step(step: int):
        batch = [samples[i] for i in order.indices(step)]
        local = batch[engine.dp_rank :: engine.dp_size]
        loss_tokens = count_loss_tokens(batch)
        stats = engine.train_step(
            micro_batches(local, tokenizer.pad_token_id, stage.micro_batch_size), loss_tokens
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
