"""A verl GRPO stage's inputs and outputs in our formats: the prompt set as verl's parquet files,
verl's last checkpoint as our Hugging Face final/, its torch-profiler traces as profile/ events,
and its file logger's rows as metrics.jsonl."""

from __future__ import annotations

import functools
import json
import os
import re
import shutil
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from core.atomic import atomic_write_text
from stages.data.examples import DataError, Example

# verl's record_function ranges (DistProfiler.annotate roles) -> our GRPO phases
VERL_PHASES = {
    "actor_compute_log_prob": "policy_logprob",
    "ref_compute_log_prob": "reference_logprob",
    "actor_update": "policy_update",
}
# verl's step timers (marked_timer names, logged as timing_s/<name>) -> our phases
VERL_TIMERS = {
    "gen": "rollout",
    "reward": "reward",
    "old_log_prob": "policy_logprob",
    "ref": "reference_logprob",
    "adv": "advantage",
    "update_actor": "policy_update",
    "update_weights": "weight_sync",
    "save_checkpoint": "checkpoint",
}
_TRACE_STEP = re.compile(r"_step(\d+)_")


def verl_rows(examples: list[Example], split: str, data_source: str) -> list[dict]:
    """verl's RL dataset rows: the prompt as one chat user turn (verl applies the model's chat
    template, as encode_prompt does for the native engine) and the answer as reward ground truth."""
    return [
        {
            "data_source": data_source,
            "prompt": [{"role": "user", "content": ex.prompt}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": ex.answer},
            "extra_info": {"split": split, "index": i, "id": ex.id},
        }
        for i, ex in enumerate(examples)
    ]


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    tmp.replace(path)


def check_prompt_lengths(examples: list[Example], tokenizer, max_prompt_length: int, field: str) -> None:
    """verl is told to fail on a longer prompt (truncation=error) hours into the job; say it now."""
    from stages.data.tokenizer import encode_prompt

    for ex in examples:
        n = len(encode_prompt(tokenizer, ex.prompt))
        if n > max_prompt_length:
            raise DataError(
                ex.id,
                None,
                f"the prompt is {n} tokens with the chat template, above {field} ({max_prompt_length})",
            )


def latest_step(ckpt_root: Path) -> int | None:
    marker = ckpt_root / "latest_checkpointed_iteration.txt"
    return int(marker.read_text().strip()) if marker.is_file() else None


def merge_to_final(ckpt_root: Path, step: int, backend: str, final: Path) -> None:
    """verl's actor checkpoint of `step` -> a Hugging Face directory at `final`, written aside and
    renamed, so a half-written final/ never exists. FSDP: verl's merger joins the shards (and writes
    bf16 weights). megatron: verl 0.9.1 writes no megatron model shards unless asked
    (use_dist_checkpointing, off), but the model as Hugging Face files, exported by Megatron-Bridge
    with the tokenizer (utils/checkpoint/megatron_checkpoint_manager.py:245-249,1004-1040): that
    directory is final/."""
    actor = ckpt_root / f"global_step_{step}" / "actor"
    if not actor.is_dir():
        raise RuntimeError(f"verl left no actor checkpoint at {actor}")
    staging = final.with_name("final.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    if backend == "megatron":
        shutil.copytree(megatron_hf_dir(actor), staging)
    else:
        _merge_fsdp_shards(actor, staging)
    if not any(staging.glob("*.safetensors")):
        raise RuntimeError(f"verl's checkpoint gave no safetensors in {staging}")
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)


def megatron_hf_dir(actor: Path) -> Path:
    """The Hugging Face directory of verl's megatron actor checkpoint, where its manifest
    (ckpt_contents.json, written last) says the model is."""
    manifest = actor / "ckpt_contents.json"
    if not manifest.is_file():
        raise RuntimeError(f"verl's megatron checkpoint {actor} has no ckpt_contents.json: it is incomplete")
    model = json.loads(manifest.read_text())["contents"].get("model", {})
    if model.get("format") != "huggingface":
        raise RuntimeError(
            f"verl's megatron checkpoint {actor} holds the model as {model.get('format')!r}, not as "
            "Hugging Face files (megatron.use_dist_checkpointing must stay off)"
        )
    return actor / model["path"]


def _merge_fsdp_shards(actor: Path, staging: Path) -> None:
    """verl's merger (`python -m verl.model_merger merge --backend=fsdp`), run in this process: a
    Python of its own would spend seconds importing torch and verl again."""
    from verl.model_merger.base_model_merger import ModelMergerConfig
    from verl.model_merger.fsdp_model_merger import FSDPModelMerger

    staging.mkdir(parents=True)
    config = ModelMergerConfig(
        operation="merge",
        backend="fsdp",
        local_dir=str(actor),
        target_dir=str(staging),
        hf_model_config_path=str(actor / "huggingface"),  # where the checkpoint manager puts it
    )
    merger = FSDPModelMerger(config)
    merger.merge_and_save()
    merger.cleanup()


def traces_to_events(trace_dir: Path, profile_dir: Path, stage: str) -> int:
    """Every torch-profiler trace verl wrote -> profile/rank-NNNNN.jsonl (source "trace"). A rank's
    traces (one per role and profiled step) are merged in time order and its per-(group, op) call
    counters renumbered over all of them. Returns the number of events."""
    # imported here: the parser's op tables live with the profiler, which imports torch, and
    # `hpcr1 submit` imports this module without ever reading a trace
    from runtime.trace_parser import parse_trace

    paths = sorted(trace_dir.glob("*.json*"))
    parse = functools.partial(parse_trace, stage=stage, phase_names=VERL_PHASES)
    # A trace with shapes is hundreds of MB at scale: the profiled ranks' traces parse side by side.
    with ProcessPoolExecutor(max_workers=max(1, min(len(paths), os.cpu_count() or 1))) as pool:
        parsed = list(pool.map(parse, paths))
    by_rank: dict[int, list[dict]] = {}
    for path, trace_events in zip(paths, parsed, strict=True):
        step = _TRACE_STEP.search(path.name)
        for event in trace_events:
            if step:
                event["step"] = int(step.group(1))
            by_rank.setdefault(event["rank"], []).append(event)
    for rank, events in by_rank.items():
        events.sort(key=lambda e: e["t_start"])
        seq: dict[tuple, int] = {}
        for e in events:
            key = (tuple(e["group_ranks"]), e["op"])
            e["seq"] = seq[key] = seq.get(key, -1) + 1
        atomic_write_text(
            profile_dir / f"rank-{rank:05d}.jsonl", "".join(json.dumps(e) + "\n" for e in events)
        )
    return sum(len(events) for events in by_rank.values())


def next_metrics_file(folder: Path) -> Path:
    """The file verl's file logger writes in this attempt: a new one each, since it opens its file
    with "wb" (verl/utils/tracking.py) and would erase the metrics of the attempts before."""
    folder.mkdir(parents=True, exist_ok=True)
    return folder / f"attempt-{len(list(folder.glob('attempt-*.jsonl'))) + 1:03d}.jsonl"


def verl_metric_rows(folder: Path) -> list[dict]:
    """Every attempt's file-logger rows ({"step", "data"}), in attempt order; a step an attempt
    logged again (it resumed from a checkpoint before it) keeps the later row."""
    by_step: dict[int, dict] = {}
    for path in sorted(folder.glob("attempt-*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                row = json.loads(line)
                by_step[row["step"]] = row
    return sorted(by_step.values(), key=lambda row: row["step"])


def write_metrics(rows: list[dict], metrics: Path, separate_rollout: bool = False) -> None:
    """verl's file-logger rows as our metrics.jsonl: its own keys, plus the step's phase wall times
    under our names (phase_time/<phase>, what `hpcr1 report` reads). With a rollout pool of its own
    (separate_async) verl's `gen` timer is the trainers' wait for sampled batches: rollout_wait."""
    timers = VERL_TIMERS | ({"gen": "rollout_wait"} if separate_rollout else {})
    out = []
    for row in rows:
        data = row["data"]
        phases = {
            f"phase_time/{ours}": data[f"timing_s/{theirs}"]
            for theirs, ours in timers.items()
            if f"timing_s/{theirs}" in data
        }
        out.append({"step": row["step"], **data, **phases})
    atomic_write_text(metrics, "".join(json.dumps(r) + "\n" for r in out))
