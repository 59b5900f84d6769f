"""`hpcr1 sweep CONFIG --gpus 16,32,64,128 --per-gpu-batch 4`: weak scaling, one run directory per GPU
count, the work per rank held fixed while the ranks grow.

What "per-GPU batch" B means for each kind of stage (steps are never changed):
- SFT: sequences per data-parallel rank per optimizer step, global_batch_size = B * dp with
  dp = N / (tp * pp); a tensor-parallel group shares its sequences.
- GRPO: prompts per rank per step, prompts_per_step = B * N (every rank holds a shard of the
  actor and generates for its own prompts; each prompt gives group_size responses).
- synthesis: its batch_size is already per rank; the prompts answered grow with the ranks from the
  base config's share, num_prompts = base num_prompts * N / base nproc.

Every scale's config is resolved and checked as `hpcr1 run`/`submit` would, and (with --cluster)
its node count worked out, before anything is written: a scale that does not fit stops the sweep
with the scale and the field named. <sweep>/sweep.json lists the scales, their run directories,
B and the job ids once submitted; `hpcr1 report <sweep>` reads it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.atomic import atomic_write_text
from core.cluster import ClusterProfile
from core.config import ConfigError, GRPOStage, RunConfig, SFTStage, SynthStage, load_config
from core.rundir import RunDir
from pipeline.driver import check_run, prepare_run, run_pipeline
from pipeline.submit import submit

SWEEP_FILE = "sweep.json"


@dataclass
class Scale:
    gpus: int
    cfg: RunConfig
    run: RunDir
    nodes: int | None = None
    jobs: dict[str, str] | None = None


def parse_gpu_counts(text: str) -> list[int]:
    try:
        counts = [int(x) for x in text.split(",")]
    except ValueError:
        raise ConfigError("--gpus", f"{text!r} is not a comma-separated list of GPU counts") from None
    if any(n < 1 for n in counts) or len(set(counts)) != len(counts):
        raise ConfigError("--gpus", f"{text!r}: GPU counts must be positive and distinct")
    return sorted(counts)


def scaled_overrides(base: RunConfig, gpus: int, per_gpu_batch: int) -> list[str]:
    """The overrides that turn the base config into its weak-scaling point at `gpus` ranks."""
    overrides = [f"nproc={gpus}"]
    for sid, stage in base.stages().items():
        if isinstance(stage, SFTStage):
            model_parallel = stage.parallel.tp * stage.parallel.pp
            if gpus % model_parallel:
                raise ConfigError(
                    f"{sid}.parallel", f"tp*pp = {model_parallel} does not divide nproc ({gpus})"
                )
            dp = gpus // model_parallel
            overrides.append(f"{sid}.global_batch_size={per_gpu_batch * dp}")
        elif isinstance(stage, GRPOStage):
            overrides.append(f"{sid}.prompts_per_step={per_gpu_batch * gpus}")
        elif isinstance(stage, SynthStage):
            if (stage.num_prompts * gpus) % base.nproc:
                raise ConfigError(
                    f"{sid}.num_prompts",
                    f"{stage.num_prompts} prompts over "
                    f"{base.nproc} ranks do not scale to a whole number at {gpus} ranks",
                )
            overrides.append(f"{sid}.num_prompts={stage.num_prompts * gpus // base.nproc}")
    return overrides


@dataclass
class Sweep:
    root: Path
    config: Path
    per_gpu_batch: int
    only: list[str] | None
    profile: ClusterProfile | None
    scales: list[Scale]

    def write_record(self, dry_run: bool) -> None:
        record = {
            "config": str(self.config.resolve()),
            "per_gpu_batch": self.per_gpu_batch,
            "only": self.only,
            "cluster": self.profile.name if self.profile else None,
            "dry_run": dry_run,
            "scales": [
                {"gpus": s.gpus, "nodes": s.nodes, "run_dir": s.run.root.name, "jobs": s.jobs}
                for s in self.scales
            ],
        }
        atomic_write_text(self.root / SWEEP_FILE, json.dumps(record, indent=2) + "\n")


def plan_sweep(
    config: Path,
    overrides: list[str],
    gpus: list[int],
    per_gpu_batch: int,
    root: Path | None,
    only: list[str] | None,
    profile: ClusterProfile | None,
) -> Sweep:
    """Every scale resolved and validated (root defaults to runs/<name>-sweep); nothing is written."""
    if per_gpu_batch < 1:
        raise ConfigError("--per-gpu-batch", f"must be at least 1 (got {per_gpu_batch})")
    base = load_config(config, overrides)
    check_run(base, config.parent, only)  # --only and the data, which every scale shares
    root = root or Path("runs") / f"{base.name}-sweep"
    scales = []
    for n in gpus:
        try:
            cfg = load_config(config, [*overrides, *scaled_overrides(base, n, per_gpu_batch)])
            nodes = nodes_for(n, profile) if profile else None
        except ConfigError as e:
            raise ConfigError(f"--gpus {n}", str(e)) from None
        scales.append(Scale(n, cfg, RunDir(root / f"gpus-{n:04d}"), nodes))
    return Sweep(root, config, per_gpu_batch, only, profile, scales)


def nodes_for(gpus: int, profile: ClusterProfile) -> int:
    per_node = profile.tasks_per_node()
    if gpus % per_node:
        raise ConfigError(
            "nproc",
            f"{gpus} is not a whole number of nodes of cluster profile {profile.name!r} "
            f"({per_node} tasks per node)",
        )
    return gpus // per_node


def run_sweep(sweep: Sweep, dry_run: bool, echo=print) -> None:
    """Submit every scale (with a cluster profile), or prepare (dry run) or run them here one after
    another; sweep.json is written first and again after each scale."""
    config_dir = sweep.config.parent
    for scale in sweep.scales:
        sweep.write_record(dry_run)
        echo(f"== {scale.gpus} GPUs: {scale.run.root}")
        if sweep.profile is not None:
            jobs = submit(
                scale.cfg, scale.run, config_dir, sweep.profile, scale.nodes, dry_run, echo, sweep.only
            )
            scale.jobs = None if dry_run else jobs  # a dry run returns the scripts' paths, not jobs
        elif dry_run:
            prepare_run(scale.cfg, scale.run, config_dir, sweep.only)
        else:
            run_pipeline(scale.cfg, scale.run, config_dir, sweep.only, echo)
    sweep.write_record(dry_run)


def sweep_run_dirs(root: Path) -> list[Path]:
    """The run directories of a sweep, smallest scale first."""
    record = json.loads((root / SWEEP_FILE).read_text())
    return [root / s["run_dir"] for s in sorted(record["scales"], key=lambda s: s["gpus"])]
