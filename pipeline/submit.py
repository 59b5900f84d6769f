"""`hpcr1 submit` / `resume --cluster` / `cancel`, and the body of each stage job (`hpcr1 stage`).

Submission writes one sbatch script per stage into <stage>/logs/, and submits the stages that are
not done in graph order, each depending on the previous with afterok; job ids go into the
manifest. A dependant of a failed job is killed by Slurm (DependencyParameters=kill_invalid_depend
on the local cluster; `--kill-on-invalid-dep=yes` on the command line elsewhere).
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from analysis.auto_layout import auto_fields, resolve_auto_layouts
from analysis.model_shape import model_shape
from analysis.native_fit import overflow_message, too_large
from core.atomic import atomic_write_text
from core.cluster import ClusterProfile
from core.config import ConfigError, RunConfig, load_resolved
from core.manifest import Manifest
from core.rundir import RunDir
from launch.container import refuse_unmountable
from launch.ray_cluster import end_ray_steps
from launch.sbatch import render_stage_script, render_verl_script, sbatch_command
from launch.slurm_jobs import recorded_conf, slurm_env
from launch.slurm_launch import nccl_plugin_problem, requeue_self
from launch.verl_job import check_verl_job, verl_launcher
from pipeline.checks import Check, checks_without_a_job
from pipeline.driver import StagePreempted, check_run, run_stage, stages_to_run, write_run
from pipeline.runlock import hold_run_dir, holder_after
from runtime.rank_failure import record_exception
from stages.engines.verl_trainer import verl_stages


def submit(
    cfg: RunConfig,
    run: RunDir,
    config_dir: Path,
    profile: ClusterProfile,
    nodes: int,
    dry_run: bool,
    echo=print,
    only: list[str] | None = None,
    checks: bool = True,
) -> dict[str, str]:
    """Returns {stage id: job id} (script paths on a dry run); `only` limits it to those stages;
    `checks`: refuse where the run directory cannot hold what the stages will write."""
    if nodes < 1:
        raise ConfigError("--nodes", f"must be at least 1 (got {nodes})")
    refuse_unmountable(profile.container, run.root)
    world = nodes * profile.tasks_per_node()
    if world != cfg.nproc:
        raise ConfigError(
            "nproc",
            f"{cfg.nproc} ranks do not match {nodes} node(s) x {profile.tasks_per_node()} "
            f"tasks per node of cluster profile {profile.name!r}: set nproc={world}",
        )
    cfg = resolve_layouts(cfg, config_dir, profile, nodes, echo)
    for sid in verl_stages(cfg, only):
        check_verl_job(cfg, run, sid, nodes, profile.verl_gpus_per_node(), profile.verl_platform)
    refuse_native_overflow(cfg, config_dir, profile, only)
    if checks:
        refuse_failed_checks(cfg, run, config_dir, profile, only, echo, refuse=not dry_run)
    task = check_run(cfg, config_dir, only)
    with hold_run_dir(run.lock, echo):
        write_run(cfg, run, task, config_dir)
        return _submit_stages(cfg, run, profile, nodes, dry_run, echo, only)


def resolve_layouts(cfg: RunConfig, config_dir: Path, profile: ClusterProfile, nodes: int, echo) -> RunConfig:
    """`cfg` with the verl engines' 'auto' layout fields chosen for the jobs' GPUs, each said."""
    if not auto_fields(cfg):
        return cfg
    gpus = nodes * profile.verl_gpus_per_node()
    cfg, lines = resolve_auto_layouts(cfg, model_shape(cfg, config_dir), profile, gpus)
    for line in lines:
        echo(f"layout: {line}")
    return cfg


def refuse_native_overflow(cfg: RunConfig, config_dir: Path, profile: ClusterProfile, only) -> None:
    """A native-engine stage whose weights and states alone exceed one GPU of the profile: refused
    before anything is queued (a CPU profile has no GPU memory to check)."""
    if not profile.gpus_per_node or profile.gpu_memory_gib <= 0:
        return
    P = model_shape(cfg, config_dir).params()
    stage_ids = [sid for sid in cfg.stages() if not only or sid in only]
    for r in too_large(cfg, P, stage_ids, profile.gpu_memory_gib):
        raise ConfigError(r.field, overflow_message(r, P, profile.gpu_memory_gib, profile.name))


def refuse_failed_checks(
    cfg: RunConfig, run: RunDir, config_dir: Path, profile: ClusterProfile, only, echo, refuse: bool = True
):
    """The checks that need no job (pipeline/checks.py), on the stages not yet done: a WARN is said,
    the first FAIL refuses the submission naming its field, any others said before it (a dry run,
    which submits nothing, says them all)."""
    done = {sid for sid, entry in Manifest(run.root).data["stages"].items() if entry.get("state") == "done"}
    to_run = [sid for sid in cfg.stages() if (not only or sid in only) and sid not in done]
    checks = checks_without_a_job(cfg, run.root, model_shape(cfg, config_dir), profile, to_run)
    refuse_first_fail(checks, echo, refuse, " (or --skip-checks)")


def refuse_first_fail(checks: list[tuple[str, Check]], echo, refuse: bool = True, way_past: str = "") -> None:
    """Says every check but a PASS; the first FAIL (where `refuse`) is a ConfigError naming its field
    instead, `way_past` after its fix."""
    first = next(((f, c) for f, c in checks if c.verdict == "FAIL"), None) if refuse else None
    for _, check in checks:
        if check.verdict != "PASS" and (first is None or check is not first[1]):
            echo(check.line())
    if first:
        field, check = first
        raise ConfigError(field, f"{check.name} FAIL: {check.detail} -> {check.fix}{way_past}")


def _submit_stages(
    cfg: RunConfig,
    run: RunDir,
    profile: ClusterProfile,
    nodes: int,
    dry_run: bool,
    echo,
    only: list[str] | None,
) -> dict[str, str]:
    manifest = Manifest(run.root)
    submitted: dict[str, str] = {}
    previous, waits_on = None, None
    for sid in [sid for sid in stages_to_run(cfg, run, manifest) if not only or sid in only]:
        script = run.logs(sid) / f"{sid}.sbatch"
        render = render_verl_script if sid in verl_stages(cfg) else render_stage_script
        atomic_write_text(script, render(profile, run.root.resolve(), sid, nodes))
        cmd = sbatch_command(script, run.root.resolve(), sid, previous)
        if dry_run:
            echo(f"{sid}: {script}\n  {' '.join(cmd)}")
            submitted[sid] = str(script)
            continue
        out = subprocess.run(cmd, capture_output=True, text=True, env=slurm_env(profile.slurm_conf))
        if out.returncode != 0:
            raise RuntimeError(f"sbatch for {sid} failed: {out.stderr.strip()}")
        previous = out.stdout.strip().split(";")[0]
        # `after`: the stage this job waits on (afterok), for status to say when it never will run.
        manifest.update(
            sid, job_id=previous, cluster=profile.name, slurm_conf=profile.slurm_conf, after=waits_on
        )
        submitted[sid], waits_on = previous, sid
        echo(f"{sid}: submitted as job {previous}")
    return submitted


# A stage job may start while `hpcr1 submit` still holds the run directory, submitting later stages.
SUBMIT_GRACE_S = 120


def run_stage_job(run: RunDir, stage_id: str) -> int:
    """The body of one stage's batch job: run the ranks, requeue the job if they were preempted. The
    job holds the run directory like `hpcr1 run` does (its launcher too), so a local run or resume
    started meanwhile is refused instead of writing beside it."""
    cfg = load_resolved(run)
    launch = verl_launcher(cfg, stage_id)
    with hold_run_dir(run.lock, wait_s=SUBMIT_GRACE_S) as lock_fd:
        try:
            try:
                run_stage(
                    cfg,
                    run,
                    Manifest(run.root),
                    stage_id,
                    lambda: _launch_if_nccl_can_start(
                        run, stage_id, lambda: launch(run.root, stage_id, pass_fds=(lock_fd,))
                    ),
                )
            finally:
                end_ray_steps()
        except StagePreempted as e:
            print(e, flush=True)
            requeue_self()
    return 0


def _launch_if_nccl_can_start(run: RunDir, stage_id: str, launch) -> int:
    """`launch()`'s exit code, or 1 with the reason recorded as rank 0's failure (what the manifest
    shows) when NCCL could not start its communicators on this node."""
    problem = nccl_plugin_problem()
    if problem is None:
        return launch()
    record_exception(run.logs(stage_id), 0, RuntimeError(problem))
    print(f"hpcr1: {stage_id}: {problem}", flush=True)
    return 1


# Slurm's default KillWait (30 s from SIGTERM to SIGKILL) and some margin for a loaded node.
CANCEL_WAIT_S = 60


def cancel(run: RunDir, echo=print) -> list[str]:
    manifest = Manifest(run.root)
    jobs = [e["job_id"] for e in manifest.data["stages"].values() if e.get("job_id") and e["state"] != "done"]
    if jobs:
        conf = recorded_conf(manifest.data["stages"])
        subprocess.run(["scancel", *jobs], check=False, env=slurm_env(conf))
    for sid, entry in manifest.data["stages"].items():
        if entry.get("job_id") in jobs and entry["state"] in ("pending", "running"):
            manifest.fail(sid, {"summary": "cancelled by hpcr1 cancel"})
    echo(f"cancelled {len(jobs)} job(s): {' '.join(jobs) or '-'}")
    # scancel returns before the jobs' processes end (Slurm's KillWait): wait, so that a resume
    # right after is not refused by the cancelled stage still holding the run directory.
    holder = holder_after(run.lock, CANCEL_WAIT_S) if jobs else None
    if holder:
        echo(
            f"hpcr1: warning: {holder} still holds {run.root} after {CANCEL_WAIT_S} s; "
            "a resume is refused until it ends"
        )
    return jobs
