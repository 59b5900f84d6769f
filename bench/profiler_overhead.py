"""Step time with the communication profiler on vs off, on 2 ranks, in the same invocation; prints
the ratio (on / off) last. The target is at most 1.03 on the embedded default's GRPO stage.

    python bench/profiler_overhead.py --workload grpo        # one GRPO step of the embedded default
    python bench/profiler_overhead.py                        # small DDP training step (--workload ddp)
    python bench/profiler_overhead.py --workload MOD:FUNC    # FUNC() -> a callable running one step

Blocks of steps alternate off/on so that drift (other load on the machine, warming caches) hits
both sides alike; the median block time per side is compared.
"""

from __future__ import annotations

import argparse
import importlib
import itertools
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
    model = torch.nn.parallel.DistributedDataParallel(
        torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 256))
    )
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    data = torch.randn(32, 256)

    def step():
        model(data).square().mean().backward()
        opt.step()
        opt.zero_grad()

    return step


def embedded_grpo_step():
    """One step of the embedded default's stage2_grpo (configs/tiny-cpu.yaml: its tiny model, 16
    prompts x 8 samples, 64 new tokens, DDP over the ranks) through the stage's own roles and
    step: weight sync, rollout, reward, log-probs, advantages, update. The model is the freshly
    built base model, not stage 1's (which would need stage 1 run first); its responses rarely end
    before the token budget, so steps are the stage's costliest shape and hardly vary."""
    import torch.distributed as dist
    from transformers import AutoTokenizer

    from core.config import load_config
    from pipeline.driver import prepare_run
    from stages.data.examples import read_examples
    from stages.grpo.prompts import PromptSchedule
    from stages.grpo.trainer import build_roles, train_step_at

    cfg = load_config(
        REPO / "configs" / "tiny-cpu.yaml", ["data.arithmetic.sft_size=16", "wandb.mode=disabled"]
    )
    run, scratch = shared_run_dir()
    if dist.get_rank() == 0:
        prepare_run(cfg, run, REPO / "configs")
    dist.barrier()
    stage = cfg.stage2_grpo
    roles = build_roles(run.base_model, AutoTokenizer.from_pretrained(run.base_model), stage)
    schedule = PromptSchedule(read_examples(run.task_file("prompts")), stage.prompts_per_step, cfg.seed)
    steps = itertools.count()

    def step():
        train_step_at(roles, schedule, stage, cfg.seed, next(steps))

    step.scratch = scratch  # the run directory lives as long as the step that reads it
    return step


def shared_run_dir():
    """A scratch run directory every rank sees, picked by rank 0, and on rank 0 the handle that
    deletes it when dropped (None elsewhere)."""
    import torch.distributed as dist

    from core.rundir import RunDir

    scratch = tempfile.TemporaryDirectory(prefix="hpcr1-bench-") if dist.get_rank() == 0 else None
    path = [scratch.name if scratch else None]
    dist.broadcast_object_list(path, src=0)
    return RunDir(Path(path[0]) / "run"), scratch


# name -> (factory of the one-step callable, default blocks, default steps a block): a GRPO step takes
# about a second where a DDP step takes milliseconds.
WORKLOADS = {"ddp": (ddp_step, 10, 20), "grpo": (embedded_grpo_step, 8, 2)}


def load_workload(spec: str | None):
    if spec is None or spec in WORKLOADS:
        return WORKLOADS[spec or "ddp"][0]
    module, func = spec.split(":")
    return getattr(importlib.import_module(module), func)


def block_shape(args) -> tuple[int, int]:
    _, blocks, steps = WORKLOADS.get(args.workload or "ddp", WORKLOADS["ddp"])
    return args.blocks or blocks, args.steps or steps


def timed_block(step, steps: int, after=lambda: None) -> tuple[float, float]:
    """(wall seconds, CPU seconds of all ranks) per step over `steps` steps and then `after()`.
    CPU time (every thread of the rank) is the steadier figure on a machine shared with other work:
    waiting for a descheduled peer adds wall time but no CPU time."""
    import torch
    import torch.distributed as dist

    dist.barrier()
    started, cpu_started = time.perf_counter(), time.process_time()
    for _ in range(steps):
        step()
    after()
    cpu = torch.tensor([time.process_time() - cpu_started])
    dist.barrier()
    wall = time.perf_counter() - started
    dist.all_reduce(cpu)
    return wall / steps, cpu.item() / steps


def measure(step, blocks: int, steps: int, out_dir: Path, rank: int) -> dict[str, tuple[float, float]]:
    """{"wall"|"cpu": (median seconds a step off, on)}. The on side includes writing the events."""
    off, on = [], []
    timed_block(step, steps)  # warm-up
    for block in range(blocks):
        # Which side runs first alternates, so that whatever favours a place in the pair hits both.
        for profiled in (False, True) if block % 2 == 0 else (True, False):
            if profiled:
                on.append(profiled_block(step, steps, out_dir, rank, block))
            else:
                off.append(timed_block(step, steps))
    return {
        kind: (statistics.median(b[i] for b in off), statistics.median(b[i] for b in on))
        for i, kind in enumerate(("wall", "cpu"))
    }


def profiled_block(step, steps: int, out_dir: Path, rank: int, block: int) -> tuple[float, float]:
    from runtime.comm_profiler import CommProfiler
    from runtime.phases import phase

    with CommProfiler(out_dir, "bench", rank) as prof:
        prof.set_step(block)
        with phase("bench"):
            return timed_block(step, steps, after=prof.flush)


def rank_main(args) -> None:
    import torch.distributed as dist

    from runtime.dist import shutdown_distributed

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    step = load_workload(args.workload)()
    blocks, steps = block_shape(args)
    with tempfile.TemporaryDirectory() as tmp:
        times = measure(step, blocks, steps, Path(tmp), rank)
        recorded = len((Path(tmp) / f"rank-{rank:05d}.jsonl").read_text().splitlines())
    if rank == 0:
        print(
            f"{blocks} blocks of {steps} steps each side; "
            f"{recorded / (blocks * steps):.0f} calls recorded a step "
            f"on rank 0; load average {os.getloadavg()[0]:.2f}"
        )
        (cpu_off, cpu_on), (off, on) = times["cpu"], times["wall"]
        print(
            f"CPU per step (all ranks) off {cpu_off * 1e3:.3f} ms, on {cpu_on * 1e3:.3f} ms, "
            f"ratio {cpu_on / cpu_off:.4f}"
        )
        print(f"step off {off * 1e3:.3f} ms, on {on * 1e3:.3f} ms")
        print(f"ratio on/off {on / off:.4f}")
    shutdown_distributed()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument(
        "--workload",
        help=f"{' or '.join(WORKLOADS)} (default ddp), or MODULE:FUNC returning a "
        "one-step callable (run on every rank)",
    )
    p.add_argument("--blocks", type=int, help="off/on pairs of blocks (default: ddp 10, grpo 8)")
    p.add_argument("--steps", type=int, help="steps a block (default: ddp 20, grpo 2)")
    args = p.parse_args()
    if "RANK" in os.environ:
        rank_main(args)
        return
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", __file__, *sys.argv[1:]]
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    sys.exit(subprocess.run(cmd, env=env).returncode)


if __name__ == "__main__":
    main()
