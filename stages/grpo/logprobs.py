"""Forwards over prompt+response sequences: per-token log-probabilities of the response tokens (and
their entropy), shared by the actor and the reference.

A batch can be forwarded in length-sorted micro-batches: rows sorted by response length, cut into
groups of `micro_batch_size`, each forwarded only up to its own longest response. Responses end at
different lengths and the rollout pads them all to the longest, so one forward over the whole batch
spends much of its time on padding; the right padding cut away changes nothing (attention is causal)."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from verl.protocol import DataProto
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits

INPUTS = ("input_ids", "attention_mask", "position_ids")


def response_log_probs(model, batch: DataProto, with_entropy: bool = False, micro_batch_size: int | None = None):
    """(log_probs [b, r], entropy [b, r] or None), in the batch's row order; positions past each
    micro-batch's longest response are 0. Logits are divided by the sampling temperature, so the
    log-probabilities are those of the distribution the rollout sampled from. The entropy carries no
    gradient (it is a statistic)."""
    t, temperature = batch.batch, batch.meta_info["temperature"]
    width = t["responses"].shape[1]
    if micro_batch_size is None or micro_batch_size >= len(batch):
        return _forward(model, t, torch.arange(len(batch)), width, temperature, with_entropy)
    order = torch.argsort(t["response_mask"].sum(dim=1), descending=True, stable=True)
    pieces = [_forward(model, t, rows, width, temperature, with_entropy) for rows in order.split(micro_batch_size)]
    restore = torch.empty_like(order)
    restore[order] = torch.arange(len(order))
    log_probs = torch.cat([lp for lp, _ in pieces])[restore]
    return log_probs, torch.cat([e for _, e in pieces])[restore] if with_entropy else None


def _forward(model, t, rows: torch.Tensor, width: int, temperature: float, with_entropy: bool):
    """The rows' log-probs (and entropy), forwarded up to their longest response, zero-padded to `width`."""
    length = max(int(t["response_mask"][rows].sum(dim=1).max()), 1)
    cut = t["input_ids"].shape[1] - width + length  # prompt columns + the longest response here
    inputs = {key: t[key][rows, :cut] for key in INPUTS}
    logits = model(**inputs, use_cache=False).logits
    # The logits at position i predict token i + 1: the response's are the `length` positions before the end.
    logits = logits[:, -length - 1:-1].float() / temperature
    log_probs = F.pad(logprobs_from_logits(logits, t["responses"][rows, :length]), (0, width - length))
    if not with_entropy:
        return log_probs, None
    with torch.no_grad():
        return log_probs, F.pad(entropy_from_logits(logits.detach()), (0, width - length))
