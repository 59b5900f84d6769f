"""verl's weight hand-over from the trainers to a rollout pool of its own, over gloo: what verl's
`nccl` checkpoint engine is on GPUs, for the CPU test platform (stages/engines/verl_cpu.py), where
none of verl 0.9.1's engines runs (nccl, nixl, hccl, mooncake and kimi need an accelerator or an
RDMA library; `naive` hands over inside one process only). verl's `separate_async` trainer refuses
`naive` (verl/trainer/ppo/v1/trainer_separate_async.py), so a rollout on ranks of its own needs one.

Registered as the `gloo` backend when imported: verl imports `checkpoint_engine.custom_backend_module`
in the driver, the trainers and the rollout workers (verl/checkpoint_engine/base.py).

Each hand-over is one gloo group of its own: the trainers' rank 0, which holds a TCPStore for the
group's rendezvous, and every rollout worker. Rank 0 fills a bucket from the trainers' weights (the
other trainers take part in gathering each weight only) and broadcasts it; the bucket's table of
contents goes through the store first, so that a receiver knows what it is about to get.
"""

from __future__ import annotations

import asyncio
import pickle
import uuid
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from verl.checkpoint_engine.base import (
    CheckpointEngine,
    CheckpointEngineRegistry,
    merge_weight_chunks,
    split_weight_chunks,
)
from verl.workers.rollout.utils import ensure_async_iterator

from runtime.dist import collective_timeout

BACKEND = "gloo"
SENDER = 0  # the trainers' rank 0, the group's broadcast root


@dataclass(frozen=True)
class Rendezvous:
    """Where a hand-over's group meets: rank 0's store, and the keys of this hand-over in it."""

    host: str
    port: int
    prefix: str


@CheckpointEngineRegistry.register(BACKEND)
class GlooCheckpointEngine(CheckpointEngine):
    """`bucket_size` bytes a broadcast (verl's `update_weights_bucket_megabytes`); `is_master` on
    the trainers' rank 0, which sends."""

    def __init__(self, bucket_size: int, is_master: bool = False, **_ignored) -> None:
        self.bucket_size = bucket_size
        self.is_master = is_master
        self.timeout = collective_timeout() or timedelta(minutes=10)
        self._server: dist.TCPStore | None = None  # rank 0's, kept for the process's life
        self.rank = -1
        self.group = self.store = None

    def prepare(self) -> Rendezvous | None:
        if not self.is_master:
            return None
        if self._server is None:
            import ray

            host = ray.util.get_node_ip_address().strip("[]")
            self._server = dist.TCPStore(
                host, 0, is_master=True, wait_for_workers=False, timeout=self.timeout
            )
        return Rendezvous(self._server.host, self._server.port, uuid.uuid4().hex)

    @classmethod
    def build_topology(cls, actor_wg_world_size: int, rollout_world_size: int, metadata: list):
        rendezvous = metadata[0]
        if not isinstance(rendezvous, Rendezvous):
            raise RuntimeError("the trainers' rank 0 must hold the weight hand-over's store (is_master)")
        world_size = 1 + rollout_world_size
        actor = {
            "rank": [SENDER] + [-1] * (actor_wg_world_size - 1),  # the others only help gather
            "world_size": [world_size] * actor_wg_world_size,
            "rendezvous": [rendezvous] * actor_wg_world_size,
        }
        rollout = {
            "rank": list(range(1, world_size)),
            "world_size": [world_size] * rollout_world_size,
            "rendezvous": [rendezvous] * rollout_world_size,
        }
        return actor, rollout

    def init_process_group(self, rank: int, world_size: int, rendezvous: Rendezvous):
        self.rank = rank
        if rank < 0:
            return
        store = self._server or dist.TCPStore(rendezvous.host, rendezvous.port, timeout=self.timeout)
        self.store = dist.PrefixStore(rendezvous.prefix, store)
        self.group = dist.ProcessGroupGloo(self.store, rank, world_size, self.timeout)

    def finalize(self):
        self.group = self.store = None
        self.rank = -1

    @torch.no_grad()
    async def send_weights(self, weights, global_steps: int | None = None):
        if self.rank < 0:  # gathering each weight is collective over the trainers: walk them all
            async for _ in ensure_async_iterator(weights):
                pass
            return {}
        bucket = torch.empty(self.bucket_size, dtype=torch.uint8)
        contents, offset, sent = {}, 0, 0
        async for meta, chunk in split_weight_chunks(weights, self.bucket_size):
            if offset + meta.chunk_size > self.bucket_size:
                await self._broadcast(bucket, contents, offset, sent, is_last=False)
                contents, offset, sent = {}, 0, sent + 1
            meta.offset = offset
            contents[meta.name] = meta
            bucket[offset : offset + meta.chunk_size] = chunk.to("cpu")
            offset += meta.chunk_size
        await self._broadcast(bucket, contents, offset, sent, is_last=True)
        return {}

    async def _broadcast(self, bucket: torch.Tensor, contents: dict, length: int, index: int, is_last: bool):
        table = {"contents": contents, "length": length, "is_last": is_last}
        self.store.set(f"bucket/{index}", pickle.dumps(table))
        await asyncio.to_thread(lambda: self.group.broadcast(bucket[:length], SENDER).wait())

    @torch.no_grad()
    async def receive_weights(self, global_steps: int | None = None):
        async for name, weight in merge_weight_chunks(self._received_chunks(), self.bucket_size):
            yield name, weight

    async def _received_chunks(self):
        index, is_last = 0, False
        while not is_last:
            table = pickle.loads(await asyncio.to_thread(self.store.get, f"bucket/{index}"))
            # a bucket of its own each time: the weights yielded stay valid however long they are kept
            bucket = torch.empty(table["length"], dtype=torch.uint8)
            await asyncio.to_thread(lambda: self.group.broadcast(bucket, SENDER).wait())
            for meta in table["contents"].values():
                yield meta, bucket[meta.offset : meta.offset + meta.chunk_size]
            index, is_last = index + 1, table["is_last"]
