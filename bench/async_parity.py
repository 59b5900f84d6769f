"""Does GRPO learn as well a step stale? The embedded default's stage2_grpo (40 steps, 2 ranks) from
one stage-1 model: synchronous at 3 seeds, then with the rollout on a rank of its own a step
ahead (rollout_ranks=1, max_staleness=1) with and without the importance correction. Prints each
run's held-out accuracy (greedy / mean@4, n=200) after the same samples, and the synchronous spread.

    python bench/async_parity.py [--out DIR] [--seeds 0 1 2]

The split runs take the old policy's log-probs from the actor (old_log_probs=actor): with the
embedded default's 'rollout' the old and the behaviour policy are one, and there is nothing to
correct (the PPO ratio is then taken against the stale policy itself: printed as a third row).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from async_vs_sync import run_grpo, train_stage1  # noqa: E402

SPLIT = {"rollout_ranks": 1, "max_staleness": 1}
# run directory: (what the row says, the changes to stage2_grpo)
VARIANTS = {
    "corrected": ("split, corrected (cap 2)", {**SPLIT, "old_log_probs": "actor", "importance_cap": 2.0}),
    "uncorrected": ("split, uncorrected", {**SPLIT, "old_log_probs": "actor", "importance_cap": None}),
    "bypass": ("split, old policy = behaviour ('rollout')", SPLIT),
}


def held_out(run: Path) -> tuple[float, float]:
    result = json.loads((run / "stage2_grpo" / "eval.json").read_text())
    return result["accuracy"], result["mean_at_k"]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=None, help="keep the runs here (default: a temp dir)")
    args = parser.parse_args()
    root = args.out or Path(tempfile.mkdtemp(prefix="async-parity-"))
    stage1 = train_stage1(root, ["wandb.mode=disabled"])
    sync = []
    for seed in args.seeds:
        run_grpo(stage1, root / f"sync-{seed}", {}, seed=seed)
        sync.append(held_out(root / f"sync-{seed}"))
        print(f"synchronous, seed {seed}: {sync[-1][0]:.3f} / {sync[-1][1]:.3f} (greedy / mean@4)")
    low, high = min(a for a, _ in sync), max(a for a, _ in sync)
    print(f"synchronous spread (greedy): {low:.3f} .. {high:.3f}")
    seed = args.seeds[0]
    for name, (label, changes) in VARIANTS.items():
        rows = run_grpo(stage1, root / name, changes, seed=seed)
        greedy, mean_at_k = held_out(root / name)
        verdict = "within" if low <= greedy <= high else "above" if greedy > high else "below"
        capped = sum(r.get("importance/capped", 0.0) for r in rows) / len(rows)
        most = max(r["importance/max"] for r in rows)
        print(f"{label}, seed {seed}: {greedy:.3f} / {mean_at_k:.3f}, {verdict} the synchronous spread; "
              f"importance ratio max {most:.2f}, {capped:.3%} of tokens capped")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
