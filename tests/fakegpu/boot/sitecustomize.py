"""Installs the emulated accelerator (tests/fakegpu) at interpreter startup when HPCR1_FAKEGPU=1:
`fakegpu.child_env()` puts this directory first on PYTHONPATH, so every process of a run (torchrun,
its ranks, the stages the CLI starts) has the device before its own code runs. A sitecustomize
found further down the path still runs after it."""

import importlib.machinery
import importlib.util
import os
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]


def _install() -> None:
    """Install the harness, or end the process: site.py would report a failure here in one line and
    go on, and the run would pass on the CPU without having tested anything."""
    try:
        if str(REPO) not in sys.path:  # before site-packages, where verl installs a `tests` package
            sys.path.insert(1 + _position_of_here(), str(REPO))
        from tests import fakegpu

        fakegpu.install()
    except BaseException:
        traceback.print_exc()
        sys.stderr.write("tests/fakegpu/boot/sitecustomize.py: the emulated accelerator failed to install\n")
        raise SystemExit(70)


def _position_of_here() -> int:
    paths = [Path(p or ".").resolve() for p in sys.path]
    return paths.index(HERE) if HERE in paths else -1


def _chain() -> None:
    """Run the sitecustomize this one shadows, if there is one."""
    rest = [p for p in sys.path if Path(p or ".").resolve() != HERE]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is not None:
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)


if os.environ.get("HPCR1_FAKEGPU") == "1":
    _install()
_chain()
