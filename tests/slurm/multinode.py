"""Starting and stopping the multi-node local Slurm (slurm/local/start-multinode.sh) from tests; the
fixture that does both for a module is `multinode_env` (tests/slurm/conftest.py)."""

from __future__ import annotations

import subprocess
import time

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
