"""Shared test fixtures: launching real ranks with torchrun, the repository's paths, and reading
the report's Markdown tables back."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]

# Modules that share one service and must run in one xdist worker, one after the other: the
# multi-node cluster is a session fixture that one module's test stops and the others restart; the
# single-node one's two CPUs fit one stage job at a time, and verl's Ray ports are the profile's.
SHARED_SERVICE_GROUPS = {
    "tests/slurm/test_multinode_": "multinode-slurm",
    "tests/slurm/test_slurm_": "local-slurm",
}


def work_unit(nodeid: str) -> str:
    """What one xdist worker runs whole: the test's module, where its module-scoped fixtures are
    built once, or the group of modules sharing its service."""
    module = nodeid.split("::", 1)[0]
    return next((g for prefix, g in SHARED_SERVICE_GROUPS.items() if module.startswith(prefix)), module)


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` (make test) hands out work units as `work_unit` names them. (pytest 9
    ignores the node ids that `--dist loadgroup` rewrites, so xdist_group marks group nothing.)"""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_collection_modifyitems(config, items):
    """In xdist workers, the work units holding Slurm tests, then those holding slow tests, first:
    workers take the units in collection order (`--no-loadscope-reorder`), and the longest must not
    start last. One process keeps pytest's order."""
    if not hasattr(config, "workerinput"):
        return
    tier: dict[str, int] = {}
    for item in items:
        unit = work_unit(item.nodeid)
        mine = 0 if item.get_closest_marker("slurm") else 1 if item.get_closest_marker("slow") else 2
        tier[unit] = min(tier.get(unit, mine), mine)
    items.sort(key=lambda item: tier[work_unit(item.nodeid)])  # stable: a module keeps its order


# A run small enough for tests: 20 SFT steps of the tiny model on 512 arithmetic examples.
SMALL_RUN = {
    "name": "small",
    "seed": 3,
    "nproc": 2,
    "data": {"arithmetic": {"sft_size": 512, "prompts_size": 16, "eval_size": 16}},
    # Greedy answers to the held-out split only: the sampled ones and the validation split, ~2 s a
    # run, are scored where they are tested (EVAL_IN_FULL: test_stages_on_fakegpu, and every run of
    # the embedded default).
    "eval": {
        "num_examples": 16,
        "max_new_tokens": 40,
        "batch_size": 16,
        "samples": 0,
        "validation_examples": 0,
    },
    "wandb": {"mode": "disabled"},
    "stage1_sft": {
        "steps": 20,
        "global_batch_size": 16,
        "micro_batch_size": 4,
        "lr": 3e-3,
        "min_lr": 3e-4,
        "warmup_steps": 2,
        "checkpoint_every": 5,
        "parallel": {"tp": 1, "pp": 1, "zero_stage": 1},
    },
}

# SMALL_RUN's eval as the embedded default scores it: 4 sampled answers a problem, and the validation split.
EVAL_IN_FULL = ("eval.samples=4", "eval.validation_examples=null")


def hpcr1_env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(REPO / ".torch_extensions")}


def tiny_base_built_here(config: Path, base: Path, overrides) -> list[str]:
    """For a config whose base model is the tiny one: that model built in this process, by the
    driver's own builder from the same fields, at `base` (unless there), given to the run as
    `model.source=hf` (overrides after the test's own). The driver's build is a run's longest serial
    part, ~5 s of importing transformers' model code before any rank starts, which this process
    pays once. [] where the driver builds nothing or the config is bad (the driver reports it)."""
    from core.config import ConfigError, load_config
    from stages.inputs import build_tiny_base

    try:
        cfg = load_config(config, [o for o in overrides if "=" in o and not o.startswith("-")])
    except ConfigError:
        return []
    if cfg.model.source != "tiny":
        return []
    if not base.exists():
        build_tiny_base(cfg, base)
    return ["model.source=hf", f"model.path={base}"]


def tiny_base_of(run_dir: Path) -> Path:
    """Where hpcr1_run builds a run's tiny base model: beside it, as a test may write into its model."""
    return run_dir.with_name(f"{run_dir.name}.base")


def hpcr1_run(
    run_dir: Path,
    *overrides: str,
    wait: bool = True,
    env: dict[str, str] | None = None,
    config: dict = SMALL_RUN,
    check: bool = True,
    tiny_base: Path | None = None,
):
    """`hpcr1 run` of `config` (file paths in it relative to run_dir's parent) into run_dir: waited
    for and checked to succeed (unless not `check`), or (wait=False) the running process, in a
    session of its own so that a test can kill it with its ranks. A tiny base model is built here,
    at `tiny_base` (default: `tiny_base_of(run_dir)`; a copied run continues with its original's,
    the path being part of the model's fingerprint)."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    base = tiny_base_built_here(path, tiny_base or tiny_base_of(run_dir), overrides)
    cmd = [
        sys.executable,
        "-m",
        "pipeline.cli",
        "run",
        str(path),
        "--run-dir",
        str(run_dir),
        *overrides,
        *base,
    ]
    full_env = {**hpcr1_env(), **(env or {})}
    if not wait:
        return subprocess.Popen(
            cmd,
            cwd=REPO,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    proc = subprocess.run(cmd, cwd=REPO, env=full_env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 or not check, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


def run_once(root: Path, *common: str):
    """`get(name, *overrides, env=None)`: the run directory root/name, made by `hpcr1_run` with
    `common` and `overrides` on first request and shared by every later one (a module's tests
    compare runs without repeating them)."""
    made: dict[str, Path] = {}

    def get(name: str, *overrides: str, env: dict[str, str] | None = None) -> Path:
        if name not in made:
            made[name] = root / name
            hpcr1_run(made[name], *common, *overrides, env=env)
        return made[name]

    return get


def sft_losses(run_dir: Path) -> list[float]:
    """stage1_sft's loss at each step, from metrics.jsonl, checked to hold each step once, in order."""
    lines = (run_dir / "stage1_sft" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line) for line in lines]
    assert [m["step"] for m in steps] == list(range(1, len(steps) + 1)), "each step exactly once, in order"
    return [m["loss"] for m in steps]


def resumed_steps(run_dir: Path, stage_id: str = "stage1_sft") -> list[int]:
    """The steps rank 0 of the stage said it resumed from, over all its attempts."""
    log = (run_dir / stage_id / "logs" / "rank-00000.log").read_text()
    return [int(line.rsplit(" ", 1)[1]) for line in log.splitlines() if "resumed from step" in line]


def snapshot(root: Path) -> dict[str, str]:
    """Every path under root with its content's sha256 (directories and links marked as such):
    equal snapshots mean nothing was added, removed or changed."""
    from core.atomic import file_sha256

    def state(p: Path) -> str:
        if p.is_symlink():
            return f"link -> {os.readlink(p)}"
        return "dir" if p.is_dir() else file_sha256(p)

    return {str(p.relative_to(root)): state(p) for p in sorted(root.rglob("*"))}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_torchrun(
    script: Path | str, nproc: int, *args: str, timeout: float = 600, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """Run `script` on `nproc` real ranks (gloo) and fail the test with its output if it fails."""
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc-per-node={nproc}",
        f"--master-port={free_port()}",
        str(script),
        *args,
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO), **(env or {})}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=REPO)
    if proc.returncode != 0:
        pytest.fail(
            f"torchrun {script} failed (rc={proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-8000:]}"
        )
    return proc


def markdown_tables(text: str) -> list[list[list[str]]]:
    """Every Markdown table in `text` as rows of cells, header first (the |---| rule left out)."""
    tables, current = [], None
    for line in text.splitlines():
        if line.startswith("|"):
            if current is None:
                current = []
                tables.append(current)
            if not line.startswith("|---"):
                current.append([c.strip() for c in line.strip("|").split("|")])
        else:
            current = None
    return tables


def markdown_table(text: str, title: str) -> list[list[str]]:
    """The rows (header first) of the Markdown table under `#### title`."""
    return markdown_tables(text.split(f"#### {title}\n", 1)[1])[0]


SECONDS_PER_UNIT = {"s": 1.0, "ms": 1e-3, "µs": 1e-6}


def seconds(cell: str) -> float:
    """Inverse of analysis.tables.elapsed ("16.88 ms" -> 0.01688), good to the printed digits."""
    if cell == "0":
        return 0.0
    number, unit = cell.split(" ")
    return float(number) * SECONDS_PER_UNIT[unit]


@pytest.fixture
def torchrun():
    return run_torchrun


def shared_tmp_root(tmp_path_factory) -> Path:
    """The pytest run's base temporary directory, the same in every xdist worker (each worker's own
    base is a folder of it)."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


@pytest.fixture(scope="session")
def trained_runs(tmp_path_factory):
    """Trained run directories shared, read-only, by the tests of this pytest run that only need a
    trained model: `trained_runs.get(*overrides, config=SMALL_RUN, stages=("stage1_sft",), env=None)`
    (tests/support/trained_runs.py). At the end, every one handed out is checked to be unchanged."""
    from tests.support.trained_runs import TrainedRuns

    runs = TrainedRuns(shared_tmp_root(tmp_path_factory) / "trained-runs")
    yield runs
    runs.check_all_unchanged()
