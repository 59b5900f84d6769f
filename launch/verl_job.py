"""A stage job that runs verl, once slurm/templates/verl_stage.sbatch has Ray up on every node of
the allocation (verl joins it through RAY_ADDRESS):
- GRPO on verl: check the config against verl again, write verl's data, run `verl.trainer.main_ppo`,
  then hand its results over in our formats: final/ (merged from verl's last checkpoint), profile/
  events from its torch-profiler traces, and eval.json from its validation of the last step's policy;
- synthesis on verl: verl's generation server samples, our reward filter keeps (stages/synth.py);
- any other stage when eval.engine is 'verl': our ranks train, then the generation server answers
  the held-out prompts greedily and our reward scores them.

`hpcr1 stage` calls `verl_launcher(cfg, sid)` in place of the srun launcher, so the manifest
treats the stage like any other: done only when final/ and eval.json are there.

What imports torch (transformers, our engines, phases) is imported where verl's side runs: `hpcr1
submit` and the job of every stage import this module, and most of them never need torch.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import os
import signal
import subprocess
import sys
import traceback
from pathlib import Path

from core.atomic import atomic_write_text
from core.config import (
    ConfigError,
    GRPOStage,
    RunConfig,
    SynthStage,
    VerlRolloutConfig,
    engine_of,
    load_resolved,
)
from core.rundir import RunDir
from launch.local import repo_env
from launch.slurm_launch import run_stage_in_allocation
from runtime.preemption import PREEMPTED_EXIT
from runtime.rank_failure import record_exception, record_printed_exception
from stages.data.examples import DataError, Example, read_examples
from stages.engines.verl_generation import (
    GREEDY,
    RESPONSES,
    SAMPLED_RESPONSES,
    Sampling,
    check_generation,
    generation_overrides,
    read_responses,
    replica_count,
)
from stages.engines.verl_generation import MODULE as GENERATION_MODULE
from stages.engines.verl_io import (
    check_prompt_lengths,
    latest_step,
    merge_to_final,
    next_metrics_file,
    traces_to_events,
    verl_metric_rows,
    verl_rows,
    write_metrics,
    write_parquet,
)
from stages.engines.verl_platform_names import CPU_PLATFORM
from stages.engines.verl_trainer import (
    DATA_SOURCE,
    check_verl_stage,
    platform_overrides,
    runtime_env_overrides,
    uses_verl,
    verl_paths,
    verl_process_env,
)


def run_verl_stage(run_dir: Path, sid: str, pass_fds: tuple[int, ...] = ()) -> int:
    """A GRPO stage on verl: main_ppo's exit code. `pass_fds`: descriptors the children inherit
    (the run directory's lock)."""
    return _verl_job(run_dir, sid, lambda cfg, run, nodes: _train_on_verl(cfg, run, sid, nodes, pass_fds))


def run_verl_synth(run_dir: Path, sid: str, pass_fds: tuple[int, ...] = ()) -> int:
    """A synthesis stage on verl's generation server; our reward filter keeps the answers."""
    return _verl_job(
        run_dir, sid, lambda cfg, run, nodes: _synthesise_on_verl(cfg, run, sid, nodes, pass_fds)
    )


def run_then_eval_on_verl(run_dir: Path, sid: str, pass_fds: tuple[int, ...] = ()) -> int:
    """A stage on our engines whose held-out answers come from verl (eval.engine 'verl'): the ranks
    train and export final/ (their srun step, --overlap as Ray's are, shares the nodes with them), then
    verl's generation server answers the held-out prompts greedily."""
    rc = run_stage_in_allocation(run_dir, sid, pass_fds, overlap=True)
    if rc != 0:
        return rc
    return _verl_job(run_dir, sid, lambda cfg, run, nodes: _evaluate_on_verl(cfg, run, sid, nodes, pass_fds))


def verl_launcher(cfg: RunConfig, sid: str):
    """What runs stage `sid` inside its Slurm allocation."""
    stage = getattr(cfg, sid)
    if not uses_verl(cfg, stage):
        return run_stage_in_allocation
    if engine_of(stage) != "verl":
        return run_then_eval_on_verl
    return run_verl_synth if isinstance(stage, SynthStage) else run_verl_stage


def check_verl_job(
    cfg: RunConfig, run: RunDir, sid: str, nnodes: int, gpus_per_node: int, platform: str = "gpu"
) -> None:
    """Everything verl would refuse in stage `sid`'s job, before it is queued (ConfigError)."""
    stage = getattr(cfg, sid)
    if engine_of(stage) == "verl" and isinstance(stage, GRPOStage):
        check_verl_stage(cfg, run, sid, nnodes, gpus_per_node, platform)
        check_backend_installed(stage, sid, platform)
        return
    field, rollout, sampling = generation_of(cfg, sid)
    paths = generation_paths(run, sid)
    answers = planned_answers(cfg, sid)
    overrides = generation_overrides(  # the model is an earlier stage's, not there yet: any path composes
        Path("/model"),
        rollout,
        sampling,
        paths["prompts"],
        paths["output"],
        cfg.seed,
        nnodes,
        gpus_per_node,
        answers,
    ) + platform_overrides(platform)
    check_generation(field, rollout, sampling, overrides, (nnodes, gpus_per_node))


# verl 0.9.1's megatron engine builds its models with Megatron-Bridge, on Transformer Engine layers,
# and forces flash attention; `make setup-gpu` builds the last two (requirements-gpu-nodeps.lock).
# transformer_engine_torch is Transformer Engine's compiled torch extension, which the core wheel lacks.
MEGATRON_BACKEND_PACKAGES = {
    "megatron.bridge": "Megatron-Bridge",
    "transformer_engine_torch": "Transformer Engine's torch extension",
    "flash_attn": "flash-attn",
}
PACKING_PACKAGES = {"flash_attn": "flash-attn"}


def check_backend_installed(stage: GRPOStage, sid: str, platform: str = "gpu") -> None:
    """The jobs run with this Python: a backend whose packages it lacks would die at import, after
    the stages before it have run for hours. Refused where this Python is a GPU venv (a CUDA torch,
    as `make setup-gpu` installs); where it is not (the CPU .venv, checking or dry-running a GPU
    config), one warning line on stderr instead. On the CPU platform the megatron backend needs
    Megatron-Bridge only (megatron-core's local layers stand in for Transformer Engine's, and
    packing is off: stages/engines/verl_cpu_megatron.py), and is refused without it."""
    if platform == CPU_PLATFORM and stage.verl.backend == "megatron":
        if not _installed("megatron.bridge"):
            raise ConfigError(
                f"{sid}.verl.backend",
                f"'megatron' needs Megatron-Bridge in {sys.executable}, which runs the jobs: "
                "`make setup-twin` builds .venv-twin with it",
            )
        return
    needs = {"remove_padding": PACKING_PACKAGES} if stage.verl.remove_padding else {}
    if stage.verl.backend == "megatron":
        needs["backend"] = MEGATRON_BACKEND_PACKAGES
    for field, packages in needs.items():
        names = [name for module, name in packages.items() if not _installed(module)]
        if not names:
            continue
        missing = " and ".join([", ".join(names[:-1]), names[-1]] if len(names) > 1 else names)
        what = "packing" if field == "remove_padding" else "'megatron'"
        if _cuda_torch():
            raise ConfigError(
                f"{sid}.verl.{field}",
                f"{what} needs {missing} in {sys.executable}, which runs the jobs: `make setup-gpu` "
                "builds them into .venv-gpu",
            )
        print(
            f"hpcr1: warning: {sid}.verl.{field}: {what} needs {missing} in the jobs' Python, and "
            f"{sys.executable} (no CUDA torch) lacks {'them' if len(names) > 1 else 'it'}: submit with "
            ".venv-gpu/bin/hpcr1, which `make setup-gpu` builds with them",
            file=sys.stderr,
        )


def _cuda_torch() -> bool:
    """Whether this Python's torch is a CUDA build: the GPU venv's, not the CPU .venv's."""
    import torch

    return torch.version.cuda is not None


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # its parent package is missing
        return False


def generation_of(cfg: RunConfig, sid: str) -> tuple[str, VerlRolloutConfig, Sampling]:
    """(config section, rollout settings, sampling) of the generation stage `sid`'s job runs on verl."""
    stage = getattr(cfg, sid)
    if isinstance(stage, SynthStage) and stage.engine == "verl":
        sampling = Sampling(stage.samples_per_prompt, stage.temperature, stage.top_p, stage.max_new_tokens)
        return sid, stage.verl, sampling
    return "eval", cfg.eval.verl, Sampling(1, GREEDY, 1.0, cfg.eval.max_new_tokens)


def planned_answers(cfg: RunConfig, sid: str) -> int:
    """The answers stage `sid`'s generation on verl asks for at most: synthesis's, or held-out eval's
    (greedy and k sampled, for the held-out and validation examples)."""
    field, _, sampling = generation_of(cfg, sid)
    if field == sid:
        return getattr(cfg, sid).num_prompts * sampling.n
    return (cfg.eval.num_examples + cfg.eval.validation_count) * (1 + cfg.eval.samples)


def generation_paths(run: RunDir, sid: str) -> dict[str, Path]:
    data = run.stage(sid).resolve() / "verl_data"
    return {"prompts": data / "generation_prompts.parquet", "output": data / "generation_answers.parquet"}


def _platform() -> str:
    """Where verl runs: the cluster profile's verl_platform, exported by verl_stage.sbatch."""
    return os.environ.get("HPCR1_VERL_PLATFORM", "gpu")


def _verl_job(run_dir: Path, sid: str, body) -> int:
    """`body(cfg, run, (nnodes, gpus_per_node))`'s exit code, or 1 with the exception recorded where
    the driver looks for a failed rank's (logs/rank-00000.*), or PREEMPTED_EXIT when a USR1 (the
    job nears its time limit) stopped it, wherever it was: verl, or the hand-over after it."""
    run = RunDir(run_dir)
    try:
        with _usr1_stops_the_job():
            cfg = load_resolved(run)
            if "RAY_ADDRESS" not in os.environ:
                raise RuntimeError(
                    "RAY_ADDRESS is not set: a verl job runs from verl_stage.sbatch, after it has "
                    "started Ray on the allocation"
                )
            return body(cfg, run, (int(os.environ["SLURM_NNODES"]), int(os.environ["HPCR1_GPUS_PER_NODE"])))
    except _StopRequested:
        print(f"{sid}: stopped on USR1; the requeued job continues from verl's newest checkpoint", flush=True)
        return PREEMPTED_EXIT
    except Exception as e:
        record_exception(run.logs(sid), 0, e)
        traceback.print_exc()
        return 1


class _StopRequested(BaseException):
    """A USR1 reached the job. Not an Exception: no `except Exception` on the way may swallow it."""


@contextlib.contextmanager
def _usr1_stops_the_job():
    """A USR1 raises _StopRequested where the job is (a child being waited for is then stopped by
    whoever started it); later ones are ignored. The handler before is back on leaving."""

    def stop(signum, frame):
        signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        raise _StopRequested

    previous = signal.signal(signal.SIGUSR1, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGUSR1, previous)


def _train_on_verl(cfg, run: RunDir, sid: str, nodes: tuple[int, int], pass_fds) -> int:
    """main_ppo to the last step (unless an attempt before got there), the hand-over, then final/'s
    held-out eval on verl's replicas, as every stage on verl is scored."""
    overrides, paths = check_verl_stage(cfg, run, sid, *nodes, _platform()), verl_paths(run, sid)
    if latest_step(paths["ckpt"]) != getattr(cfg, sid).steps:
        prompts = _prompts_to_learn(cfg, run, sid, nodes, pass_fds)
        if isinstance(prompts, int):
            return prompts
        write_verl_data(cfg, run, sid, prompts)
        env = verl_env(cfg, run, sid, next_metrics_file(paths["metrics"]))
        args = ["-m", "verl.trainer.main_ppo", *overrides, *runtime_env_overrides(env)]
        rc = _run_verl(run, sid, args, env, pass_fds)
        if rc != 0:
            return rc
    finish_verl_stage(cfg, run, sid)
    return _evaluate_on_verl(cfg, run, sid, nodes, pass_fds)


def _prompts_to_learn(cfg, run: RunDir, sid: str, nodes: tuple[int, int], pass_fds) -> list[Example] | int:
    """The prompt set, less the prompts the starting model solves more than max_pass_rate of the time,
    as the native engine selects them (stages/grpo/difficulty.py), its group_size answers a prompt
    sampled by verl's replicas; or that generation's exit code. The pass counts are kept for the
    stage's later attempts, which then train on the same prompts in the same order."""
    stage = getattr(cfg, sid)
    prompts = read_examples(run.task_file("prompts"))
    if stage.max_pass_rate >= 1:
        return prompts
    from stages.grpo.difficulty import select_prompts
    from stages.kept import MISSING, inputs_fingerprint, load_record, save_record
    from stages.rewards.math_reward import score

    path, model_dir = run.prompt_selection(sid), run.model_dir(stage.init_from)
    fingerprint = inputs_fingerprint(stage, cfg.seed, model_dir, run.task_file("prompts"), engine="verl")
    counts, problem = load_record(path, fingerprint)
    if problem not in (None, MISSING):
        print(f"{sid}: the kept prompt selection {path} is not used, {problem}: sampled again", flush=True)
    if counts is None:
        sampling = Sampling(stage.group_size, stage.temperature, stage.top_p, stage.max_new_tokens)
        answers = _generate_on_verl(
            cfg, run, sid, model_dir, prompts, nodes, pass_fds, generation=(sid, stage.verl, sampling)
        )
        if isinstance(answers, int):
            return answers
        rows = zip(prompts, answers[RESPONSES], strict=True)
        counts = [sum(score(answer, ex.answer).correct for answer in row) for ex, row in rows]
        save_record(path, fingerprint, counts)
    field = f"{sid}.max_pass_rate"
    kept = select_prompts(
        prompts, counts, stage.group_size, stage.max_pass_rate, stage.prompts_per_step, field
    )
    print(
        f"{sid}: training on the {len(kept)} of {len(prompts)} prompts the starting model solves at "
        f"most {stage.max_pass_rate:g} of the time ({stage.group_size} answers each, on verl)",
        flush=True,
    )
    return kept


def verl_env(cfg, run: RunDir, sid: str, metrics_file: Path) -> dict[str, str]:
    """What verl's processes read from their environment: its file logger's path (one file an
    attempt: verl opens it with "wb"), wandb's mode, folder and run (verl's wandb.init names none), and
    the platform. Given to main_ppo's process and to its Ray job's runtime environment."""
    env = {"VERL_FILE_LOGGER_PATH": str(metrics_file), "WANDB_DIR": str(run.stage(sid).resolve())}
    if cfg.wandb.mode != "disabled":
        # one wandb run for every attempt (verl's wandb.init names no id: a requeue would open another)
        env.update(WANDB_MODE=cfg.wandb.mode, WANDB_RUN_ID=run.wandb_run(sid)[1], WANDB_RESUME="allow")
    return {**env, **verl_process_env(_platform())}


def _generate_on_verl(
    cfg,
    run: RunDir,
    sid: str,
    model_dir: Path,
    examples: list[Example],
    nodes: tuple[int, int],
    pass_fds,
    sampled: Sampling | None = None,
    generation: tuple[str, VerlRolloutConfig, Sampling] | None = None,
) -> dict[str, list[list[str]]] | int:
    """verl's answers to `examples` from `model_dir` ({RESPONSES: a list of n a prompt}, and with
    `sampled` its answers under SAMPLED_RESPONSES, from the same replicas), or its exit code.
    `generation`: (config section, rollout settings, sampling) when not the stage's generation_of."""
    from transformers import AutoTokenizer

    from runtime.phases import phase

    field, rollout, sampling = generation or generation_of(cfg, sid)
    paths = generation_paths(run, sid)
    answers = len(examples) * (sampling.n + (sampled.n if sampled else 0))
    overrides = generation_overrides(
        model_dir.resolve(), rollout, sampling, paths["prompts"], paths["output"], cfg.seed, *nodes, answers
    ) + platform_overrides(_platform())
    check_generation(field, rollout, sampling, overrides, nodes)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    check_prompt_lengths(examples, tokenizer, rollout.max_prompt_length, f"{field}.verl.max_prompt_length")
    write_parquet(paths["prompts"], verl_rows(examples, "generation", DATA_SOURCE))
    paths["output"].unlink(missing_ok=True)  # an earlier attempt's
    env = verl_process_env(_platform())
    limits = [str(rollout.requests_in_flight), str(rollout.request_timeout_s)]
    extra = json.dumps(sampled and {"n": sampled.n, "temperature": sampled.temperature})
    with phase("generation"):
        rc = _run_verl(
            run, sid, ["-m", GENERATION_MODULE, json.dumps(env), *limits, extra, *overrides], env, pass_fds
        )
    if rc != 0:
        return rc
    columns = {RESPONSES: sampling.n, **({SAMPLED_RESPONSES: sampled.n} if sampled else {})}
    return {
        column: read_responses(paths["output"], len(examples), n, column) for column, n in columns.items()
    }


def _synthesise_on_verl(cfg, run: RunDir, sid: str, nodes: tuple[int, int], pass_fds) -> int:
    from runtime.phases import phase
    from stages.synth import accepted_answers, write_outputs

    stage = getattr(cfg, sid)
    model_dir = run.model_dir(stage.init_from)
    prompts = read_examples(run.task_file("prompts"))[: stage.num_prompts]
    answers = _generate_on_verl(cfg, run, sid, model_dir, prompts, nodes, pass_fds)
    if isinstance(answers, int):
        return answers
    with phase("scoring"):
        accepted = accepted_answers(prompts, answers[RESPONSES])
    replicas = replica_count(stage.verl, len(prompts) * stage.samples_per_prompt, *nodes)
    write_outputs(
        cfg,
        run,
        sid,
        prompts,
        accepted,
        len(prompts) * stage.samples_per_prompt,
        model_dir,
        {"replicas": replicas},
    )
    return 0


def _evaluate_on_verl(cfg, run: RunDir, sid: str, nodes: tuple[int, int], pass_fds) -> int:
    """final/'s held-out and validation results as the native eval measures them (stages/eval.py):
    greedy answers, and the mean accuracy of eval.samples (k) answers sampled at eval.temperature, all
    at eval.max_new_tokens, by verl's replicas in one pass."""
    from stages.inputs import validation_examples

    held_out = read_examples(run.task_file("eval"))[: cfg.eval.num_examples]
    validation = validation_examples(run, cfg.eval.validation_count)
    k = cfg.eval.samples
    sampled = Sampling(k, cfg.eval.temperature, 1.0, cfg.eval.max_new_tokens) if k else None
    answers = _generate_on_verl(
        cfg, run, sid, run.final(sid), held_out + validation, nodes, pass_fds, sampled
    )
    if isinstance(answers, int):
        return answers
    split = len(held_out)
    result = _scored(cfg, held_out, {column: rows[:split] for column, rows in answers.items()})
    if validation:
        result["validation"] = _scored(
            cfg, validation, {column: rows[split:] for column, rows in answers.items()}
        )
    atomic_write_text(run.eval_result(sid), json.dumps(result))
    print(f"{sid}: held-out accuracy {result['accuracy']:.3f} on {result['n']} examples (verl)", flush=True)
    return 0


def _scored(cfg, examples: list[Example], answers: dict[str, list[list[str]]]) -> dict:
    """The eval result of `examples` from verl's answers to them (greedy, and k sampled where asked)."""
    from stages.eval import accuracy_of, mean_at_k, tally

    result = accuracy_of(tally(examples, [a[0] for a in answers[RESPONSES]]))
    if SAMPLED_RESPONSES in answers:
        k = cfg.eval.samples
        rows = [ex for ex in examples for _ in range(k)]  # each problem's k answers side by side
        flat = [a for row in answers[SAMPLED_RESPONSES] for a in row]
        result.update(mean_at_k(tally(rows, flat), k), temperature=cfg.eval.temperature)
    return {**result, "engine": "verl", "max_new_tokens": cfg.eval.max_new_tokens}


def write_verl_data(cfg, run: RunDir, sid: str, prompts: list[Example]) -> None:
    """verl's train.parquet (`prompts`, those the stage trains on) and val.parquet (held-out)."""
    from transformers import AutoTokenizer

    stage, paths = getattr(cfg, sid), verl_paths(run, sid)
    held_out = read_examples(run.task_file("eval"))[: cfg.eval.num_examples]
    if len(prompts) < stage.prompts_per_step:  # verl's loader drops the last partial batch: no step at all
        raise DataError(
            run.task_file("prompts"),
            None,
            f"{len(prompts)} prompts, fewer than {sid}.prompts_per_step ({stage.prompts_per_step})",
        )
    tokenizer = AutoTokenizer.from_pretrained(run.model_dir(stage.init_from))
    check_prompt_lengths(
        prompts + held_out, tokenizer, stage.verl.max_prompt_length, f"{sid}.verl.max_prompt_length"
    )
    write_parquet(paths["train"], verl_rows(prompts, "train", DATA_SOURCE))
    write_parquet(paths["val"], verl_rows(held_out, "eval", DATA_SOURCE))


def _run_verl(run: RunDir, sid: str, args: list[str], env: dict[str, str], pass_fds: tuple[int, ...]) -> int:
    """`python ARGS` (verl's trainer or our generation driver) with `env` added; its output goes to
    logs/rank-00000.log, where a failure's traceback is looked for. On USR1 (_usr1_stops_the_job)
    it is stopped: the requeued job resumes GRPO from verl's newest checkpoint
    (trainer.resume_mode=auto), losing the steps since then; generation starts over."""
    run.logs(sid).mkdir(parents=True, exist_ok=True)
    log_path = run.logs(sid) / "rank-00000.log"
    start = log_path.stat().st_size if log_path.exists() else 0
    with open(log_path, "a") as log:
        proc = subprocess.Popen(
            [sys.executable, *args],
            env={**repo_env(), **env},
            stdout=log,
            stderr=subprocess.STDOUT,
            pass_fds=pass_fds,
        )
        try:
            rc = proc.wait()
        except _StopRequested:
            proc.terminate()
            proc.wait()
            raise
    if rc != 0:  # what verl raised, for the manifest's error (the driver reads rank 0's record)
        with open(log_path, errors="replace") as log:
            log.seek(start)
            record_printed_exception(run.logs(sid), 0, log.read())
    return rc


def finish_verl_stage(cfg, run: RunDir, sid: str) -> None:
    stage, paths = getattr(cfg, sid), verl_paths(run, sid)
    step = latest_step(paths["ckpt"])
    if step != stage.steps:
        raise RuntimeError(f"verl exited cleanly but its newest checkpoint is step {step}, not {stage.steps}")
    merge_to_final(paths["ckpt"], step, stage.verl.backend, run.final(sid))
    if paths["traces"].is_dir():
        n = traces_to_events(paths["traces"], run.profile(sid), sid)
        print(f"{sid}: {n} communication events from verl's torch-profiler traces", flush=True)
    write_metrics(
        verl_metric_rows(paths["metrics"]), run.metrics(sid), separate_rollout=stage.rollout_ranks > 0
    )
