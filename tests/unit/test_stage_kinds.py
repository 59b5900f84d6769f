"""stages/kinds.py is the one table of stage kinds: every stage type the config schema allows has
a runner, and each runner runs its own stage module."""

from __future__ import annotations

import importlib
import typing

import pytest

from core.config import GRPOStage, RunConfig, SFTStage, SynthStage
from stages.kinds import STAGE_RUNNERS


def stage_types_of_the_schema() -> set[type]:
    types = set()
    for name, field in RunConfig.model_fields.items():
        if name.startswith("stage"):
            types |= {t for t in typing.get_args(field.annotation) if t is not type(None)}
    return types


def test_every_stage_type_of_the_schema_has_a_runner():
    assert stage_types_of_the_schema() == set(STAGE_RUNNERS)


@pytest.mark.parametrize(
    "kind, module",
    [(SFTStage, "stages.sft"), (GRPOStage, "stages.grpo.trainer"), (SynthStage, "stages.synth")],
)
def test_each_runner_runs_its_stage_module(monkeypatch, kind, module):
    calls = []
    monkeypatch.setattr(importlib.import_module(module), "run", calls.append)
    ctx = object()
    STAGE_RUNNERS[kind](ctx)
    assert calls == [ctx]
