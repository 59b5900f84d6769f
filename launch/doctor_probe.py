"""What `hpcr1 doctor`'s probe job finds on a node: `python -m launch.doctor_probe OUT_DIR`, one task a
node, writes OUT_DIR/node-<host>.json with the node's GPUs and driver (nvidia-smi's own words), the
container, Python, glibc and venv the stage jobs' steps run in, the CUDA builds in that venv, and the
free room of the run directory's and the node-local scratch's file systems. pipeline/checks.py judges
them."""

from __future__ import annotations

import json
import os
import platform
import shutil
import socket
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from runtime.linux import container_here

# Where a node's caches go (Triton, torch extensions, Ray's spill): TMPDIR where the site sets one.
SCRATCH_VARS = ("TMPDIR", "SLURM_TMPDIR")


def nvidia_smi() -> str | None:
    """nvidia-smi's summary (its header names the driver and the CUDA it supports) and one CSV row
    a GPU; None on a node without it."""
    if shutil.which("nvidia-smi") is None:
        return None
    query = ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"]
    header = subprocess.run(["nvidia-smi"], capture_output=True, text=True, timeout=60).stdout
    rows = subprocess.run(query, capture_output=True, text=True, timeout=60).stdout
    return header + "\n--query-gpu=name,memory.total\n" + rows


def torch_cuda() -> str | None:
    """The CUDA the venv's torch was built for, read from its version module without importing torch."""
    try:
        text = Path(metadata.distribution("torch").locate_file("torch/version.py")).read_text()
    except (metadata.PackageNotFoundError, OSError):
        return None
    for line in text.splitlines():
        if line.startswith("cuda"):
            value = line.split("=", 1)[1].split("#")[0].strip().strip("'\"")
            return None if value in ("None", "") else value
    return None


def installed() -> dict[str, str]:
    return {d.metadata["Name"]: d.version for d in metadata.distributions() if d.metadata["Name"]}


def free_room(path: Path) -> dict:
    """The file system `path` will be made on (its nearest existing parent): free bytes and inodes;
    `counts_inodes` false where it keeps no inode count (btrfs reports 0 files)."""
    path = path.resolve()
    while not path.exists():
        path = path.parent
    fs = os.statvfs(path)
    return {
        "path": str(path),
        "free_bytes": fs.f_bavail * fs.f_frsize,
        "free_inodes": fs.f_favail,
        "counts_inodes": fs.f_files > 0,
    }


def node_facts(run_dir: Path) -> dict:
    scratch = {var: free_room(Path(os.environ[var])) for var in SCRATCH_VARS if os.environ.get(var)}
    return {
        "host": socket.gethostname(),
        "container": container_here(),
        "python": platform.python_version(),
        "executable": sys.executable,
        "glibc": os.confstr("CS_GNU_LIBC_VERSION"),
        "nvidia_smi": nvidia_smi(),
        "torch_cuda": torch_cuda(),
        "packages": installed(),
        "run_dir": free_room(run_dir),
        "scratch": scratch,
    }


def main(argv: list[str]) -> int:
    out, run_dir = Path(argv[0]), Path(argv[1])
    facts = node_facts(run_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"node-{facts['host']}.json").write_text(json.dumps(facts, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
