"""`hpcr1 doctor CONFIG --cluster PROFILE [--run-dir DIR]`: before a first run on a cluster, one short
probe job on the profile (2 nodes where the config needs more than one) and a table of checks,
each PASS, WARN or FAIL with its fix; exit 1 on any FAIL. The probe's findings and its job's output
(job.log, NCCL's INFO lines among it) stay in <run dir>/doctor/."""

from __future__ import annotations

import json
import platform
import shutil
import subprocess
import sys
from pathlib import Path

from analysis.model_shape import model_shape
from analysis.nccl_transport import detect_in_logs
from core.atomic import atomic_write_text
from core.cluster import ClusterProfile
from core.config import ConfigError, RunConfig
from core.rundir import RunDir
from launch.container import refuse_unmountable
from launch.sbatch import render_doctor_script
from launch.slurm_jobs import slurm_env
from pipeline.checks import (
    Check,
    bandwidth_check,
    checks_without_a_job,
    container_check,
    cuda_needs,
    driver_check,
    gpu_check,
    python_check,
)
from pipeline.submit import resolve_layouts

# The probe job asks for 10 minutes; a queue may hold it longer before it starts.
PROBE_WAIT_S = 3600


def doctor(
    cfg: RunConfig, config_dir: Path, profile: ClusterProfile, run: RunDir, nodes: int, echo=print
) -> int:
    """Runs the checks, prints the table; 1 where any FAILed."""
    if shutil.which("sbatch") is None:
        raise ConfigError("--cluster", "sbatch is not on PATH: run hpcr1 doctor where Slurm's commands are")
    refuse_unmountable(profile.container, run.root)
    cfg = resolve_layouts(cfg, config_dir, profile, nodes, lambda _: None)  # as submit lays them out
    shape, stage_ids = model_shape(cfg, config_dir), list(cfg.stages())
    checks = [check for _, check in checks_without_a_job(cfg, run.root, shape, profile, stage_ids)]
    probe_nodes = min(nodes, 2)
    echo(f"probing {probe_nodes} node(s) of {profile.name} (one short job)...")
    out = run.root / "doctor"
    facts, bench, problem = probe(profile, out, run.root, probe_nodes)
    if problem or len(facts) < probe_nodes:
        found = ", ".join(f["host"] for f in facts) or "none"
        detail = f"{len(facts)} of {probe_nodes} nodes reported ({found})" + (
            f": {problem}" if problem else ""
        )
        checks.append(Check("probe job", "FAIL", detail, f"read {out / 'job.log'}"))
    checks += node_checks(facts, profile)
    if probe_nodes > 1:
        transport = detect_in_logs(out)
        network = sorted(transport.networks)[0] if transport and transport.networks else None
        checks.append(bandwidth_check(probe_nodes, bench, profile.expected_bus_gbs, network))
    for check in checks:
        echo(check.line())
    failed = [c for c in checks if c.verdict == "FAIL"]
    echo(f"{len(checks)} checks: {len(failed)} failed" + (f" (details: {out})" if failed else ""))
    return 1 if failed else 0


def probe(
    profile: ClusterProfile, out: Path, run_dir: Path, nodes: int
) -> tuple[list[dict], dict | None, str]:
    """Submit the probe job and wait for it: (each node's facts, the all_reduce timing or None, what
    went wrong with the job: '' where nothing did)."""
    out.mkdir(parents=True, exist_ok=True)
    for old in [*out.glob("node-*.json"), out / "commbench.json"]:
        old.unlink(missing_ok=True)
    script = out / "doctor.sbatch"
    atomic_write_text(script, render_doctor_script(profile, out.resolve(), run_dir.resolve(), nodes))
    cmd = [
        "sbatch",
        "--wait",
        "--parsable",
        "--job-name=hpcr1-doctor",
        f"--output={out / 'job.log'}",
        str(script),
    ]
    problem = wait_for_job(cmd, profile)
    facts = [json.loads(p.read_text()) for p in sorted(out.glob("node-*.json"))]
    bench = out / "commbench.json"
    return facts, json.loads(bench.read_text()) if bench.is_file() else None, problem


def wait_for_job(cmd: list[str], profile: ClusterProfile) -> str:
    """`sbatch --wait`'s run of the probe: '' where the job succeeded, else what went wrong."""
    try:
        job = subprocess.run(
            cmd, capture_output=True, text=True, env=slurm_env(profile.slurm_conf), timeout=PROBE_WAIT_S
        )
    except subprocess.TimeoutExpired:
        return f"the job had not ended after {PROBE_WAIT_S} s (still queued? squeue -n hpcr1-doctor)"
    return (
        "" if job.returncode == 0 else f"sbatch --wait exited {job.returncode}: {job.stderr.strip()[-300:]}"
    )


def node_checks(facts: list[dict], profile: ClusterProfile) -> list[Check]:
    here = {"executable": sys.executable, "python": platform.python_version()}
    checks = []
    for node in facts:
        checks.append(python_check(node, here))
        checks.append(container_check(node["host"], node["container"], profile.container))
        checks.append(
            gpu_check(node["host"], node["nvidia_smi"], profile.gpus_per_node, profile.gpu_memory_gib)
        )
        if profile.gpus_per_node:
            needs = cuda_needs(node["torch_cuda"], node["packages"])
            checks.append(driver_check(node["host"], node["nvidia_smi"], needs))
    return checks
