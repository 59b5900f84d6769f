"""Kill `hpcr1 run` anywhere, resume it, and compare with an uninterrupted run byte for byte.

    python bench/kill_anywhere.py --kills 20 [--seed S] [--nproc N] [--out DIR]

A tiny five-stage pipeline (configs/tiny-cpu.yaml shrunk by TINY_PIPELINE: a few steps a stage,
frequent checkpoints) runs once uninterrupted, and the harness records when each stage's steps
were logged. Kill times are drawn uniformly over that run's duration (seeded). Each becomes a point
of progress, the last step or stage boundary reached before it plus the seconds after that, so a
run that resumed from a checkpoint is killed at the same place in the work, not at the same
wall-clock time. A second run directory is then killed at each point in turn (SIGKILL to the whole
process group: driver, torchrun and ranks) and resumed with `hpcr1 run`, and finally run to the end.
Every stage's final weights and the synthetic data must equal the uninterrupted run's (sha256),
every stage's metrics.jsonl must hold each step exactly once, and no process of the run may
outlive a kill.

Prints, per kill: its time in the uninterrupted run, the point it was mapped to, and what it
interrupted (read from the manifest and the files the killed attempt left); then the verdict.
Exit code 1 on any mismatch. `--kills 0` compares two uninterrupted runs: the determinism check.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.atomic import tree_checksums  # noqa: E402
from core.config import STAGE_IDS, load_resolved  # noqa: E402
from core.rundir import RunDir  # noqa: E402
from launch.local import repo_env  # noqa: E402

CONFIG = REPO / "configs" / "tiny-cpu.yaml"
POLL_S = 0.05
OUTLIVE_S = 5.0  # the kernel ends a killed group's processes at once; this is ample
SFT = {"global_batch_size": 16, "micro_batch_size": 4, "warmup_steps": 2, "steps": 6, "checkpoint_every": 2}
GRPO = {"prompts_per_step": 4, "group_size": 2, "max_new_tokens": 48, "steps": 4, "checkpoint_every": 2}
# The embedded default, a few steps a stage. One-digit sums: thirty SFT steps teach the answer
# format, so that the synthesis stage keeps some sampled answers and stage3_sft has data.
TINY_PIPELINE = {
    "name": "kill-anywhere",
    "wandb": {"mode": "disabled"},
    "data": {
        "arithmetic": {
            "num_operands": 2,
            "digits": 1,
            "sft_size": 64,
            "prompts_size": 8,
            "eval_size": 8,
            "validation_size": 1,
        }
    },
    "eval": {"num_examples": 8, "max_new_tokens": 48, "batch_size": 8},
    "stage1_sft": {**SFT, "steps": 30, "checkpoint_every": 10, "lr": 3e-3, "min_lr": 3e-4},
    "stage2_grpo": GRPO,
    "stage3_synth": {"num_prompts": 8, "samples_per_prompt": 4, "max_new_tokens": 48, "batch_size": 2},
    "stage3_sft": SFT,
    "stage4_grpo": GRPO,
}


def dotted(tree: dict, prefix: str = "") -> list[str]:
    """A nested config section as `hpcr1` KEY=VALUE overrides."""
    out = []
    for key, value in tree.items():
        out += dotted(value, f"{prefix}{key}.") if isinstance(value, dict) else [f"{prefix}{key}={value}"]
    return out


def pipeline_overrides(nproc: int) -> list[str]:
    return [*dotted(TINY_PIPELINE), f"nproc={nproc}"]


@dataclass(frozen=True)
class KillPoint:
    time: float  # seconds into the uninterrupted run
    after: tuple[int, int]  # (stage index, steps logged) last reached before that time
    delay: float  # seconds after reaching it
    before: tuple[int, int]  # the point reached next: a faster attempt is killed there


class Attempt:
    """One `hpcr1 run` on a run directory, in its own process group, watched from outside."""

    def __init__(self, run_dir: Path, overrides: list[str], log: Path):
        self.run = RunDir(run_dir)
        self.started_wall, self.started = time.time(), time.monotonic()
        # metrics.jsonl files as earlier attempts left them: the ranks rewrite each when they
        # (re)start its stage, and only then do its lines say what this attempt has done.
        self.stale_metrics = {sid: _inode(self.run.metrics(sid)) for sid in STAGE_IDS}
        self.launched = self._attempts()
        self.outlived: list[int] = []
        cmd = [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            str(CONFIG),
            "--run-dir",
            str(run_dir),
            *overrides,
        ]
        with open(log, "w") as out:
            self.proc = subprocess.Popen(
                cmd, cwd=REPO, env=repo_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, *exc) -> None:
        """Leave nothing running when the harness itself stops (Ctrl-C, an error)."""
        if self.proc.poll() is None:
            self._kill()

    def _kill(self) -> None:
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        self.outlived = self._outliving()
        for pid in self.outlived:  # so that they cannot disturb the attempts that follow
            os.kill(pid, signal.SIGKILL)

    def _outliving(self) -> list[int]:
        """Processes of this run (their command line names its directory, or they hold a file in it
        open: a rank's log) still there a few seconds after the process group was killed: ranks in
        sessions of their own, or not told of their launcher's death."""
        deadline = time.monotonic() + OUTLIVE_S
        while (left := _processes_of(self.run.root)) and time.monotonic() < deadline:
            time.sleep(POLL_S)
        return left

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def _manifest(self) -> dict:
        try:
            return json.loads((self.run.root / "manifest.json").read_text())["stages"]
        except (OSError, ValueError):
            return {}

    def _attempts(self) -> dict[str, int]:
        return {sid: entry["attempts"] for sid, entry in self._manifest().items()}

    def steps_logged(self, sid: str) -> int | None:
        """The last step this attempt's ranks logged for the stage; None before they (re)started it."""
        path = self.run.metrics(sid)
        if _inode(path) in (None, self.stale_metrics[sid]):
            return None
        complete = [line for line in path.read_text().splitlines(keepends=True) if line.endswith("\n")]
        return json.loads(complete[-1])["step"] if complete else 0

    def progress(self) -> tuple[int, int]:
        """(index of the first stage not done, steps logged in it by this attempt)."""
        manifest = self._manifest()
        for index, sid in enumerate(STAGE_IDS):
            if manifest.get(sid, {}).get("state") != "done":
                return index, self.steps_logged(sid) or 0
        return len(STAGE_IDS), 0

    def watch(self) -> list[tuple[float, tuple[int, int]]]:
        """Run to the end, recording when the progress changed."""
        timeline = [(0.0, self.progress())]
        while self.proc.poll() is None:
            if (now := self.progress()) != timeline[-1][1]:
                timeline.append((self.elapsed(), now))
            time.sleep(POLL_S)
        return timeline

    def kill_at(self, point: KillPoint) -> bool:
        """SIGKILL the process group `point.delay` seconds after the run reaches `point.after`, or
        when it reaches `point.before` if sooner (the load on the machine varies: this keeps the
        kill between the same two points as in the uninterrupted run); False if it finished first."""
        reached = None
        while self.proc.poll() is None:
            progress = self.progress()
            if reached is None and progress >= point.after:
                reached = time.monotonic()
            if reached is not None and (
                time.monotonic() - reached >= point.delay or progress >= point.before
            ):
                self._kill()
                return True
            time.sleep(POLL_S)
        return False

    def interrupted(self) -> tuple[str, str]:
        """(stage, what it was doing) when killed, from the manifest and the files left behind."""
        index, _ = self.progress()
        if index == len(STAGE_IDS):
            return "-", "the driver, after the last stage"
        sid = STAGE_IDS[index]
        if self._attempts().get(sid, 0) == self.launched.get(sid, 0):
            return sid, "the driver, before launching the stage's ranks"
        stage = self.run.stage(sid)
        staging = [p for p in stage.glob("ckpt/.step-*.tmp") if self._fresh(p)]
        if staging:
            return sid, f"writing checkpoint {staging[0].name[1:-4]}"
        if self._fresh(stage / "final.tmp"):
            return sid, "exporting final/"
        if self._fresh(self.run.final(sid)):
            return sid, "evaluating final/ and recording it"
        step = self.steps_logged(sid)
        if step is None:
            return sid, "its ranks starting, loading, resuming (no step logged yet)"
        if step == getattr(self._config(sid), "steps", None):
            return sid, "after its last step, before the export"
        return sid, f"step {step + 1} (step {step} logged)"

    def _config(self, sid: str):
        return load_resolved(self.run).stages()[sid]

    def _fresh(self, path: Path) -> bool:
        """Written by this attempt (not left by an earlier one)."""
        return path.exists() and path.stat().st_mtime >= self.started_wall


def _processes_of(run_root: Path) -> list[int]:
    pids = []
    for proc in Path("/proc").glob("[0-9]*"):
        if proc.name == str(os.getpid()):
            continue
        try:
            named = str(run_root).encode() in (proc / "cmdline").read_bytes().split(b"\0")
            if named or any(Path(os.readlink(fd)).is_relative_to(run_root) for fd in (proc / "fd").iterdir()):
                pids.append(int(proc.name))
        except OSError:  # gone meanwhile
            continue
    return pids


def _inode(path: Path) -> int | None:
    try:
        return path.stat().st_ino
    except FileNotFoundError:
        return None


def point_at(timeline: list[tuple[float, tuple[int, int]]], t: float) -> KillPoint:
    """Time t of the uninterrupted run as a point of progress."""
    reached = [(s, p) for s, p in timeline if s <= t]
    since, after = reached[-1]
    before = timeline[len(reached)][1] if len(reached) < len(timeline) else (len(STAGE_IDS) + 1, 0)
    return KillPoint(t, after, t - since, before)


def kill_points(
    timeline: list[tuple[float, tuple[int, int]]], duration: float, kills: int, rng: random.Random
) -> list[KillPoint]:
    return [point_at(timeline, t) for t in sorted(rng.uniform(0, duration) for _ in range(kills))]


def handed_on(run_dir: Path) -> dict[str, str]:
    """sha256 of what each stage hands to the next: its weights, or its synthetic data."""
    run = RunDir(run_dir)
    return {
        f"{sid}/final/{name}": digest
        for sid in STAGE_IDS
        for name, digest in tree_checksums(run.final(sid)).items()
        if name.endswith((".safetensors", ".jsonl"))
    }


def logged_steps(run_dir: Path) -> dict[str, list[int]]:
    run = RunDir(run_dir)
    return {
        sid: [json.loads(line)["step"] for line in run.metrics(sid).read_text().splitlines()]
        for sid in STAGE_IDS
    }


def run_to_end(run_dir: Path, overrides: list[str], log: Path):
    with Attempt(run_dir, overrides, log) as attempt:
        timeline = attempt.watch()
    if attempt.proc.returncode != 0:
        sys.exit(f"hpcr1 run {run_dir} failed (exit code {attempt.proc.returncode}); see {log}")
    return timeline, attempt.elapsed()


def kill_and_resume(
    run_dir: Path, overrides: list[str], points: list[KillPoint], logs: Path
) -> tuple[list[str], int]:
    """Kill at each point in turn, resuming each time; returns the stages hit and the number of
    kills that left processes of the run running."""
    hit, outlived = [], 0
    for number, point in enumerate(points, 1):
        stage_index, steps = point.after
        where = (
            f"{STAGE_IDS[stage_index] if stage_index < len(STAGE_IDS) else 'end'} "
            f"step {steps} + {point.delay:4.1f}s"
        )
        log = logs / f"attempt-{number:02d}.log"
        with Attempt(run_dir, overrides, log) as attempt:
            killed, seconds = attempt.kill_at(point), attempt.elapsed()
        if not killed and attempt.proc.returncode != 0:
            sys.exit(
                f"hpcr1 run {run_dir} failed (exit code {attempt.proc.returncode}) after kill {number - 1}; "
                f"see {log}"
            )
        if not killed:
            print(
                f"kill {number:2d}  t={point.time:6.1f}s  ({where})  not made: the run finished first",
                flush=True,
            )
            continue
        stage, what = attempt.interrupted()
        hit.append(stage)
        print(
            f"kill {number:2d}  t={point.time:6.1f}s  ({where})  after {seconds:5.1f}s of the attempt: "
            f"{stage}: {what}",
            flush=True,
        )
        if attempt.outlived:
            outlived += 1
            print(f"         OUTLIVED THE KILL: processes {attempt.outlived} were still running", flush=True)
    return hit, outlived


def verdict(reference: Path, killed: Path) -> bool:
    ok = True
    expected, actual = handed_on(reference), handed_on(killed)
    for name in sorted(expected.keys() | actual.keys()):
        same = expected.get(name) == actual.get(name)
        ok &= same
        print(f"{'identical' if same else 'DIFFERENT'}  {name}  {str(actual.get(name))[:16]}")
    expected_steps, actual_steps = logged_steps(reference), logged_steps(killed)
    for sid in STAGE_IDS:
        if actual_steps[sid] != expected_steps[sid]:
            ok = False
            print(
                f"DIFFERENT  {sid}/metrics.jsonl steps {actual_steps[sid]} "
                f"(uninterrupted: {expected_steps[sid]})"
            )
    return ok


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument(
        "--seed", type=int, default=0, help="seeds the kill times (the pipeline's seed is the config's)"
    )
    p.add_argument("--nproc", type=int, default=2, help="ranks per stage")
    p.add_argument(
        "--out", default="runs/kill-anywhere", help="the two run directories and the attempts' logs"
    )
    args = p.parse_args(argv)
    out = Path(args.out).resolve()
    shutil.rmtree(out, ignore_errors=True)
    (out / "logs").mkdir(parents=True)
    overrides = pipeline_overrides(args.nproc)

    timeline, duration = run_to_end(out / "uninterrupted", overrides, out / "logs" / "uninterrupted.log")
    print(f"uninterrupted run: {duration:.1f}s", flush=True)
    (out / "logs" / "uninterrupted-progress.json").write_text(json.dumps(timeline))
    points = kill_points(timeline, duration, args.kills, random.Random(args.seed))
    hit, outlived = kill_and_resume(out / "killed", overrides, points, out / "logs")
    run_to_end(out / "killed", overrides, out / "logs" / "final-resume.log")
    ok = verdict(out / "uninterrupted", out / "killed") and not outlived
    print(
        f"{len(hit)} kills of {len(points)} made; stages hit: {dict(collections.Counter(hit))}; "
        f"{outlived} left processes running; {'all identical' if ok else 'MISMATCH'}"
    )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
