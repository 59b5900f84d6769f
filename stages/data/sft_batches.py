"""SFT batches: tokenised examples, a deterministic resumable order, padded micro-batches.

The order is a fresh permutation per epoch drawn from (seed, epoch), so the batch of any step can
be rebuilt from the step number alone: resuming needs no dataloader state beyond the step.
Every rank sees the same global batch and takes its data-parallel slice of it, which also lets it
count the global number of loss tokens without communication.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from stages.data.examples import Example
from stages.data.tokenizer import encode_sft

MOSTLY_TRUNCATED = 0.5  # above this share of truncated examples an SFT stage warns on the terminal


@dataclass
class Sample:
    input_ids: list[int]
    loss_mask: list[int]


@dataclass
class MicroBatch:
    input_ids: torch.Tensor  # [b, s] tokens fed to the model
    labels: torch.Tensor  # [b, s] next tokens
    loss_mask: torch.Tensor  # [b, s] 1.0 where the label is a response token
    position_ids: torch.Tensor  # [b, s]

    def to(self, device: torch.device) -> MicroBatch:
        """On the model's device; from page-locked memory on CUDA, so the copy overlaps the step."""
        if device.type == "cpu":
            return self
        pinned = device.type == "cuda"
        return MicroBatch(
            *(
                # contiguous: the positions are an expanded view, which cannot be pinned
                (t.contiguous().pin_memory() if pinned else t).to(device, non_blocking=pinned)
                for t in (self.input_ids, self.labels, self.loss_mask, self.position_ids)
            )
        )


@dataclass(frozen=True)
class Truncation:
    """What cutting a stage's examples to max_seq_len (+1: the last token is only a label) did."""

    max_seq_len: int
    examples: int
    truncated: int  # examples that were longer
    tokens_cut: int
    response_tokens_cut: int
    left_out: int  # truncated examples without a response token left: they would train nothing
    longest_prompt: int
    longest: int  # tokens of the longest example, whole

    @property
    def kept(self) -> int:
        return self.examples - self.left_out

    def refusal(self, field: str) -> str | None:
        """Why the stage must not train, naming the field (`field`) to raise; None if it may."""
        if self.kept:
            return None
        return (
            f"{self.max_seq_len} leaves no response token in any of the {self.examples} examples (prompts "
            f"up to {self.longest_prompt} tokens, whole examples up to {self.longest}); raise {field}"
        )

    def warning(self, field: str) -> str | None:
        """What to warn of when most examples were truncated; None otherwise."""
        if not self.kept or self.truncated <= MOSTLY_TRUNCATED * self.examples:
            return None
        return (
            f"{self.truncated} of {self.examples} examples are longer than {field}={self.max_seq_len} and "
            f"were truncated: {self.response_tokens_cut} response tokens cut, {self.left_out} example(s) "
            "left without any (left out of training)"
        )


def tokenize_examples(
    tokenizer, examples: list[Example], max_seq_len: int
) -> tuple[list[Sample], Truncation]:
    """The examples cut to max_seq_len, those left without a response token left out, and the count
    of what was cut."""
    whole = [Sample(*encode_sft(tokenizer, ex)) for ex in examples]
    cut = [Sample(s.input_ids[: max_seq_len + 1], s.loss_mask[: max_seq_len + 1]) for s in whole]
    kept = [s for s in cut if any(s.loss_mask)]
    truncation = Truncation(
        max_seq_len=max_seq_len,
        examples=len(whole),
        truncated=sum(len(s.input_ids) > max_seq_len + 1 for s in whole),
        tokens_cut=sum(len(w.input_ids) - len(c.input_ids) for w, c in zip(whole, cut)),
        response_tokens_cut=sum(sum(w.loss_mask) - sum(c.loss_mask) for w, c in zip(whole, cut)),
        left_out=len(cut) - len(kept),
        longest_prompt=max((len(s.loss_mask) - sum(s.loss_mask) for s in whole), default=0),
        longest=max((len(s.input_ids) for s in whole), default=0),
    )
    return kept, truncation


class GlobalBatchOrder:
    """Indices of the global batch of each step: epoch-wise permutations, never skipping a sample."""

    def __init__(self, num_samples: int, global_batch_size: int, seed: int):
        self.n, self.size, self.seed = num_samples, global_batch_size, seed
        self._epoch, self._perm = -1, None

    def indices(self, step: int) -> list[int]:
        out = []
        for pos in range(step * self.size, (step + 1) * self.size):
            epoch, offset = divmod(pos, self.n)
            out.append(self._permutation(epoch)[offset])
        return out

    def _permutation(self, epoch: int) -> list[int]:
        if epoch != self._epoch:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            self._epoch, self._perm = epoch, torch.randperm(self.n, generator=g).tolist()
        return self._perm


def micro_batches(
    samples: list[Sample], pad_id: int, micro_batch_size: int, one_shape: bool = False
) -> list[MicroBatch]:
    """Split into micro-batches of samples of similar length, each padded (on the right) only to its
    own longest: the samples are sorted by length first. Curated sets mix short and long solutions,
    and padding every micro-batch to the longest sample spent much of the step on padding; the loss
    and gradient of the step are sums over the same samples either way. `one_shape`: all padded to
    the longest of `samples` (pipeline stages exchange activations of one shape)."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    chunks = [ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size)]
    return [_collate(c, pad_id, len((ordered if one_shape else c)[0].input_ids) - 1) for c in chunks]


def _collate(samples: list[Sample], pad_id: int, length: int) -> MicroBatch:
    ids = torch.full((len(samples), length + 1), pad_id, dtype=torch.long)
    mask = torch.zeros((len(samples), length + 1))
    for row, s in enumerate(samples):
        ids[row, : len(s.input_ids)] = torch.tensor(s.input_ids)
        mask[row, : len(s.loss_mask)] = torch.tensor(s.loss_mask, dtype=torch.float)
    positions = torch.arange(length).expand(len(samples), length)
    return MicroBatch(ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask[:, 1:].contiguous(), positions)


def count_loss_tokens(samples: list[Sample]) -> int:
    # The first token is never a label (labels are shifted by one).
    return sum(sum(s.loss_mask[1:]) for s in samples)
