"""The local driver: walk the stage graph, skip what is done, (re)start the rest.

Resume rules (docs/design.md): a done stage is never recomputed unless its inputs changed (then it and
the stages that read it run again, and the manifest says which input changed); a running or failed
stage is started again and its ranks continue from the newest valid step checkpoint.
"""

from __future__ import annotations

import functools
import json
import shutil
from pathlib import Path

from core.atomic import atomic_write_text, tree_checksums
from core.config import ConfigError, RunConfig, dump_config
from core.digests import file_stats
from core.manifest import Manifest, describe_eval
from core.rundir import RunDir
from launch.local import run_stage_locally
from pipeline.fingerprint import changed_parts, content_parts, digest, input_parts
from pipeline.runlock import hold_run_dir
from runtime.preemption import PREEMPTED_EXIT
from runtime.rank_failure import forget_failures, stage_error
from stages.checkpoint import CheckpointDir
from stages.engines.verl_trainer import refuse_local_verl
from stages.inputs import load_task, prepare_inputs


class StageFailed(RuntimeError):
    pass


class StagePreempted(RuntimeError):
    """The ranks checkpointed and stopped on a signal; starting the stage again continues it."""


def run_pipeline(
    cfg: RunConfig,
    run: RunDir,
    config_dir: Path,
    only: list[str] | None = None,
    echo=print,
    launcher=run_stage_locally,
) -> None:
    """`launcher(run_dir, stage_id, nproc, pass_fds=...)` starts a stage's ranks and returns their
    exit code: torchrun here; tests of the stage graph's decisions pass a quick stand-in."""
    refuse_local_verl(cfg, only)
    task = check_run(cfg, config_dir, only)
    with hold_run_dir(run.lock, echo) as lock_fd:
        write_run(cfg, run, task, config_dir)
        manifest = Manifest(run.root)
        for sid in cfg.stages():
            if not only or sid in only:
                # torchrun holds the lock too: ranks left running by a killed driver keep the run dir taken.
                launch = functools.partial(launcher, run.root, sid, cfg.nproc, pass_fds=(lock_fd,))
                run_stage(cfg, run, manifest, sid, launch, echo)


def prepare_run(cfg: RunConfig, run: RunDir, config_dir: Path, only: list[str] | None = None) -> None:
    write_run(cfg, run, check_run(cfg, config_dir, only), config_dir)


def check_run(cfg: RunConfig, config_dir: Path, only: list[str] | None = None) -> dict:
    """Check --only and read every data file: a bad one is reported before anything is written."""
    unknown = [sid for sid in only or () if sid not in cfg.stages()]
    if unknown:
        raise ConfigError(
            "--only", f"{', '.join(unknown)} not in this config's stages ({', '.join(cfg.stages())})"
        )
    return load_task(cfg, config_dir)


def write_run(cfg: RunConfig, run: RunDir, task: dict, config_dir: Path) -> None:
    """The resolved config and the inputs, (re)written where they changed."""
    _write_config(cfg, run)
    prepare_inputs(cfg, run, task, config_dir)


def stages_to_run(cfg: RunConfig, run: RunDir, manifest: Manifest) -> list[str]:
    """Stages not done with their current inputs, in graph order (a changed stage makes every later
    one that reads it changed too, through its output checksums)."""
    return [sid for sid in cfg.stages() if rerun_reason(cfg, run, manifest, sid) is not None]


def rerun_reason(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str) -> str | None:
    """None if the stage is done and current; otherwise why it must run."""
    entry = manifest.stage(sid)
    if entry["state"] != "done":
        return f"it is {entry['state']}"
    now = stage_inputs(cfg, run, manifest, sid)
    changed = changed_parts(entry.get("inputs"), now)
    if changed and _copied(cfg, run, manifest, sid, changed):
        manifest.update(sid, inputs=now, input_hash=digest(now))
        changed = []
    if changed:
        return f"changed since it was done: {', '.join(changed)}"
    if not _final_intact(run, manifest, sid):
        return "its final/ no longer matches the checksums in the manifest"
    return None


def _copied(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str, changed: list[str]) -> bool:
    """Whether every part that changed has the content it had when the stage ran (a run directory
    copied with new modification times). Nothing is read unless each has a recorded content digest."""
    recorded = manifest.stage(sid).get("input_contents") or {}
    if not set(changed) <= recorded.keys():
        return False
    now = content_parts(cfg, run, sid)
    return all(recorded[part] == now.get(part) for part in changed)


def stage_inputs(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str) -> dict[str, str]:
    upstream = {src: manifest.stage(src).get("checksums") for src in getattr(cfg, sid).upstream()}
    return input_parts(cfg, run, sid, upstream)


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
    reason = rerun_reason(cfg, run, manifest, sid)
    if reason is None:
        echo(f"{sid}: done (accuracy {entry.get('eval', {}).get('accuracy')}), skipped")
        return
    parts = stage_inputs(cfg, run, manifest, sid)
    changed = changed_parts(entry.get("inputs"), parts) if entry["attempts"] else []
    if changed:
        # Checkpoints and outputs of other inputs must not be resumed from.
        shutil.rmtree(run.stage(sid), ignore_errors=True)
        reason = f"changed since the last attempt: {', '.join(changed)}"
    if changed or entry["state"] == "done":
        manifest.update(sid, rerun_reason=reason)
        echo(f"{sid}: running again, {reason}")
    if entry["state"] == "done":
        # It no longer matches its checksums: the ranks would evaluate it as exported by an earlier attempt.
        shutil.rmtree(run.final(sid), ignore_errors=True)
    manifest.start_attempt(sid)
    contents = content_parts(cfg, run, sid)
    manifest.update(sid, inputs=parts, input_hash=digest(parts), input_contents=contents)
    _report_resume_point(cfg, run, manifest, sid, echo)
    echo(f"{sid}: starting (attempt {manifest.stage(sid)['attempts']}, {cfg.nproc} ranks)")
    forget_failures(run.logs(sid))
    run.training_data(sid).unlink(missing_ok=True)  # an earlier attempt's, which this one rewrites
    rc = launch()
    manifest.update(sid, checkpoints=CheckpointDir(run.ckpt(sid), keep=1).digests())
    _record_outcome(run, manifest, sid, rc, echo)


def _report_resume_point(cfg: RunConfig, run: RunDir, manifest: Manifest, sid: str, echo) -> None:
    """Say which checkpoint the ranks will continue from, and which newer ones they will skip as
    corrupt (rank 0 verifies again: the decision is theirs, this is the report)."""
    step, skipped = CheckpointDir(run.ckpt(sid), keep=1).survey()
    for name, problem in skipped.items():
        echo(f"{sid}: warning: checkpoint {name} is unusable ({problem}); it is skipped")
    if step is not None:
        echo(f"{sid}: resuming from step {step}")
    manifest.update(sid, resume_from=step, skipped_checkpoints=skipped)


def _record_outcome(run: RunDir, manifest: Manifest, sid: str, rc: int, echo) -> None:
    _record_training_data(run, manifest, sid)
    if rc == PREEMPTED_EXIT:
        manifest.update(sid, state="pending", preempted=manifest.stage(sid).get("preempted", 0) + 1)
        raise StagePreempted(f"{sid} checkpointed and stopped on a signal; run it again to continue")
    if rc != 0:
        error = stage_error(run.logs(sid), rc)
        manifest.fail(sid, error)
        tail = _log_tail(run, sid, error.get("log"))
        raise StageFailed(f"{sid} failed (exit code {rc}): {error['summary']}\n{tail}")
    evaluation = json.loads(run.eval_result(sid).read_text())
    manifest.finish(
        sid,
        outputs={"final": str(run.final(sid))},
        checksums=tree_checksums(run.final(sid)),
        final_stats=file_stats(run.final(sid)),
        eval=evaluation,
    )
    echo(f"{sid}: done, {_outcome(evaluation)}")


def _record_training_data(run: RunDir, manifest: Manifest, sid: str) -> None:
    """What an SFT stage's ranks made of its examples goes into the manifest; if they refused to
    train (no response token within max_seq_len), the stage failed on bad input: a ConfigError."""
    path = run.training_data(sid)
    if not path.is_file():
        return
    data = json.loads(path.read_text())
    manifest.update(sid, training_data=data)
    refused = data.get("refused")
    if refused:
        manifest.fail(sid, {"summary": f"refused to train: {refused['field']}: {refused['message']}"})
        raise ConfigError(refused["field"], refused["message"])


def _outcome(evaluation: dict) -> str:
    """A generation stage reports how many of its samples it kept; a training stage its model's
    held-out accuracy."""
    if "kept" in evaluation:
        return (
            f"kept {evaluation['kept']} of {evaluation['n']} sampled answers "
            f"(acceptance {evaluation['accuracy']:.3f})"
        )
    return describe_eval(evaluation)


def _final_intact(run: RunDir, manifest: Manifest, sid: str) -> bool:
    """final/ is read only if a file's size or modification time is not the recorded one (or none
    was recorded); once its checksums match again, the new stats are recorded."""
    entry, final = manifest.stage(sid), run.final(sid)
    if not final.is_dir():
        return False
    stats = file_stats(final)
    if stats == entry.get("final_stats"):
        return True
    if tree_checksums(final) != entry.get("checksums"):
        return False
    manifest.update(sid, final_stats=stats)
    return True


def _log_tail(run: RunDir, sid: str, first: str | None, lines: int = 25) -> str:
    """The ends of the logs with a traceback, the first failed rank's (`first`) first."""
    tails = []
    for log in sorted(run.logs(sid).glob("rank-*.log"), key=lambda p: (str(p) != first, p.name)):
        text = log.read_text(errors="replace").splitlines()
        if any("Traceback" in line or "Error" in line for line in text):
            tails.append(f"--- {log.name} (last {lines} lines)\n" + "\n".join(text[-lines:]))
    return "\n".join(tails[:2])
