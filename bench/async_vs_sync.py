"""GRPO with the rollout on a rank of its own, a step ahead (stage2_grpo.rollout_ranks=1,
max_staleness=1: 1 generator + 1 trainer), against the synchronous stage on the same 2 ranks
(every rank generates, then trains), in one invocation: samples per second of each (repetitions
alternate the modes, so that drift hits both), their ratio, each mode's phase times, and the ratio
a phase model predicts.

    python bench/async_vs_sync.py [--repetitions 3] [--steps 6] [--out DIR] [KEY=VALUE ...]

The model: the synchronous step takes G + L (G: weight sync and rollout, L: the rest, all on 2
ranks); the split step takes W + max(G', L'), W the trainers' weight broadcast, G' the generator's
time on a batch (sampling to sent), L' the trainer's time on it (both over the whole batch on one
rank), all measured in the split run. Predicted ratio (G + L) / (W + max(G', L')); measured: the
samples per second of the split over the synchronous stage's. Steps after the first are timed.

Stage 1 (the embedded default's model and task, 30 SFT steps) runs once; each GRPO run
starts from it, launched as the driver launches a stage. KEY=VALUE overrides apply to both modes
(e.g. stage2_grpo.max_new_tokens=96 for a longer rollout).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from launch.local import torchrun_command  # noqa: E402

STAGE1 = [
    "wandb.mode=disabled",
    "data.arithmetic.sft_size=2000",
    "eval={num_examples: 8, max_new_tokens: 24, batch_size: 8, samples: 0, validation_examples: 0}",
    "stage1_sft.steps=30",
    "stage1_sft.global_batch_size=16",
    "stage1_sft.micro_batch_size=4",
    "stage1_sft.lr=3e-3",
    "stage1_sft.min_lr=3e-4",
    "stage1_sft.checkpoint_every=30",
]
GEN, LEARN = "G'", "L'"  # the split's sides
MODES = {"sync": {"rollout_ranks": 0}, "async": {"rollout_ranks": 1, "max_staleness": 1}}


def train_stage1(root: Path, overrides: list[str]) -> Path:
    """root/stage1: a run of the embedded default with stage 1 done (`overrides` after the rest)."""
    run = root / "stage1"
    cmd = [sys.executable, "-m", "pipeline.cli", "run", str(REPO / "configs" / "tiny-cpu.yaml"),
           "--run-dir", str(run), "--only", "stage1_sft", *overrides]  # fmt: skip
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        sys.exit(f"stage1_sft failed:\n{proc.stderr[-3000:]}")
    return run


def run_grpo(stage1: Path, run: Path, changes: dict, seed: int | None = None) -> list[dict]:
    """stage2_grpo with `changes` to its fields (and the run's seed) on 2 ranks, from stage 1's
    model, launched as the driver launches a stage; its metrics.jsonl rows."""
    shutil.rmtree(run, ignore_errors=True)
    shutil.copytree(stage1, run)
    config = yaml.safe_load((run / "config.yaml").read_text())
    config["stage2_grpo"] |= changes
    config["seed"] = config["seed"] if seed is None else seed
    (run / "config.yaml").write_text(yaml.safe_dump(config))
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run(torchrun_command(run, "stage2_grpo", nproc=2), cwd=REPO, env=env,
                          capture_output=True, text=True)  # fmt: skip
    if proc.returncode:
        log = (run / "stage2_grpo" / "logs" / "rank-00000.log").read_text()[-3000:]
        sys.exit(f"stage2_grpo ({changes}) failed:\n{log}")
    return [json.loads(line) for line in (run / "stage2_grpo" / "metrics.jsonl").read_text().splitlines()]


def mean(rows: list[dict], key: str) -> float:
    return statistics.fmean(row.get(key, 0.0) for row in rows)


def phases(rows: list[dict], mode: str) -> dict[str, float]:
    """Seconds a step: G and L for the synchronous stage; W, G', L' and the trainer's wait for the split."""
    step = mean(rows, "step_time_s")
    sync_s = mean(rows, "phase_time/weight_sync")
    if mode == "sync":
        generation = sync_s + mean(rows, "phase_time/rollout")
        return {"step": step, "G": generation, "L": step - generation}
    wait = mean(rows, "phase_time/rollout_wait")
    generation = mean(rows, "rollout/generation_s")
    return {"step": step, "W": sync_s, GEN: generation, LEARN: step - sync_s - wait, "wait": wait}


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    parser.add_argument("overrides", nargs="*", help="KEY=VALUE for both modes' config")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="async-vs-sync-"))
    stage1 = train_stage1(root, [*STAGE1, *args.overrides])
    config = yaml.safe_load((stage1 / "config.yaml").read_text())["stage2_grpo"]
    samples = config["prompts_per_step"] * config["group_size"]
    print(f"stage2_grpo: {samples} samples a step ({config['prompts_per_step']} prompts x "
          f"{config['group_size']}), {config['max_new_tokens']} new tokens at most, {args.steps} steps "
          f"(the first untimed), 2 ranks")  # fmt: skip
    measured: dict[str, list[dict]] = {mode: [] for mode in MODES}
    for rep in range(1, args.repetitions + 1):
        for mode in MODES:
            changes = {"steps": args.steps, "checkpoint_every": args.steps, **MODES[mode]}
            # the first step warms caches and starts both sides at once: untimed
            p = phases(run_grpo(stage1, root / f"{mode}-{rep}", changes)[1:], mode)
            measured[mode].append(p)
            times = "  ".join(f"{k} {v:.3f}" for k, v in p.items() if k != "step")
            rate = samples / p["step"]
            print(f"{mode:5s} rep {rep}: {rate:7.1f} samples/s  step {p['step']:.3f} s  ({times})")
    sync, split = ({k: statistics.median(p[k] for p in measured[m]) for k in measured[m][0]} for m in MODES)
    ratios = [s["step"] / a["step"] for s, a in zip(measured["sync"], measured["async"], strict=True)]
    predicted = (sync["G"] + sync["L"]) / (split["W"] + max(split[GEN], split[LEARN]))
    ratio = statistics.median(ratios)
    print(f"generation: {sync['G'] / sync['step']:.0%} of the synchronous step")
    busy = f"generator busy {split[GEN]:.3f} s, trainer busy {split[LEARN]:.3f} s"
    print(f"split, per step: {busy}, trainer waiting for a batch {split['wait']:.3f} s, "
          f"weight broadcast {split['W']:.3f} s")  # fmt: skip
    print(f"predicted ratio (G + L) / (W + max(G', L')): {predicted:.3f}")
    print(f"measured ratio (split / synchronous samples per second): {ratio:.3f} "
          f"(repetitions: {', '.join(f'{r:.3f}' for r in ratios)}); "
          f"{abs(ratio / predicted - 1):.0%} from the prediction")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
