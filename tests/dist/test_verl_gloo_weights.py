"""verl's weight hand-over to a rollout pool of its own on the CPU platform (the gloo checkpoint
engine): what the trainers' rank 0 sends reaches every rollout worker bit for bit, weights larger
than a bucket included, while a trainer outside the group still walks its weights (on a GPU cluster
producing each is a collective of the trainers). Driven as verl's CheckpointEngineManager drives it:
prepare, build_topology, init_process_group, send/receive, finalize."""

from __future__ import annotations

import asyncio
import io
import multiprocessing

import pytest
import torch

from stages.engines.verl_gloo_weights import GlooCheckpointEngine

pytestmark = pytest.mark.dist
BUCKET = 512  # bytes: "big" (1200) spans three buckets, the others share them


def weights() -> list[tuple[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    return [
        ("embed", torch.randn(10, 7, generator=g)),
        ("big", torch.randn(300, generator=g)),
        ("norm", torch.randn(16, generator=g).to(torch.bfloat16)),
        ("step", torch.arange(5)),
    ]


def receive(topology, out) -> None:
    rank, world_size, rendezvous = topology.get(timeout=60)
    engine = GlooCheckpointEngine(bucket_size=BUCKET)
    assert engine.prepare() is None
    engine.init_process_group(rank=rank, world_size=world_size, rendezvous=rendezvous)

    async def every_weight():  # kept whole: each must outlive the buckets after it
        return [(name, tensor) async for name, tensor in engine.receive_weights()]

    # as bytes: a tensor put in a Queue travels as a file descriptor that dies with this process
    buffer = io.BytesIO()
    torch.save([(name, tensor.clone()) for name, tensor in asyncio.run(every_weight())], buffer)
    out.put((rank, buffer.getvalue()))
    engine.finalize()


def test_the_rollout_workers_receive_the_trainers_weights_bit_for_bit():
    # forked before rank 0's store starts its thread: a fork copies the imports, not the threads
    fork = multiprocessing.get_context("fork")
    topology, out = fork.Queue(), fork.Queue()
    workers = [fork.Process(target=receive, args=(topology, out)) for _ in range(2)]
    for w in workers:
        w.start()
    sender = GlooCheckpointEngine(bucket_size=BUCKET, is_master=True)
    helper = GlooCheckpointEngine(bucket_size=BUCKET)  # the trainers' other rank
    metadata = [sender.prepare(), helper.prepare(), None, None]
    actor, rollout = GlooCheckpointEngine.build_topology(2, 2, metadata)
    assert actor["rank"] == [0, -1] and rollout["rank"] == [1, 2]
    for i in range(2):
        topology.put(tuple(rollout[key][i] for key in ("rank", "world_size", "rendezvous")))
    try:
        for engine, i in ((sender, 0), (helper, 1)):
            engine.init_process_group(**{key: values[i] for key, values in actor.items()})
        walked = []

        def helpers_weights():
            for name, tensor in weights():
                walked.append(name)
                yield name, tensor

        asyncio.run(helper.send_weights(helpers_weights()))
        asyncio.run(sender.send_weights(iter(weights())))
        received = {
            rank: torch.load(io.BytesIO(data)) for rank, data in (out.get(timeout=60) for _ in workers)
        }
    finally:
        for w in workers:
            w.join(timeout=60)
            if w.is_alive():
                w.kill()
    assert walked == [name for name, _ in weights()]
    for rank in (1, 2):
        got = received[rank]
        assert [name for name, _ in got] == [name for name, _ in weights()]
        for (name, tensor), (_, expected) in zip(got, weights()):
            assert tensor.dtype == expected.dtype and torch.equal(tensor, expected), name
    # the next hand-over meets under keys of its own in rank 0's store
    assert sender.prepare().prefix != metadata[0].prefix
