"""The `RESULT {json}` lines a worker prints and its test reads back."""

from __future__ import annotations

import json
import sys

PREFIX = "RESULT "


def print_result(finding: dict) -> None:
    """One write call a line: the ranks share the test's stdout pipe, and where stdout is unbuffered
    (PYTHONUNBUFFERED), print's separate write of the newline let two ranks' lines run into one."""
    sys.stdout.write(PREFIX + json.dumps(finding) + "\n")
    sys.stdout.flush()


def read_results(stdout: str) -> list[dict]:
    """The findings of every `RESULT` line of the workers' output, in order."""
    return [json.loads(line.removeprefix(PREFIX)) for line in stdout.splitlines() if line.startswith(PREFIX)]
