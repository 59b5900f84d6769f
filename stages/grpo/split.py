"""GRPO with the rollout on ranks of its own (the stage's rollout_ranks): the last ranks generate,
the others train, each side at its own pace. The batch trained at step s (0-based) is generated
with the weights of step s - max_staleness (the initial ones before that): fixed, so that the
schedule is a function of the step and a resumed stage repeats it exactly.

Per step s, on every rank: the trainers' first rank broadcasts the weights of step s to the
generators (phase weight_sync) where a generator will use them; each generator then samples the
batch of step s + k (at step 0, those of steps 0..k) for each trainer it serves and sends it
(pickled, over a gloo group: host bytes on any device), while the trainers receive the batch of step
s (phase rollout_wait) and learn from it. With k = 1, generating step s + 1 overlaps training step s.
A checkpoint after step s holds the batches of steps s + 1 .. s + k, sent and not yet trained on:
the next attempt trains on them as this one would have."""

from __future__ import annotations

import pickle
import time
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from verl.protocol import DataProto

from runtime.dist import rank_device
from runtime.phases import phase

# The weights go in broadcasts of about this many bytes: few calls, and no second copy of the model.
BUCKET_BYTES = 32 << 20
PENDING = "pending-batches-rank{rank:05d}.pt"
STEP, WEIGHTS_VERSION = "step", "weights_version"  # the step a batch is for; its weights' step
GENERATION_S = "generation_s"  # the generator's seconds on a batch, from sampling to sent
GENERATED_AT = "generated_at"  # when its sampling began (Unix time, the clock metrics' t_start is on)


@dataclass(frozen=True)
class RankSplit:
    world: int
    generators: int  # the last `generators` ranks

    @property
    def trainers(self) -> int:
        return self.world - self.generators

    def generates(self, rank: int) -> bool:
        return rank >= self.trainers

    def source(self, trainer: int) -> int:
        """The generator that samples `trainer`'s batches."""
        return self.trainers + trainer % self.generators

    def served(self, generator: int) -> list[int]:
        return [t for t in range(self.trainers) if self.source(t) == generator]


def batches_generated_at(step: int, staleness: int, steps: int) -> list[int]:
    """The steps whose batches the generators sample in step `step`, with its weights."""
    wanted = range(staleness + 1) if step == 0 else [step + staleness]
    return [s for s in wanted if s < steps]


@dataclass
class SplitGroups:
    """The process groups of a split (every rank creates every group, in this order)."""

    training: dist.ProcessGroup  # the trainers: gradients, statistics, checkpoints
    weights: dist.ProcessGroup  # trainer 0 and the generators: the weight broadcast
    batches: dist.ProcessGroup  # every rank, gloo: the batches, pickled


def split_groups(split: RankSplit) -> SplitGroups:
    return SplitGroups(
        training=dist.new_group(list(range(split.trainers))),
        weights=dist.new_group([0, *range(split.trainers, split.world)]),
        batches=dist.new_group(backend="gloo"),
    )


def _buckets(shapes: list[tuple[str, torch.Size]], element_size: int) -> list[list[tuple[str, torch.Size]]]:
    buckets, current, size = [], [], 0
    for name, shape in shapes:
        current.append((name, shape))
        size += shape.numel() * element_size
        if size >= BUCKET_BYTES:
            buckets.append(current)
            current, size = [], 0
    return [*buckets, current] if current else buckets


def broadcast_weights(weights: dict[str, torch.Tensor], dtype: torch.dtype, group) -> None:
    """Trainer 0: the policy's parameters, in the rollout's dtype, to every generator."""
    shapes = [(name, weights[name].shape) for name in sorted(weights)]
    for bucket in _buckets(shapes, torch.empty((), dtype=dtype).element_size()):
        flat = torch.cat([weights[name].detach().to(dtype).reshape(-1) for name, _ in bucket])
        dist.broadcast(flat, group_src=0, group=group)


@torch.no_grad()
def receive_weights(model: torch.nn.Module, group) -> None:
    """A generator: the trainers' parameters, into its rollout copy (broadcast_weights' order)."""
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype
    shapes = [(name, params[name].shape) for name in sorted(params)]
    for bucket in _buckets(shapes, torch.empty((), dtype=dtype).element_size()):
        flat = torch.empty(sum(shape.numel() for _, shape in bucket), dtype=dtype, device=rank_device())
        dist.broadcast(flat, group_src=0, group=group)
        offset = 0
        for name, shape in bucket:
            params[name].copy_(flat[offset : offset + shape.numel()].view(shape))
            offset += shape.numel()


class BatchSender:
    """A generator's batches on their way: sent without waiting, so that it samples the next one
    while a trainer is still busy; each kept until its trainer has received it."""

    def __init__(self, group):
        self.group, self.in_flight = group, []

    def send(self, batch: DataProto, trainer: int, started: float) -> None:
        """`batch` to `trainer`, stamped with the seconds since `started` (when its sampling began)."""
        batch = batch.to("cpu")
        seconds = time.perf_counter() - started
        batch.meta_info.update({GENERATION_S: seconds, GENERATED_AT: time.time() - seconds})
        payload = torch.frombuffer(bytearray(pickle.dumps(batch)), dtype=torch.uint8)
        size = torch.tensor([payload.numel()], dtype=torch.int64)
        works = [dist.isend(t, dst=trainer, group=self.group) for t in (size, payload)]
        self.in_flight.append((works, size, payload))
        self.in_flight = [sent for sent in self.in_flight if not all(w.is_completed() for w in sent[0])]

    def wait(self) -> None:
        for works, *_ in self.in_flight:
            for work in works:
                work.wait()
        self.in_flight = []


class StaleBatches:
    """A trainer's batches by step, received from its generator in the order they were sent."""

    def __init__(self, source: int, group):
        self.source, self.group = source, group
        self.by_step: dict[int, torch.Tensor] = {}  # pickled batches, as they came

    def _receive(self) -> None:
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, src=self.source, group=self.group)
        payload = torch.empty(int(size), dtype=torch.uint8)
        dist.recv(payload, src=self.source, group=self.group)
        self.by_step[_unpickled(payload).meta_info[STEP]] = payload

    def take(self, step: int) -> DataProto:
        with phase("rollout_wait"):
            while step not in self.by_step:
                self._receive()
        return _unpickled(self.by_step.pop(step)).to(rank_device())

    def save(self, directory: Path, steps: list[int], rank: int) -> None:
        """Into a checkpoint: the batches of `steps`, received first where they are still coming."""
        with phase("rollout_wait"):
            while not set(steps) <= self.by_step.keys():
                self._receive()
        torch.save({s: self.by_step[s] for s in steps}, directory / PENDING.format(rank=rank))

    def load(self, directory: Path, rank: int) -> None:
        self.by_step = torch.load(directory / PENDING.format(rank=rank))


def _unpickled(payload: torch.Tensor) -> DataProto:
    return pickle.loads(payload.numpy().tobytes())
