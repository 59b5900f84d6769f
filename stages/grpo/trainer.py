"""GRPO (stage2_grpo, stage4_grpo): SPMD on torch.distributed. Every rank holds the four roles;
a step is rollout -> reward -> old/reference log-probs -> advantages -> policy update, each in its
named phase, with the phase wall times in the step's metrics. Resumable from the newest valid step
checkpoint: the prompt order and the sampling seeds are functions of (seed, step, rank)."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist
from verl.protocol import DataProto

from runtime.context import StageContext
from runtime.dist import rank_device, set_training_group, training_group
from runtime.group import from_rank0
from runtime.phases import phase
from runtime.preemption import leave_if_requested
from stages.data.examples import read_examples
from stages.data.tokenizer import load_tokenizer
from stages.engines.precision import enable_tf32
from stages.engines.state_dicts import TRAINER_STATE
from stages.grpo.actor import Actor
from stages.grpo.balance import balance_across_ranks
from stages.grpo.difficulty import pass_counts, select_prompts
from stages.grpo.losses import grpo_advantages
from stages.grpo.placement import role_dtype
from stages.grpo.prompts import PromptSchedule, rank_share
from stages.grpo.reference import Reference
from stages.grpo.reward import RuleReward
from stages.grpo.rollout import Rollout
from stages.grpo.split import (
    GENERATED_AT,
    GENERATION_S,
    STEP,
    WEIGHTS_VERSION,
    BatchSender,
    RankSplit,
    SplitGroups,
    StaleBatches,
    batches_generated_at,
    broadcast_weights,
    receive_weights,
    split_groups,
)
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


def build_roles(init_dir, tokenizer, stage, with_rollout: bool = True) -> Roles:
    """Every role, or all but the rollout (a training rank whose batches come from generators)."""
    reward = RuleReward(stage.format_reward)  # first: its scoring process starts while the models load
    return Roles(
        actor=Actor(init_dir, stage),
        reference=Reference(init_dir, stage) if stage.kl_coef > 0 else None,
        rollout=build_rollout(init_dir, tokenizer, stage, stage.old_log_probs == "rollout")
        if with_rollout
        else None,
        reward=reward,
    )


def build_rollout(init_dir, tokenizer, stage, with_log_probs: bool) -> Rollout:
    return Rollout(
        init_dir,
        tokenizer,
        stage.group_size,
        stage.max_new_tokens,
        stage.temperature,
        stage.top_p,
        with_log_probs=with_log_probs,
        dtype=role_dtype(stage),
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
    if stage.rollout_ranks:  # the batch may be stale: how far its behaviour policy is from the old one
        update_stats |= importance_stats(batch, stage.importance_cap)
    return {**rollout_stats(batch), **update_stats}


def importance_stats(batch: DataProto, cap: float | None) -> dict[str, float]:
    """The old-to-behaviour probability ratio over the step's response tokens (all training ranks):
    its mean and max before truncation, and the fraction the cap truncates (0 without a cap)."""
    t = batch.batch
    mask = t["response_mask"].bool()
    ratio = torch.exp((t["old_log_probs"] - t["rollout_log_probs"]).clamp(-20, 20))[mask]
    capped = (ratio > cap).sum().to(ratio.dtype) if cap is not None else ratio.new_tensor(0.0)
    sums = torch.stack([ratio.sum(), capped, ratio.new_tensor(ratio.numel())])
    most = ratio.max() if ratio.numel() else ratio.new_tensor(0.0)
    dist.all_reduce(sums, group=training_group())
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=training_group())
    total, capped, tokens = sums.tolist()
    tokens = max(tokens, 1.0)
    return {
        "importance/mean": total / tokens,
        "importance/max": most.item(),
        "importance/capped": capped / tokens,
    }


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
    dist.all_reduce(sums, group=training_group())
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


def progress_postfix(stats: dict) -> dict:
    return {"reward": f"{stats['reward/mean']:.3f}", "acc": f"{stats['accuracy']:.2f}"}


def run(ctx: StageContext) -> None:
    stage, cfg = ctx.stage, ctx.cfg
    enable_tf32(rank_device())
    init_dir = ctx.run.model_dir(stage.init_from)
    tokenizer = load_tokenizer(init_dir)
    prompts = read_examples(ctx.run.task_file("prompts"))
    if stage.rollout_ranks:
        run_split(ctx, init_dir, tokenizer, PromptSchedule(prompts, stage.prompts_per_step, cfg.seed))
        return
    roles = build_roles(init_dir, tokenizer, stage)
    if stage.max_pass_rate < 1:
        prompts = prompts_to_learn(ctx, roles, prompts)
    schedule = PromptSchedule(prompts, stage.prompts_per_step, cfg.seed)
    samples = {"samples": stage.prompts_per_step * stage.group_size}
    train(
        ctx,
        roles,
        init_dir,
        lambda step: (train_step_at(roles, schedule, stage, cfg.seed, step), samples),
        progress_postfix,
    )


class Generator:
    """A rank of the rollout's own (stage.rollout_ranks, stages/grpo/split.py): per step, the
    trainers' weights in, then the batches of a later step out. The training loop's engine there:
    it has nothing of its own to checkpoint or export."""

    def __init__(self, rollout: Rollout, split: RankSplit, groups: SplitGroups, schedule, stage, seed: int):
        self.rollout, self.split, self.groups = rollout, split, groups
        self.schedule, self.stage, self.seed = schedule, stage, seed
        self.sender = BatchSender(groups.batches)

    def step(self, step: int) -> tuple[dict, dict]:
        stage = self.stage
        steps = batches_generated_at(step, stage.max_staleness, stage.steps)
        if steps:
            with phase("weight_sync"):
                receive_weights(self.rollout.model, self.groups.weights)
        for later in steps:
            global_batch = self.schedule.global_batch(later)
            for trainer in self.split.served(dist.get_rank()):
                prompts = rank_share(global_batch, trainer, self.split.trainers, stage.mini_batches)
                with phase("rollout"):
                    started = time.perf_counter()
                    batch = self.rollout.generate(prompts, sampling_seed(self.seed, later, trainer))
                    # the host's time: sending copies the batch to the host, which waits for the device
                    batch.meta_info.update({STEP: later, WEIGHTS_VERSION: step})
                    self.sender.send(batch, trainer, started)
        if step == stage.steps - 1:
            self.sender.wait()
        return {}, {}

    def save(self, directory, trainer_state: dict) -> None:
        pass

    def load(self, directory) -> dict:
        return json.loads((directory / TRAINER_STATE).read_text())

    def export_hf(self, out_dir, tokenizer_dir) -> None:
        pass

    def close(self) -> None:
        self.sender.wait()
        self.rollout = None


@dataclass
class SplitTrainer:
    """A training rank of a split stage: the roles but the rollout, and the batches its generator
    sent ahead, which a checkpoint keeps."""

    roles: Roles
    batches: StaleBatches
    groups: SplitGroups
    generators: int

    def step(self, step: int) -> dict[str, float]:
        stage = self.roles.actor.stage
        if batches_generated_at(step, stage.max_staleness, stage.steps):
            with phase("weight_sync"), self.roles.actor.gathered_weights() as weights:
                if dist.get_rank() == 0:
                    broadcast_weights(weights, role_dtype(stage), self.groups.weights)
        batch = self.batches.take(step)
        if self.roles.actor.recomputes_old_log_probs:
            batch.pop(batch_keys=["entropy"])  # the actor's forward gives the step's own
        # this trainer's batch's own: taken out, as the trainers' batches are merged when balanced
        meta = {key: batch.meta_info.pop(key) for key in (STEP, WEIGHTS_VERSION, GENERATION_S, GENERATED_AT)}
        stats = learn_from(self.roles, batch, step + 1)
        return {
            **stats,
            "rollout/weights_version": meta[WEIGHTS_VERSION],
            "rollout/staleness": step - meta[WEIGHTS_VERSION],
            "rollout/generation_s": self.generator_seconds(meta[GENERATION_S]),
            "rollout/generated_at": self.first_start(meta[GENERATED_AT]),
        }

    def generator_seconds(self, seconds: float) -> float:
        """A generator's seconds on the step's batches, the mean over generators: the trainers'
        batches' seconds summed (a generator may serve several trainers), over the generators."""
        total = torch.tensor([seconds], dtype=torch.float64, device=rank_device())
        dist.all_reduce(total, group=training_group())
        return total.item() / self.generators

    def first_start(self, started_at: float) -> float:
        """When the first of the step's batches began to be sampled (the timeline's generation)."""
        first = torch.tensor([started_at], dtype=torch.float64, device=rank_device())
        dist.all_reduce(first, op=dist.ReduceOp.MIN, group=training_group())
        return first.item()

    def save(self, directory, trainer_state: dict) -> None:
        self.roles.save(directory, trainer_state)
        stage, done = self.roles.actor.stage, trainer_state["step"]
        ahead = range(done, min(done + stage.max_staleness, stage.steps))
        self.batches.save(directory, list(ahead), dist.get_rank())

    def load(self, directory) -> dict:
        state = self.roles.load(directory)
        self.batches.load(directory, dist.get_rank())
        return state

    def export_hf(self, out_dir, tokenizer_dir) -> None:
        self.roles.export_hf(out_dir, tokenizer_dir)

    def close(self) -> None:
        self.roles.close()


def run_split(ctx: StageContext, init_dir, tokenizer, schedule: PromptSchedule) -> None:
    """The stage with its last stage.rollout_ranks ranks generating, the others training."""
    stage, rank = ctx.stage, dist.get_rank()
    split = RankSplit(dist.get_world_size(), stage.rollout_ranks)
    groups = split_groups(split)
    if split.generates(rank):  # the behaviour policy's log-probs go with every batch
        rollout = build_rollout(init_dir, tokenizer, stage, with_log_probs=True)
        generator = Generator(rollout, split, groups, schedule, stage, ctx.cfg.seed)
        train(ctx, generator, init_dir, generator.step, lambda stats: {})
        return
    set_training_group(groups.training)
    roles = build_roles(init_dir, tokenizer, stage, with_rollout=False)
    trainer = SplitTrainer(roles, StaleBatches(split.source(rank), groups.batches), groups, split.generators)
    samples = {"samples": stage.prompts_per_step * stage.group_size}
    train(ctx, trainer, init_dir, lambda step: (trainer.step(step), samples), progress_postfix)
