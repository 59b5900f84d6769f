"""`hpcr1 sweep`: a dry run over four scales writes four run directories that differ from the base
config only in the ranks and the batches grown with them, with sbatch scripts for the right nodes;
a scale that does not fit stops the sweep before anything is written. And the scaling report's
communication fraction, on events whose answer is known."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from analysis.auto_layout import auto_fields
from analysis.scaling import comm_fraction, scaling
from core.config import dump_config, load_config
from pipeline.cli import main
from tests.conftest import REPO

CONFIG = REPO / "configs" / "llama-3.1-8b.yaml"
# The shipped Llama 3.1 8B shape (config.json only) and a generated task instead of the data files.
OVERRIDES = [
    "model.path=models/llama-3.1-8b",
    "data.task=arithmetic",
    "data.arithmetic.sft_size=64",
    "data.arithmetic.prompts_size=64",
    "data.arithmetic.eval_size=16",
]
GPUS = (16, 32, 64, 128)


def sweep(tmp_path: Path, *args: str) -> int:
    return main(["sweep", str(CONFIG), "--sweep-dir", str(tmp_path / "sweep"), *args, *OVERRIDES])


def directives(script: Path) -> list[str]:
    return [line.split(None, 1)[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("dry")
    assert (
        sweep(
            tmp,
            "--gpus",
            ",".join(map(str, GPUS)),
            "--per-gpu-batch",
            "4",
            "--cluster",
            "perlmutter",
            "--dry-run",
        )
        == 0
    )
    return tmp / "sweep"


def test_dry_run_writes_one_run_dir_per_scale_listed_in_sweep_json(dry_run):
    record = json.loads((dry_run / "sweep.json").read_text())
    assert [s["gpus"] for s in record["scales"]] == list(GPUS)
    assert [s["nodes"] for s in record["scales"]] == [n // 4 for n in GPUS]  # Perlmutter: 4 GPUs a node
    assert record["per_gpu_batch"] == 4 and record["cluster"] == "perlmutter" and record["dry_run"] is True
    assert all(s["jobs"] is None for s in record["scales"])  # nothing was submitted
    assert sorted(p.name for p in dry_run.iterdir() if p.is_dir()) == [f"gpus-{n:04d}" for n in GPUS]


@pytest.mark.parametrize("gpus", GPUS)
def test_each_scale_differs_from_the_base_only_in_ranks_and_batches(dry_run, gpus):
    base = yaml.safe_load(dump_config(load_config(CONFIG, OVERRIDES)))
    scaled = yaml.safe_load((dry_run / f"gpus-{gpus:04d}" / "config.yaml").read_text())
    dp = gpus // 2  # the config's SFT stages use tp=2, pp=1
    expected = {
        ("nproc",): gpus,
        ("stage1_sft", "global_batch_size"): 4 * dp,
        ("stage3_sft", "global_batch_size"): 4 * dp,
        ("stage2_grpo", "prompts_per_step"): 4 * gpus,
        ("stage4_grpo", "prompts_per_step"): 4 * gpus,
        # synthesis keeps the base config's prompts per rank: 20000 over 16 ranks
        ("stage3_synth", "num_prompts"): 20000 * gpus // 16,
    }
    # 'auto' layouts are chosen for the scale's GPUs at its submission (analysis/auto_layout.py)
    expected.update({tuple(key.split(".")): int for key in auto_fields(load_config(CONFIG, OVERRIDES))})
    for *sections, field in expected:
        scaled_part, base_part = scaled, base
        for section in sections:
            scaled_part, base_part = scaled_part[section], base_part[section]
        want, got = expected[(*sections, field)], scaled_part.pop(field)
        assert isinstance(got, want) if isinstance(want, type) else got == want
        base_part.pop(field)
    assert scaled == base  # everything else, steps included, as the base config says


@pytest.mark.parametrize("gpus", GPUS)
def test_sbatch_scripts_ask_for_the_nodes_of_their_scale(dry_run, gpus):
    scripts = sorted((dry_run / f"gpus-{gpus:04d}").glob("*/logs/*.sbatch"))
    assert [s.parent.parent.name for s in scripts] == sorted(
        ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]
    )
    for script in scripts:
        d = directives(script)
        assert f"--nodes={gpus // 4}" in d and "--ntasks-per-node=4" in d and "--gpus-per-node=4" in d, d


@pytest.mark.parametrize(
    "args, named",
    [
        (
            ["--gpus", "16,18", "--per-gpu-batch", "4", "--cluster", "perlmutter"],
            "--gpus 18: nproc",
        ),  # 4.5 nodes
        (
            ["--gpus", "16,3", "--per-gpu-batch", "4"],
            "--gpus 3: stage1_sft.parallel",
        ),  # tp=2 does not divide 3
        (
            ["--gpus", "16,32", "--per-gpu-batch", "3", "stage1_sft.micro_batch_size=2"],
            "--gpus 16: stage1_sft.global_batch_size",
        ),  # 3 sequences a rank in micro-batches of 2
        (
            ["--gpus", "16,32", "--per-gpu-batch", "3", "stage2_grpo.engine=native"],
            "--gpus 16: stage2_grpo.mini_batches",
        ),  # 2 do not divide 3 (the native engine's rule; the config's verl splits batches its own way)
        (
            ["--gpus", "16,20", "--per-gpu-batch", "4", "stage3_synth.num_prompts=10"],
            "--gpus 20: stage3_synth.num_prompts",
        ),  # 10 prompts over 16 ranks make 12.5 over 20
        (["--gpus", "16,x", "--per-gpu-batch", "4"], "--gpus"),
        (["--gpus", "16", "--per-gpu-batch", "0"], "--per-gpu-batch"),
        (["--gpus", "16", "--per-gpu-batch", "4", "--only", "stage9"], "--only"),
    ],
)
def test_a_scale_that_does_not_fit_exits_2_naming_it_and_writes_nothing(tmp_path, capsys, args, named):
    assert sweep(tmp_path, *args, "--dry-run") == 2  # (were it to pass, a dry run starts no ranks)
    err = capsys.readouterr().err
    assert err.startswith(f"hpcr1: error: {named}") and err.count("\n") == 1, err
    assert list(tmp_path.iterdir()) == []


def event(
    rank: int,
    t0: float,
    t1: float,
    step: int = 1,
    group: int = 2,
    async_op: bool = False,
    t_wait: float | None = None,
) -> dict:
    return {
        "stage": "s",
        "step": step,
        "phase": "p",
        "rank": rank,
        "op": "all_reduce",
        "bytes": 4,
        "dtype": "f",
        "group_size": group,
        "group_ranks": list(range(group)),
        "peer": None,
        "seq": 0,
        "t_start": t0,
        "t_end": t1,
        "backend": "gloo",
        "source": "torch.distributed",
        "async_op": async_op,
        "t_wait": t_wait,
    }


def test_comm_fraction_counts_blocked_time_inside_steps_only(tmp_path):
    """Two ranks, two steps [10, 11) and [12, 13): what counts is worked out by hand below."""
    events = {
        0: [
            event(0, 5.0, 6.0, step=0),  # setup before step 1: outside every window
            event(0, 10.0, 10.2),  # 0.2 s blocked
            event(0, 10.1, 10.3),  # overlaps the previous one: +0.1 s
            event(0, 10.5, 10.6, group=1),  # a group of one rank: not communication
            event(0, 12.0, 12.8, async_op=True, t_wait=12.6),  # overlapped until 12.6, then 0.2 s waited
            event(0, 12.9, 13.4),
        ],  # crosses the step's end: 0.1 s inside
        1: [event(1, 10.0, 10.5), event(1, 11.2, 11.8)],
    }  # 0.5 s; the second is between steps
    (tmp_path / "profile").mkdir()
    for rank, rows in events.items():
        (tmp_path / "profile" / f"rank-{rank:05d}.jsonl").write_text(
            "".join(json.dumps(e) + "\n" for e in rows)
        )
    windows = [(10.0, 11.0), (12.0, 13.0)]
    rank0, rank1 = 0.2 + 0.1 + 0.2 + 0.1, 0.5
    assert comm_fraction(tmp_path, windows, gpus=2) == pytest.approx((rank0 / 2 + rank1 / 2) / 2)
    assert comm_fraction(tmp_path, windows, gpus=3) is None  # a rank's profile is missing


def test_only_submits_the_stages_named(tmp_path):
    assert (
        sweep(
            tmp_path,
            "--gpus",
            "16,32",
            "--per-gpu-batch",
            "4",
            "--cluster",
            "perlmutter",
            "--dry-run",
            "--only",
            "stage1_sft",
        )
        == 0
    )
    for n in (16, 32):
        scripts = sorted((tmp_path / "sweep" / f"gpus-{n:04d}").glob("*/logs/*.sbatch"))
        assert [s.name for s in scripts] == ["stage1_sft.sbatch"]
    assert json.loads((tmp_path / "sweep" / "sweep.json").read_text())["only"] == ["stage1_sft"]


def write_run(run: Path, nproc: int, stage: str, metrics: list[dict]) -> None:
    (run / stage).mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump({"nproc": nproc, "profile": {"comm": False}}))
    (run / stage / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_grpo_and_synthesis_throughput_and_efficiency(tmp_path):
    """GRPO: samples over every step but the first, over their time; synthesis: answers sampled over
    the slowest rank's generation time; efficiency against the smallest scale."""
    grpo = {
        2: [(9.0, 1.0), (8.0, 2.0), (4.0, 2.0)],
        4: [(9.0, 1.0), (10.0, 3.2), (20.0, 1.6)],
    }  # (samples/s, s)
    synth = {2: ([5.0, 4.0], 40), 4: ([5.0, 8.0], 64)}  # (generation seconds per rank, answers sampled)
    for n in (2, 4):
        write_run(
            tmp_path / f"n{n}",
            n,
            "stage2_grpo",
            [{"step": i + 1, "samples_per_s": r, "step_time_s": t} for i, (r, t) in enumerate(grpo[n])],
        )
        write_run(
            tmp_path / f"n{n}",
            n,
            "stage3_synth",
            [{"step": 1, "generation_time_s_per_rank": synth[n][0], "sampled": synth[n][1]}],
        )
    stages, left_out = scaling([tmp_path / "n4", tmp_path / "n2"], ["n4", "n2"])
    assert left_out == []
    g2, g4 = stages["stage2_grpo"]
    assert (g2.gpus, g4.gpus) == (2, 4)  # smallest first
    assert g2.samples_per_s == pytest.approx((16 + 8) / 4) and g4.samples_per_s == pytest.approx(
        (32 + 32) / 4.8
    )
    assert g4.efficiency == pytest.approx((64 / 4.8 / 4) / (6 / 2)) and g2.efficiency == 1.0
    assert g2.comm_fraction is None  # the runs did not profile
    s2, s4 = stages["stage3_synth"]
    assert s2.samples_per_s == pytest.approx(40 / 5) and s4.samples_per_s == pytest.approx(64 / 8)
    assert s4.efficiency == pytest.approx((8 / 4) / (8 / 2))


def test_metrics_without_throughput_are_named_not_guessed(tmp_path):
    write_run(tmp_path / "old", 2, "stage1_sft", [{"step": 1, "loss": 1.0, "step_time_s": 0.1}])
    assert scaling([tmp_path / "old"], ["old"]) == ({}, ["old/stage1_sft"])
