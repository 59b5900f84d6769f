"""What a stage's result depends on, part by part: its own config section, the data files it
reads, the base model or the outputs of the stages it starts from, and the validation and held-out
sets its recorded accuracies are measured on. Stored in the manifest when the stage starts; a done stage whose
parts differ on the next run is rerun, and the parts that differ say why."""

from __future__ import annotations

import hashlib
import json

from core.atomic import file_sha256
from core.config import GRPOStage, RunConfig, SFTStage, SynthStage
from core.digests import cached_tree_sha256, files_fingerprint
from core.rundir import RunDir


def digest(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]


def input_parts(
    cfg: RunConfig, run: RunDir, sid: str, upstream_checksums: dict[str, dict | None]
) -> dict[str, str]:
    """{part: digest}; `upstream_checksums` are the manifest checksums of the stages `sid` reads."""
    stage = getattr(cfg, sid)
    parts = {
        f"config of {sid}": digest(stage.model_dump(mode="json")),
        "seed and nproc": digest([cfg.seed, cfg.nproc]),
        # The accuracies in the manifest are part of the result; the batch size only changes the
        # speed of greedy answers (sampled ones draw their tokens batch by batch).
        "held-out set": digest(
            [
                file_sha256(run.task_file("eval")),
                cfg.eval.model_dump(mode="json", exclude=set() if cfg.eval.samples else {"batch_size"}),
            ]
        ),
    }
    if run.task_file("validation").is_file():
        parts["validation set"] = file_sha256(run.task_file("validation"))[:16]
    if stage.init_from == "base":
        parts["base model"] = digest([cfg.model.model_dump(mode="json"), files_fingerprint(run.base_model)])
    for split in data_splits(stage):
        parts[f"{split} data"] = file_sha256(run.task_file(split))[:16]
    for src in stage.upstream():
        parts[f"output of {src}"] = digest(upstream_checksums.get(src))
    return parts


def content_parts(cfg: RunConfig, run: RunDir, sid: str) -> dict[str, str]:
    """The parts `input_parts` fingerprints by stat, by content instead: what recognises a copied
    run directory (new modification times, same files). Each file is read only when its stat is
    not the one cached beside it, so this is cheap after the first time."""
    if getattr(cfg, sid).init_from != "base":
        return {}
    files = cached_tree_sha256(run.base_model, run.base_model_digests)
    return {"base model": digest([cfg.model.model_dump(mode="json"), files])}


def data_splits(stage: SFTStage | GRPOStage | SynthStage) -> list[str]:
    """The task files (inputs/data/<split>.jsonl) a stage trains or samples on."""
    if isinstance(stage, SFTStage):
        return ["sft"] if stage.data == "curated" else []
    return ["prompts"]


def changed_parts(before: dict[str, str] | None, now: dict[str, str]) -> list[str]:
    if before is None:
        return ["its inputs (no per-part fingerprint was recorded)"]
    return sorted(k for k in before.keys() | now.keys() if before.get(k) != now.get(k))
