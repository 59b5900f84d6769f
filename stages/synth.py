"""Synthetic data (stage3_synth) by rejection sampling: an earlier stage's model answers the first
`num_prompts` prompts `samples_per_prompt` times each; only answers that the task's reward scores
correct AND well-formed are kept, deduplicated and capped per prompt, and written as JSONL with
provenance (prompt id, sample index, reward, and the generating model's checksum and its path
relative to the run directory, so that the dataset's bytes do not depend on where the run lives).

Work is spread dynamically: batches of prompts are taken from a counter in the process group's
store, so a rank that finishes early takes the next batch instead of idling. Each batch samples
from its own seed, so the dataset does not depend on which rank took which batch, nor on which
attempt: every sampled batch is kept as a record of its own (stages/kept.py), a preempted stage
(USR1) stops taking batches and leaves for the requeue, and the next attempt samples only the
batches without a record.

The stage's final/ is not a model: it holds the dataset (a hard link to data/synthetic.jsonl, so
the driver's checksum covers exactly the file the next stage reads) and provenance.json. Its
eval.json reports the acceptance rate (kept / sampled) as `accuracy` over `n` samples.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from core.atomic import atomic_write_text
from runtime.context import StageContext
from runtime.dist import rank_device
from runtime.group import from_rank0
from runtime.phases import phase, take_phase_times
from runtime.preemption import leave_if_requested, signalled
from stages.data.examples import Example, read_examples, write_examples
from stages.data.tokenizer import load_tokenizer
from stages.engines.ddp import load_replicated
from stages.engines.precision import compute_dtype, enable_tf32
from stages.generation import generate_responses
from stages.kept import MISSING, inputs_fingerprint, load_record, save_record
from stages.metrics import MetricsLogger
from stages.models.hf_files import weights_sha256
from stages.rewards.math_reward import score


@dataclass(frozen=True)
class Candidate:
    prompt_index: int
    sample_index: int
    response: str
    reward: float


class BatchQueue:
    """`batches` handed out once each across all ranks, first come first served; none once any rank
    was signalled to stop (it tells the others through the store)."""

    def __init__(self, key: str, batches: list[int]):
        self.store, self.key, self.batches = dist.distributed_c10d._get_default_store(), key, batches

    def __iter__(self):
        while not self._stopping() and (i := self.store.add(self.key, 1) - 1) < len(self.batches):
            yield self.batches[i]

    def _stopping(self) -> bool:
        return self.store.add(f"{self.key}/stop", 1 if signalled() else 0) > 0


class BatchRecords:
    """Each sampled batch's accepted answers and number of samples, kept by the rank that sampled
    it as a record of its own, valid for the inputs of `fingerprint`."""

    def __init__(self, directory: Path, fingerprint: str):
        self.directory, self.fingerprint = directory, fingerprint

    def path(self, batch: int) -> Path:
        return self.directory / f"batch-{batch:06d}.json"

    def save(self, batch: int, accepted: list[Candidate], sampled: int) -> None:
        payload = {"sampled": sampled, "accepted": [asdict(c) for c in accepted]}
        save_record(self.path(batch), self.fingerprint, payload)

    def load(self, batch: int) -> tuple[tuple[list[Candidate], int] | None, str | None]:
        """((accepted, sampled), None), or (None, why the batch has no usable record)."""
        payload, problem = load_record(self.path(batch), self.fingerprint)
        if problem:
            return None, problem
        return ([Candidate(**c) for c in payload["accepted"]], payload["sampled"]), None

    def left_to_sample(self, num_batches: int, log: logging.Logger) -> list[int]:
        """The batches without a usable record, saying how many are kept and why others are not."""
        problems = {b: self.load(b)[1] for b in range(num_batches)}
        left = [b for b, problem in problems.items() if problem]
        unusable = Counter(problem for problem in problems.values() if problem and problem != MISSING)
        for problem, n in unusable.items():
            log.warning("%d batch record(s) in %s not used, %s: sampled again", n, self.directory, problem)
        log.info("%d of %d batches kept from earlier attempts", num_batches - len(left), num_batches)
        return left

    def read_all(self, num_batches: int) -> tuple[list[Candidate], int]:
        """Every batch's accepted answers, in batch order, and the number of samples."""
        candidates, sampled = [], 0
        for b in range(num_batches):
            kept, problem = self.load(b)
            if problem:
                raise RuntimeError(f"batch {b} was sampled but its record {self.path(b)} is {problem}")
            candidates += kept[0]
            sampled += kept[1]
        return candidates, sampled


def sample_batch(
    model, tokenizer, prompts: list[Example], first: int, stage, seed: int
) -> tuple[list[Candidate], int]:
    """Sample and score one batch; returns the accepted candidates and the number of samples."""
    torch.manual_seed(seed)
    repeated = [ex.prompt for ex in prompts for _ in range(stage.samples_per_prompt)]
    with phase("generation"):
        responses = generate_responses(
            model, tokenizer, repeated, stage.max_new_tokens, stage.temperature, stage.top_p
        )
    with phase("scoring"):
        per_prompt = [
            responses[i : i + stage.samples_per_prompt]
            for i in range(0, len(responses), stage.samples_per_prompt)
        ]
        return accepted_answers(prompts, per_prompt, first), len(responses)


def accepted_answers(prompts: list[Example], responses: list[list[str]], first: int = 0) -> list[Candidate]:
    """The samples (`responses[i]` answers `prompts[i]`, whose index in the prompt set is first + i)
    that the task's reward scores correct and well-formed: the one filter of every engine."""
    accepted = []
    for offset, (ex, samples) in enumerate(zip(prompts, responses, strict=True)):
        for sample, response in enumerate(samples):
            s = score(response, ex.answer)
            if s.correct and s.format_ok:
                accepted.append(Candidate(first + offset, sample, response, s.reward))
    return accepted


def keep_distinct(candidates: list[Candidate], max_per_prompt: int) -> list[Candidate]:
    """Per prompt, in sample order: the first `max_per_prompt` distinct responses."""
    kept, seen, per_prompt = [], set(), {}
    for c in sorted(candidates, key=lambda c: (c.prompt_index, c.sample_index)):
        if (c.prompt_index, c.response) in seen or per_prompt.get(c.prompt_index, 0) >= max_per_prompt:
            continue
        seen.add((c.prompt_index, c.response))
        per_prompt[c.prompt_index] = per_prompt.get(c.prompt_index, 0) + 1
        kept.append(c)
    return kept


def gather_to_main(value):
    """Every rank's `value`, in rank order, on rank 0 (None elsewhere)."""
    out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(value, out, dst=0)
    return out


def batch_records(ctx: StageContext, model_dir: Path) -> BatchRecords:
    fingerprint = inputs_fingerprint(ctx.stage, ctx.cfg.seed, model_dir, ctx.run.task_file("prompts"))
    return BatchRecords(ctx.run.synthesis_batches(ctx.stage_id), fingerprint)


def run(ctx: StageContext) -> None:
    stage, run, cfg = ctx.stage, ctx.run, ctx.cfg
    model_dir = run.model_dir(stage.init_from)
    tokenizer = load_tokenizer(model_dir)
    device = rank_device()
    enable_tf32(device)
    model = load_replicated(model_dir, trainable=False, compute_dtype=compute_dtype(stage.dtype, device))
    prompts = read_examples(run.task_file("prompts"))[: stage.num_prompts]
    num_batches = -(-len(prompts) // stage.batch_size)

    def what_is_left():  # decided by rank 0, so that every rank hands out the same batches
        records = batch_records(ctx, model_dir)
        return records, records.left_to_sample(num_batches, ctx.log)

    records, left = from_rank0(what_is_left)

    ctx.begin_step(1)
    started = time.perf_counter()
    batches_taken = 0
    bar = ctx.progress(num_batches, initial=num_batches - len(left), unit="batch")
    for b in BatchQueue(f"{ctx.stage_id}/next_batch", left):
        first = b * stage.batch_size
        accepted, n = sample_batch(
            model,
            tokenizer,
            prompts[first : first + stage.batch_size],
            first,
            stage,
            seed=cfg.seed * 1_000_003 + b,
        )
        records.save(b, accepted, n)
        ctx.log.info("sampled batch %d: %d of %d answers accepted", b, len(accepted), n)
        batches_taken += 1
        bar.update()  # rank 0's own batches only: a lower bound on the progress of all ranks
    busy = time.perf_counter() - started
    bar.close()
    leave_if_requested(ctx.log, "synthesis (its sampled batches are kept)")
    with phase("gather"):
        gathered = gather_to_main((batches_taken, busy))
    if ctx.is_main:
        times = [t for _, t in gathered]
        spread = {
            "generation_time_s_per_rank": times,
            "batches_per_rank": [b for b, _ in gathered],
            "batches_kept_from_earlier_attempts": num_batches - len(left),
            "imbalance_slowest_over_fastest": max(times) / max(min(times), 1e-9),
        }
        candidates, sampled = records.read_all(num_batches)
        write_outputs(ctx.cfg, ctx.run, ctx.stage_id, prompts, candidates, sampled, model_dir, spread)
        ctx.log.info(
            "generation time per rank %s s, slowest/fastest %.2f",
            [round(t, 1) for t in times],
            spread["imbalance_slowest_over_fastest"],
        )
    dist.barrier()


def write_outputs(
    cfg,
    run,
    sid: str,
    prompts: list[Example],
    candidates: list[Candidate],
    sampled: int,
    model_dir,
    extra: dict,
) -> dict:
    """The dataset, final/, metrics and eval.json of a synthesis stage from its accepted answers,
    whichever engine sampled them; `extra` (the engine's own figures) joins the summary."""
    stage = getattr(cfg, sid)
    kept = keep_distinct(candidates, stage.max_per_prompt)
    if not kept:
        raise RuntimeError(
            f"none of the {sampled} answers of {model_dir} was correct and well-formed: "
            "there is no data for the SFT stage that reads this one"
        )
    model = {"path": str(model_dir.relative_to(run.root)), "sha256": weights_sha256(model_dir)}
    examples = [
        Example(
            f"{prompts[c.prompt_index].id}-s{c.sample_index}",
            prompts[c.prompt_index].prompt,
            prompts[c.prompt_index].answer,
            c.response,
        )
        for c in kept
    ]
    provenance = [
        {
            "prompt_id": prompts[c.prompt_index].id,
            "sample_index": c.sample_index,
            "reward": c.reward,
            "model": model,
        }
        for c in kept
    ]
    data = run.synthetic_data(sid)
    write_examples(data, examples, extra=provenance)
    summary = {
        "engine": stage.engine,
        "model": model,
        "prompts": len(prompts),
        "sampled": sampled,
        "accepted": len(candidates),
        "kept": len(kept),
        "prompts_covered": len({c.prompt_index for c in kept}),
        "acceptance_rate": len(candidates) / max(sampled, 1),
        **extra,
    }
    publish_final(run, sid, data, summary)
    metrics = MetricsLogger(
        run.metrics(sid),
        True,
        0,
        cfg.wandb.mode,
        cfg.wandb.project,
        run.wandb_run(sid),
        cfg.model_dump(mode="json"),
    )
    metrics.log(1, {**summary, **{f"phase_time/{k}": v for k, v in take_phase_times().items()}})
    metrics.close()
    atomic_write_text(
        run.eval_result(sid),
        json.dumps({"accuracy": summary["acceptance_rate"], "n": sampled, "kept": len(kept)}),
    )
    logging.getLogger(f"hpcr1.{sid}").info(
        "kept %d of %d samples (%d correct) for %d of %d prompts",
        len(kept),
        sampled,
        len(candidates),
        summary["prompts_covered"],
        len(prompts),
    )
    return summary


def publish_final(run, sid: str, data, summary: dict) -> None:
    """final/ = the dataset and its provenance, assembled aside and renamed into place."""
    final = run.final(sid)
    staging = final.with_name("final.tmp")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    os.link(data, staging / data.name)
    atomic_write_text(staging / "provenance.json", json.dumps(summary, indent=1))
    if final.exists():
        shutil.rmtree(final)
    staging.rename(final)
