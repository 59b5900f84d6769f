"""Rendering one stage's sbatch script from a cluster profile.

Only plain tokens (validated by the profile) go into #SBATCH lines. Everything a user controls —
the run directory, paths, environment values — reaches the shell through `shlex.quote`, and the job
name and output file are passed on sbatch's command line (no shell parses them), so quotes, `$()`,
backticks, spaces or newlines in them cannot run anything.
"""

from __future__ import annotations

import re
import shlex
import sys
from pathlib import Path

from core.cluster import COLLECTIVE_TIMEOUT_ENV, ClusterProfile
from launch.container import REPO, array_lines, export_line, step_words

TEMPLATE = REPO / "slurm" / "templates" / "stage.sbatch"
VERL_TEMPLATE = TEMPLATE.with_name("verl_stage.sbatch")
DOCTOR_TEMPLATE = TEMPLATE.with_name("doctor.sbatch")
# Where Ray keeps its sessions (/tmp/ray): a Ray in the profile's container serves the batch shell's Ray
# CLI and the stage driver, outside it, through the sockets there.
RAY_TEMP_ROOT = Path("/tmp")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def directives(profile: ClusterProfile, nodes: int) -> list[str]:
    lines = [
        f"--nodes={nodes}",
        f"--ntasks-per-node={profile.tasks_per_node()}",
        f"--cpus-per-task={profile.cpus_per_task}",
        f"--time={profile.time_limit}",
        f"--signal=B:USR1@{profile.signal_seconds}",
        "--open-mode=append",
    ]
    if profile.gpus_per_node:
        lines.append(f"--gpus-per-node={profile.gpus_per_node}")
    for flag, value in (
        ("partition", profile.partition),
        ("account", profile.account),
        ("qos", profile.qos),
        ("constraint", profile.constraint),
    ):
        if value:
            lines.append(f"--{flag}={value}")
    if profile.requeue:
        lines.append("--requeue")
    if nodes > 1:
        # A node lost keeps the job: its srun step ends (Slurm's node failure) while the batch shell,
        # the stage driver, lives on to record the failure and name the node, instead of the whole job
        # being killed (and, with --requeue, silently put back in the queue) with the manifest left
        # saying "running".
        lines.append("--no-kill")
    return lines + profile.extra_directives


def env_exports(profile: ClusterProfile) -> list[str]:
    # The ranks' bound on one collective (runtime.dist.init_distributed); the profile's env may override it.
    exports = [f"export {COLLECTIVE_TIMEOUT_ENV}={profile.collective_timeout_s}"]
    for name, value in profile.env.items():
        if not _ENV_NAME.match(name):
            raise ValueError(f"cluster profile env: {name!r} is not a valid variable name")
        exports.append(f"export {name}={shlex.quote(value)}")
    return exports


def render_stage_script(
    profile: ClusterProfile, run_dir: Path, stage_id: str, nodes: int, python: str = sys.executable
) -> str:
    return _render(TEMPLATE, profile, run_dir, stage_id, nodes, python)


def render_verl_script(
    profile: ClusterProfile, run_dir: Path, stage_id: str, nodes: int, python: str = sys.executable
) -> str:
    """A stage whose job runs verl (stages.engines.verl_trainer.verl_stages): Ray on the allocation
    with the profile's ports, then the stage."""
    return _render(
        VERL_TEMPLATE,
        profile,
        run_dir,
        stage_id,
        nodes,
        python,
        gpus_per_node=profile.gpus_per_node,
        verl_gpus=profile.verl_gpus_per_node(),
        verl_platform=profile.verl_platform,
        ray_cpus=ray_cpus_option(profile),
        mounts=(RAY_TEMP_ROOT,),
        **profile.ray.model_dump(),
    )


def render_doctor_script(
    profile: ClusterProfile, out_dir: Path, run_dir: Path, nodes: int, python: str = sys.executable
) -> str:
    """`hpcr1 doctor`'s probe job: one task a node, a few minutes, never requeued; the all_reduce
    only where there are nodes to cross."""
    q = shlex.quote
    probe = profile.model_copy(
        update={"ranks_per_node": 1, "gpus_per_node": profile.gpus_per_node and 1, "time_limit": "00:10:00"}
    )
    kept = [d for d in directives(probe, nodes) if not d.startswith(("--signal", "--requeue"))]
    if profile.gpus_per_node:  # the node's every GPU for nvidia-smi, one task a node
        kept = [f"--gpus-per-node={profile.gpus_per_node}" if d.startswith("--gpus") else d for d in kept]
    # 64 MiB: where NCCL's all_reduce reaches its bus bandwidth; a few calls tell a healthy link from
    # a shaped one or sockets, and a slow link still ends in seconds.
    bench = [q(python), "-m", "launch.commbench", "--ops", "all_reduce", "--sizes", "64M", "--iters", "3"]
    bench += ["--warmup", "1", "--out", q(str(out_dir / "commbench.json"))]
    return _render(
        DOCTOR_TEMPLATE,
        profile,
        run_dir,
        "doctor",
        nodes,
        python,
        directive_lines=kept,
        mounts=(out_dir,),
        out=q(str(out_dir)),
        commbench=f'srun "${{srun_container[@]}}" "${{in_container[@]}}" {" ".join(bench)}'
        if nodes > 1
        else "# one node: no link between nodes to time",
    )


def ray_cpus_option(profile: ClusterProfile) -> str:
    """On the CPU platform, Ray's logical CPUs for verl's actors, which hold CPU bundles and would
    wait forever for a small node's cores: 3 a rank (verl's placement-group bundles), and 8 for the
    trainer, the TransferQueue controller and storage, reward and agent-loop workers. On GPU nodes
    Ray counts the cores, dozens."""
    if profile.verl_platform != "cpu":
        return ""
    return f"--num-cpus={3 * profile.ranks_per_node + 8} "


def _render(
    template: Path,
    profile: ClusterProfile,
    run_dir: Path,
    stage_id: str,
    nodes: int,
    python: str,
    directive_lines: list[str] | None = None,
    mounts: tuple[Path, ...] = (),
    **extra,
) -> str:
    """`template` filled from the profile; `directive_lines`: #SBATCH options other than a stage's;
    `mounts`: what the job's steps write beside the run directory, mounted in the profile's container."""
    q = shlex.quote
    container = step_words(profile.container, [REPO, run_dir, *mounts], REPO, python)
    lines = directives(profile, nodes) if directive_lines is None else directive_lines
    return template.read_text().format(
        directives="\n".join(f"#SBATCH {d}" for d in lines),
        profile=profile.name,
        env="\n".join(env_exports(profile)) or "# (no environment from the profile)",
        setup="\n".join(profile.setup) or "# (no setup lines in the profile)",
        launcher=q(profile.launcher),
        repo=q(str(REPO)),
        python=q(python),
        run_dir=q(str(run_dir)),
        stage=q(stage_id),
        container_export=export_line(container),
        container_arrays=array_lines(container),
        **extra,
    )


def sbatch_command(script: Path, run_dir: Path, stage_id: str, dependency: str | None) -> list[str]:
    """The sbatch argv (run without a shell): user-derived values stay single arguments."""
    cmd = [
        "sbatch",
        "--parsable",
        f"--job-name=hpcr1-{stage_id}",
        f"--output={run_dir / stage_id / 'logs' / 'slurm-%j.out'}",
    ]
    if dependency:
        cmd.append(f"--dependency=afterok:{dependency}")
    return cmd + [str(script)]
