"""torchrun, recording how each failed rank ended: `python -m launch.torchrun FAILURES_JSON ARGS...`
runs `torchrun ARGS...` and, if ranks fail, writes to FAILURES_JSON each failed rank's exit code,
signal and torchrun's timestamp (whole seconds), in the order torchrun saw them end. A rank killed
by a signal leaves no record of its own: this is where the driver learns which rank it was and how
it ended (runtime.rank_failure).

It also carries preemption through torchrun, which on its own would die of a USR1 (the default
action) and report ranks that stopped to be requeued as failed: USR1 is passed on to the ranks,
and when ranks stopped with PREEMPTED_EXIT (their checkpoint sealed behind a barrier) and the rest
only by torchrun's SIGTERM that followed, this process exits with PREEMPTED_EXIT too.
"""

from __future__ import annotations

import json
import signal
import sys

import psutil
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from core.atomic import atomic_write_text
from runtime.preemption import PREEMPTED_EXIT


def _forward_to_ranks(signum, frame) -> None:
    # torchrun runs in this process; the ranks are its direct children.
    for child in psutil.Process().children():
        try:
            child.send_signal(signum)
        except psutil.NoSuchProcess:  # ended meanwhile
            pass


def preempted(failures) -> bool:
    codes = {f.exitcode for f in failures}
    return PREEMPTED_EXIT in codes and codes <= {PREEMPTED_EXIT, -signal.SIGTERM}


def main(argv: list[str]) -> None:
    failures_file, *torchrun_args = argv
    signal.signal(signal.SIGUSR1, _forward_to_ranks)
    try:
        run(parse_args(torchrun_args))
    except ChildFailedError as e:
        if preempted(e.failures.values()):
            sys.exit(PREEMPTED_EXIT)
        # Insertion order is the order torchrun's monitor saw the ranks end (a poll every 0.1 s).
        ended = [
            {
                "rank": rank,
                "exitcode": f.exitcode,
                "signal": None if f.exitcode >= 0 else f.signal_name(),
                "timestamp": f.timestamp,
            }
            for rank, f in e.failures.items()
        ]
        atomic_write_text(failures_file, json.dumps(ended, indent=2) + "\n")
        raise


if __name__ == "__main__":
    main(sys.argv[1:])
