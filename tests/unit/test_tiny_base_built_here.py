"""The tiny base model a test's `hpcr1 run` gets from the test's own process (tests/conftest.py:
tiny_base_built_here) is the one the driver would have built for the same config, file for file."""

from __future__ import annotations

import subprocess
import sys

import yaml

from tests.conftest import REPO, SMALL_RUN, hpcr1_env, tiny_base_built_here

DRIVERS_BUILD = """
import sys
from pathlib import Path
from core.config import load_config
from core.rundir import RunDir
from pipeline.driver import prepare_run
config = Path(sys.argv[1])
prepare_run(load_config(config, sys.argv[3:]), RunDir(Path(sys.argv[2])), config.parent)
"""


def files(model_dir) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(model_dir.iterdir())}


def test_the_base_a_test_run_gets_is_the_drivers_build_for_its_seed_and_shape(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(SMALL_RUN))
    overrides = ["seed=11", "model.tiny.hidden_size=64", "stage1_sft.steps=3"]
    given = tiny_base_built_here(config, tmp_path / "run.base", ["--only", "stage1_sft", *overrides])
    assert given == ["model.source=hf", f"model.path={tmp_path / 'run.base'}"]

    driver = tmp_path / "driver"  # in a process of its own, as `hpcr1 run` builds it
    subprocess.run(
        [sys.executable, "-c", DRIVERS_BUILD, str(config), str(driver), *overrides],
        cwd=REPO,
        env=hpcr1_env(),
        check=True,
    )
    assert files(tmp_path / "run.base") == files(driver / "inputs" / "model")


def test_a_given_model_or_a_bad_config_is_left_to_the_driver(tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(SMALL_RUN))
    assert tiny_base_built_here(config, tmp_path / "a.base", ["model.source=hf", "model.path=/x"]) == []
    assert tiny_base_built_here(config, tmp_path / "b.base", ["model.tiny.num_kv_heads=3"]) == []
    assert not list(tmp_path.glob("*.base"))
