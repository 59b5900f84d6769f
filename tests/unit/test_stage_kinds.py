"""stages/kinds.py is the one table of stage kinds: every stage type the config schema allows has
a module, and a stage of each type runs its own module."""

from __future__ import annotations

import importlib
import typing
from types import SimpleNamespace

import pytest

from core.config import GRPOStage, RunConfig, SFTStage, SynthStage
from stages.kinds import STAGE_MODULES, run_stage


def stage_types_of_the_schema() -> set[type]:
    types = set()
    for name, field in RunConfig.model_fields.items():
        if name.startswith("stage"):
            types |= {t for t in typing.get_args(field.annotation) if t is not type(None)}
    return types


def test_every_stage_type_of_the_schema_has_a_module():
    assert stage_types_of_the_schema() == set(STAGE_MODULES)


@pytest.mark.parametrize(
    "kind, module",
    [(SFTStage, "stages.sft"), (GRPOStage, "stages.grpo.trainer"), (SynthStage, "stages.synth")],
)
def test_each_stage_runs_its_stage_module(monkeypatch, kind, module):
    calls = []
    monkeypatch.setattr(importlib.import_module(module), "run", calls.append)
    ctx = SimpleNamespace(stage=kind.model_construct())
    run_stage(ctx)
    assert calls == [ctx]
