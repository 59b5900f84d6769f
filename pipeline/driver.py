"""The local driver: walk the stage graph, skip what is done, (re)start the rest.

Resume rules (DESIGN.md): a done stage is never recomputed unless its inputs changed; a running or
failed stage is started again and its ranks continue from the newest valid step checkpoint.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from launch.local import run_stage_locally
from launch.preemption import PREEMPTED_EXIT
from pipeline.atomic import atomic_write_text, tree_checksums
from pipeline.config import ConfigError, RunConfig, dump_config
from pipeline.inputs import load_task, prepare_inputs
from pipeline.manifest import Manifest
from pipeline.rundir import RunDir


class StageFailed(RuntimeError):
    pass


class StagePreempted(RuntimeError):
    """The ranks checkpointed and stopped on a signal; starting the stage again continues it."""


def run_pipeline(cfg: RunConfig, run: RunDir, config_dir: Path, only: list[str] | None = None,
                 echo=print) -> None:
    prepare_run(cfg, run, config_dir, only)
    manifest = Manifest(run.root)
    for sid in cfg.stages():
        if not only or sid in only:
            run_stage(cfg, run, manifest, sid, lambda: run_stage_locally(run.root, sid, cfg.nproc), echo)


def prepare_run(cfg: RunConfig, run: RunDir, config_dir: Path, only: list[str] | None = None) -> None:
    """Check --only, read every data file (nothing is written if one is bad), then write the
    resolved config and the inputs."""
    unknown = [sid for sid in only or () if sid not in cfg.stages()]
    if unknown:
        raise ConfigError("--only", f"{', '.join(unknown)} not in this config's stages ({', '.join(cfg.stages())})")
    task = load_task(cfg, config_dir)
    _write_config(cfg, run)
    prepare_inputs(cfg, run, task, config_dir)


def stages_to_run(cfg: RunConfig, run: RunDir, manifest: Manifest) -> list[str]:
    """Stages not done with their current inputs, in graph order (a changed stage makes every later
    one that reads it changed too, through the checksums in the input hash)."""
    return [sid for sid in cfg.stages() if not _is_current(cfg, run, manifest, sid)]


def _is_current(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str) -> bool:
    entry = manifest.stage(sid)
    return (entry["state"] == "done" and entry.get("input_hash") == input_hash(cfg, sid, manifest)
            and _final_intact(run, sid, entry))


def _write_config(cfg: RunConfig, run: RunDir) -> None:
    text = dump_config(cfg)
    if not run.config.exists() or run.config.read_text() != text:
        atomic_write_text(run.config, text)


def run_stage(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str, launch, echo=print) -> None:
    """Skip the stage if it is done with the same inputs; otherwise `launch()` its ranks (returning
    their exit code) and record the outcome in the manifest."""
    entry = manifest.stage(sid)
    for src in getattr(cfg, sid).upstream():
        if manifest.stage(src)["state"] != "done":
            raise StageFailed(f"{sid} starts from {src}, which is not done: run it first")
    if _is_current(cfg, run, manifest, sid):
        echo(f"{sid}: done (accuracy {entry.get('eval', {}).get('accuracy')}), skipped")
        return
    digest = input_hash(cfg, sid, manifest)
    if entry.get("input_hash") not in (None, digest):
        # Checkpoints of other inputs must not be resumed from.
        shutil.rmtree(run.stage(sid), ignore_errors=True)
        manifest.update(sid, rerun_reason="its config or input changed since the last attempt")
    manifest.start_attempt(sid)
    manifest.update(sid, input_hash=digest)
    echo(f"{sid}: starting (attempt {manifest.stage(sid)['attempts']}, {cfg.nproc} ranks)")
    rc = launch()
    if rc == PREEMPTED_EXIT:
        manifest.update(sid, state="pending", preempted=manifest.stage(sid).get("preempted", 0) + 1)
        raise StagePreempted(f"{sid} checkpointed and stopped on a signal; run it again to continue")
    if rc != 0:
        manifest.fail(sid, f"ranks exited with code {rc}; logs in {run.logs(sid)}")
        raise StageFailed(f"{sid} failed (exit code {rc}); rank logs: {run.logs(sid)}\n{_log_tail(run, sid)}")
    evaluation = json.loads(run.eval_result(sid).read_text())
    manifest.finish(sid, outputs={"final": str(run.final(sid))}, checksums=tree_checksums(run.final(sid)),
                    eval=evaluation)
    echo(f"{sid}: done, {_outcome(evaluation)}")


def _outcome(evaluation: dict) -> str:
    """A generation stage reports how many of its samples it kept; a training stage its model's
    held-out accuracy."""
    if "kept" in evaluation:
        return f"kept {evaluation['kept']} of {evaluation['n']} sampled answers (acceptance {evaluation['accuracy']:.3f})"
    return f"held-out accuracy {evaluation['accuracy']:.3f} (n={evaluation['n']})"


def input_hash(cfg: RunConfig, sid: str, manifest: Manifest) -> str:
    """What the stage's result depends on: its own section, the shared sections, and the outputs
    (checksums) of the stages it reads from."""
    stage = getattr(cfg, sid)
    upstream = {src: manifest.stage(src).get("checksums") for src in stage.upstream()}
    payload = {"stage": stage.model_dump(mode="json"), "model": cfg.model.model_dump(mode="json"),
               "data": cfg.data.model_dump(mode="json"), "seed": cfg.seed, "nproc": cfg.nproc, "upstream": upstream}
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:16]


def _final_intact(run: RunDir, sid: str, entry: dict) -> bool:
    return run.final(sid).is_dir() and tree_checksums(run.final(sid)) == entry.get("checksums")


def _log_tail(run: RunDir, sid: str, lines: int = 25) -> str:
    tails = []
    for log in sorted(run.logs(sid).glob("rank-*.log")):
        text = log.read_text(errors="replace").splitlines()
        if any("Traceback" in line or "Error" in line for line in text):
            tails.append(f"--- {log.name} (last {lines} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(tails[:2])
