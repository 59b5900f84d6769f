"""How long a rank waits in a collective while a checkpoint is sealed and verified (issue 40).

Two ranks (gloo, this machine) run the training loop's own `save_checkpoint` with an engine that
writes uneven shards, as ZeRO-2 does (rank 0 also holds the model states: 3/4 of the bytes here),
then a restarted stage's `agreed_resume_step` twice: with every file as sealed, and after every
file got a new modification time (a copied run directory), which makes the ranks read it all again.
Every collective the ranks enter is timed (except the engine's own barrier at the end of its
save, which waits for the slowest writer); the longest wait per phase is printed.

    python bench/checkpoint_seal.py --gib 4 --dir /tmp/ckpt-bench     # several GB
    python bench/checkpoint_seal.py --gib 0.01                        # small

Run it against the previous stages/checkpoint.py to see the waits grow with the size.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.checkpoint import CheckpointDir, agreed_resume_step  # noqa: E402
from stages.training_loop import save_checkpoint  # noqa: E402

COLLECTIVES = ("barrier", "broadcast_object_list", "all_gather_object", "gather_object")
BLOCK = os.urandom(16 << 20)
ENGINE_BARRIER = dist.barrier  # the engine's own wait for its slowest writer is not sealing's


class ShardWriter:
    """An engine whose `save` writes this rank's shard: rank 0 three quarters of the bytes."""

    def __init__(self, total_bytes: int):
        self.total = total_bytes

    def save(self, directory: Path, trainer_state: dict) -> None:
        directory.mkdir(parents=True, exist_ok=True)
        share = self.total * 3 // 4 if dist.get_rank() == 0 else self.total // 4
        with open(directory / f"shard-rank-{dist.get_rank():05d}.bin", "wb") as f:
            while share > 0:
                f.write(BLOCK[: min(len(BLOCK), share)])
                share -= len(BLOCK)
        ENGINE_BARRIER()  # as the engines' save does


def timed_collectives(waits: list[float]) -> None:
    """Every collective this process enters appends its wall time to `waits`."""
    for name in COLLECTIVES:
        original = getattr(dist, name)

        def timed(*args, _original=original, **kwargs):
            started = time.perf_counter()
            try:
                return _original(*args, **kwargs)
            finally:
                waits.append(time.perf_counter() - started)

        setattr(dist, name, timed)


def rank_main(rank: int, root: str, total_bytes: int, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{root}/store", rank=rank, world_size=2)
    waits: list[float] = []
    timed_collectives(waits)
    ckpts_root = Path(root) / "ckpt"
    result = {}

    def measure(name, fn):
        waits.clear()
        started = time.perf_counter()
        fn()
        result[name] = {"seconds": time.perf_counter() - started, "longest_wait": max(waits, default=0.0)}

    measure("seal", lambda: save_checkpoint(ShardWriter(total_bytes), CheckpointDir(ckpts_root, keep=2), 1))
    measure("resume, stats unchanged", lambda: agreed_resume_step(CheckpointDir(ckpts_root, keep=2)))
    if rank == 0:
        for path in (ckpts_root / "step-000001").iterdir():
            os.utime(path)  # new modification times, the same bytes
    dist.barrier()
    measure("resume, every file touched", lambda: agreed_resume_step(CheckpointDir(ckpts_root, keep=2)))
    Path(out, f"rank-{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--gib", type=float, default=4.0, help="checkpoint size in GiB, both ranks together")
    parser.add_argument("--dir", default=None, help="where to write it (removed afterwards)")
    args = parser.parse_args()
    root = Path(tempfile.mkdtemp(prefix="ckpt-bench-", dir=args.dir))
    try:
        mp.spawn(rank_main, args=(str(root), int(args.gib * 2**30), str(root)), nprocs=2)
        results = [json.loads((root / f"rank-{r}.json").read_text()) for r in range(2)]
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print(f"checkpoint of {args.gib:g} GiB on 2 ranks (rank 0 wrote 3/4 of it)")
    for name in results[0]:
        cells = ", ".join(
            f"rank {r}: {res[name]['seconds']:.2f} s, "
            f"longest collective wait {res[name]['longest_wait']:.2f} s"
            for r, res in enumerate(results)
        )
        print(f"  {name:28s} {cells}")


if __name__ == "__main__":
    main()
