"""`hpcr1`: the command line. Parse, build, run; the work lives in the modules it calls.

Exit codes: 0 success, 2 bad input (one message naming the field or line), 1 a failure while running.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

# Commands whose own parser lives with their module: everything after the name is theirs (`--help`
# included), which argparse's REMAINDER cannot pass on when it starts with an option.
DELEGATED = {"report": "analysis.report", "commbench": "launch.commbench"}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in DELEGATED:
        command = lambda: _delegate(DELEGATED[argv[0]], argv[1:])  # noqa: E731
    else:
        args = _parse(argv)
        command = lambda: args.func(args) or 0  # noqa: E731
    from core.config import ConfigError
    from pipeline.runlock import RunDirBusy
    from stages.data.examples import DataError

    try:
        return command()
    except (ConfigError, DataError) as e:
        print(f"hpcr1: error: {e}", file=sys.stderr)
        return 2
    except RunDirBusy as e:
        print(f"hpcr1: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("hpcr1: interrupted; `hpcr1 run` again resumes from the last checkpoint", file=sys.stderr)
        return 130


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = _parser()
    # Overrides may follow options (`run CFG --run-dir D a.b=1`): leftovers are overrides where taken.
    args, leftover = parser.parse_known_args(argv)
    # An option the command does not know is an unknown option, not a malformed override.
    unknown = [arg for arg in leftover if arg.startswith("-")]
    if unknown or (leftover and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(unknown or leftover)}")
    if leftover:
        args.overrides = [*args.overrides, *leftover]
    return args


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="hpcr1", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(required=True, metavar="COMMAND")

    run = sub.add_parser("run", help="run the stage graph here (torchrun or mpirun), resuming what is there")
    run.add_argument("config")
    run.add_argument("--run-dir", help="default: runs/<name>")
    run.add_argument("--only", help="comma-separated stage ids")
    add_launcher_option(run)
    run.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    run.set_defaults(func=cmd_run)

    show = sub.add_parser("config", help="print the fully resolved config")
    show.add_argument("config")
    show.add_argument(
        "--cluster", help="also lay it out for this profile and check each stage's memory on its GPUs"
    )
    show.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    show.set_defaults(func=cmd_config)

    sb = sub.add_parser("submit", help="submit the stages as chained Slurm jobs")
    sb.add_argument("config")
    sb.add_argument("--cluster", required=True, help="profile name in slurm/profiles/ or a YAML path")
    sb.add_argument("--nodes", type=int, help=NODES_HELP)
    sb.add_argument("--run-dir", help="default: runs/<name>")
    sb.add_argument("--dry-run", action="store_true", help="write and print the scripts, submit nothing")
    add_skip_checks_option(sb)
    sb.add_argument("--only", help="comma-separated stage ids")
    sb.add_argument("--from", dest="from_stage", metavar="STAGE", help="this stage and those after it")
    sb.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    sb.set_defaults(func=cmd_submit)

    dr = sub.add_parser(
        "doctor", help="probe a cluster profile with one short job: PASS / WARN / FAIL checks"
    )
    dr.add_argument("config")
    dr.add_argument("--cluster", required=True, help="profile name in slurm/profiles/ or a YAML path")
    dr.add_argument("--nodes", type=int, help=NODES_HELP)
    dr.add_argument(
        "--run-dir",
        help="where the run would write (default: runs/<name>); the probe's files go to its doctor/",
    )
    dr.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    dr.set_defaults(func=cmd_doctor)

    sw = sub.add_parser("sweep", help="weak scaling: one run per GPU count, the batch per GPU fixed")
    sw.add_argument("config")
    sw.add_argument("--gpus", required=True, help="GPU (rank) counts, comma-separated, e.g. 16,32,64,128")
    sw.add_argument(
        "--per-gpu-batch",
        type=int,
        required=True,
        help="SFT sequences per data-parallel rank, GRPO prompts per rank (pipeline/sweep.py)",
    )
    sw.add_argument(
        "--cluster", help="submit every scale to this cluster (default: run them here, one by one)"
    )
    sw.add_argument("--sweep-dir", help="default: runs/<name>-sweep")
    sw.add_argument("--only", help="comma-separated stage ids")
    sw.add_argument(
        "--dry-run",
        action="store_true",
        help="write the run directories (and sbatch scripts with --cluster), run or submit nothing",
    )
    sw.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    sw.set_defaults(func=cmd_sweep)

    rs = sub.add_parser("resume", help="continue a run from its first stage that is not done")
    rs.add_argument("run_dir")
    rs.add_argument("--cluster", help="resubmit to this cluster (default: run here)")
    rs.add_argument("--nodes", type=int, help=NODES_HELP)
    add_skip_checks_option(rs)
    add_launcher_option(rs)
    rs.set_defaults(func=cmd_resume)

    cn = sub.add_parser("cancel", help="cancel a run's queued and running Slurm jobs")
    cn.add_argument("run_dir")
    cn.set_defaults(func=cmd_cancel)

    st = sub.add_parser("stage", help="(inside a batch job) run one stage of a run directory")
    st.add_argument("run_dir")
    st.add_argument("stage_id")
    st.set_defaults(func=cmd_stage)

    status = sub.add_parser("status", help="the state of each stage of a run")
    status.add_argument("run_dir")
    status.set_defaults(func=cmd_status)

    pl = sub.add_parser(
        "plan", help="memory per GPU and per node of each stage for each GPU count, and the verdict"
    )
    pl.add_argument("config")
    pl.add_argument("--gpus", default="1,2,4,8,16,32,64,128,256", help="GPU counts, comma-separated")
    pl.add_argument("--cluster", default="perlmutter", help="profile name in slurm/profiles/ or a YAML path")
    pl.add_argument(
        "--gpu-memory-gib", type=float, help="instead of the profile's (80: Perlmutter's hbm80g nodes)"
    )
    pl.add_argument("--prompt-tokens", type=int, help="prompt length assumed for GRPO and generation")
    pl.add_argument("--json", action="store_true", help="print JSON instead of text")
    pl.add_argument("--out", help="the Markdown plan (default: plan-<name>.md here)")
    pl.add_argument(
        "--write-overrides",
        metavar="FILE",
        help="write the planned settings at the config's nproc as KEY=VALUE lines for run/submit",
    )
    pl.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    pl.set_defaults(func=cmd_plan)

    # Listed for `hpcr1 --help`; main() hands them their arguments before this parser runs.
    sub.add_parser("report", help="communication and phase breakdown of run directories", add_help=False)
    sub.add_parser("commbench", help="collective bandwidth sweep (torch.distributed or MPI)", add_help=False)

    ev = sub.add_parser("eval", help="held-out accuracy of a Hugging Face model directory")
    ev.add_argument("model_dir")
    ev.add_argument("--data", required=True, help="JSONL or Parquet file with prompts and answers")
    ev.add_argument("--max-new-tokens", type=int, default=64)
    ev.add_argument("--limit", type=int, default=None, help="score only the first N examples")
    ev.add_argument("--samples", type=int, default=4, help="k sampled answers a problem (mean@k)")
    ev.add_argument("--temperature", type=float, default=1.0, help="sampling temperature of the k answers")
    ev.add_argument("--seed", type=int, default=0, help="seeds the k answers' draws")
    ev.set_defaults(func=cmd_eval)
    return p


NODES_HELP = "nodes per stage job (default: the config's nproc over the profile's tasks per node)"


def add_skip_checks_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--skip-checks",
        action="store_true",
        help="submit even where a check fails (each stage's memory on the profile's GPUs, the run "
        "directory's room for the planned checkpoints)",
    )


def add_launcher_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--launcher",
        choices=("torchrun", "mpirun"),
        default="torchrun",
        help="what starts a stage's ranks here (mpirun: they find each other through MPI)",
    )


def _delegate(module: str, argv: list[str]) -> int:
    """Commands whose own parser lives with their module."""
    import importlib

    return importlib.import_module(module).main(argv)


def cmd_run(args) -> int:
    from core.config import load_config
    from core.rundir import RunDir

    cfg = load_config(args.config, args.overrides)
    run = RunDir(Path(args.run_dir or f"runs/{cfg.name}"))
    only = args.only.split(",") if args.only else None
    rc = run_here(cfg, run, Path(args.config).parent, only, args.launcher)
    if rc == 0:
        print(f"run directory: {run.root}")
    return rc


def run_here(cfg, run, base: Path, only: list[str] | None = None, launcher: str = "torchrun") -> int:
    """Run the stage graph on this machine, each stage's ranks started by `launcher`; the exit code
    says how it ended."""
    import functools
    import shutil

    from core.config import ConfigError
    from launch.local import run_stage_locally
    from pipeline.driver import run_pipeline

    if launcher == "mpirun" and shutil.which("mpirun") is None:  # torchrun comes with torch
        raise ConfigError("--launcher", "mpirun is not on PATH (Open MPI: make system-packages)")
    start = functools.partial(run_stage_locally, launcher=launcher)
    return stages_exit_code(lambda: run_pipeline(cfg, run, base, only, launcher=start))


def stages_exit_code(run_stages) -> int:
    """Call `run_stages()` (stages run here): 0, 1 when a stage failed, PREEMPTED_EXIT when one
    stopped on a signal with a checkpoint."""
    from pipeline.driver import StageFailed, StagePreempted
    from runtime.preemption import PREEMPTED_EXIT

    try:
        run_stages()
    except StageFailed as e:
        print(f"hpcr1: {e}", file=sys.stderr)
        return 1
    except StagePreempted as e:  # a USR1 (e.g. a batch system's warning): the same command continues
        print(f"hpcr1: {e}", file=sys.stderr)
        return PREEMPTED_EXIT
    return 0


def cmd_submit(args) -> int:
    from core.cluster import load_profile
    from core.config import load_config
    from core.rundir import RunDir
    from pipeline.submit import submit

    cfg = load_config(args.config, args.overrides)
    run = RunDir(Path(args.run_dir or f"runs/{cfg.name}"))
    only = selected_stages(cfg, args.only, args.from_stage)
    profile = load_profile(args.cluster)
    submit(
        cfg,
        run,
        Path(args.config).parent,
        profile,
        job_nodes(args.nodes, cfg, profile),
        args.dry_run,
        only=only,
        checks=not args.skip_checks,
    )
    return 0


def cmd_doctor(args) -> int:
    from core.cluster import load_profile
    from core.config import load_config
    from core.rundir import RunDir
    from pipeline.doctor import doctor

    cfg = load_config(args.config, args.overrides)
    run = RunDir(Path(args.run_dir or f"runs/{cfg.name}"))
    profile = load_profile(args.cluster)
    return doctor(cfg, Path(args.config).parent, profile, run, job_nodes(args.nodes, cfg, profile))


def job_nodes(nodes: int | None, cfg, profile) -> int:
    """--nodes, or as many nodes as the config's ranks fill (nproc 2, one rank a node: 2)."""
    from pipeline.sweep import nodes_for

    return nodes if nodes is not None else nodes_for(cfg.nproc, profile)


def selected_stages(cfg, only: str | None, from_stage: str | None) -> list[str] | None:
    """--only's stages, or --from's stage and every one after it in graph order; None: all."""
    from core.config import ConfigError

    stages = list(cfg.stages())
    if only and from_stage:
        raise ConfigError("--from", "give --only or --from, not both")
    if from_stage is None:
        return only.split(",") if only else None
    if from_stage not in stages:
        raise ConfigError("--from", f"no stage {from_stage!r} (stages: {', '.join(stages)})")
    return stages[stages.index(from_stage) :]


def cmd_sweep(args) -> int:
    from core.cluster import load_profile
    from pipeline.sweep import parse_gpu_counts, plan_sweep, run_sweep

    only = args.only.split(",") if args.only else None
    profile = load_profile(args.cluster) if args.cluster else None
    sweep = plan_sweep(
        Path(args.config),
        args.overrides,
        parse_gpu_counts(args.gpus),
        args.per_gpu_batch,
        Path(args.sweep_dir) if args.sweep_dir else None,
        only,
        profile,
    )
    rc = stages_exit_code(lambda: run_sweep(sweep, args.dry_run))
    if rc == 0:
        print(f"sweep directory: {sweep.root} (hpcr1 report {sweep.root})")
    return rc


def cmd_resume(args) -> int:
    from core.cluster import load_profile
    from core.config import load_resolved
    from core.rundir import RunDir
    from pipeline.status import fail_orphaned_stages
    from pipeline.submit import submit

    run = RunDir(Path(args.run_dir))
    cfg = load_resolved(run)
    if args.cluster:
        fail_orphaned_stages(run.root)  # else its job, still RUNNING, would run beside the resubmitted one
        profile = load_profile(args.cluster)
        nodes = job_nodes(args.nodes, cfg, profile)
        submit(cfg, run, run.root, profile, nodes, dry_run=False, checks=not args.skip_checks)
        return 0
    return run_here(cfg, run, run.root, launcher=args.launcher)


def cmd_cancel(args) -> int:
    from core.rundir import RunDir
    from pipeline.submit import cancel

    cancel(RunDir(Path(args.run_dir)))
    return 0


def cmd_stage(args) -> int:
    from core.rundir import RunDir
    from pipeline.driver import StageFailed
    from pipeline.submit import run_stage_job

    try:
        return run_stage_job(RunDir(Path(args.run_dir)), args.stage_id)
    except StageFailed as e:
        print(f"hpcr1: {e}", file=sys.stderr)
        return 1


def cmd_config(args) -> int:
    from core.config import dump_config, load_config

    cfg = load_config(args.config, args.overrides)
    if args.cluster:
        cfg = checked_on(cfg, Path(args.config).parent, args.cluster)
    print(dump_config(cfg), end="")
    return 0


def checked_on(cfg, config_dir: Path, cluster: str):
    """`cfg` laid out as `hpcr1 submit` lays it out on the profile, its memory checked there: a
    FAIL is a ConfigError (exit 2), a WARN is said on stderr."""
    from analysis.model_shape import model_shape
    from core.cluster import load_profile
    from pipeline.checks import memory_checks
    from pipeline.submit import refuse_first_fail, resolve_layouts

    profile = load_profile(cluster)

    def say(line: str) -> None:
        print(line, file=sys.stderr)

    cfg = resolve_layouts(cfg, config_dir, profile, job_nodes(None, cfg, profile), say)
    refuse_first_fail(memory_checks(cfg, model_shape(cfg, config_dir), profile, list(cfg.stages())), say)
    return cfg


def cmd_plan(args) -> int:
    from analysis import plan_report
    from analysis.auto_layout import smallest_layouts
    from analysis.memory import PROMPT_TOKENS
    from analysis.model_shape import model_shape
    from analysis.plan import Machine, overrides, parse_gpus, plan
    from analysis.plan_search import with_settings
    from analysis.plan_split import plan_splits
    from core.atomic import atomic_write_text
    from core.cluster import load_profile
    from core.config import ConfigError, load_config

    gpus = parse_gpus(args.gpus)
    prompt_tokens = PROMPT_TOKENS if args.prompt_tokens is None else args.prompt_tokens
    if prompt_tokens < 1:
        raise ConfigError("--prompt-tokens", f"must be at least 1 (got {prompt_tokens})")
    if args.gpu_memory_gib is not None and args.gpu_memory_gib <= 0:
        raise ConfigError("--gpu-memory-gib", f"must be positive (got {args.gpu_memory_gib})")
    cfg = load_config(args.config, args.overrides, data_files=False)
    shape = model_shape(cfg, Path(args.config).parent)
    profile = load_profile(args.cluster)
    machine = Machine.from_profile(profile, args.gpu_memory_gib)
    # 'auto' layouts: the planner searches them; as "configured", the smallest (what it tries first)
    cfg = with_settings(cfg, smallest_layouts(cfg, shape, cfg.nproc, profile.verl_gpus_per_node()))
    plans = plan(cfg, shape, machine, gpus, prompt_tokens)
    splits = plan_splits(cfg, shape, machine, prompt_tokens)
    out = Path(args.out or f"plan-{cfg.name}.md")
    atomic_write_text(out, plan_report.render_markdown(cfg.name, shape, machine, plans, splits))
    if args.json:
        print(json.dumps(plan_report.plan_json(cfg.name, shape, machine, plans, splits), indent=2))
    else:
        print(plan_report.render_text(cfg.name, shape, machine, plans, splits), end="")
    print(f"markdown: {out}", file=sys.stderr)
    if args.write_overrides:
        lines, left = overrides(plans, cfg.nproc)
        atomic_write_text(Path(args.write_overrides), "\n".join(lines) + "\n")
        for why in left:
            print(f"hpcr1 plan: {why}", file=sys.stderr)
        path = args.write_overrides
        print(f"overrides: {path} (hpcr1 submit CONFIG --cluster NAME ... $(cat {path}))", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    from core.config import ConfigError
    from pipeline.status import fail_orphaned_stages, stage_rows

    if not (Path(args.run_dir) / "manifest.json").exists():
        raise ConfigError(args.run_dir, "not a run directory (no manifest.json)")
    fail_orphaned_stages(Path(args.run_dir))
    for row in stage_rows(Path(args.run_dir)):
        print(row)
    return 0


def cmd_eval(args) -> int:
    from core.config import ConfigError, EvalConfig
    from stages.data.examples import read_examples
    from stages.eval import evaluate_model_dir

    if args.samples < 0:
        raise ConfigError("--samples", f"must be 0 or more (got {args.samples})")
    if not args.temperature > 0:
        raise ConfigError("--temperature", f"must be positive (got {args.temperature})")
    examples = read_examples(args.data)[: args.limit]
    settings = EvalConfig.model_validate(
        {"max_new_tokens": args.max_new_tokens, "samples": args.samples, "temperature": args.temperature}
    )
    result = evaluate_model_dir(Path(args.model_dir), examples, settings, args.seed)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
