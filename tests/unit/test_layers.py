"""The packages' one-way layering (pyproject's import-linter contract, docs/design.md) holds, and
an import pointing up the layers, or across from stages to analysis, breaks it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("pipeline", "launch", "stages", "analysis", "runtime", "core")
LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=root, capture_output=True, text=True)


@pytest.fixture
def copy_of_the_packages(tmp_path):
    for package in PACKAGES:
        shutil.copytree(REPO / package, tmp_path / package, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    return tmp_path


def test_the_repository_keeps_the_layers():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "1 kept, 0 broken" in result.stdout


@pytest.mark.parametrize(
    "module, upward",
    [
        ("core/config.py", "pipeline.driver"),  # the contract reaching for the driver
        ("runtime/phases.py", "stages.kinds"),  # the runtime reaching for a stage
        ("stages/sft.py", "analysis.report"),  # siblings: stages never import analysis
        ("analysis/report.py", "stages.eval"),  # nor analysis stages
        ("launch/worker.py", "pipeline.cli"),  # the launcher reaching for the command line
    ],
)
def test_an_import_against_the_layers_breaks_the_contract(copy_of_the_packages, module, upward):
    path = copy_of_the_packages / module
    assert lint_imports(copy_of_the_packages).returncode == 0
    path.write_text(path.read_text() + f"\nimport {upward}  # noqa: E402\n")
    result = lint_imports(copy_of_the_packages)
    importer = module.removesuffix(".py").replace("/", ".")
    assert result.returncode != 0
    assert f"{importer} -> {upward}" in result.stdout, result.stdout
