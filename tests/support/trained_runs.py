"""Trained run directories made once per pytest run and shared, read-only, by every test that only
needs a trained model (a stage-1 model, or a stage-2 one) and not the training itself.

    trained = trained_runs.get(*overrides, config=SMALL_RUN, stages=("stage1_sft",), env=None)
    trained.path                                # the shared run directory: read it, never write it
    trained.continue_into(run_dir, "stage2_grpo.steps=2", stages=("stage2_grpo",), env=...)

A trained run is keyed by what made it: the resolved config (`hpcr1 run`'s, defaults filled in),
the stages run, the environment given beyond the tests' own, and the digest of the project's code,
so that a changed field, stage, device or source file makes a new one instead of reading a stale
one. The cache lives in the pytest run's base temporary directory, shared by the xdist workers; a
file lock per key lets one worker train while the others wait. The shared directory is made
read-only (chmod) and its files' checksums are checked again at each hand-out and at the end of
the session, which catches a writer that chmod does not stop (root).

`continue_into` copies the run (new modification times: the driver recognises the copy by content,
inputs/model.sha256.json and the manifest's input_contents) and runs the trained stages again with
more: the driver must skip them as done, which is checked.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import json
import os
import shutil
import stat
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from tests.conftest import REPO, SMALL_RUN, hpcr1_env, hpcr1_run, snapshot, tiny_base_of

# What a stage's ranks and the driver run: a change to any of their files makes new trained runs.
CODE = [
    *(REPO / p for p in ("core", "runtime", "stages", "launch", "pipeline", "analysis")),
    REPO / "tests" / "fakegpu",
]


@functools.cache
def code_digest() -> str:
    """sha256 over the path and content of every Python and C++ file of the code that trains."""
    h = hashlib.sha256()
    for root in CODE:
        for path in sorted(p for p in root.rglob("*") if p.suffix in (".py", ".cpp") and p.is_file()):
            h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    return h.hexdigest()


def env_given(env: dict[str, str] | None) -> dict[str, str]:
    """The variables of `env` that differ from what every test run gets (hpcr1_env)."""
    base = hpcr1_env()
    return {k: v for k, v in sorted((env or {}).items()) if base.get(k) != v}


def resolved_config(config: dict, overrides: tuple[str, ...], scratch: Path) -> str:
    """The config as `hpcr1 run` resolves it (overrides applied, defaults filled in)."""
    from core.config import dump_config, load_config

    cfg = load_config(_write_yaml(scratch, config), list(overrides))
    assert cfg.data.task != "files" and cfg.model.source != "hf", (
        "a trained run's key holds no data or model files: give it a self-contained config"
    )
    return dump_config(cfg)


def key_inputs(config: dict, overrides: tuple[str, ...], stages: tuple[str, ...], env, scratch: Path) -> dict:
    assert not any(o.startswith("-") for o in overrides), "KEY=VALUE overrides only: stages= says what runs"
    return {
        "config": resolved_config(config, overrides, scratch),
        "stages": list(stages),
        "env": env_given(env),
        "code": code_digest(),
    }


def key_of(inputs: dict) -> str:
    return hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()[:20]


@dataclass(frozen=True)
class TrainedRun:
    """A run directory in which `stages` are done, made by `hpcr1 run` of `config` with `overrides`
    under `env`; shared, so read-only."""

    path: Path
    config: dict
    overrides: tuple[str, ...]
    stages: tuple[str, ...]
    env: dict[str, str] | None
    checksums: dict[str, str] = field(repr=False)

    def check_unchanged(self) -> None:
        now = snapshot(self.path)
        changed = sorted(p for p in now.keys() | self.checksums.keys() if now.get(p) != self.checksums.get(p))
        assert not changed, f"a test wrote into the shared trained run {self.path}: {changed[:10]}"

    def copy_to(self, run_dir: Path) -> Path:
        """A writable copy of the run directory at run_dir (which must not exist)."""
        shutil.copytree(self.path, run_dir, copy_function=shutil.copyfile)
        _chmod_tree(run_dir, writable=True)
        return run_dir

    def continue_into(
        self,
        run_dir: Path,
        *overrides: str,
        stages: tuple[str, ...],
        env: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess:
        """Copy to run_dir and `hpcr1 run` this run's stages and `stages` with this run's overrides
        and `overrides`; the copied stages are checked to have been skipped as done."""
        self.copy_to(run_dir)
        only = ",".join((*self.stages, *stages))
        proc = hpcr1_run(
            run_dir,
            "--only",
            only,
            *self.overrides,
            *overrides,
            config=self.config,
            env=env,
            check=check,
            tiny_base=tiny_base_of(self.path),
        )
        for sid in self.stages:
            assert f"{sid}: done (" in proc.stdout and f"{sid}: starting" not in proc.stdout, (
                f"{sid} of the copied run was not skipped as done:\n{proc.stdout[-3000:]}"
            )
        return proc


class TrainedRuns:
    """The session's trained runs under `root` (shared by the xdist workers of one pytest run)."""

    def __init__(self, root: Path):
        self.root = root
        self.handed_out: dict[str, TrainedRun] = {}
        root.mkdir(parents=True, exist_ok=True)

    def get(
        self,
        *overrides: str,
        config: dict = SMALL_RUN,
        stages: tuple[str, ...] = ("stage1_sft",),
        env: dict[str, str] | None = None,
    ) -> TrainedRun:
        """The run of `config` with `overrides` (KEY=VALUE) whose `stages` are done (`--only`), under
        `env` (hpcr1_run's); trained by the first caller of this pytest run, reused after."""
        scratch = self.root / f"scratch-{os.getpid()}"
        inputs = key_inputs(config, overrides, stages, env, scratch)
        key = key_of(inputs)
        if key not in self.handed_out:
            with _locked(self.root / f"{key}.lock"):
                if not (self.root / f"{key}.json").exists():
                    self._train(key, inputs, overrides, config, stages, env)
            checksums = json.loads((self.root / f"{key}.json").read_text())["checksums"]
            self.handed_out[key] = TrainedRun(
                self.root / key / "run", config, overrides, stages, env, checksums
            )
        trained = self.handed_out[key]
        trained.check_unchanged()
        return trained

    def _train(self, key, inputs, overrides, config, stages, env) -> None:
        """Train into root/key, make it read-only, then write root/key.json (what made it and its
        checksums): the mark that it is complete."""
        home = self.root / key
        if home.exists():  # a build that died half-way
            _chmod_tree(home, writable=True)
            shutil.rmtree(home)
        home.mkdir()
        hpcr1_run(home / "run", "--only", ",".join(stages), *overrides, config=config, env=env)
        _chmod_tree(home, writable=False)
        record = {**inputs, "checksums": snapshot(home / "run")}
        tmp = self.root / f"{key}.json.tmp"
        tmp.write_text(json.dumps(record, indent=1))
        tmp.rename(self.root / f"{key}.json")

    def check_all_unchanged(self) -> None:
        for trained in self.handed_out.values():
            trained.check_unchanged()


class _locked:
    """An exclusive flock on `path` for the block: one process of the pytest run at a time."""

    def __init__(self, path: Path):
        self.path = path

    def __enter__(self):
        self.file = open(self.path, "a")
        fcntl.flock(self.file, fcntl.LOCK_EX)

    def __exit__(self, *exc):
        fcntl.flock(self.file, fcntl.LOCK_UN)
        self.file.close()


def _chmod_tree(root: Path, writable: bool) -> None:
    """Owner write permission on or off for every file and directory under root, root included."""
    for path in [root, *root.rglob("*")]:
        if path.is_symlink():
            continue
        mode = path.stat().st_mode
        os.chmod(
            path, mode | stat.S_IWUSR if writable else mode & ~(stat.S_IWUSR | stat.S_IWGRP | stat.S_IWOTH)
        )


def _write_yaml(scratch: Path, config: dict) -> Path:
    scratch.mkdir(parents=True, exist_ok=True)
    path = scratch / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path
