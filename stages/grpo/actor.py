"""The actor role: the policy being trained, sharded over all ranks (FSDP2) or whole on each (DDP;
the stage's data_parallel). It gives the old log-probabilities of a rollout batch and runs the
clipped-surrogate update over several epochs of mini-batches.

The first mini-batch of the first epoch is on-policy: no optimizer step has happened when the update
reaches it, so its old log-probabilities are the update's own forward, detached (verl's on-policy
shortcut). They are taken there, not in a forward of their own before the update; later epochs
reuse them. With `old_log_probs: rollout` the actor computes no old log-probabilities at all: the
rollout's are used (verl's bypass mode)."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
import torch.distributed as dist
from verl.protocol import DataProto

from core.config import GRPOStage
from runtime.dist import training_group
from stages.engines import ddp, fsdp2, state_dicts
from stages.grpo.logprobs import micro_batch_log_probs, response_log_probs, update_micro_batches
from stages.grpo.losses import actor_loss, policy_loss_config
from stages.grpo.placement import load_role_model, role_dtype


class Actor:
    def __init__(self, model_dir: Path, stage: GRPOStage):
        self.stage = stage
        self.sharded = stage.data_parallel == "fsdp2"
        self.model = load_role_model(model_dir, stage, trainable=True)
        # fused: one kernel over all parameters; the default loops over them, op by op (for FSDP2, through
        # DTensor's per-shard dispatch, which made clip + step ~3x slower)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=stage.lr, weight_decay=0.0, fused=True)
        self.loss_config = policy_loss_config(stage.clip_ratio, stage.group_size)
        self.recomputes_old_log_probs = stage.old_log_probs == "actor"
        # Batches from ranks of their own may be stale: corrected towards the old policy.
        self.importance_cap = stage.importance_cap if stage.rollout_ranks else None
        if self.sharded and stage.shares_prompts:
            # A backward over shared prompts differentiates each layer twice (the responses' forward,
            # then the prompts'); kept gathered after the first, the layer needs no second all-gather.
            # The update reshards by hand once the backward is done.
            self.model.set_reshard_after_backward(False)

    @torch.no_grad()
    def compute_log_prob(self, batch: DataProto) -> DataProto:
        """Old log-probs and entropy of every mini-batch but the first, which the update fills in
        (NaN until then, so that a use before it shows)."""
        first = len(batch) // self.stage.mini_batches
        responses = batch.batch["responses"]
        out = {
            key: torch.full(responses.shape, float("nan"), device=responses.device)
            for key in ("old_log_probs", "entropy")
        }
        if first < len(batch):
            out["old_log_probs"][first:], out["entropy"][first:] = response_log_probs(
                self.model,
                batch[first:],
                with_entropy=True,
                micro_batch_size=self.stage.micro_batch_size,
                share_prompts=self.stage.shares_prompts,
            )
        return DataProto.from_dict(tensors=out)

    def update(self, batch: DataProto, iteration: int) -> dict[str, float]:
        """ppo_epochs passes over the batch, one optimizer step per mini-batch; returns the means of
        the losses, KL, clip fraction and gradient norm over the steps (and ranks). The learning
        rate is a function of the iteration (1-based), so a resumed run needs no scheduler state."""
        self._set_lr(self.stage.lr * min(1.0, iteration / max(self.stage.warmup_steps, 1)))
        totals: dict[str, torch.Tensor] = {}
        world = dist.get_world_size(training_group())
        for epoch in range(self.stage.ppo_epochs):
            for index, mini in enumerate(batch.chunk(self.stage.mini_batches)):
                on_policy = self.recomputes_old_log_probs and epoch == 0 and index == 0
                stats = self._accumulate_gradients(mini, on_policy, world)
                if self.sharded and self.stage.shares_prompts:
                    fsdp2.reshard(
                        self.model
                    )  # before the step: it updates the shards, which the next forward gathers
                grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.stage.grad_clip)
                self.optimizer.step()
                self.optimizer.zero_grad(set_to_none=True)
                stats["grad_norm"] = (
                    grad_norm.full_tensor() if self.sharded else grad_norm
                )  # FSDP2's: a DTensor
                for key, value in stats.items():
                    totals[key] = totals.get(key, 0.0) + value.detach().float()
        # Every statistic's sum over ranks / ranks is its global value: the losses are this rank's
        # share of a global token mean, the clip fraction a per-rank mean, the norm the same everywhere.
        names = sorted(totals)
        summed = torch.stack([totals[k] for k in names])
        dist.all_reduce(summed, group=training_group())
        updates = self.stage.ppo_epochs * self.stage.mini_batches
        return {f"actor/{k}": v / (updates * world) for k, v in zip(names, summed.tolist())}

    def _accumulate_gradients(self, mini: DataProto, on_policy: bool, world: int) -> dict[str, torch.Tensor]:
        """Forward and backward one micro-batch at a time, so that only one micro-batch's activations
        are ever alive: each loss is its share of the mini-batch's global token mean, and the summed
        gradient the whole mini-batch's. The statistics are the mini-batch's (the clip fraction a
        mean over this rank's tokens). On policy, the forwards' own log-probs become the old ones."""
        mask = mini.batch["response_mask"]
        global_tokens = mask.sum()
        dist.all_reduce(global_tokens, group=training_group())
        global_tokens, rank_tokens = int(global_tokens.clamp(min=1)), mask.sum().clamp(min=1)
        groups = update_micro_batches(
            mini, self.stage.micro_batch_size, self.stage.shares_prompts, self.sharded
        )
        totals: dict[str, torch.Tensor] = {}
        for i, rows in enumerate(groups):
            with self._gradient_sync(last=i == len(groups) - 1):
                micro = mini.select_idxs(rows)
                stats = self._backward(mini, micro, rows, on_policy, global_tokens, world)
            stats["clip_frac"] = stats["clip_frac"] * micro.batch["response_mask"].sum() / rank_tokens
            for key, value in stats.items():
                totals[key] = totals.get(key, 0.0) + value
        return totals

    def _backward(self, mini, micro, rows, on_policy: bool, global_tokens: int, world: int) -> dict:
        """One micro-batch's forward and backward (`micro`: the `rows` of `mini`); its statistics."""
        log_prob, entropy = micro_batch_log_probs(self.model, micro, on_policy, self.stage.shares_prompts)
        if on_policy:  # into the batch (mini is a view of it) for the later epochs
            for key, value in (("old_log_probs", log_prob.detach()), ("entropy", entropy)):
                mini.batch[key][rows] = micro.batch[key] = value
        loss, stats = actor_loss(
            log_prob,
            micro,
            self.loss_config,
            self.stage.kl_coef,
            self.stage.kl_type,
            global_tokens,
            world,
            self.importance_cap,
        )
        loss.backward()
        return stats

    def _gradient_sync(self, last: bool):
        """DDP all-reduces in the last micro-batch's backward only (its gradients are whole on every
        rank anyway). FSDP2 reduce-scatters in every backward: without, every layer's unsharded
        gradient, the whole model's, would stay until the last one."""
        return contextlib.nullcontext() if self.sharded or last else self.model.no_sync()

    def _set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def gathered_weights(self):
        """A context: the policy's parameters whole, by name, inside it (every rank enters it)."""
        return (fsdp2 if self.sharded else ddp).gathered_parameters(self.model)

    def save(self, directory: Path, trainer_state: dict) -> None:
        state_dicts.save_checkpoint(self.model, self.optimizer, directory, trainer_state)

    def load(self, directory: Path) -> dict:
        return state_dicts.load_checkpoint(self.model, self.optimizer, directory)

    def export_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        state_dicts.export_hf(self.model, out_dir, tokenizer_dir, role_dtype(self.stage))

    def close(self) -> None:
        """Free the sharded policy and its optimizer state before final/ is evaluated."""
        self.model = self.optimizer = None
