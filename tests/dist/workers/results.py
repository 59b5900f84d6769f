"""The `RESULT {json}` lines a worker prints for its test to parse."""
from __future__ import annotations

import json
import sys


def print_result(finding: dict) -> None:
    """One write call a line: the ranks share the test's stdout pipe, and where stdout is unbuffered
    (PYTHONUNBUFFERED), print's separate write of the newline let two ranks' lines run into one."""
    sys.stdout.write("RESULT " + json.dumps(finding) + "\n")
    sys.stdout.flush()
