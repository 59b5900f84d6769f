"""What forking a node's ranks from one preloaded process saves (launch/torchrun.py).

The same stage, from scratch, started two ways on this machine:
- ours: `python -m launch.torchrun ... -m launch.worker RUN STAGE`, as `hpcr1 run` starts it: the
  ranks are forked from a forkserver that imported the stage's modules once;
- peer: `python -m torch.distributed.run ... -m launch.worker RUN STAGE`, plain torchrun: each rank
  is a fresh interpreter that imports them itself.
Repetitions alternate ours / peer. Each is timed by its wall clock and by the CPU-seconds the whole
machine was busy meanwhile (/proc/stat: a forked rank's CPU is not reaped by the launcher, so a
child's rusage would miss it); run it on a quiet machine. Printed last: median busy CPU-s ours /
peer, and the same for wall.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.versus import prepare  # noqa: E402
from launch.local import rank_env, torchrun_command  # noqa: E402
from runtime.group import free_port  # noqa: E402


def busy_cpu_seconds() -> float:
    """CPU-seconds the machine has spent on anything but idle and I/O wait since boot."""
    user, nice, system, _idle, _iowait, irq, softirq, steal = map(
        int, Path("/proc/stat").read_text().split()[1:9]
    )
    return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")


def peer_command(run_root: Path, stage_id: str, nproc: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        "-m",
        "launch.worker",
        str(run_root),
        stage_id,
    ]


def timed(command: list[str], run, stage_id: str, nproc: int) -> tuple[float, float]:
    """(wall s, busy CPU-s) of the stage from scratch."""
    shutil.rmtree(run.stage(stage_id), ignore_errors=True)
    env = rank_env(nproc)
    wall, busy = time.monotonic(), busy_cpu_seconds()
    proc = subprocess.run(command, env=env, cwd=REPO, capture_output=True, text=True)
    wall, busy = time.monotonic() - wall, busy_cpu_seconds() - busy
    if proc.returncode != 0:
        logs = "".join(p.read_text()[-2000:] for p in sorted(run.logs(stage_id).glob("rank-*.log")))
        sys.exit(f"{command[2]} failed (rc={proc.returncode}):\n{proc.stderr[-2000:]}\n{logs}")
    return wall, busy


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--out", default="runs/bench-rank-start", help="run directory of the benchmark (reused)")
    p.add_argument("--stage", default="stage1_sft")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--reps", type=int, default=3, help="repetitions of each side, interleaved")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for hpcr1 run")
    args = p.parse_args()
    # A stage of a few steps: what is measured is the start, not the training.
    overrides = [f"{args.stage}.steps=2", f"{args.stage}.checkpoint_every=2", *args.overrides]
    _, run = prepare(args.config, args.out, overrides)
    sides = {
        "ours (forked from a preloaded forkserver)": torchrun_command,
        "peer (plain torchrun, an interpreter a rank)": peer_command,
    }
    results = {name: [] for name in sides}
    for rep in range(args.reps):
        for name, command in sides.items():
            wall, busy = timed(command(run.root, args.stage, args.nproc), run, args.stage, args.nproc)
            results[name].append((wall, busy))
            print(f"rep {rep + 1} {name}: wall {wall:.1f} s, machine busy {busy:.1f} CPU-s", flush=True)
    (ours, peer) = ([statistics.median(x[i] for x in results[name]) for i in (0, 1)] for name in sides)
    print(f"{args.stage} on {args.nproc} ranks, median of {args.reps}:")
    print(f"  wall: ours {ours[0]:.1f} s, peer {peer[0]:.1f} s, ours/peer {ours[0] / peer[0]:.2f}")
    print(f"  busy CPU-s: ours {ours[1]:.1f}, peer {peer[1]:.1f}, ours/peer {ours[1] / peer[1]:.2f}")


if __name__ == "__main__":
    main()
