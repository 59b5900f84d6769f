"""The process of one rank of one stage: `python -m launch.worker RUN_DIR STAGE_ID` under srun or
mpirun, or `run_rank(RUN_DIR, STAGE_ID)` in a process torchrun forks (launch/torchrun.py). Discovers
its rank, joins the process group, runs the stage, leaves cleanly."""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import multiprocessing
import os
import signal
import socket
import sys
import traceback
from pathlib import Path


def redirect_output(log_dir: Path, rank: int):
    """Send this rank's stdout/stderr (library chatter included) to logs/rank-N.log and return a
    handle on the original terminal, where rank 0 draws its progress bar."""
    log_dir.mkdir(parents=True, exist_ok=True)
    terminal = os.fdopen(os.dup(2), "w", buffering=1)
    log = open(log_dir / f"rank-{rank:05d}.log", "a", buffering=1)
    sys.stdout.flush(), sys.stderr.flush()
    os.dup2(log.fileno(), 1)
    os.dup2(log.fileno(), 2)
    logging.basicConfig(
        level=logging.INFO,
        stream=sys.stderr,
        force=True,
        format=f"%(asctime)s rank{rank} %(name)s: %(message)s",
    )
    return terminal


def die_with_launcher() -> None:
    """A rank in a session of its own (torchrun starts a command that way) outlives a SIGKILL to the
    process group of `hpcr1 run` (kill -9 -PGID, a job step killed by its scheduler), as does a rank
    whose forkserver is left without torchrun: ranks went on writing checkpoints and final/ next to
    the attempt that resumed the stage. Ask the kernel to SIGKILL this rank when the process that
    started it dies (Linux); a forkserver leaves when its torchrun has gone."""
    from runtime.linux import die_with_parent

    die_with_parent()


def address_towards(host: str) -> str:
    """This host's address on the route to `host` (the master): which node, and which network, the
    rank talks from. A UDP connect sends nothing; it only picks the route."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((host, 9))
            return s.getsockname()[0]
    except OSError as e:  # a name that does not resolve here: the rendezvous fails and says why
        return f"unknown ({e})"


def main(argv: list[str] | None = None) -> None:
    run_dir, stage_id = (argv or sys.argv[1:])[:2]
    import torch.distributed as dist

    from core.config import load_resolved
    from core.manifest import Manifest
    from core.rundir import RunDir
    from runtime.comm_profiler import CommProfiler
    from runtime.context import StageContext
    from runtime.dist import discover_ranks, init_distributed, rank_device, shutdown_distributed
    from runtime.linux import container_here
    from runtime.mpi_profiler import CallLog
    from runtime.preemption import PREEMPTED_EXIT, install_handlers
    from runtime.rank_failure import record_crashes, record_exception
    from stages.kinds import run_stage

    run = RunDir(Path(run_dir))
    rank = discover_ranks().rank
    terminal = redirect_output(run.logs(stage_id), rank)
    record_crashes(run.logs(stage_id), rank)
    cfg = load_resolved(run)
    bootstrap = CallLog()  # the MPI rank discovery's calls, made before the profiler exists
    info = init_distributed(mpi_calls=bootstrap)
    logging.getLogger("hpcr1").info(
        "rank %d of %d on %s (%s), host %s address %s, master %s:%s, ranks from %s, pid %d, container %s",
        info.rank,
        info.world_size,
        rank_device(),
        dist.get_backend(),
        socket.gethostname(),
        address_towards(os.environ["MASTER_ADDR"]),
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
        info.source,
        os.getpid(),
        container_here(),
    )
    install_handlers()
    attempt = Manifest(run.root).stage(stage_id)["attempts"]
    profiler = (
        CommProfiler(run.profile(stage_id), stage_id, info.rank, attempt, cfg.profile.flush_every_s)
        if cfg.profile.comm
        else None
    )
    ctx = StageContext(cfg=cfg, run=run, stage_id=stage_id, rank=info, terminal=terminal, profiler=profiler)
    preempted = False
    try:
        with profiler or contextlib.nullcontext(), watch_for_hangs(profiler, run.logs(stage_id), info.rank):
            if profiler is not None:
                bootstrap.hand_to(profiler, phase="bootstrap")
            run_stage(ctx)
    except Exception as e:
        logging.getLogger("hpcr1").exception("stage %s failed on rank %d", stage_id, info.rank)
        record_exception(run.logs(stage_id), info.rank, e)
        # Leave now: the other ranks wait in a collective until this process is gone, and an orderly
        # exit (collecting torch/megatron/DeepSpeed's garbage) can take many seconds.
        leave_now(1)
    except SystemExit as e:
        if e.code != PREEMPTED_EXIT:
            raise
        preempted = True
    finally:
        shutdown_distributed()
    if preempted:
        # Every rank is past shutdown's barrier, the checkpoint sealed: leave together, not after
        # finalisations seconds apart, which also resets the TERM handler that leave_for_requeue set.
        leave_now(PREEMPTED_EXIT)


def watch_for_hangs(profiler, log_dir: Path, rank: int):
    """The rank's report of a call that runs past half its timeout and its watcher from outside
    (runtime/hang_watch.py); the report reads the calls the profiler holds open, so none without one."""
    import torch.distributed as dist

    from runtime.dist import collective_timeout
    from runtime.hang_watch import HangWatch, report_after_s, start_outside_watch

    if profiler is None:
        return contextlib.nullcontext()
    start_outside_watch(log_dir, rank)
    return HangWatch(profiler, log_dir, rank, report_after_s(collective_timeout(), dist.get_backend()))


def leave_now(code: int) -> None:
    """Exit without the interpreter's finalisation: a rank past `shutdown_distributed` has still
    been aborted there under load by a gloo thread being torn down (SIGABRT, "terminate called
    without an active exception"; test workers end this way too)."""
    sys.stdout.flush(), sys.stderr.flush()
    os._exit(code)


def run_rank(run_dir: str, stage_id: str) -> None:
    """The whole life of a rank process started by a command (srun, mpirun)."""
    faulthandler.enable()  # a crash while importing: its stack to the launcher's output
    die_with_launcher()
    main([run_dir, stage_id])


# What the parent of a forked rank passes on to it: torchrun's SIGTERM, a preemption's USR1. Not
# SIGINT: Ctrl-C reaches the rank itself, in the terminal's process group.
PASSED_ON = (signal.SIGTERM, signal.SIGUSR1)


def run_forked_rank(run_dir: str, stage_id: str) -> None:
    """torchrun's entry point in a process its forkserver forked (launch/torchrun.py). The rank runs
    in a child of this process, which passes signals on, waits and records how it ended: a rank
    killed by a signal cannot, and torchrun reports only the first of its forked ranks to end."""
    from core.rundir import RunDir
    from runtime.rank_failure import record_exit

    die_with_launcher()
    child = os.fork()
    if child == 0:
        _run_and_leave(run_dir, stage_id)
    for signum in PASSED_ON:
        signal.signal(signum, lambda signum, frame: pass_on(child, signum))
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    if code == 0:
        return
    record_exit(RunDir(Path(run_dir)).logs(stage_id), int(os.environ["RANK"]), code)
    if code < 0:  # end as the rank did, for torchrun to report
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    leave_now(code)


def pass_on(child: int, signum: int) -> None:
    os.kill(child, signum)
    if signum == signal.SIGTERM:  # a stopped rank (SIGSTOP, a debugger) ends now, not at SIGKILL 30 s later
        os.kill(child, signal.SIGCONT)


def _run_and_leave(run_dir: str, stage_id: str) -> None:
    # The platform's start method, as a rank started by a command has: the forkserver's would have
    # the rank's multiprocessing locks (tqdm's) registered with torchrun's resource tracker, and
    # reported there as leaked when the rank leaves without the interpreter's finalisation.
    multiprocessing.set_start_method(None, force=True)
    code = 1
    try:
        run_rank(run_dir, stage_id)
        code = 0
    except SystemExit as e:  # as the interpreter reads it: None is success, a message failure
        code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
    finally:
        leave_now(code)  # never back into the forkserver's code


if __name__ == "__main__":
    run_rank(*sys.argv[1:3])
