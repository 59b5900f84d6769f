"""One forward over a whole batch of prompt+response sequences: per-token log-probabilities of the
response tokens (and their entropy), shared by the actor and the reference."""
from __future__ import annotations

from verl.protocol import DataProto
from verl.utils.torch_functional import entropy_from_logits, logprobs_from_logits


def response_log_probs(model, batch: DataProto, with_entropy: bool = False):
    """(log_probs [b, r], entropy [b, r] or None). Logits are divided by the sampling temperature,
    so the log-probabilities are those of the distribution the rollout sampled from."""
    t = batch.batch
    responses = t["responses"]
    logits = model(input_ids=t["input_ids"], attention_mask=t["attention_mask"], position_ids=t["position_ids"],
                   use_cache=False).logits
    # The logits at position i predict token i + 1: the response's are the r positions before the end.
    logits = logits[:, -responses.shape[1] - 1:-1].float() / batch.meta_info["temperature"]
    entropy = entropy_from_logits(logits) if with_entropy else None
    return logprobs_from_logits(logits, responses), entropy
