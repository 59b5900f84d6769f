"""`hpcr1 commbench`: achievable latency and bandwidth per collective and message size, through
torch.distributed (gloo or nccl) or MPI (mpi4py), with nccl-tests' definitions: S = the whole array
(all_gather's output, reduce_scatter's input), algbw = S / t, busbw = algbw * the op's bus factor.
The JSON it writes is what the report draws as the achievable bandwidth line.

Run outside a launcher, it starts itself on --nproc ranks (torchrun, or mpirun for --backend mpi).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from analysis.bandwidth import alg_bandwidth, bus_bandwidth

OPS = ("all_reduce", "all_gather", "reduce_scatter", "broadcast", "all_to_all", "send_recv")
DEFAULT_SIZES = "1K,4K,16K,64K,256K,1M,4M"
UNITS = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    return int(float(text[:-1]) * UNITS[text[-1]]) if text[-1] in UNITS else int(text)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="hpcr1 commbench", description=__doc__)
    p.add_argument(
        "--backend",
        choices=("auto", "gloo", "nccl", "mpi"),
        default="auto",
        help="auto: the node's accelerator's (nccl on a GPU node), else gloo",
    )
    p.add_argument("--ops", default=",".join(OPS), help=f"comma-separated, from {', '.join(OPS)}")
    p.add_argument(
        "--sizes", default=DEFAULT_SIZES, help="bytes S per call, comma-separated (K/M/G suffixes)"
    )
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--nproc", type=int, default=2, help="ranks to start when not already under a launcher")
    p.add_argument("--out", type=Path, default=Path("commbench.json"))
    args = p.parse_args(argv)
    args.ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    unknown = sorted(set(args.ops) - set(OPS))
    if unknown:
        p.error(f"--ops: unknown {', '.join(unknown)}")
    try:
        args.sizes = [parse_size(s) for s in args.sizes.split(",")]
    except (ValueError, IndexError):
        p.error(f"--sizes: cannot read {args.sizes!r}")
    return args


def result_row(op: str, nbytes: int, seconds: float, n: int) -> dict:
    name = "send" if op == "send_recv" else op
    return {
        "bytes": nbytes,
        "latency_us": seconds * 1e6,
        "algbw_GBps": alg_bandwidth(nbytes, seconds) / 1e9,
        "busbw_GBps": bus_bandwidth(name, nbytes, seconds, n) / 1e9,
    }


# ---- torch.distributed -----------------------------------------------------------------------
def torch_call(op: str, nbytes: int, rank: int, n: int, device):
    """A closure running one call of `op` moving S = nbytes (float32)."""
    import torch
    import torch.distributed as dist

    numel = max(n, nbytes // 4 // n * n)  # divisible by n so every rank holds an equal piece
    whole = torch.ones(numel, device=device)
    piece = torch.ones(numel // n, device=device)
    peer = rank ^ 1
    calls = {
        "all_reduce": lambda: dist.all_reduce(whole),
        "all_gather": lambda: dist.all_gather_into_tensor(whole, piece),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(piece, whole),
        "broadcast": lambda: dist.broadcast(whole, 0),
        "all_to_all": lambda: dist.all_to_all_single(torch.empty_like(whole), whole),
        "send_recv": lambda: (
            (dist.send(whole, peer) if rank % 2 == 0 else dist.recv(whole, peer)) if peer < n else None
        ),
    }
    return calls[op], numel * 4


def run_torch(args) -> dict:
    import torch
    import torch.distributed as dist

    from runtime.dist import init_distributed, rank_device, shutdown_distributed

    info = init_distributed(None if args.backend == "auto" else args.backend)
    backend = dist.get_backend()
    # Every buffer, the timing too, on the device the backend serves: nccl refuses CPU tensors.
    device = torch.device("cpu") if backend == "gloo" else rank_device()
    sync = (lambda: None) if device.type == "cpu" else torch.accelerator.synchronize
    results = {}
    for op in args.ops:
        rows = []
        for size in args.sizes:
            call, nbytes = torch_call(op, size, info.rank, info.world_size, device)
            for _ in range(args.warmup):
                call()
            sync()
            dist.barrier()
            started = time.perf_counter()
            for _ in range(args.iters):
                call()
            sync()
            elapsed = torch.tensor([(time.perf_counter() - started) / args.iters], device=device)
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # the call is as slow as its slowest rank
            rows.append(result_row(op, nbytes, elapsed.item(), info.world_size))
        results[op] = rows
    shutdown_distributed()
    return {"backend": backend, "world_size": info.world_size, "rank": info.rank, "results": results}


# ---- MPI -------------------------------------------------------------------------------------
def mpi_call(comm, op: str, nbytes: int):
    import numpy as np
    from mpi4py import MPI

    rank, n = comm.Get_rank(), comm.Get_size()
    numel = max(n, nbytes // 4 // n * n)
    whole, piece, other = (
        np.ones(numel, np.float32),
        np.ones(numel // n, np.float32),
        np.empty(numel, np.float32),
    )
    peer = rank ^ 1
    calls = {
        "all_reduce": lambda: comm.Allreduce(whole, other, op=MPI.SUM),
        "all_gather": lambda: comm.Allgather(piece, whole),
        "reduce_scatter": lambda: comm.Reduce_scatter_block(whole, piece, op=MPI.SUM),
        "broadcast": lambda: comm.Bcast(whole, root=0),
        "all_to_all": lambda: comm.Alltoall(whole, other),
        "send_recv": lambda: (
            (comm.Send(whole, dest=peer) if rank % 2 == 0 else comm.Recv(whole, source=peer))
            if peer < n
            else None
        ),
    }
    return calls[op], numel * 4


def run_mpi(args) -> dict:
    from mpi4py import MPI

    comm = MPI.COMM_WORLD
    results = {}
    for op in args.ops:
        rows = []
        for size in args.sizes:
            call, nbytes = mpi_call(comm, op, size)
            for _ in range(args.warmup):
                call()
            comm.Barrier()
            started = MPI.Wtime()
            for _ in range(args.iters):
                call()
            elapsed = comm.allreduce((MPI.Wtime() - started) / args.iters, op=MPI.MAX)
            rows.append(result_row(op, nbytes, elapsed, comm.Get_size()))
        results[op] = rows
    return {"backend": "mpi", "world_size": comm.Get_size(), "rank": comm.Get_rank(), "results": results}


# ---- entry -----------------------------------------------------------------------------------
def under_launcher() -> bool:
    return any(k in os.environ for k in ("RANK", "OMPI_COMM_WORLD_RANK", "SLURM_PROCID"))


def without_nproc(argv: list[str]) -> list[str]:
    """The arguments for the ranks: --nproc is the launcher's (torchrun also refuses it as an ambiguous
    prefix of its own --nproc-per-node anywhere on its command line)."""
    out, skip = [], False
    for arg in argv:
        if skip:
            skip = False
        elif arg == "--nproc":
            skip = True
        elif not arg.startswith("--nproc="):
            out.append(arg)
    return out


def relaunch(args, argv: list[str]) -> int:
    argv = without_nproc(argv)
    me = [sys.executable, "-m", "launch.commbench", *argv]
    if args.backend == "mpi":
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(args.nproc), *me]
    else:
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={args.nproc}",
            "-m",
            "launch.commbench",
            *argv,
        ]
    return subprocess.run(cmd).returncode


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if not under_launcher():
        return relaunch(args, argv)
    report = run_mpi(args) if args.backend == "mpi" else run_torch(args)
    if report.pop("rank") == 0:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(report, indent=1))
        for op, rows in report["results"].items():
            best = max(rows, key=lambda r: r["busbw_GBps"])
            print(f"{op:15s} best busbw {best['busbw_GBps']:.3f} GB/s at {best['bytes']} B")
    return 0


if __name__ == "__main__":
    sys.exit(main())
