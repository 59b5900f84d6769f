"""torchrun, recording how each failed rank ended: `python -m launch.torchrun FAILURES_JSON ARGS...`
runs `torchrun ARGS...` and, if ranks fail, writes to FAILURES_JSON each failed rank's exit code,
signal and torchrun's timestamp (whole seconds), in the order torchrun saw them end. A rank killed
by a signal leaves no record of its own: this is where the driver learns which rank it was and how
it ended (launch.rank_failure).
"""
from __future__ import annotations

import json
import sys

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from pipeline.atomic import atomic_write_text


def main(argv: list[str]) -> None:
    failures_file, *torchrun_args = argv
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        # Insertion order is the order torchrun's monitor saw the ranks end (a poll every 0.1 s).
        ended = [{"rank": rank, "exitcode": f.exitcode, "signal": None if f.exitcode >= 0 else f.signal_name(),
                  "timestamp": f.timestamp} for rank, f in e.failures.items()]
        atomic_write_text(failures_file, json.dumps(ended, indent=2) + "\n")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
