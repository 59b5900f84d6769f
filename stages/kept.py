"""Work a stage keeps across its attempts, so that a requeued job (a preemption, a time limit) does
not do it again: GRPO's prompt selection and synthesis's sampled batches. A record is a JSON file in
the stage's run directory, written atomically, holding the fingerprint of what the work was computed
from and the sha256 of its payload; a record made from other inputs (a changed config, model or
data) or a damaged one is not used, and its work is done again."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.atomic import atomic_write_text, file_sha256
from core.digests import files_fingerprint

MISSING = "missing"


def inputs_fingerprint(stage, seed: int, model_dir: Path, data_file: Path, **extra) -> str:
    """What a stage's sampling reads: its config section, the run's seed, the starting model (its
    files' names, sizes and modification times, as the driver fingerprints the base model), the
    data file's content, and `extra` (the world size, where the work is split by rank)."""
    return _sha256(
        [stage.model_dump(mode="json"), seed, files_fingerprint(model_dir), file_sha256(data_file), extra]
    )


def _sha256(value) -> str:
    return hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()


def save_record(path: Path, fingerprint: str, payload) -> None:
    """Keep `payload` (JSON: dicts, lists, strings, numbers) as made from `fingerprint`'s inputs."""
    record = {"fingerprint": fingerprint, "sha256": _sha256(payload), "payload": payload}
    atomic_write_text(path, json.dumps(record))


def load_record(path: Path, fingerprint: str) -> tuple[object, str | None]:
    """(payload, None) for a record made from `fingerprint`'s inputs and intact; otherwise (None,
    why it is not used): MISSING, made from other inputs, or damaged."""
    if not path.is_file():
        return None, MISSING
    try:
        record = json.loads(path.read_text())
        payload, checksum, made_from = record["payload"], record["sha256"], record["fingerprint"]
    except (ValueError, KeyError, TypeError) as e:
        return None, f"damaged ({type(e).__name__}: {e})"
    if checksum != _sha256(payload):
        return None, "damaged (its payload does not match its checksum)"
    if made_from != fingerprint:
        return None, "made from other inputs (config, seed, model or data)"
    return payload, None
