"""Samples (and generated tokens) per second of our stage2_grpo (actor and reference as the config's
data_parallel has them, DDP on the default; our decode loop for the rollout; N ranks) against TRL's
GRPOTrainer (one process, HF generate, no vLLM), on the same starting model, prompts, reward
function (ours), prompts per step, group size, max new tokens, temperature, PPO epochs and
mini-batches, clip ratio, KL coefficient (TRL's beta; TRL's KL is k3, ours the config's kl_type),
fp32 and total thread count. A sample is one sampled response; a step is one rollout of prompts x G
responses and the updates on it. Prints each repetition, the medians, and the ratio ours / TRL last.

    python bench/grpo_vs_trl.py [--model HF_DIR] [--reps 3] [--steps 8] [--warmup 2] [--nproc N] [KEY=VALUE ...]

Without --model, the stage-1 model is trained first in the benchmark's run directory (the config's
stage1_sft with --sft-steps steps; reused by later invocations): response lengths, and so the cost of a
step, depend on it.
"""  # noqa: E501 (the usage line, printed by --help as it stands)

from __future__ import annotations

import sys

import versus
from versus import Step

STAGE = "stage2_grpo"


def ours_steps(rows: list[dict], samples: int) -> list[Step]:
    return [
        Step(seconds, {"samples": samples, "generated tokens": r["response_length/mean"] * samples})
        for seconds, r in zip(versus.step_wall_seconds(rows), rows)
    ]


def peer_worker(run_dir: str, out: str, steps: str) -> None:
    """TRL's GRPOTrainer on the run's stage-2 starting model and prompts, with our reward, one process."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from stages.data.examples import read_examples
    from stages.rewards.math_reward import score, start_symbolic_worker

    start_symbolic_worker()  # before the models load, as our trainer does: in neither side's timed steps
    run, cfg, stage, model_dir = versus.peer_setup(run_dir, STAGE)
    prompts = read_examples(run.task_file("prompts"))
    data = Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": ex.prompt}] for ex in prompts],
            "answer": [ex.answer for ex in prompts],
        }
    )
    samples = stage.prompts_per_step * stage.group_size
    updates = stage.mini_batches * stage.ppo_epochs  # optimizer steps per rollout
    args = GRPOConfig(
        output_dir=str(run.root / "trl-grpo"),
        per_device_train_batch_size=samples // stage.mini_batches,
        gradient_accumulation_steps=1,
        steps_per_generation=stage.mini_batches,
        num_iterations=stage.ppo_epochs,
        num_generations=stage.group_size,
        max_completion_length=stage.max_new_tokens,
        temperature=stage.temperature,
        top_p=stage.top_p,
        beta=stage.kl_coef,
        epsilon=stage.clip_ratio,
        loss_type="dapo",
        learning_rate=stage.lr,
        lr_scheduler_type="constant",
        weight_decay=0.0,
        max_grad_norm=stage.grad_clip,
        max_steps=int(steps) * updates,
        **versus.trl_cpu_args(cfg.seed),
    )
    generated = [0]

    def reward(completions, answer, completion_ids, **_):
        generated[0] += sum(len(ids) for ids in completion_ids)
        return [
            score(c[0]["content"], a, format_weight=stage.format_reward).reward
            for c, a in zip(completions, answer)
        ]

    def take_units() -> dict:
        units = {"samples": samples, "generated tokens": generated[0]}
        generated[0] = 0
        return units

    clock = versus.trainer_clock(updates, take_units)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=data,
        processing_class=tokenizer,
        callbacks=[clock],
    ).train()
    versus.write_steps(out, clock.steps)


def stage1_model(run, nproc: int, threads: int) -> None:
    """Train the stage-1 model GRPO starts from, unless the run directory has it."""
    if not (run.final("stage1_sft") / "config.json").is_file():
        print("training the stage-1 model first (once per --out)", flush=True)
        versus.run_ours(run, "stage1_sft", nproc, threads)


def main() -> None:
    p = versus.parser(__doc__, steps=8, warmup=2)
    p.add_argument(
        "--model", help="HF model directory GRPO starts from (default: a stage-1 model trained here)"
    )
    p.add_argument("--sft-steps", type=int, default=300, help="stage-1 steps when --model is not given")
    args = p.parse_args()
    total = args.warmup + args.steps
    start = (
        ["model.source=hf", f"model.path={versus.Path(args.model).resolve()}", f"{STAGE}.init_from=base"]
        if args.model
        else [f"stage1_sft.steps={args.sft_steps}", f"{STAGE}.init_from=stage1_sft"]
    )
    overrides = [
        *start,
        f"{STAGE}.steps={total}",
        f"{STAGE}.checkpoint_every={total}",
        "eval.num_examples=10",
        *args.overrides,
    ]
    cfg, run = versus.prepare(args.config, args.out, overrides)
    nproc = args.nproc or cfg.nproc
    stage = cfg.stage2_grpo
    if stage.kl_coef <= 0:
        sys.exit(f"{STAGE}.kl_coef: the comparison runs with the KL term on, got {stage.kl_coef}")
    if not args.model:
        stage1_model(run, nproc, args.threads)
    samples = stage.prompts_per_step * stage.group_size
    runs = versus.interleaved(
        args.reps,
        lambda: ours_steps(versus.run_ours(run, STAGE, nproc, args.threads, args.warmup), samples),
        lambda: versus.run_peer(__file__, run, args.threads, [str(total)]),
    )
    setup = (
        f"{STAGE} vs TRL GRPOTrainer from {run.model_dir(stage.init_from)}: "
        f"{stage.prompts_per_step} prompts x "
        f"G={stage.group_size}, max_new_tokens {stage.max_new_tokens}, temperature {stage.temperature}, "
        f"{stage.ppo_epochs} PPO epoch(s) x {stage.mini_batches} mini-batches, KL {stage.kl_coef} "
        f"(ours {stage.kl_type}, TRL k3), fp32; "
        f"ours {nproc} ranks x {max(1, args.threads // nproc)} threads, "
        f"TRL 1 process x {args.threads} threads; {args.steps} steps after {args.warmup} warm-up"
    )
    versus.compare(runs, args.warmup, ["samples", "generated tokens"], "samples", setup)


if __name__ == "__main__":
    if sys.argv[1:2] == [versus.PEER_FLAG]:
        peer_worker(*sys.argv[2:])
    else:
        main()
