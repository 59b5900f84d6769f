"""bench/gpu_acceptance.py where there is no GPU: it checks what it can, says that no GPU is present,
lists every check as not run and exits 2; a bad --only exits 2 naming the checks; the figures it
prints are read from what the checks wrote."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest
import torch

from tests.conftest import REPO

BENCH = REPO / "bench" / "gpu_acceptance.py"


def run_bench(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_a_gpu_it_says_so_and_runs_nothing(tmp_path):
    out = run_bench("--out", str(tmp_path / "acc"))
    assert out.returncode == 2
    assert "no GPU present" in out.stderr
    rows = out.stdout.splitlines()[1:]
    assert [r.split()[0] for r in rows] == ["commbench", "sft_mfu", "pipeline", "report", "verl"]
    assert all(r.split()[1:3] == ["NOT", "RUN"] for r in rows)
    assert not (tmp_path / "acc").exists()


def test_an_unknown_check_exits_2_naming_the_choices():
    out = run_bench("--only", "commbench,nope")
    assert out.returncode == 2
    assert "choose from commbench, sft_mfu, pipeline, report, verl" in out.stderr


def test_figures_come_from_what_the_checks_wrote(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import commbench_figure, cuda_timing_problems, profile_events

    bench = {
        "backend": "nccl",
        "world_size": 4,
        "results": {
            "all_reduce": [
                {"bytes": 1 << 20, "latency_us": 40.0, "busbw_GBps": 39.3},
                {"bytes": 256 << 20, "latency_us": 2100.0, "busbw_GBps": 191.7},
            ]
        },
    }
    assert commbench_figure(bench) == "nccl x4: all_reduce 256 MiB 2100 us, busbw 191.7 GB/s"
    times = [(1.0, 1.2, 1.5), (1.0, None, 1.5), (1.0, 1.6, 1.5)]  # ordered, no stream time, ready after end
    rows = [
        {"op": "all_reduce", "seq": i, "rank": 0, "backend": b, "t_start": s, "t_ready": r, "t_end": e}
        for i, (b, (s, r, e)) in enumerate(zip(("nccl", "gloo", "nccl"), times))
    ]
    (tmp_path / "rank-00000.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    events = profile_events(tmp_path)
    assert {e["backend"] for e in events} == {"nccl", "gloo"}
    problems = [p.split(":")[0] for p in cuda_timing_problems(events)]
    assert problems == ["all_reduce seq 1 rank 0", "all_reduce seq 2 rank 0"]


def test_the_verl_check_gives_the_stage_driver_what_a_verl_job_gives_it():
    """The verl check runs `hpcr1 stage` outside Slurm: its environment must hold what
    launch/verl_job.py reads from verl_stage.sbatch's job, or the check dies on a KeyError on the GPU."""
    import argparse
    import inspect

    from launch import verl_job

    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import local_ray_head

    env = local_ray_head(argparse.Namespace(gpus=1)).env

    read = set(re.findall(r'os\.environ\["(\w+)"\]', inspect.getsource(verl_job)))
    assert read and read <= set(env), read - set(env)


def write_grpo_stage(stage_dir, lines: list[dict], t_ends: list[float]) -> None:
    """A GRPO stage of rank 0: metrics lines, and one policy_update all-reduce per t_end (t_ready 10.0)."""
    (stage_dir / "profile").mkdir(parents=True)
    events = [
        {
            "stage": "stage2_grpo",
            "step": 1,
            "phase": "policy_update",
            "rank": 0,
            "op": "all_reduce",
            "bytes": 8,
        }
        | {"group_ranks": [0], "seq": i, "t_start": 9.999, "t_ready": 10.0, "t_end": end, "backend": "nccl"}
        for i, end in enumerate(t_ends)
    ]
    (stage_dir / "profile" / "rank-00000.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    (stage_dir / "metrics.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))


STEP_PHASES = {"weight_sync": 0.1, "rollout": 0.5, "reward": 0.05, "advantage": 0.05, "policy_update": 0.25}


def test_the_grpo_split_passes_when_phases_cover_the_step_and_times_agree(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import grpo_split

    lines = [
        {"step": s, "step_time_s": 1.0, **{f"phase_time/{p}": t for p, t in STEP_PHASES.items()}}
        for s in (1, 2)
    ]
    write_grpo_stage(tmp_path, lines, [10.1])
    assert grpo_split(tmp_path) == ("GRPO phases cover 95% of the step time (median of 2 steps)", [])


def test_the_grpo_split_fails_on_a_missing_phase_an_uncovered_step_or_contradicting_times(tmp_path):
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_acceptance import grpo_split

    no_rollout = {f"phase_time/{p}": t for p, t in STEP_PHASES.items() if p != "rollout"}
    lines = [{"step": s, "step_time_s": 1.0, **no_rollout} for s in (1, 2)]
    write_grpo_stage(tmp_path, lines, [9.998, 11.0])  # one call ends before it began; 1 s in a 0.5 s phase
    _, problems = grpo_split(tmp_path)
    assert [p.split(":")[0].split(" (")[0] for p in problems] == [
        "1 calls of rank 0 end before they begin",
        "phase policy_update",
        "step 1 has no time for rollout",
        "step 2 has no time for rollout",
        "its phases add up to 45% of the step time, not",
    ]
