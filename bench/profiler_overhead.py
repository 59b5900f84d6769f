"""Step time with the communication profiler on vs off, on 2 ranks, in the same invocation; prints
the ratio (on / off) last. The target is at most 1.03 on the embedded default's GRPO stage.

    python bench/profiler_overhead.py                        # small DDP training step
    python bench/profiler_overhead.py --workload MOD:FUNC    # FUNC() -> a callable running one step

Blocks of steps alternate off/on so that drift (other load on the machine, warming caches) hits
both sides alike; the median block time per side is compared.
"""
from __future__ import annotations

import argparse
import importlib
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def ddp_step():
    """Default workload: DDP training of a small MLP (gradients all-reduced every step)."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)

    def step():
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def load_workload(spec: str | None):
    if spec is None:
        return ddp_step
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def timed_block(step, steps: int) -> float:
    import torch.distributed as dist

    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step()
    dist.barrier()
    return (time.perf_counter() - started) / steps


def measure(step, blocks: int, steps: int, out_dir: Path, rank: int) -> tuple[float, float]:
    from launch.comm_profiler import CommProfiler
    from launch.phases import phase

    off, on = [], []
    timed_block(step, steps)  # warm-up
    for block in range(blocks):
        off.append(timed_block(step, steps))
        with CommProfiler(out_dir, "bench", rank) as prof:
            prof.set_step(block)
            with phase("bench"):
                on.append(timed_block(step, steps))
    return statistics.median(off), statistics.median(on)


def rank_main(args) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = load_workload(args.workload)()
    with tempfile.TemporaryDirectory() as tmp:
        off, on = measure(step, args.blocks, args.steps, Path(tmp), rank)
    if rank == 0:
        print(f"step off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms")
        print(f"ratio on/off {on / off:.4f}")
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--workload", help="MODULE:FUNC returning a one-step callable (run on every rank)")
    p.add_argument("--blocks", type=int, default=10)
    p.add_argument("--steps", type=int, default=20)
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
