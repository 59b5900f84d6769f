"""Trained tokens per second of our stage1_sft (megatron-core + DeepSpeed ZeRO, N ranks) against TRL's
SFTTrainer (one process), on the same base model, the same tokenised curated examples with the same
loss masks (response tokens only), global batch, micro-batch, sequence length, fp32 and total thread
count. Trained tokens are the tokens that get a loss. Prints each repetition, the medians, and
the ratio ours / TRL last.

    python bench/sft_vs_trl.py [--reps 3] [--steps 30] [--warmup 5] [--nproc N] [--threads T] [KEY=VALUE ...]
"""

from __future__ import annotations

import sys

import versus
from versus import Step

STAGE = "stage1_sft"


def ours_steps(rows: list[dict], global_batch: int) -> list[Step]:
    return [
        Step(seconds, {"trained tokens": r["loss_tokens"], "samples": global_batch})
        for seconds, r in zip(versus.step_wall_seconds(rows), rows)
    ]


def peer_worker(run_dir: str, out: str, steps: str) -> None:
    """TRL's SFTTrainer on the run's base model and curated data, one process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    from stages.data.examples import read_examples
    from stages.data.sft_batches import tokenize_examples

    run, cfg, stage, model_dir = versus.peer_setup(run_dir, STAGE)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    samples, _ = tokenize_examples(tokenizer, read_examples(run.task_file("sft")), stage.max_seq_len)
    data = Dataset.from_dict(
        {"input_ids": [s.input_ids for s in samples], "completion_mask": [s.loss_mask for s in samples]}
    )
    args = SFTConfig(
        output_dir=str(run.root / "trl-sft"),
        per_device_train_batch_size=stage.micro_batch_size,
        gradient_accumulation_steps=stage.global_batch_size // stage.micro_batch_size,
        max_steps=int(steps),
        learning_rate=stage.lr,
        lr_scheduler_type="cosine",
        warmup_steps=stage.warmup_steps,
        weight_decay=stage.weight_decay,
        max_grad_norm=stage.grad_clip,
        max_length=stage.max_seq_len + 1,
        completion_only_loss=True,
        **versus.trl_cpu_args(cfg.seed),
    )
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    trained_tokens = [0]

    def take_units() -> dict:
        units = {"trained tokens": trained_tokens[0], "samples": stage.global_batch_size}
        trained_tokens[0] = 0
        return units

    class Trainer(SFTTrainer):
        def compute_loss(self, model, inputs, *args, **kwargs):
            trained_tokens[0] += int((inputs["labels"][:, 1:] != -100).sum())  # label 0 is never predicted
            return super().compute_loss(model, inputs, *args, **kwargs)

    clock = versus.trainer_clock(1, take_units)
    Trainer(model=model, args=args, train_dataset=data, processing_class=tokenizer, callbacks=[clock]).train()
    versus.write_steps(out, clock.steps)


def main() -> None:
    args = versus.parser(__doc__, steps=30, warmup=5).parse_args()
    total = args.warmup + args.steps
    overrides = [
        f"{STAGE}.steps={total}",
        f"{STAGE}.checkpoint_every={total}",
        "eval.num_examples=10",
        *args.overrides,
    ]
    cfg, run = versus.prepare(args.config, args.out, overrides)
    nproc = args.nproc or cfg.nproc
    stage = cfg.stage1_sft
    if stage.dtype != "fp32":
        sys.exit(f"{STAGE}.dtype: the comparison is in fp32, got {stage.dtype}")
    runs = versus.interleaved(
        args.reps,
        lambda: ours_steps(
            versus.run_ours(run, STAGE, nproc, args.threads, args.warmup), stage.global_batch_size
        ),
        lambda: versus.run_peer(__file__, run, args.threads, [str(total)]),
    )
    setup = (
        f"{STAGE} vs TRL SFTTrainer: global batch {stage.global_batch_size}, "
        f"micro {stage.micro_batch_size}, "
        f"max_seq_len {stage.max_seq_len}, {stage.dtype}; "
        f"ours {nproc} ranks x {max(1, args.threads // nproc)} "
        f"threads, TRL 1 process x {args.threads} threads; {args.steps} steps after {args.warmup} warm-up"
    )
    versus.compare(runs, args.warmup, ["trained tokens", "samples"], "trained tokens", setup)


if __name__ == "__main__":
    if sys.argv[1:2] == [versus.PEER_FLAG]:
        peer_worker(*sys.argv[2:])
    else:
        main()
