"""Running a job's srun steps inside the cluster profile's container (core/cluster.py: Container).

Every runtime is given the same things: the image, host directories mounted at their own paths, the
working directory, and the environment srun gave the step (SLURM_*, MASTER_ADDR, the profile's env):
- podman, podman-hpc: `run --rm` in the node's network, IPC and PID namespaces, so ranks meet as
  they would outside it (the node's addresses, /dev/shm, signals, a rank's watcher reading its stack),
  the command under launch/task_guard.py, which ends it with its srun task;
- apptainer, singularity: `exec`, which shares those namespaces and the environment by default;
- pyxis: srun's own --container-* options (enroot), with no command in front.
The job script exports the words as HPCR1_CONTAINER for the srun steps the stage driver starts
(launch/slurm_launch.py), and holds them in two arrays for its own."""

from __future__ import annotations

import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path

from core.cluster import Container
from core.config import ConfigError

CONTAINER_ENV = "HPCR1_CONTAINER"
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class StepWords:
    """What turns `srun CMD` into a step inside the container: `srun *srun *command CMD`."""

    srun: list[str] = field(default_factory=list)
    command: list[str] = field(default_factory=list)

    def wrap(self, srun: list[str], command: list[str]) -> list[str]:
        return [*srun, *self.srun, *self.command, *command]


def step_words(container: Container | None, mounts: list[Path], workdir: Path, python: str) -> StepWords:
    """`mounts`: what the job reads and writes (the project, the run directory), beside the
    profile's own; `python`: the one that runs launch.task_guard in podman's containers."""
    if container is None:
        return StepWords()
    paths = list(dict.fromkeys([*map(str, mounts), *container.mounts]))
    if container.runtime == "pyxis":
        mounted = ",".join(f"{p}:{p}" for p in paths)
        return StepWords(
            srun=[
                f"--container-image={container.image}",
                f"--container-mounts={mounted}",
                f"--container-workdir={workdir}",
                *container.options,
            ]
        )
    if container.runtime in ("apptainer", "singularity"):
        bind = ["--bind", ",".join(paths), "--pwd", str(workdir)]
        return StepWords(command=[container.runtime, "exec", *bind, *container.options, container.image])
    volumes = [word for p in paths for word in ("--volume", f"{p}:{p}")]
    shared = ["--network=host", "--ipc=host", "--pid=host", "--env-host"]
    return StepWords(
        command=[
            container.runtime,
            "run",
            "--rm",
            *shared,
            *volumes,
            f"--workdir={workdir}",
            *container.options,
            container.image,
            *(python, "-m", "launch.task_guard"),
        ]
    )


def refuse_unmountable(container: Container | None, run_dir: Path) -> None:
    """Every runtime's mount option splits on ':' (podman's -v, pyxis) or ',' (apptainer's --bind,
    pyxis): a run directory or project path holding one is refused before anything is written."""
    if container is None:
        return
    for option, path in (("--run-dir", run_dir), ("the project's path", REPO)):
        if {":", ","} & set(str(path)):
            raise ConfigError(
                option,
                f"{path} holds ':' or ',', which {container.runtime}'s mount option cannot take: "
                "choose a path without them for the profile's container",
            )


def export_line(words: StepWords) -> str:
    """The job script's export, for the srun steps the stage driver starts."""
    words_json = json.dumps({"srun": words.srun, "command": words.command})
    return f"export {CONTAINER_ENV}={shlex.quote(words_json)}"


def array_lines(words: StepWords) -> str:
    """Two arrays for the job script's own srun lines: `srun "${srun_container[@]}" OPTIONS
    "${in_container[@]}" CMD`."""
    q = shlex.quote
    return (
        f"srun_container=({' '.join(map(q, words.srun))})\nin_container=({' '.join(map(q, words.command))})"
    )


def words_from_env(env: dict[str, str] | None = None) -> StepWords:
    raw = (os.environ if env is None else env).get(CONTAINER_ENV)
    if not raw:
        return StepWords()
    words = json.loads(raw)
    return StepWords(srun=words["srun"], command=words["command"])
