"""verl's custom reward function (`reward.custom_reward_function`): our math reward, so that a
verl GRPO stage and a native one score every response the same way.

verl loads this file by path in its reward workers and calls
`compute_score(data_source=, solution_str=, ground_truth=, extra_info=, **reward_kwargs)`; the
repository must be importable there (the job exports PYTHONPATH before Ray starts).
"""

from __future__ import annotations

from stages.rewards.math_reward import score


def compute_score(
    data_source: str, solution_str: str, ground_truth: str, extra_info=None, format_weight: float = 0.1
) -> dict:
    """`score` is the reward; `acc` makes verl report held-out accuracy as its core metric."""
    s = score(solution_str, ground_truth, format_weight=format_weight)
    return {"score": s.reward, "acc": float(s.correct), "format_ok": float(s.format_ok)}
