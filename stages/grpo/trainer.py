"""GRPO (stage2_grpo, stage4_grpo): SPMD on torch.distributed. Every rank holds the four roles;
a step is rollout -> reward -> old/reference log-probs -> advantages -> policy update, each in its
named phase, with the phase wall times in the step's metrics. Resumable from the newest valid step
checkpoint: the prompt order and the sampling seeds are functions of (seed, step, rank)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from verl.protocol import DataProto

from runtime.context import StageContext
from runtime.dist import rank_device
from runtime.group import from_rank0
from runtime.phases import phase
from runtime.preemption import leave_if_requested
from stages.data.examples import read_examples
from stages.data.tokenizer import load_tokenizer
from stages.engines.precision import enable_tf32
from stages.grpo.actor import Actor
from stages.grpo.balance import balance_across_ranks
from stages.grpo.difficulty import pass_counts, select_prompts
from stages.grpo.losses import grpo_advantages
from stages.grpo.placement import role_dtype
from stages.grpo.prompts import PromptSchedule, rank_share
from stages.grpo.reference import Reference
from stages.grpo.reward import RuleReward
from stages.grpo.rollout import Rollout
from stages.kept import MISSING, inputs_fingerprint, load_record, save_record
from stages.training_loop import train


@dataclass
class Roles:
    actor: Actor
    reference: Reference | None  # None when kl_coef is 0
    rollout: Rollout | None  # None where a test feeds fixed rollout batches
    reward: RuleReward

    # The training loop's engine: checkpoints and final/ are the actor's.
    def save(self, directory, trainer_state: dict) -> None:
        self.actor.save(directory, trainer_state)

    def load(self, directory) -> dict:
        return self.actor.load(directory)

    def export_hf(self, out_dir, tokenizer_dir) -> None:
        self.actor.export_hf(out_dir, tokenizer_dir)

    def close(self) -> None:
        """Free every role's model before final/ is evaluated on the same devices."""
        self.actor.close()
        self.reference = self.rollout = None


def build_roles(init_dir, tokenizer, stage) -> Roles:
    reward = RuleReward(stage.format_reward)  # first: its scoring process starts while the models load
    return Roles(
        actor=Actor(init_dir, stage),
        reference=Reference(init_dir, stage) if stage.kl_coef > 0 else None,
        rollout=Rollout(
            init_dir,
            tokenizer,
            stage.group_size,
            stage.max_new_tokens,
            stage.temperature,
            stage.top_p,
            with_log_probs=stage.old_log_probs == "rollout",
            dtype=role_dtype(stage),
        ),
        reward=reward,
    )


def sampling_seed(seed: int, step: int, rank: int) -> int:
    """A distinct, reproducible sampling stream per (run seed, step, rank)."""
    return (seed * 1_000_003 + step) * 65_537 + rank


def train_step(roles: Roles, prompts, seed: int, iteration: int) -> dict[str, float]:
    with phase("weight_sync"), roles.actor.gathered_weights() as weights:
        roles.rollout.load_weights(weights)
    with phase("rollout"):
        batch = roles.rollout.generate(prompts, seed)
    return learn_from(roles, batch, iteration)


def train_step_at(roles: Roles, schedule: PromptSchedule, stage, seed: int, step: int) -> dict[str, float]:
    """Step `step` (0-based) of the stage: this rank's share of the step's prompts, sampled from the
    seed stream of (seed, step, rank), so that a resumed run repeats it exactly."""
    rank, world = dist.get_rank(), dist.get_world_size()
    prompts = rank_share(schedule.global_batch(step), rank, world, stage.mini_batches)
    return train_step(roles, prompts, sampling_seed(seed, step, rank), step + 1)


def learn_from(roles: Roles, batch: DataProto, iteration: int) -> dict[str, float]:
    """Everything after the rollout: score, balance the rows over the ranks, log-probs, advantages,
    update. The reference goes first: once its layers stay gathered (reshard_after_forward false) it
    makes no collective call, so without balancing a rank whose rollout ended early works on it
    instead of waiting for the others in the actor's first all-gather."""
    stage = roles.actor.stage
    with phase("reward"):
        batch = batch.union(roles.reward(batch))
    if stage.balance_batch:
        with phase("balance"):
            batch = balance_across_ranks(batch, stage.mini_batches, stage.group_size)
    if roles.reference is not None:
        with phase("reference_logprob"):
            batch = batch.union(roles.reference.compute_ref_log_prob(batch))
    if roles.actor.recomputes_old_log_probs:
        with phase("policy_logprob"):
            batch = batch.union(roles.actor.compute_log_prob(batch))
    else:  # verl's bypass mode: the rollout's log-probs are the old policy's
        batch.batch["old_log_probs"] = batch.batch["rollout_log_probs"]
    with phase("advantage"):
        batch = batch.union(grpo_advantages(batch))
    with phase("policy_update"):
        update_stats = roles.actor.update(batch, iteration)
    return {**rollout_stats(batch), **update_stats}


def rollout_stats(batch: DataProto) -> dict[str, float]:
    """Reward mean/std, accuracy, format rate, response length and policy entropy over all ranks."""
    t, nt = batch.batch, batch.non_tensor_batch
    rewards = t["token_level_rewards"].sum(dim=1)
    mask = t["response_mask"].float()
    sums = torch.stack(
        [
            torch.tensor(float(len(batch))),
            rewards.sum().cpu(),
            rewards.square().sum().cpu(),
            torch.tensor(float(nt["correct"].sum())),
            torch.tensor(float(nt["format_ok"].sum())),
            mask.sum().cpu(),
            (t["entropy"] * mask).sum().cpu(),
        ]
    ).to(rewards.device)
    dist.all_reduce(sums)
    n, r, r2, correct, well_formed, tokens, entropy = sums.tolist()
    mean = r / n
    return {
        "reward/mean": mean,
        "reward/std": max(r2 / n - mean * mean, 0.0) ** 0.5,
        "accuracy": correct / n,
        "format_rate": well_formed / n,
        "response_length/mean": tokens / n,
        "entropy": entropy / max(tokens, 1),
    }


def prompts_to_learn(ctx: StageContext, roles: Roles, prompts: list) -> list:
    """The prompts the starting model solves at most max_pass_rate of the time (stages/grpo/difficulty.py)."""
    stage = ctx.stage
    counts = kept_pass_counts(ctx, roles, prompts)
    kept = select_prompts(
        prompts,
        counts,
        stage.group_size,
        stage.max_pass_rate,
        stage.prompts_per_step,
        f"{ctx.stage_id}.max_pass_rate",
    )
    ctx.log.info(
        "training on the %d of %d prompts the starting model solves at most %g of the time "
        "(%d answers each; mean pass rate %.3f)",
        len(kept),
        len(prompts),
        stage.max_pass_rate,
        stage.group_size,
        sum(counts) / (len(prompts) * stage.group_size),
    )
    return kept


def kept_pass_counts(ctx: StageContext, roles: Roles, prompts: list) -> list[int]:
    """The prompts' pass counts, sampled once a stage: kept for its later attempts (a requeued job
    starts training at once), sampled again where the kept ones are of other inputs. A signal
    that came while sampling stops the stage once they are kept."""
    stage, run, rank = ctx.stage, ctx.run, dist.get_rank()
    path = run.prompt_selection(ctx.stage_id)

    def kept():  # decided by rank 0, so that every rank samples or none does
        init_dir = run.model_dir(stage.init_from)
        fingerprint = inputs_fingerprint(
            stage, ctx.cfg.seed, init_dir, run.task_file("prompts"), world_size=dist.get_world_size()
        )
        counts, problem = load_record(path, fingerprint)
        if problem not in (None, MISSING):
            ctx.log.warning("the kept prompt selection %s is not used, %s: sampled again", path, problem)
        return fingerprint, counts

    fingerprint, counts = from_rank0(kept)
    if counts is not None:
        ctx.log.info("prompt selection's pass counts kept from an earlier attempt (%s)", path)
        return counts
    with phase("prompt_selection"):
        # seeded past the stage's steps: no training rollout draws the same stream
        counts = pass_counts(
            roles.rollout, prompts, lambda call: sampling_seed(ctx.cfg.seed, stage.steps + 1 + call, rank)
        )
    if ctx.is_main:
        save_record(path, fingerprint, counts)
    leave_if_requested(ctx.log, "after prompt selection (its pass counts are kept)")
    return counts


def run(ctx: StageContext) -> None:
    stage, cfg = ctx.stage, ctx.cfg
    enable_tf32(rank_device())
    init_dir = ctx.run.model_dir(stage.init_from)
    tokenizer = load_tokenizer(init_dir)
    roles = build_roles(init_dir, tokenizer, stage)
    prompts = read_examples(ctx.run.task_file("prompts"))
    if stage.max_pass_rate < 1:
        prompts = prompts_to_learn(ctx, roles, prompts)
    schedule = PromptSchedule(prompts, stage.prompts_per_step, cfg.seed)
    samples = {"samples": stage.prompts_per_step * stage.group_size}
    train(
        ctx,
        roles,
        init_dir,
        lambda step: (train_step_at(roles, schedule, stage, cfg.seed, step), samples),
        lambda stats: {"reward": f"{stats['reward/mean']:.3f}", "acc": f"{stats['accuracy']:.2f}"},
    )
