"""The GPU path, end to end, in one command for the day a GPU is lent: a PASS/FAIL table at the end.

    python bench/gpu_acceptance.py                 # every GPU of this node, results under runs/gpu-acceptance
    python bench/gpu_acceptance.py --gpus 1 --only commbench,pipeline

Checks, each a subprocess with its own time limit and log (under --out):
  commbench   NCCL collectives over the node's GPUs (launch.commbench --backend nccl)
  sft_mfu     megatron-core + DeepSpeed SFT of a random ~1.5B Llama (Llama 3.1 8B's shape cut to 2
              layers) in bf16: tokens/s and MFU (bench/gpu_mfu.py)
  pipeline    the embedded default, all five stages and their held-out evals, on the GPUs (SFT with
              DeepSpeed's overlap_comm)
  report      `hpcr1 report` of that run: its events must be NCCL's, their CUDA times ordered, and
              on 2 GPUs or more SFT's reduction must overlap its backward; GRPO's step time split
              by phase (device-timed, runtime/phases.py), with no negative or inconsistent exposed
              communication
  verl        a few steps of verl.trainer.main_ppo with a vLLM rollout on a random ~0.4B Llama, under a
              Ray head on this node (needs `make setup-gpu`; on a node without network,
              bench/gpu_relay/install_and_run.py installs the lock offline and runs this check)
About 10 minutes on one GPU. Without a GPU it checks what it can (imports, configs) and says so.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PY = sys.executable
TINY = REPO / "configs" / "tiny-cpu.yaml"
# ~0.4B parameters with the character tokenizer: 24 layers of width 1024.
TRAINING_STAGES = ("stage1_sft", "stage2_grpo", "stage3_sft", "stage4_grpo")
VERL_MODEL = [
    "model.tiny.hidden_size=1024",
    "model.tiny.num_layers=24",
    "model.tiny.num_heads=16",
    "model.tiny.num_kv_heads=8",
    "model.tiny.ffn_hidden_size=4096",
]


@dataclass
class Outcome:
    passed: bool
    figure: str  # the measurement, or why it failed


@dataclass
class Check:
    name: str
    what: str
    timeout_s: int
    run: Callable[[argparse.Namespace], Outcome]


def run_logged(name: str, argv: list[str], args, timeout_s: int, env: dict | None = None) -> int | None:
    """Runs argv with output to OUT/NAME.log; the exit code, or None when it ran past timeout_s."""
    log = args.out / f"{name}.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            argv,
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env or child_env(),
            start_new_session=True,
        )
        try:
            return proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return None


def child_env() -> dict[str, str]:
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    )
    env.setdefault("WANDB_MODE", "offline")
    return env


def failed(name: str, rc: int | None, args) -> Outcome:
    why = "timed out" if rc is None else f"exit {rc}"
    tail = (args.out / f"{name}.log").read_text(errors="replace").strip().splitlines()[-1:] or [""]
    return Outcome(False, f"{why}: {tail[0][:100]} (log: {args.out / name}.log)")


def hpcr1(*argv: str) -> list[str]:
    return [PY, "-m", "pipeline.cli", *argv]


# ---- the checks -------------------------------------------------------------------------------
def check_commbench(args) -> Outcome:
    out = args.out / "commbench.json"
    argv = [PY, "-m", "launch.commbench", "--backend", "nccl", "--nproc", str(args.gpus)]
    argv += ["--ops", "all_reduce,all_gather,reduce_scatter", "--sizes", "1M,64M,256M", "--out", str(out)]
    rc = run_logged("commbench", argv, args, CHECKS_BY_NAME["commbench"].timeout_s)
    if rc != 0 or not out.is_file():
        return failed("commbench", rc, args)
    return Outcome(True, commbench_figure(json.loads(out.read_text())))


def commbench_figure(bench: dict) -> str:
    """The largest all-reduce's latency and bus bandwidth (the bus factor is 0 on one GPU)."""
    row = max(bench["results"]["all_reduce"], key=lambda r: r["bytes"])
    return (
        f"{bench['backend']} x{bench['world_size']}: all_reduce {row['bytes'] >> 20} MiB "
        f"{row['latency_us']:.0f} us, busbw {row['busbw_GBps']:.1f} GB/s"
    )


def check_sft_mfu(args) -> Outcome:
    model = REPO / "configs" / "models" / "llama-3.1-8b" / "config.json"
    argv = [PY, "-m", "torch.distributed.run", f"--nproc-per-node={args.gpus}", "bench/gpu_mfu.py"]
    argv += ["--model-config", str(model), "--layers", "2", "--seq-len", "2048", "--micro-batch", "4"]
    rc = run_logged("sft_mfu", argv, args, CHECKS_BY_NAME["sft_mfu"].timeout_s)
    lines = (args.out / "sft_mfu.log").read_text(errors="replace").splitlines()
    found = [line for line in lines if line.startswith("SFT model FLOP/s per GPU")]
    speed = [line.split(", ")[-2] for line in lines if "tokens/s per GPU" in line]
    if rc != 0 or not found:
        return failed("sft_mfu", rc, args)
    return Outcome(True, f"{speed[0] if speed else ''}; {found[0].split(': ', 1)[1]}")


# DeepSpeed's reduction on a stream of its own, so that the report can show SFT's overlap.
OVERLAP_COMM = [f"{sid}.parallel.overlap_comm=true" for sid in ("stage1_sft", "stage3_sft")]


def check_pipeline(args) -> Outcome:
    argv = hpcr1("run", str(TINY), f"nproc={args.gpus}", "--run-dir", str(args.out / "run"), *OVERLAP_COMM)
    rc = run_logged("pipeline", argv, args, CHECKS_BY_NAME["pipeline"].timeout_s)
    if rc != 0:
        return failed("pipeline", rc, args)
    accuracies = [held_out(args.out / "run", s) for s in TRAINING_STAGES]
    return Outcome(True, "held-out accuracy " + " / ".join(f"{a:.3f}" for a in accuracies))


def held_out(run_dir: Path, stage_id: str) -> float:
    return json.loads((run_dir / stage_id / "eval.json").read_text())["accuracy"]


def check_report(args) -> Outcome:
    run_dir, report = args.out / "run", args.out / "report"
    if not (run_dir / "stage2_grpo" / "eval.json").is_file():
        return Outcome(False, "no run to report on (the pipeline check did not pass)")
    rc = run_logged("report", hpcr1("report", str(run_dir), "--out", str(report)), args, 120)
    if rc != 0:
        return failed("report", rc, args)
    events = profile_events(run_dir / "stage2_grpo" / "profile")
    backends = {e.get("backend", "?") for e in events}
    if backends != {"nccl"}:
        return Outcome(False, f"GRPO's events were carried by {sorted(backends)}, not NCCL alone")
    problems = cuda_timing_problems(events)
    if problems:
        return Outcome(False, f"{len(problems)} events with CUDA times out of order, e.g. {problems[0]}")
    overlap = sft_overlap(run_dir / "stage1_sft") if args.gpus > 1 else None
    if overlap is not None and overlap <= 0:
        return Outcome(False, "stage1_sft: DeepSpeed's overlap_comm reductions show no overlap with backward")
    split, split_problems = grpo_split(run_dir / "stage2_grpo")
    if split_problems:
        return Outcome(False, f"stage2_grpo's phase split: {'; '.join(split_problems[:3])}")
    shown = "" if overlap is None else f", SFT overlap {overlap:.0%} on rank 0"
    return Outcome(
        True, f"NCCL only, enqueue <= stream ready <= end on all {len(events)}{shown}; {split}; {report}"
    )


# The phases of a native GRPO step (stages/grpo/trainer.py): those it always runs, and all of them.
GRPO_STEP_PHASES = ("weight_sync", "rollout", "reward", "advantage", "policy_update")
GRPO_ALL_STEP_PHASES = (*GRPO_STEP_PHASES, "balance", "reference_logprob", "policy_logprob")
# The share of a step's host-timed step_time_s its device-timed phases may cover (median over steps):
# the step's statistics synchronise at its end, so the two clocks should agree to launch latencies.
STEP_COVERAGE = (0.8, 1.05)


def grpo_split(stage_dir: Path) -> tuple[str, list[str]]:
    """(figure, problems) of GRPO's time by phase: every step's line times each phase of the step,
    the phases add up to the step's time, and no phase shows negative exposed communication or
    times that contradict each other (analysis/breakdown.py's clock_problems)."""
    from analysis.breakdown import summarise_stage
    from analysis.events import phase_times

    summary = summarise_stage(stage_dir)
    problems = list(summary.clock_problems())
    problems += [
        f"{name}: exposed {exposed:.6f} s, compute {compute:.6f} s"
        for name, _, exposed, compute in summary.phase_split()
        if exposed < 0 or compute < 0
    ]
    coverage = []
    for row in (r for r in summary.metrics if "step_time_s" in r):
        times = phase_times(row)
        missing = [p for p in GRPO_STEP_PHASES if p not in times]
        if missing:
            problems.append(f"step {row['step']} has no time for {', '.join(missing)}")
        coverage.append(sum(times.get(p, 0.0) for p in GRPO_ALL_STEP_PHASES) / row["step_time_s"])
    if not coverage:
        return "", [*problems, f"{stage_dir / 'metrics.jsonl'}: no step lines"]
    median = statistics.median(coverage)
    if not STEP_COVERAGE[0] <= median <= STEP_COVERAGE[1]:
        problems.append(f"its phases add up to {median:.0%} of the step time, not {STEP_COVERAGE}")
    return f"GRPO phases cover {median:.0%} of the step time (median of {len(coverage)} steps)", problems


def sft_overlap(stage_dir: Path) -> float:
    """Rank 0's overlap of communication with compute in an SFT stage (the report's figure)."""
    from analysis.events import load_events
    from analysis.overlap import overlap_fraction

    return overlap_fraction([e for e in load_events(stage_dir) if e["rank"] == 0])


def profile_events(profile_dir: Path) -> list[dict]:
    lines = [line for path in profile_dir.glob("*.jsonl") for line in path.read_text().splitlines()]
    return [json.loads(line) for line in lines]


def cuda_timing_problems(events: list[dict], slack_s: float = 1e-3) -> list[str]:
    """The profiler's three CUDA moments must be present and ordered: the host enqueues (t_start)
    before its stream reaches the call (t_ready), which is before the stream may go on (t_end).
    slack_s: the error of mapping CUDA event times to wall-clock seconds."""
    problems = []
    for e in events:
        start, ready, end = e["t_start"], e.get("t_ready"), e["t_end"]
        if ready is None or end is None or not (start - slack_s <= ready <= end + slack_s):
            problems.append(f"{e['op']} seq {e['seq']} rank {e['rank']}: {start}, {ready}, {end}")
    return problems


def check_verl(args) -> Outcome:
    missing = [m for m in ("verl", "vllm", "ray") if importlib.util.find_spec(m) is None]
    if missing:
        return Outcome(False, f"not installed: {', '.join(missing)} (make setup-gpu)")
    run_dir = args.out / "verl-run"
    overrides = [f"nproc={args.gpus}", *VERL_MODEL, "stage1_sft.steps=50", "stage1_sft.checkpoint_every=50"]
    overrides += [
        "stage2_grpo.engine=verl",
        "stage2_grpo.steps=3",
        f"stage2_grpo.verl.rollout_tp={args.gpus}",
    ]
    argv = hpcr1("run", str(TINY), *overrides, "--only", "stage1_sft", "--run-dir", str(run_dir))
    rc = run_logged("verl-sft", argv, args, 300)
    if rc != 0:
        return failed("verl-sft", rc, args)
    with local_ray_head(args) as env:
        rc = run_logged("verl", hpcr1("stage", str(run_dir), "stage2_grpo"), args, 420, env)
    if rc != 0:
        return failed("verl", rc, args)
    return Outcome(True, f"3 steps; held-out accuracy {held_out(run_dir, 'stage2_grpo'):.3f}")


class local_ray_head:
    """A Ray head on this node for verl's trainer to join (RAY_ADDRESS), stopped afterwards."""

    def __init__(self, args):
        self.args, self.env = args, child_env()
        self.env["RAY_ADDRESS"] = "127.0.0.1:6379"
        # As verl_stage.sbatch starts Ray (why, there): a token in the home changes nothing.
        self.env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(32))
        # What verl_stage.sbatch's job gives the stage driver (launch/verl_job.py reads both).
        self.env.update(HPCR1_GPUS_PER_NODE=str(args.gpus), SLURM_NNODES="1")

    def __enter__(self) -> dict[str, str]:
        ray = [PY, "-m", "ray.scripts.scripts"]
        start = [
            *ray,
            "start",
            "--head",
            "--port=6379",
            f"--num-gpus={self.args.gpus}",
            "--include-dashboard=false",
        ]
        subprocess.run(start, env=self.env, check=True, capture_output=True, timeout=120)
        return self.env

    def __exit__(self, *exc) -> None:
        subprocess.run(
            [PY, "-m", "ray.scripts.scripts", "stop", "--force"], env=self.env, capture_output=True
        )


CHECKS = [
    Check("commbench", "NCCL collective bandwidth", 180, check_commbench),
    Check("sft_mfu", "bf16 SFT of a ~1.5B Llama: tokens/s, MFU", 240, check_sft_mfu),
    Check("pipeline", "the embedded default's five stages on the GPUs", 420, check_pipeline),
    Check("report", "communication report of that run", 120, check_report),
    Check("verl", "verl main_ppo with a vLLM rollout", 720, check_verl),
]
CHECKS_BY_NAME = {c.name: c for c in CHECKS}


# ---- entry ------------------------------------------------------------------------------------
def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=REPO / "runs" / "gpu-acceptance")
    p.add_argument("--gpus", type=int, help="GPUs to use (default: every GPU torch sees)")
    p.add_argument("--only", help=f"comma-separated checks, from {', '.join(CHECKS_BY_NAME)}")
    args = p.parse_args(argv)
    args.checks = CHECKS if args.only is None else [CHECKS_BY_NAME.get(n) for n in args.only.split(",")]
    if None in args.checks:
        p.error(f"--only: choose from {', '.join(CHECKS_BY_NAME)}")
    return args


def preflight() -> list[str]:
    """What is missing for the checks, found without a GPU: the engines and the shipped configs."""
    problems = [
        f"python package '{m}' missing"
        for m in ("deepspeed", "megatron.core", "transformers")
        if not importlib.util.find_spec(m.split(".")[0])
    ]
    for config in (TINY, REPO / "configs" / "models" / "llama-3.1-8b" / "config.json"):
        if not config.is_file():
            problems.append(f"{config} missing")
    return problems


def table(rows: list[tuple[Check, Outcome | None, float]]) -> str:
    lines = [f"{'check':10s} {'result':7s} {'s':>5s}  figure"]
    for check, outcome, seconds in rows:
        verdict = "NOT RUN" if outcome is None else "PASS" if outcome.passed else "FAIL"
        figure = check.what if outcome is None else outcome.figure
        lines.append(f"{check.name:10s} {verdict:7s} {seconds:5.0f}  {figure}")
    return "\n".join(lines)


def main(argv=None) -> int:
    args = parse_args(argv)
    import torch

    problems = preflight()
    for problem in problems:
        print(f"gpu_acceptance: {problem}", file=sys.stderr)
    if not torch.cuda.is_available():
        print(
            "gpu_acceptance: no GPU present (torch.cuda.is_available() is False; torch "
            f"{torch.__version__}, CUDA build {torch.version.cuda}): nothing was run. Run it on a GPU "
            "node after `make setup-gpu`.",
            file=sys.stderr,
        )
        print(table([(c, None, 0.0) for c in args.checks]))
        return 2
    args.gpus = args.gpus or torch.cuda.device_count()
    shutil.rmtree(args.out, ignore_errors=True)
    args.out.mkdir(parents=True)
    gpu = torch.cuda.get_device_name()
    print(f"gpu_acceptance: {args.gpus} x {gpu}, torch {torch.__version__}; logs in {args.out}")
    rows = []
    for check in args.checks:
        started = time.monotonic()
        outcome = check.run(args)
        rows.append((check, outcome, time.monotonic() - started))
        print(f"{check.name}: {'PASS' if outcome.passed else 'FAIL'} {outcome.figure}", flush=True)
    print(table(rows))
    return 0 if all(o.passed for _, o, _ in rows) and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
