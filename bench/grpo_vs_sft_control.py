"""Is GRPO worth its time here? For each seed: stage 1 and stage 2 of a config, then the control —
the stage 1 model trained on by plain SFT on the curated data for as long as stage 2 trained — all
through `hpcr1 run`. Prints the held-out accuracy of each per seed, then the mean GRPO gain over
stage 1 and over the control last.

    python bench/grpo_vs_sft_control.py --seeds 0,1,2 [--config configs/tiny-cpu.yaml] [KEY=VALUE ...]

The control is the config's `stage3_sft` section (its learning rate and schedule: the pipeline's own
way of continuing SFT from stage 1) pointed at the curated data, with as many steps as fit in stage
2's training time at stage 1's median step time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HPCR1 = [sys.executable, "-m", "pipeline.cli"]


def hpcr1_run(config: str, run_dir: Path, only: str, overrides: list[str]) -> None:
    cmd = [*HPCR1, "run", config, "--run-dir", str(run_dir), "--only", only, *overrides]
    subprocess.run(cmd, cwd=REPO, check=True)


def metric_values(run_dir: Path, stage: str, key: str) -> list[float]:
    lines = (run_dir / stage / "metrics.jsonl").read_text().splitlines()
    return [row[key] for row in map(json.loads, lines) if key in row]


def accuracy(run_dir: Path, stage: str) -> float:
    return json.loads((run_dir / "manifest.json").read_text())["stages"][stage]["eval"]["accuracy"]


def one_seed(config: str, seed: int, out: Path, overrides: list[str]) -> dict[str, float]:
    run_dir = out / f"seed-{seed}"
    common = [f"seed={seed}", *overrides]
    hpcr1_run(config, run_dir, "stage1_sft,stage2_grpo", common)
    grpo_seconds = sum(metric_values(run_dir, "stage2_grpo", "step_time_s"))
    sft_step = statistics.median(metric_values(run_dir, "stage1_sft", "step_time_s"))
    control_steps = max(1, round(grpo_seconds / sft_step))
    hpcr1_run(
        config,
        run_dir,
        "stage3_sft",
        [
            *common,
            "stage3_sft.init_from=stage1_sft",
            "stage3_sft.data=curated",
            f"stage3_sft.steps={control_steps}",
        ],
    )
    result = {
        "stage1": accuracy(run_dir, "stage1_sft"),
        "grpo": accuracy(run_dir, "stage2_grpo"),
        "control": accuracy(run_dir, "stage3_sft"),
        "grpo_s": grpo_seconds,
        "control_steps": control_steps,
    }
    print(
        f"seed {seed}: stage 1 {result['stage1']:.3f}, GRPO {result['grpo']:.3f} ({grpo_seconds:.0f} s), "
        f"continued SFT {result['control']:.3f} ({control_steps} steps)",
        flush=True,
    )
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", default="configs/tiny-cpu.yaml")
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--out", default="runs/grpo-vs-sft", help="one run directory per seed under this")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    args = p.parse_args()
    results = [
        one_seed(args.config, int(s), Path(args.out).resolve(), args.overrides) for s in args.seeds.split(",")
    ]
    mean = {k: statistics.mean(r[k] for r in results) for k in ("stage1", "grpo", "control")}
    print(
        f"mean over {len(results)} seeds: stage 1 {mean['stage1']:.3f}, GRPO {mean['grpo']:.3f}, "
        f"continued SFT {mean['control']:.3f}"
    )
    print(
        f"GRPO gain: {mean['grpo'] - mean['stage1']:+.3f} over stage 1, "
        f"{mean['grpo'] - mean['control']:+.3f} "
        "over the SFT control"
    )


if __name__ == "__main__":
    main()
