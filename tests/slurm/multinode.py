"""Starting and stopping the multi-node local Slurm (slurm/local/start-multinode.sh) from tests; the
fixture that does both for a module is `multinode_env` (tests/slurm/conftest.py)."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

from tests.conftest import REPO, hpcr1_env

SCRIPTS = REPO / "slurm" / "local"
# The start must stay quick: tests pay for it once per module.
START_BUDGET_S = 30


def start_multinode(nodes: int = 2) -> tuple[dict[str, str], float]:
    """The clients' environment (SLURM_CONF set) and the seconds the start took."""
    began = time.monotonic()
    out = subprocess.run(
        ["bash", str(SCRIPTS / "start-multinode.sh"), str(nodes)], capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - began
    assert out.returncode == 0, out.stdout + out.stderr
    conf = out.stdout.strip().splitlines()[-1].split("=", 1)[1]
    return {**hpcr1_env(), "SLURM_CONF": conf}, took


def stop_multinode() -> None:
    subprocess.run(["bash", str(SCRIPTS / "stop-multinode.sh")], capture_output=True, timeout=120, check=True)


# The faults a node of the cluster can suffer (tests/slurm/test_multinode_faults.py), and its return.
MN_DIR = Path("/var/tmp/hpcr1-slurm-multinode")


def workers_on(node: int, run: Path | None = None) -> list[int]:
    """The pids of the stage ranks (launch.worker) running on node `node` (its network namespace);
    only those of run directory `run` where given: another run's ranks may share the node."""
    out = subprocess.run(["ip", "netns", "pids", f"hpcr1-mnode{node}"], capture_output=True, text=True)
    pids = []
    for pid in out.stdout.split():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
            if is_rank(argv) and (run is None or run.resolve() in {Path(a).resolve() for a in argv[1:] if a}):
                pids.append(int(pid))
        except OSError:  # it ended meanwhile
            pass
    return pids


def is_rank(argv: list[str]) -> bool:
    """`python [-u] -m launch.worker ...`; not the srun (or launch.torchrun) that started it, whose
    arguments name launch.worker too: a cut-off batch host keeps its srun until it is back."""
    first_module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else None
    return "python" in Path(argv[0]).name and first_module == "launch.worker"


def cut_link(node: int) -> None:
    """The node's cable pulled: its veth's host side down (its processes live on, unreachable)."""
    subprocess.run(["ip", "link", "set", f"hpcr1v{node}", "down"], check=True)


def kill_slurmd(node: int) -> None:
    subprocess.run(["kill", (MN_DIR / "run" / f"slurmd-mnode{node}.pid").read_text().strip()], check=True)


def bring_back(node: int, nodes: int = 2) -> None:
    """The node's link up again and its slurmd running (start-multinode.sh restarts what is missing
    and resumes the nodes Slurm set down)."""
    subprocess.run(["ip", "link", "set", f"hpcr1v{node}", "up"], check=True)
    start_multinode(nodes)


def freeze(pids: list[int]) -> list[int]:
    """The processes stopped (SIGSTOP) where they are; see thaw."""
    for pid in pids:
        signal_if_alive(pid, signal.SIGSTOP)
    return pids


def thaw(pids: list[int]) -> None:
    for pid in pids:
        signal_if_alive(pid, signal.SIGCONT)


def signal_if_alive(pid: int, sig: signal.Signals) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # it ended meanwhile
        pass


def node_state(node: int) -> str:
    """Slurm's state of node `node` ("idle", "allocated", "down*", ...), lower case; the
    multi-node cluster's config, whatever SLURM_CONF says."""
    out = subprocess.run(
        ["sinfo", "-h", "-N", "-n", f"mnode{node}", "-o", "%T"],
        env={**os.environ, "SLURM_CONF": str(MN_DIR / "etc" / "slurm.conf")},
        capture_output=True,
        text=True,
        check=True,
    )
    return out.stdout.strip().lower()
