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


def tokenize_examples(tokenizer, examples: list[Example], max_seq_len: int) -> list[Sample]:
    samples = []
    for ex in examples:
        ids, mask = encode_sft(tokenizer, ex)
        samples.append(Sample(ids[: max_seq_len + 1], mask[: max_seq_len + 1]))
    return samples


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


def micro_batches(samples: list[Sample], pad_id: int, micro_batch_size: int) -> list[MicroBatch]:
    """Split into micro-batches of samples of similar length, each padded (on the right) only to its
    own longest: the samples are sorted by length first. Curated sets mix short and long solutions,
    and padding every micro-batch to the longest sample spent much of the step on padding; the loss
    and gradient of the step are sums over the same samples either way."""
    ordered = sorted(samples, key=lambda s: len(s.input_ids), reverse=True)
    return [
        _collate(chunk, pad_id, len(chunk[0].input_ids) - 1)
        for chunk in (ordered[i : i + micro_batch_size] for i in range(0, len(ordered), micro_batch_size))
    ]


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
