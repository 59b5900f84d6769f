"""A real stage under mpirun (`hpcr1 run --launcher mpirun`, 2 ranks): the ranks meet at the endpoint
rank 0 broadcast through MPI, and the report shows the MPI bootstrap's calls, sized, beside the
gloo calls of the stage."""

from __future__ import annotations

import copy
import pickle
import re
import socket
from pathlib import Path

import pytest

from analysis.events import load_events
from analysis.report import write_report
from analysis.tables import size
from tests.conftest import SMALL_RUN, hpcr1_run, markdown_table

pytestmark = [
    pytest.mark.dist,
]
# SMALL_RUN's SFT stage cut to 4 steps and a 4-example evaluation: the test is about the launch.
TINY = copy.deepcopy(SMALL_RUN)
TINY["stage1_sft"].update(steps=4, checkpoint_every=4)
TINY["data"]["arithmetic"].update(sft_size=64, eval_size=4)
TINY["eval"].update(num_examples=4, max_new_tokens=8, batch_size=4)
# Open MPI refuses to start ranks as root unless told twice (test containers run as root).
MPIRUN_ENV = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"}
BY_ORIGIN = "Communication by source, backend and operation (per rank)"


@pytest.fixture(scope="module")
def mpi_run(tmp_path_factory) -> Path:
    run = tmp_path_factory.mktemp("mpi") / "run"
    hpcr1_run(run, "--launcher", "mpirun", config=TINY, env=MPIRUN_ENV)
    write_report([run], run / "report")
    return run


def endpoints(run: Path) -> dict[int, tuple[str, int, str]]:
    """rank -> (master address, port, where the ranks came from), as each rank's log says."""
    found = {}
    for rank in (0, 1):
        log = (run / "stage1_sft" / "logs" / f"rank-{rank:05d}.log").read_text()
        addr, port, source = re.search(r"master (\S+):(\d+), ranks from (\w+)", log).groups()
        found[rank] = (addr, int(port), source)
    return found


def pickled(obj) -> int:
    return len(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL))


def test_the_ranks_meet_at_the_endpoint_rank_0_broadcast(mpi_run):
    seen = endpoints(mpi_run)
    assert seen[0] == seen[1] and seen[0][2] == "mpi", seen


def test_the_report_shows_the_bootstrap_calls_beside_the_gloo_calls(mpi_run):
    addr, port, _ = endpoints(mpi_run)[0]
    rows = markdown_table((mpi_run / "report" / "report.md").read_text(), BY_ORIGIN)
    header, rows = rows[0], {tuple(r[:3]): r[3:5] for r in rows[1:]}
    assert header[:5] == ["source", "backend", "op", "calls", "bytes"]
    mpi = {key: cells for key, cells in rows.items() if key[0] == "mpi"}
    assert mpi == {
        ("mpi", "mpi", "broadcast"): ["1", size(pickled((addr, port)))],  # rank 0's (address, port)
        ("mpi", "mpi", "all_gather"): ["1", size(2 * pickled(socket.gethostname()))],  # both ranks' hosts
    }
    assert any(src == "torch.distributed" and backend == "gloo" for src, backend, _ in rows), rows


def test_the_bootstrap_is_step_0_before_every_gloo_call(mpi_run):
    events = load_events(mpi_run / "stage1_sft")
    for rank in (0, 1):
        mine = [e for e in events if e["rank"] == rank]
        boot = [e for e in mine if e["source"] == "mpi"]
        assert {(e["op"], e["phase"], e["step"]) for e in boot} == {
            ("all_gather", "bootstrap", 0),
            ("broadcast", "bootstrap", 0),
        }
        first_gloo = min(e["t_start"] for e in mine if e["backend"] == "gloo")
        assert all(e["t_start"] <= e["t_end"] < first_gloo for e in boot)
