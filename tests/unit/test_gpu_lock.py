"""requirements-gpu.lock (what `make setup-gpu` installs) is one consistent set: pip resolves it
against PyPI to exactly the locked versions and nothing else, vLLM's torch pin is the locked torch,
verl 0.9.1's requirements (its `vllm` extra included) accept the locked vLLM, and the lock's header
names the torch it pins. pip reads metadata only (PEP 658 files, else HTTP range requests into the
wheel); the test fails if it downloads a wheel whole. About a minute, most of it PyPI's index pages.
"""

from __future__ import annotations

import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import tomllib
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-gpu.lock"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
# Anything bigger fetched whole means pip downloaded a wheel instead of reading its metadata.
MAX_WHOLE_FILE_BYTES = 20 * 2**20
# urllib3's debug line for each response, in pip's --log file.
RESPONSE = re.compile(r'"GET (\S+) HTTP/[\d.]+" (\d{3}) (\d+|None)')


def locked() -> dict[str, Requirement]:
    """The lock's lines by canonical name; each must be an exact `name[extras]==version` pin."""
    pins = {}
    for number, line in enumerate(LOCK.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==" and not req.marker, f"line {number}: {line}"
        assert canonicalize_name(req.name) not in pins, f"line {number}: {req.name} pinned twice"
        pins[canonicalize_name(req.name)] = req
    return pins


def version(req: Requirement) -> Version:
    return Version(next(iter(req.specifier)).version)


def pypi_reachable() -> str | None:
    """None if the index answers, else why not."""
    try:
        urllib.request.urlopen(f"{INDEX.rstrip('/')}/pip/", timeout=15).close()
    except (urllib.error.URLError, OSError) as e:
        return f"{INDEX} unreachable: {e}"
    return None


def resolve() -> tuple[dict, str]:
    """pip's --report of installing the lock into nothing, and pip's debug log. pip runs without
    this machine's pip configuration (extra indexes, find-links, constraints) and with an empty
    cache, as on a fresh GPU node. The log (~80 MB) and the cache go once read."""
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as tmp:
        report, log = Path(tmp, "report.json"), Path(tmp, "pip.log")
        env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
        env["PIP_CONFIG_FILE"] = os.devnull
        cmd = [
            # --quiet, oddly, is what lets urllib3's debug lines (one a response) into the log.
            sys.executable, "-m", "pip", "install", "--dry-run", "--ignore-installed", "--quiet",
            "--report", str(report), "--log", str(log), "--cache-dir", str(Path(tmp, "cache")),
            "--index-url", INDEX, "--disable-pip-version-check",
            # Where the index offers no PEP 658 metadata file, read METADATA out of the remote wheel
            # with range requests instead of downloading it (torch's is 530 MB, vLLM's 280 MB).
            "--use-feature=fast-deps",
            "-r", str(LOCK),
        ]  # fmt: skip
        out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
        text = log.read_text()
        # On a conflict pip's log says what asks for what ("The conflict is caused by: ...").
        why = text[text.rfind("The conflict is caused by") :][:3000] if "conflict is caused" in text else ""
        assert out.returncode == 0, f"pip could not resolve {LOCK.name}:\n{out.stderr[-3000:]}\n{why}"
        return json.loads(report.read_text()), text


def test_the_gpu_lock_resolves_to_itself_and_torch_vllm_verl_agree():
    if sys.platform != "linux" or platform.machine() != "x86_64" or sys.version_info[:2] != (3, 11):
        pytest.skip(
            "the lock is resolved for Linux x86_64 CPython 3.11, and pip evaluates markers and builds "
            "deepspeed's and antlr4's sdists (no wheels on PyPI) for the interpreter running it"
        )
    pins = locked()
    if why := pypi_reachable():
        pytest.skip(why)
    report, log = resolve()

    # pip fetched index pages, two small sdists to build their metadata, setuptools for that build,
    # and pieces of wheels: nothing big whole. urllib3 logs each response; without those lines
    # this check would prove nothing.
    responses = RESPONSE.findall(log)
    assert any("/torch-" in path for path, _, _ in responses), "pip's log records no responses"
    whole = [
        (path, int(size))
        for path, status, size in responses
        if status == "200" and size != "None" and int(size) > MAX_WHOLE_FILE_BYTES and "/simple/" not in path
    ]
    assert not whole, f"pip downloaded these whole instead of reading their metadata: {whole}"

    # Every locked package resolves to exactly its locked version; nothing unpinned comes along.
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    got = {name: Version(i["metadata"]["version"]) for name, i in resolved.items()}
    want = {name: version(req) for name, req in pins.items()}
    assert not set(got) - set(want), f"pulled in, not pinned: {sorted(set(got) - set(want))}"
    assert not set(want) - set(got), f"pinned, not needed: {sorted(set(want) - set(got))}"
    assert got == want, {n: (str(want[n]), str(got[n])) for n in want if got[n] != want[n]}

    torch, vllm, verl = want["torch"], want["vllm"], want["verl"]
    assert "vllm" in pins["verl"].extras, "the lock must install verl with its `vllm` extra"

    env = {**default_environment(), **report["environment"]}

    def requirements(name: str) -> list[Requirement]:
        """`name`'s Requires-Dist that apply here (Linux x86_64 CPython 3.11), with the extras pip
        was asked for and those they ask for in turn (verl[vllm] asks for verl[verl-core])."""
        reqs = [Requirement(r) for r in resolved[name]["metadata"].get("requires_dist", [])]
        extras = {""} | set(resolved[name].get("requested_extras") or ())
        while True:
            applying = [
                r
                for r in reqs
                if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras)
            ]
            more = {e for r in applying if canonicalize_name(r.name) == name for e in r.extras} - extras
            if not more:
                return [r for r in applying if canonicalize_name(r.name) != name]
            extras |= more

    def wanted_by(name: str, dep: str) -> list[Requirement]:
        return [r for r in requirements(name) if canonicalize_name(r.name) == dep]

    # vLLM pins one torch: it must be the locked one.
    assert wanted_by("vllm", "torch"), f"vllm {vllm} does not ask for torch"
    for req in wanted_by("vllm", "torch"):
        assert torch in req.specifier, f"vllm {vllm} wants {req}, the lock has torch {torch}"
    # verl 0.9.1 and its `vllm` extra accept the locked vLLM, torch and transformers.
    assert verl == Version("0.9.1")
    for dep in ("vllm", "torch", "transformers"):
        assert wanted_by("verl", dep), f"verl[vllm] {verl} does not ask for {dep}"
        for req in wanted_by("verl", dep):
            assert want[dep] in req.specifier, f"verl {verl} wants {req}, the lock has {dep} {want[dep]}"
    # And every requirement of every resolved package holds for the locked versions.
    for name in resolved:
        for req in requirements(name):
            dep = canonicalize_name(req.name)
            assert dep in want, f"{name} needs {req}, which the lock lacks"
            assert req.specifier.contains(want[dep], prereleases=True), (
                f"{name} needs {req}, lock: {want[dep]}"
            )

    # The header says which torch this is, and that it is not the CPU side's if it differs.
    header = "\n".join(line for line in LOCK.read_text().splitlines() if line.startswith("#"))
    assert f"torch=={torch}" in header
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    cpu_torch = version(
        next(Requirement(d) for d in deps if canonicalize_name(Requirement(d).name) == "torch")
    )
    if cpu_torch != torch:
        assert f"torch=={cpu_torch}" in header, "the header must say the CPU side pins another torch"
