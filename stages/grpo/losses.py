"""GRPO's arithmetic, all from verl's core_algos: group-normalised outcome advantages, the clipped
surrogate ("vanilla" registered policy loss) and the KL penalty against the reference.

Losses are token means over the whole global mini-batch: each rank divides its token sum by the
global token count and multiplies by the number of ranks, so that FSDP's gradient average over
ranks gives exactly the one-rank gradient.
"""

from __future__ import annotations

import numpy as np
import torch
from verl.protocol import DataProto
from verl.trainer.ppo.core_algos import (
    agg_loss,
    compute_grpo_outcome_advantage,
    get_policy_loss_fn,
    kl_penalty,
)
from verl.trainer.ppo.rollout_corr_helper import compute_rollout_correction_weights
from verl.workers.config.actor import ActorConfig

TOKEN_MEAN = "token-mean"


def grpo_advantages(batch: DataProto) -> DataProto:
    """(reward - group mean) / group std, one value for every token of a response."""
    advantages, _ = compute_grpo_outcome_advantage(
        batch.batch["token_level_rewards"],
        batch.batch["response_mask"],
        np.asarray(batch.non_tensor_batch["uid"]),
    )
    return DataProto.from_dict(tensors={"advantages": advantages})


def policy_loss_config(clip_ratio: float, group_size: int) -> ActorConfig:
    """The few fields of verl's ActorConfig that its policy losses read (the rest are for verl's
    own trainer; the micro-batch size only satisfies its validation)."""
    return ActorConfig(
        strategy="fsdp2",
        rollout_n=group_size,
        ppo_micro_batch_size_per_gpu=1,
        clip_ratio=clip_ratio,
        clip_ratio_low=clip_ratio,
        clip_ratio_high=clip_ratio,
        loss_agg_mode=TOKEN_MEAN,
        use_torch_compile=False,
    )


def actor_loss(
    log_prob: torch.Tensor,
    batch: DataProto,
    config: ActorConfig,
    kl_coef: float,
    kl_type: str,
    global_tokens: int,
    world: int,
    importance_cap: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate + kl_coef * KL(policy || reference) on this rank's part of a mini-batch;
    with `importance_cap`, each token's surrogate weighted by truncated_importance_weights."""
    t = batch.batch
    mask = t["response_mask"]
    config.global_batch_info.update(dp_size=world, batch_num_tokens=global_tokens)
    weights = None if importance_cap is None else truncated_importance_weights(batch, importance_cap)
    pg_loss, pg_metrics = get_policy_loss_fn("vanilla")(
        t["old_log_probs"], log_prob, t["advantages"], mask, TOKEN_MEAN, config, rollout_is_weights=weights
    )
    clip_frac = torch.tensor(pg_metrics["actor/pg_clipfrac"], device=mask.device)
    stats = {"pg_loss": pg_loss.detach(), "clip_frac": clip_frac}
    if "ref_log_probs" not in t.keys():  # kl_coef == 0: no reference model
        return pg_loss, stats
    kl = agg_loss(
        kl_penalty(log_prob, t["ref_log_probs"], kl_type),
        mask,
        TOKEN_MEAN,
        dp_size=world,
        batch_num_tokens=global_tokens,
    )
    return pg_loss + kl_coef * kl, {**stats, "kl": kl.detach()}


def truncated_importance_weights(batch: DataProto, cap: float) -> torch.Tensor:
    """min(pi_old / pi_behaviour, cap) per response token (0 on padding): the old policy's
    log-probs against those the rollout sampled with (verl's token-level TIS)."""
    t = batch.batch
    log_ratio = t["old_log_probs"] - t["rollout_log_probs"]
    weights, _ = compute_rollout_correction_weights(log_ratio, t["response_mask"], "token", cap)
    return weights
