"""Shared by the ours-versus-TRL benches (sft_vs_trl.py, grpo_vs_trl.py).

Our side is the real stage: a run directory prepared by `hpcr1`'s own code from a config, the stage
started as `hpcr1 run` starts it (torchrun, N ranks of launch.worker), its per-step times read from
the stage's metrics.jsonl. The peer (TRL) runs in a fresh process of its own with the same total
thread count. Repetitions alternate ours / peer, so a load on the shared machine hits both alike;
each repetition's throughput is taken over its steady-state steps (the first `--warmup` steps
dropped), and the figure printed last is median(ours) / median(peer).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analysis.events import load_events  # noqa: E402
from analysis.matching import match_calls, wait_by_rank  # noqa: E402
from core.config import RunConfig, load_config  # noqa: E402
from core.rundir import RunDir  # noqa: E402
from launch.local import run_stage_locally  # noqa: E402
from pipeline.driver import prepare_run  # noqa: E402

PEER_FLAG = "--peer-worker"


@dataclass
class Step:
    seconds: float
    units: dict[str, float]  # what the step processed: samples, tokens ...


def parser(doc: str, steps: int, warmup: int) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    p.add_argument("--out", default="runs/bench-vs-trl", help="run directory of the benchmark (reused)")
    p.add_argument("--reps", type=int, default=3, help="repetitions of each side, interleaved")
    p.add_argument("--steps", type=int, default=steps, help="measured steps per repetition")
    p.add_argument("--warmup", type=int, default=warmup, help="steps run first and not measured")
    p.add_argument("--nproc", type=int, help="our ranks (default: the config's nproc); TRL runs one process")
    p.add_argument(
        "--threads",
        type=int,
        default=os.cpu_count(),
        help="total intra-op threads of each side: ours threads/nproc per rank, TRL all in one process",
    )
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides, as for hpcr1 run")
    return p


def prepare(config: str, out: str, overrides: list[str]) -> tuple[RunConfig, RunDir]:
    """The benchmark's run directory: resolved config and inputs (base model, data), as hpcr1 run
    writes them."""
    cfg = load_config(config, overrides)
    run = RunDir(Path(out).resolve())
    prepare_run(cfg, run, Path(config).resolve().parent)
    return cfg, run


def run_ours(run: RunDir, stage_id: str, nproc: int, threads: int, warmup: int | None = None) -> list[dict]:
    """The stage from scratch on `nproc` ranks; its metrics.jsonl rows. With `warmup`, prints how
    long the ranks waited for one another in the steps after it."""
    shutil.rmtree(run.stage(stage_id), ignore_errors=True)
    os.environ["OMP_NUM_THREADS"] = str(max(1, threads // nproc))
    if run_stage_locally(run.root, stage_id, nproc) != 0:
        logs = "".join(p.read_text()[-2000:] for p in sorted(run.logs(stage_id).glob("rank-*.log")))
        sys.exit(f"our {stage_id} failed:\n{logs}")
    rows = [json.loads(line) for line in run.metrics(stage_id).read_text().splitlines()]
    if warmup is not None:
        print_rank_waits(
            run, stage_id, [row["step"] for row in rows[warmup:]], step_wall_seconds(rows)[warmup:]
        )
    return rows


def step_wall_seconds(rows: list[dict]) -> list[float]:
    """Each step's seconds from its start to the next step's, so that the work between two steps
    (metrics, progress bar, the checkpoint boundary's agreement on stopping) counts, as it does in
    the peer's clock; the last step, with no next, its own time (the checkpoint after it is left
    out, as the peer saves none)."""
    starts = [row["t_start"] for row in rows]
    return [b - a for a, b in zip(starts, starts[1:])] + [rows[-1]["step_time_s"]]


def print_rank_waits(run: RunDir, stage_id: str, steps: list[int], seconds: list[float]) -> None:
    """Each rank's wait in collectives for the last to arrive, per measured step: how much of our
    step synchronous data parallelism loses to the ranks' speed differing (on a shared machine,
    mostly noise), from the stage's communication profile (absent with profile.comm false)."""
    # the checkpoint after the last step and the held-out eval of final/ are outside the steps
    calls = [
        c
        for c in match_calls(load_events(run.stage(stage_id)))
        if c.step in steps and c.phase not in ("checkpoint", "eval")
    ]
    if not calls:
        return
    waits = wait_by_rank(calls)
    print(
        "ours: waiting for the slowest rank in collectives, "
        f"ms a step (of {1000 * statistics.mean(seconds):.0f}): "
        + ", ".join(f"rank {r} {1000 * waits[r] / len(steps):.0f}" for r in sorted(waits)),
        flush=True,
    )


def run_peer(script: str, run: RunDir, threads: int, args: list[str]) -> list[Step]:
    """`script --peer-worker RUN_DIR OUT ARGS` in a fresh process with `threads` threads; its steps."""
    out = run.root / "peer-steps.jsonl"
    out.unlink(missing_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "TOKENIZERS_PARALLELISM": "false"}
    log = run.root / "peer.log"
    with open(log, "w") as f:
        rc = subprocess.run(
            [sys.executable, script, PEER_FLAG, str(run.root), str(out), *args],
            env=env,
            stdout=f,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        ).returncode
    if rc != 0:
        sys.exit(f"the TRL side failed (exit {rc}):\n{log.read_text()[-3000:]}")
    return [Step(**json.loads(line)) for line in out.read_text().splitlines()]


def write_steps(path: str, steps: list[Step]) -> None:
    Path(path).write_text("".join(json.dumps({"seconds": s.seconds, "units": s.units}) + "\n" for s in steps))


def peer_setup(run_dir: str, stage_id: str):
    """The peer's view of our run directory: (run, resolved config, the stage's section, the stage's
    starting model directory), with torch seeded as our stage is."""
    import torch

    from core.config import load_resolved

    run = RunDir(Path(run_dir))
    cfg = load_resolved(run)
    stage = getattr(cfg, stage_id)
    torch.manual_seed(cfg.seed)
    return run, cfg, stage, run.model_dir(stage.init_from)


def trl_cpu_args(seed: int) -> dict:
    """The TRL trainer arguments both peers share: fp32 on the CPU, no logging, saving or reporting
    that our side does not do either, data loading in the training process, our seed."""
    return {
        "use_cpu": True,
        "bf16": False,
        "logging_steps": 1 << 30,
        "save_strategy": "no",
        "report_to": [],
        "seed": seed,
        "dataloader_num_workers": 0,
    }


def trainer_clock(every: int, take_units):
    """A transformers TrainerCallback that records a Step every `every` optimizer steps: the wall
    time since the previous one (or since training began) and take_units(), what they processed."""
    from transformers import TrainerCallback

    class Clock(TrainerCallback):
        def __init__(self):
            self.steps: list[Step] = []
            self.count, self.last = 0, time.perf_counter()

        def on_train_begin(self, *args, **kwargs):
            self.last = time.perf_counter()

        def on_step_end(self, *args, **kwargs):
            self.count += 1
            if self.count % every == 0:
                now = time.perf_counter()
                self.steps.append(Step(now - self.last, take_units()))
                self.last = now

    return Clock()


def throughput(steps: list[Step], warmup: int, unit: str) -> float:
    measured = steps[warmup:]
    if not measured:
        sys.exit(f"no steady-state steps: {len(steps)} steps run, {warmup} of them warm-up")
    return sum(s.units[unit] for s in measured) / sum(s.seconds for s in measured)


def compare(
    runs: list[tuple[list[Step], list[Step]]], warmup: int, units: list[str], headline: str, setup: str
) -> None:
    """Per repetition and median figures of both sides; the ratio of the headline unit last."""
    print(setup)
    rates = {}
    for unit in units:
        ours = [throughput(o, warmup, unit) for o, _ in runs]
        peer = [throughput(p, warmup, unit) for _, p in runs]
        rates[unit] = ours, peer
        ours_median, peer_median = statistics.median(ours), statistics.median(peer)
        print(
            f"{unit}/s  ours: {' '.join(f'{v:.1f}' for v in ours)} (median {ours_median:.1f})  "
            f"TRL: {' '.join(f'{v:.1f}' for v in peer)} (median {peer_median:.1f})  "
            f"ratio {ours_median / peer_median:.2f}"
        )
    # A pair ran back to back, so its ratio is untouched by the machine's drift between pairs (on a
    # shared VM both sides' speed can move by 10-20% over minutes): the spread says how far to trust
    # the headline, a ratio of medians taken at different times.
    ours, peer = rates[headline]
    print(
        f"ours / TRL, {headline} per second, each repetition: "
        f"{' '.join(f'{o / p:.2f}' for o, p in zip(ours, peer))}"
    )
    print(
        f"ours / TRL, {headline} per second (median of {len(runs)}): "
        f"{statistics.median(ours) / statistics.median(peer):.2f}"
    )


def interleaved(reps: int, ours, peer) -> list[tuple[list[Step], list[Step]]]:
    """`reps` pairs, ours then peer, each printed as it finishes."""
    runs = []
    for rep in range(reps):
        pair = ours(), peer()
        print(f"repetition {rep + 1}/{reps} done", flush=True)
        runs.append(pair)
    return runs
