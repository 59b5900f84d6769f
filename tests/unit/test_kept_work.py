"""Work a stage keeps across attempts (stages/kept.py): a record is used only for the inputs it was
made from and only while intact; anything else sends the stage back to doing the work."""

from __future__ import annotations

import json
import os

from core.config import GRPOStage
from stages.kept import MISSING, inputs_fingerprint, load_record, save_record


def test_the_fingerprint_changes_with_each_input_the_sampling_reads(tmp_path):
    model, data = tmp_path / "model", tmp_path / "prompts.jsonl"
    model.mkdir()
    (model / "model.safetensors").write_bytes(b"weights")
    data.write_text('{"id": "p0"}\n')
    stage = GRPOStage(init_from="base")

    def fingerprint(stage=stage, seed=0, **extra):
        return inputs_fingerprint(stage, seed, model, data, **extra)

    before = fingerprint(world_size=2)
    assert fingerprint(world_size=2) == before
    changed = {
        "config": fingerprint(stage.model_copy(update={"group_size": 4}), world_size=2),
        "seed": fingerprint(seed=1, world_size=2),
        "world size": fingerprint(world_size=4),
    }
    data.write_text('{"id": "p1"}\n')
    changed["data"] = fingerprint(world_size=2)
    data.write_text('{"id": "p0"}\n')
    assert fingerprint(world_size=2) == before
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))  # rewritten
    changed["model"] = fingerprint(world_size=2)
    assert len({before, *changed.values()}) == 1 + len(changed), changed


def test_a_record_is_used_only_for_its_own_inputs_and_intact(tmp_path):
    path = tmp_path / "record.json"
    assert load_record(path, "a") == (None, MISSING)
    save_record(path, "a", {"counts": [3, 0, 1]})
    assert load_record(path, "a") == ({"counts": [3, 0, 1]}, None)
    assert load_record(path, "b")[1].startswith("made from other inputs")

    record = json.loads(path.read_text())
    record["payload"]["counts"][0] = 2
    path.write_text(json.dumps(record))
    assert load_record(path, "a") == (None, "damaged (its payload does not match its checksum)")
    path.write_text(path.read_text()[:20])  # cut short
    payload, problem = load_record(path, "a")
    assert payload is None and problem.startswith("damaged (JSONDecodeError")
