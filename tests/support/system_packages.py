"""Commands that `make system-packages` installs (Open MPI, shellcheck, Chromium): a test that needs
one fails without it, naming the target, instead of skipping what it checks."""

from __future__ import annotations

import shutil


def system_command(*names: str) -> str:
    """The path of the first of `names` on PATH."""
    path = next(filter(None, map(shutil.which, names)), None)
    assert path, f"{' or '.join(names)}: not on PATH; `make system-packages` installs it"
    return path
