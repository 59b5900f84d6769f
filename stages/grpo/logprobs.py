"""Forwards over prompt+response sequences: per-token log-probabilities of the response tokens (and
their entropy), shared by the actor and the reference.

The G responses of a group share their prompt (the same tokens with the same left padding: the
rollout pads the whole batch together), so each distinct prompt can be forwarded once, keeping its
keys and values, and the responses forwarded against copies of them. The copies are index_selects:
the gradient of every response flows back into the one prompt forward, summed over its group. That
prompt forward is one more forward call on the model: where FSDP2 reshards its layers after every
forward, one more all-gather of every layer (and in the update, one more in the backward), so the
roles share prompts only where the layers are kept gathered. FSDP2 still reduce-scatters each
gradient once a backward: a parameter's gradient is accumulated once, after every forward call that
used it has been differentiated, and the post-backwards before that find no gradient to reduce.

A batch is forwarded in length-sorted micro-batches (`micro_batches`), each only up to its own
longest response. Responses end at different lengths and the rollout pads them all to the longest,
so one forward over the whole batch spends much of its time on padding; the right padding cut away
changes nothing (attention is causal)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from transformers import DynamicCache
from verl.protocol import DataProto
from verl.utils.torch_functional import entropy_from_logits

from runtime.dist import training_group
from stages.engines.ddp import unwrapped

INPUTS = ("input_ids", "attention_mask", "position_ids")
# Logits one logsumexp call reduces at most. Without flash-attn, verl's `logprobs_from_logits` bounds
# the memory of the reduction by calling it once a row (a call and its backward per row and pass);
# chunks of this size bound it as well in far fewer calls: a micro-batch of the default is one.
LOGSUMEXP_CHUNK_BYTES = 256 << 20


def response_log_probs(
    model,
    batch: DataProto,
    with_entropy: bool = False,
    micro_batch_size: int | None = None,
    share_prompts: bool = True,
):
    """(log_probs [b, r], entropy [b, r] or None), in the batch's row order; positions past each
    micro-batch's longest response are 0. Logits are divided by the sampling temperature, so the
    log-probabilities are those of the distribution the rollout sampled from. The entropy carries no
    gradient (it is a statistic). Without `share_prompts` (for models whose layers are gathered again
    in every forward) every row is forwarded whole and micro-batches are cut by count only: each
    more forward would cost one more all-gather of the model."""
    t, temperature = batch.batch, batch.meta_info["temperature"]
    width = t["responses"].shape[1]
    prompts = SharedPrompts.forward(model, t) if share_prompts else None
    lengths = t["response_mask"].sum(dim=1)
    groups = micro_batches(lengths, micro_batch_size or len(batch), cut_where_halved=share_prompts)
    if not share_prompts:  # layers gathered in every forward: every rank must make as many
        groups = split_to(groups, most_over_ranks(len(groups), lengths.device))
    pieces = [_forward(model, t, prompts, rows, width, temperature, with_entropy) for rows in groups]
    order = torch.cat(groups)
    restore = torch.empty_like(order)
    restore[order] = torch.arange(len(order), device=order.device)
    log_probs = torch.cat([lp for lp, _ in pieces])[restore]
    return log_probs, torch.cat([e for _, e in pieces])[restore] if with_entropy else None


def update_micro_batches(batch: DataProto, micro_batch_size: int, share_prompts: bool, sharded: bool):
    """The rows of each micro-batch the update differentiates on its own, cut as response_log_probs
    cuts them. `sharded` (FSDP2): every backward reduce-scatters, so every rank makes as many."""
    lengths = batch.batch["response_mask"].sum(dim=1)
    groups = micro_batches(lengths, micro_batch_size, cut_where_halved=share_prompts)
    return split_to(groups, most_over_ranks(len(groups), lengths.device)) if sharded else groups


def micro_batch_log_probs(model, micro: DataProto, with_entropy: bool, share_prompts: bool):
    """response_log_probs of one micro-batch forwarded on its own, its distinct prompts included:
    the update differentiates each micro-batch before the next, so nothing of one outlives it."""
    t = micro.batch
    prompts = SharedPrompts.forward(model, t) if share_prompts else None
    rows = torch.arange(len(micro), device=t["responses"].device)
    width, temperature = t["responses"].shape[1], micro.meta_info["temperature"]
    return _forward(model, t, prompts, rows, width, temperature, with_entropy)


def micro_batches(lengths: torch.Tensor, max_rows: int, cut_where_halved: bool = True) -> list[torch.Tensor]:
    """The rows of each micro-batch, by response length, longest first: at most `max_rows` a
    micro-batch, and (`cut_where_halved`) a row less than half as long as its micro-batch's longest
    starts the next one (with them, it would be mostly padding). GRPO's responses often fall into a
    short and a long kind (an answer alone, or worked out first): cut by count alone, a micro-batch
    straddling the two would forward mostly padding."""
    order = torch.argsort(lengths, descending=True, stable=True)
    sorted_lengths = lengths[order].tolist()
    groups, start = [], 0
    for i in range(1, len(order) + 1):
        if (
            i == len(order)
            or i - start == max_rows
            or cut_where_halved
            and 2 * sorted_lengths[i] < sorted_lengths[start]
        ):
            groups.append(order[start:i])
            start = i
    return groups


def most_over_ranks(count: int, device: torch.device) -> int:
    """The largest `count` of any rank, so that every rank makes as many forwards. Where FSDP2
    reshards after every forward, each forward all-gathers, and a rank with one forward fewer would
    leave the others waiting in an all-gather for good; micro-batches there are cut by count over
    equal rows, so the counts agree anyway, and this makes sure. Where prompts are shared (layers
    kept whole) the counts may differ, harmlessly: one all-gather the first forward and one
    reduce-scatter or all-reduce a backward, whatever the forwards."""
    if not dist.is_initialized() or dist.get_world_size(training_group()) == 1:
        return count
    most = torch.tensor([count], device=device)
    dist.all_reduce(most, op=dist.ReduceOp.MAX, group=training_group())
    return int(most)


def split_to(groups: list[torch.Tensor], count: int) -> list[torch.Tensor]:
    """`groups` with the largest halved until there are `count` (less padding, more forwards)."""
    groups = list(groups)
    while len(groups) < count:
        largest = max(range(len(groups)), key=lambda i: len(groups[i]))
        if len(groups[largest]) < 2:
            raise ValueError(f"cannot make {count} micro-batches of {sum(map(len, groups))} rows")
        rows = groups.pop(largest)
        groups[largest:largest] = [rows[: (len(rows) + 1) // 2], rows[(len(rows) + 1) // 2 :]]
    return groups


@dataclass
class SharedPrompts:
    """The batch's distinct prompts, forwarded once: their keys and values at every layer, the logits
    of their last position (which predict the first response token), and which of them each row has."""

    keys_values: list[tuple[torch.Tensor, torch.Tensor]]  # per layer, [distinct, kv heads, prompt, head dim]
    last_logits: torch.Tensor  # [distinct, vocab]
    of_row: torch.Tensor  # [rows]

    @classmethod
    def forward(cls, model, t) -> SharedPrompts:
        # Rows are equal prompts when their tokens, mask and positions are, whatever their uid says.
        width = t["prompts"].shape[1]
        rows = torch.cat([t[key][:, :width] for key in INPUTS], dim=1)
        distinct, of_row = torch.unique(rows, dim=0, return_inverse=True)
        ids, mask, positions = distinct.split(width, dim=1)
        out = model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True, logits_to_keep=1
        )
        keys_values = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
        return cls(keys_values, out.logits[:, -1], of_row)

    def response_logits(self, model, t, rows: torch.Tensor, length: int) -> torch.Tensor:
        """The logits predicting the rows' first `length` response tokens, with only the responses
        forwarded, against a cache holding a copy of each row's prompt (which the forward extends)."""
        index, start = self.of_row[rows], t["prompts"].shape[1]
        cache = DynamicCache(
            [(k.index_select(0, index), v.index_select(0, index)) for k, v in self.keys_values],
            config=unwrapped(model).config,
        )
        logits = model(
            input_ids=t["responses"][rows, :length],
            attention_mask=t["attention_mask"][rows, : start + length],
            position_ids=t["position_ids"][rows, start : start + length],
            past_key_values=cache,
            use_cache=True,
        ).logits
        # Response token 0 is predicted by the prompt's last position, token j by response position j - 1.
        return torch.cat([self.last_logits.index_select(0, index)[:, None], logits[:, :-1]], dim=1)


def _forward(
    model,
    t,
    prompts: SharedPrompts | None,
    rows: torch.Tensor,
    width: int,
    temperature: float,
    with_entropy: bool,
):
    """The rows' log-probs (and entropy), forwarded up to their longest response, zero-padded to `width`."""
    length = max(int(t["response_mask"][rows].sum(dim=1).max()), 1)
    if prompts is None:
        logits = _whole_rows_logits(model, t, rows, length)
    else:
        logits = prompts.response_logits(model, t, rows, length)
    logits = logits.float() / temperature
    log_probs = F.pad(token_log_probs(logits, t["responses"][rows, :length]), (0, width - length))
    if not with_entropy:
        return log_probs, None
    with torch.no_grad():
        return log_probs, F.pad(entropy_from_logits(logits.detach()), (0, width - length))


def token_log_probs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """log_softmax(logits)[tokens] for fp32 logits [rows, length, vocab]: verl's identity, the token's
    logit less the logsumexp, with the logsumexp over chunks of rows of at most LOGSUMEXP_CHUNK_BYTES."""
    rows_a_chunk = max(1, LOGSUMEXP_CHUNK_BYTES // (logits[0].numel() * logits.element_size()))
    logsumexp = torch.cat([torch.logsumexp(chunk, dim=-1) for chunk in logits.split(rows_a_chunk)])
    return logits.gather(-1, tokens.unsqueeze(-1)).squeeze(-1) - logsumexp


def _whole_rows_logits(model, t, rows: torch.Tensor, length: int) -> torch.Tensor:
    """The logits predicting the rows' first `length` response tokens, each row forwarded whole."""
    cut = t["prompts"].shape[1] + length
    logits = model(**{key: t[key][rows, :cut] for key in INPUTS}, use_cache=False).logits
    # The logits at position i predict token i + 1: the response's are the `length` positions before the end.
    return logits[:, -length - 1 : -1]
