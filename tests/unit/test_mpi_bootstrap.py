"""Rank discovery from the launchers' environments (fake env dicts), the choice of the master
endpoint under MPI, and the hand-over of calls made before the profiler existed."""

from __future__ import annotations

import json

import pytest

from runtime.comm_profiler import CommProfiler
from runtime.dist import RankInfo, discover_ranks, under_mpi
from runtime.mpi_bootstrap import check_reachable, local_rank, master_endpoint
from runtime.mpi_profiler import T_END, T_START, CallLog, object_size, pickled_size

OPEN_MPI = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1"}
HYDRA = {"PMI_RANK": "5", "PMI_SIZE": "6", "MPI_LOCALRANKID": "2"}
SRUN_PMIX = {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "PMIX_RANK": "2"}
TORCHRUN = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1"}


@pytest.mark.parametrize(
    "env, expected",
    [
        (OPEN_MPI, RankInfo(3, 8, 1, "mpi")),
        (HYDRA, RankInfo(5, 6, 2, "mpi")),
        (SRUN_PMIX, RankInfo(2, 4, 0, "slurm")),
        ({**SRUN_PMIX, **TORCHRUN}, RankInfo(1, 2, 1, "torchrun")),
        ({}, RankInfo(0, 1, 0, "single")),
    ],
)
def test_the_environment_names_the_rank(env, expected):
    assert discover_ranks(env) == expected


def test_mpi_launchers_are_told_apart_from_torchrun():
    assert under_mpi(OPEN_MPI) and under_mpi(HYDRA) and under_mpi(SRUN_PMIX)
    assert not under_mpi({**SRUN_PMIX, **TORCHRUN}), "torchrun in an srun task: torchrun's rendezvous"
    assert not under_mpi({"SLURM_PROCID": "0", "SLURM_NTASKS": "2"}) and not under_mpi({})


def test_local_rank_is_the_place_among_the_ranks_of_its_host():
    hosts = ["a", "b", "a", "b", "a"]
    assert [local_rank(hosts, r) for r in range(5)] == [0, 0, 1, 1, 2]


def test_rank_0_names_the_users_endpoint_or_its_own_with_a_free_port():
    assert master_endpoint({"MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29501"}) == ("10.1.2.3", 29501)
    addr, port = master_endpoint({})
    assert addr and 0 < port < 65536 and port != 29500


def test_a_loopback_master_is_refused_only_across_hosts():
    check_reachable("127.0.0.1", ["vm", "vm"])
    check_reachable("10.1.2.3", ["a", "b"])
    check_reachable("fd00::2", ["a", "b"])
    for loopback in ("127.0.1.1", "::1", "localhost"):
        with pytest.raises(RuntimeError, match="set MASTER_ADDR"):
            check_reachable(loopback, ["a", "b"])


def test_an_object_gather_counts_every_piece():
    pieces = ["node-a", "node-bb"]
    assert object_size("all_gather", "node-a", pieces, 2) == sum(map(pickled_size, pieces))
    assert object_size("gather", "node-a", None, 2) == 2 * pickled_size("node-a"), "a non-root rank"
    assert object_size("broadcast", None, ("10.1.2.3", 29501), 2) == pickled_size(("10.1.2.3", 29501))


def test_kept_calls_reach_the_profile_with_their_own_times(tmp_path):
    early = CallLog()
    event = early.record("broadcast", 29, "pickle", (0, 1), None, "mpi", "mpi")
    event[T_END] = event[T_START] + 0.5  # as ProfiledComm stamps it when the call returns
    profiler = CommProfiler(tmp_path, "stage1_sft", rank=1, attempt=2)
    profiler.set_step(7)  # the hand-over says step 0 whatever the profiler's step
    early.hand_to(profiler, phase="bootstrap")
    profiler.flush()
    (row,) = [json.loads(line) for line in (tmp_path / "rank-00001.jsonl").read_text().splitlines()]
    assert {k: row[k] for k in ("step", "phase", "op", "bytes", "rank", "attempt", "backend", "source")} == {
        "step": 0,
        "phase": "bootstrap",
        "op": "broadcast",
        "bytes": 29,
        "rank": 1,
        "attempt": 2,
        "backend": "mpi",
        "source": "mpi",
    }
    assert (row["t_start"], row["t_end"]) == (event[T_START], event[T_END]) and row["seq"] == 0
    assert early.calls == []
