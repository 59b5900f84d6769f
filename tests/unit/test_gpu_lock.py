"""requirements-gpu.lock (what `make setup-gpu` installs) is one consistent set for Linux x86_64
CPython 3.12: pip resolves it against PyPI to exactly the locked versions and nothing else, vLLM's
torch pin is the locked torch, verl 0.9.1's requirements (its `vllm` extra included) accept the
locked vLLM, and the lock's header names the torch it pins. requirements-gpu-nodeps.lock (installed
after it, without dependencies) has what verl's megatron backend imports: Megatron-Bridge, whose
import-time needs the lock must meet, and the two source builds, whose every requirement it must.

Resolving takes about three minutes, most of it waiting on PyPI, so the test checks a recorded
resolution (fixtures/gpu_lock_resolution.json: what pip resolved and the metadata the checks read)
offline, after checking that the record is of today's locks and resolution code (a digest of them).
Any change to either fails the test until `python -m tests.unit.test_gpu_lock --record` has resolved
live again, run every check on the live answer, and rewritten the record.

The live resolution runs under .venv's CPython 3.11, so pip resolves for another interpreter:
--python-version, manylinux platforms and --only-binary=:all:, with markers evaluated for 3.12 (pip
evaluates them for the Python running it; PIP below says how). The lock's two sdist-only pins are
built into pure-Python wheels first. pip reads metadata only (PEP 658 files, else HTTP range requests
into the wheel); recording fails if it downloads a wheel whole.
"""

from __future__ import annotations

import ast
import hashlib
import inspect
import io
import json
import os
import platform
import re
import subprocess
import sys
import tarfile
import tempfile
import textwrap
import tomllib
import urllib.error
import urllib.request
from datetime import UTC, datetime
from email.parser import HeaderParser
from importlib.metadata import version as installed_version
from pathlib import Path
from urllib.parse import urlparse

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_sdist_filename
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
LOCK = REPO / "requirements-gpu.lock"
NODEPS = REPO / "requirements-gpu-nodeps.lock"
RECORD = Path(__file__).parent / "fixtures" / "gpu_lock_resolution.json"
RECORD_COMMAND = "python -m tests.unit.test_gpu_lock --record"
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
# Anything bigger fetched whole means pip downloaded a wheel instead of reading its metadata.
MAX_WHOLE_FILE_BYTES = 20 * 2**20
# urllib3's debug line for each response, in pip's --log file.
RESPONSE = re.compile(r'"GET (\S+) HTTP/[\d.]+" (\d{3}) (\d+|None)')

PYTHON = "3.12.3"  # the GPU nodes' CPython (the lent machines' image has 3.12.3)
# glibc 2.31 and newer: every manylinux tag a wheel there may carry.
PLATFORMS = ["manylinux1", "manylinux2010", "manylinux2014"] + [
    f"manylinux_2_{minor}" for minor in (5, 12, *range(17, 32))
]
# pip runs with markers evaluated for PYTHON: it evaluates them with packaging's
# default_environment(), the running interpreter's, and --python-version changes only which files
# it picks and Requires-Python (vllm 0.24.0, e.g., wants setuptools<81 on Python 3.12 alone).
PIP = f"""
import sys
import pip._vendor.packaging.markers as markers
running = markers.default_environment
markers.default_environment = lambda: {{**running(), "python_version": "{PYTHON[:4]}",
    "python_full_version": "{PYTHON}", "implementation_version": "{PYTHON}"}}
from pip._internal.cli.main import main
sys.exit(main())
"""
# Pins PyPI has as sdists only; pip wheel builds them (with this Python: both are pure Python).
SDIST_ONLY = ("deepspeed", "antlr4-python3-runtime")
# Pins PyPI has as sources that build against CUDA: their requirements are read from their PKG-INFO.
SOURCE_BUILDS = ("transformer-engine-torch", "flash-attn")

# What the modules verl 0.9.1 imports from Megatron-Bridge (megatron.bridge, its training.config,
# training.checkpointing, training.utils.{train,config}_utils, peft.utils, models.gpt_provider and
# models.conversion.{param_mapping,model_bridge}) import when loaded, through megatron-core's modules
# they load: the distributions behind every module-level import not under try/except ImportError,
# read from Megatron-Bridge 0.5.1's and megatron-core 0.18.2's sources. Each must be in a lock.
BRIDGE_IMPORTS = {
    "megatron-core": "megatron.core, megatron.training",
    "torch": "torch",
    "triton": "megatron.core's paged_stash",
    "transformer-engine": "transformer_engine (peft.lora)",
    "transformer-engine-torch": "transformer_engine.pytorch (peft.lora)",
    "transformers": "the model bridges",
    "nvidia-modelopt": "modelopt (auto_bridge, checkpointing)",
    "flash-attn": "flash_attn (models.bailing)",
    "datasets": "data.datasets.sft",
    "einops": "models.qwen_vl",
    "omegaconf": "models.config",
    "pyyaml": "yaml",
    "tqdm": "data.datasets",
    "rich": "models.conversion",
    "typing-extensions": "models.conversion.auto_bridge",
    "numpy": "numpy",
    "packaging": "packaging",
    "safetensors": "auto_bridge",
    "filelock": "models.hf_pretrained",
}
# Megatron-Bridge's declared ranges for the above that the lock does not meet, and why that is
# accepted. (What it declares and nothing imports at load, e.g. flashinfer 0.6.8.post1, hydra-core
# <=1.3.2, mlflow, timm, megatron-core's dev extra, is not installed or not met, and not checked.)
DECLARED_NOT_MET = {
    "transformers": "Megatron-Bridge 0.5.1 asks >=5.8.1,<5.9.0; verl[vllm] 0.9.1 and vLLM 0.24.0 pin "
    "5.9.0. verl 0.9.1's own `megatron` extra pairs Megatron-Bridge 0.5.2 (r0.5.0, not on PyPI) with "
    "its vllm extra's 5.9.0, and 0.5.1's code checks only minimum transformers versions",
}


def pins_of(path: Path) -> dict[str, Requirement]:
    """A lock's lines by canonical name; each must be an exact `name[extras]==version` pin."""
    pins = {}
    for number, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        req = Requirement(line)
        spec = list(req.specifier)
        assert len(spec) == 1 and spec[0].operator == "==" and not req.marker, f"{path.name}:{number}: {line}"
        assert canonicalize_name(req.name) not in pins, f"{path.name}:{number}: {req.name} pinned twice"
        pins[canonicalize_name(req.name)] = req
    return pins


def version(req: Requirement) -> Version:
    return Version(next(iter(req.specifier)).version)


def test_the_gpu_locks_resolve_to_themselves_and_meet_verls_megatron_backend():
    record = json.loads(RECORD.read_text())
    assert record["inputs_sha256"] == inputs_digest(), (
        f"{RECORD.name} is a resolution of other locks or resolution code: re-resolve with `{RECORD_COMMAND}`"
    )
    check_resolution(record)


def check_resolution(record: dict) -> None:
    """Every check, on a resolution: live (recording) or recorded (the test)."""
    pins, nodeps = pins_of(LOCK), pins_of(NODEPS)
    assert not set(pins) & set(nodeps), f"in both locks: {sorted(set(pins) & set(nodeps))}"
    want, resolved, env = check_the_lock(pins, record)
    check_verls_megatron_backend(want, resolved, env, nodeps, record)


# --- the live resolution (`--record`) ------------------------------------------------------------


def pypi_reachable() -> str | None:
    """None if the index answers, else why not."""
    try:
        urllib.request.urlopen(f"{INDEX.rstrip('/')}/pip/", timeout=15).close()
    except (urllib.error.URLError, OSError) as e:
        return f"{INDEX} unreachable: {e}"
    return None


def pip(tmp: str, *args: str) -> subprocess.CompletedProcess:
    """pip for Linux x86_64 CPython 3.12, without this machine's pip configuration (extra indexes,
    find-links, constraints) and with an empty cache, as on a fresh GPU node. Its debug log goes to
    tmp/pip.log, one for all calls."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    cmd = [
        # --quiet, oddly, is what lets urllib3's debug lines (one a response) into the log.
        sys.executable, "-c", PIP, *args, "--quiet", "--log", str(Path(tmp, "pip.log")),
        "--cache-dir", str(Path(tmp, "cache")), "--index-url", INDEX, "--disable-pip-version-check",
    ]  # fmt: skip
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def resolve(tmp: str, requirements: Path, *args: str) -> dict:
    """pip's --report of installing `requirements` into nothing, for the GPU nodes' Python."""
    report = Path(tmp, f"{requirements.stem}.json")
    out = pip(
        tmp, "install", "--dry-run", "--ignore-installed", "--report", str(report),
        "--python-version", PYTHON[:4], "--implementation", "cp", "--only-binary=:all:",
        *(f"--platform={p}_x86_64" for p in PLATFORMS),
        # Where the index offers no PEP 658 metadata file, read METADATA out of the remote wheel
        # with range requests instead of downloading it (torch's is 530 MB, vLLM's 280 MB).
        "--use-feature=fast-deps", "-r", str(requirements), *args,
    )  # fmt: skip
    text = Path(tmp, "pip.log").read_text()
    # On a conflict pip's log says what asks for what ("The conflict is caused by: ...").
    why = text[text.rfind("The conflict is caused by") :][:3000] if "conflict is caused" in text else ""
    assert out.returncode == 0, f"pip could not resolve {requirements.name}:\n{out.stderr[-3000:]}\n{why}"
    return json.loads(report.read_text())


def sdist_requirements(name: str, pinned: Version) -> list[str]:
    """Requires-Dist of `name`'s sdist on the index, read from its PKG-INFO (static since metadata
    2.2): building it needs torch and CUDA."""
    request = urllib.request.Request(
        f"{INDEX.rstrip('/')}/{name}/", headers={"Accept": "application/vnd.pypi.simple.v1+json"}
    )
    with urllib.request.urlopen(request, timeout=60) as answer:
        files = json.load(answer)["files"]
    sdist = next(
        f
        for f in files
        if f["filename"].endswith(".tar.gz") and parse_sdist_filename(f["filename"])[1] == pinned
    )
    assert sdist["size"] <= MAX_WHOLE_FILE_BYTES, f"{sdist['filename']}: {sdist['size']} bytes"
    with urllib.request.urlopen(sdist["url"], timeout=120) as answer:
        archive = tarfile.open(fileobj=io.BytesIO(answer.read()))
    top = sdist["filename"].removesuffix(".tar.gz")
    info = HeaderParser().parsestr(archive.extractfile(f"{top}/PKG-INFO").read().decode())
    assert "Requires-Dist" not in (info.get_all("Dynamic") or []), f"{top}: its requirements are dynamic"
    return info.get_all("Requires-Dist") or []


def live_resolution() -> dict:
    """Resolve both locks against the index now; the record the test reads."""
    assert sys.platform == "linux" and platform.machine() == "x86_64", (
        "pip builds deepspeed's and antlr4's wheels here: they must be the Linux ones"
    )
    pins, nodeps = pins_of(LOCK), pins_of(NODEPS)
    if why := pypi_reachable():
        sys.exit(why)
    with tempfile.TemporaryDirectory(prefix="gpu-lock-") as tmp:
        built = Path(tmp, "wheels")
        sdists = [str(pins[name]) for name in SDIST_ONLY]
        out = pip(tmp, "wheel", "--no-deps", "--wheel-dir", str(built), *sdists)
        assert out.returncode == 0, f"pip could not build {sdists}:\n{out.stderr[-3000:]}"
        wheels = sorted(p.name for p in built.iterdir())
        assert len(wheels) == len(SDIST_ONLY) and all(w.endswith("-py3-none-any.whl") for w in wheels), wheels
        report = resolve(tmp, LOCK, "--find-links", str(built))
        # Megatron-Bridge alone, without its dependencies, as `make setup-gpu` installs it.
        Path(tmp, "bridge.txt").write_text(f"{nodeps['megatron-bridge']}\n")
        (bridge,) = resolve(tmp, Path(tmp, "bridge.txt"), "--no-deps")["install"]
        # pip fetched index pages, two small sdists to build wheels of, setuptools for that build,
        # and pieces of wheels: nothing big whole. urllib3 logs each response; without those lines
        # this check would prove nothing. (The source builds' sdists come below, through urllib.)
        check_nothing_big_downloaded_whole(Path(tmp, "pip.log").read_text())
    return {
        "inputs_sha256": inputs_digest(),
        "resolved": {
            "at": datetime.now(UTC).isoformat(timespec="seconds"),
            "index": INDEX,
            "pip": installed_version("pip"),
        },
        "environment": report["environment"],
        "install": [what_the_checks_read(item) for item in report["install"]],
        "megatron_bridge": what_the_checks_read(bridge),
        "source_builds": {name: sdist_requirements(name, version(nodeps[name])) for name in SOURCE_BUILDS},
    }


def what_the_checks_read(item: dict) -> dict:
    """One package of pip's report, cut to what the checks read, and the file pip chose."""
    meta = item["metadata"]
    return {
        "metadata": {key: meta[key] for key in ("name", "version", "requires_dist") if key in meta},
        "requested_extras": item.get("requested_extras") or [],
        "file": Path(urlparse(item["download_info"]["url"]).path).name,
    }


def check_nothing_big_downloaded_whole(log: str) -> None:
    responses = RESPONSE.findall(log)
    assert any("/torch-" in path for path, _, _ in responses), "pip's log records no responses"
    whole = [
        (path, int(size))
        for path, status, size in responses
        if status == "200" and size != "None" and int(size) > MAX_WHOLE_FILE_BYTES and "/simple/" not in path
    ]
    assert not whole, f"pip downloaded these whole instead of reading their metadata: {whole}"


def inputs_digest() -> str:
    """What a resolution depends on: the two locks, the interpreter and platforms it is for, and the
    code that resolves, as syntax trees (its layout and comments do not count); not the index."""
    code = (pip, resolve, sdist_requirements, live_resolution, what_the_checks_read)
    inputs = {
        "locks": [LOCK.read_text(), NODEPS.read_text()],
        "target": [PYTHON, PLATFORMS, PIP, SDIST_ONLY, SOURCE_BUILDS],
        "code": [ast.dump(ast.parse(textwrap.dedent(inspect.getsource(f)))) for f in code],
    }
    return hashlib.sha256(json.dumps(inputs).encode()).hexdigest()


# --- the checks ----------------------------------------------------------------------------------


def applying(reqs: list[Requirement], env: dict, extras: set[str]) -> list[Requirement]:
    return [
        r for r in reqs if r.marker is None or any(r.marker.evaluate({**env, "extra": e}) for e in extras)
    ]


def check_the_lock(pins: dict[str, Requirement], report: dict):
    """Every locked package resolves to exactly its locked version; nothing unpinned comes along;
    torch, vLLM and verl agree. Returns (pinned versions, pip's report by name, marker environment)."""
    resolved = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    got = {name: Version(i["metadata"]["version"]) for name, i in resolved.items()}
    want = {name: version(req) for name, req in pins.items()}
    assert not set(got) - set(want), f"pulled in, not pinned: {sorted(set(got) - set(want))}"
    assert not set(want) - set(got), f"pinned, not needed: {sorted(set(want) - set(got))}"
    assert got == want, {n: (str(want[n]), str(got[n])) for n in want if got[n] != want[n]}

    torch, vllm, verl = want["torch"], want["vllm"], want["verl"]
    assert "vllm" in pins["verl"].extras, "the lock must install verl with its `vllm` extra"

    env = {**default_environment(), **report["environment"]}
    assert env["python_version"] == PYTHON[:4], f"pip evaluated markers for Python {env['python_version']}"

    def requirements(name: str) -> list[Requirement]:
        """`name`'s Requires-Dist that apply here (Linux x86_64 CPython 3.12), with the extras pip
        was asked for and those they ask for in turn (verl[vllm] asks for verl[verl-core])."""
        reqs = [Requirement(r) for r in resolved[name]["metadata"].get("requires_dist", [])]
        extras = {""} | set(resolved[name].get("requested_extras") or ())
        while True:
            apply = applying(reqs, env, extras)
            more = {e for r in apply if canonicalize_name(r.name) == name for e in r.extras} - extras
            if not more:
                return [r for r in apply if canonicalize_name(r.name) != name]
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
    return want, resolved, env


def check_verls_megatron_backend(want, resolved, env, nodeps: dict[str, Requirement], record: dict) -> None:
    """What verl's megatron backend imports is installed: Megatron-Bridge at the nodeps lock's
    version, what its modules import at load time pinned at versions it declares (or excused in
    DECLARED_NOT_MET), and the source builds with every requirement pinned."""
    every = {**want, **{name: version(req) for name, req in nodeps.items()}}
    # Megatron-Bridge: pip found the pinned wheel for CPython 3.12 (it requires >=3.12,<3.13).
    wheel = record["megatron_bridge"]
    assert canonicalize_name(wheel["metadata"]["name"]) == "megatron-bridge"
    assert Version(wheel["metadata"]["version"]) == every["megatron-bridge"]
    declared = applying([Requirement(r) for r in wheel["metadata"]["requires_dist"]], env, {"", "te"})
    missing = sorted(set(BRIDGE_IMPORTS) - set(every))
    assert not missing, f"Megatron-Bridge's modules that verl imports need {missing}: in no lock"
    unmet = {}
    for req in declared:
        dep = canonicalize_name(req.name)
        if dep in BRIDGE_IMPORTS and not req.specifier.contains(every[dep], prereleases=True):
            unmet[dep] = f"{req} (locked: {every[dep]})"
    assert set(unmet) == set(DECLARED_NOT_MET), (
        f"Megatron-Bridge {every['megatron-bridge']} declares, for what its modules import: {unmet}; "
        f"DECLARED_NOT_MET excuses {sorted(DECLARED_NOT_MET)}, and must name exactly those"
    )

    # verl 0.9.1's `megatron` extra (and the flash-attn extra it asks for) accepts our pins of what
    # it shares with us; it pins megatron-bridge==0.5.2, which PyPI lacks (the nodeps lock says so).
    verl_reqs = [Requirement(r) for r in resolved["verl"]["metadata"]["requires_dist"]]
    verl_megatron = applying(verl_reqs, env, {"megatron", "flash-attn-cu130torch211"})
    for dep in ("megatron-core", "transformer-engine", "nvidia-modelopt", "flash-attn"):
        reqs = [r for r in verl_megatron if canonicalize_name(r.name) == dep]
        assert reqs, f"verl[megatron] does not ask for {dep}"
        for req in reqs:
            assert every[dep] in req.specifier, f"verl[megatron] wants {req}, the locks have {every[dep]}"
    assert any(canonicalize_name(r.name) == "megatron-bridge" for r in verl_megatron)

    # The source builds: every requirement pinned, at a version it accepts (transformer-engine-torch
    # pins its core wheel, so the two Transformer Engine versions agree).
    assert set(record["source_builds"]) == set(SOURCE_BUILDS) <= set(nodeps)
    for name, requires in record["source_builds"].items():
        for req in applying([Requirement(r) for r in requires], env, {""}):
            dep = canonicalize_name(req.name)
            assert dep in want, f"{name} needs {req}, which requirements-gpu.lock lacks"
            assert req.specifier.contains(want[dep], prereleases=True), (
                f"{name} needs {req}, lock: {want[dep]}"
            )
    assert every["transformer-engine"] == every["transformer-engine-torch"]


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: {RECORD_COMMAND}  (resolves both locks against {INDEX} and rewrites {RECORD})")
    live = live_resolution()
    check_resolution(live)  # a record is written only of a resolution that passes every check
    RECORD.write_text(json.dumps(live, indent=1, sort_keys=True) + "\n")
    print(f"{RECORD}: {len(live['install'])} packages, inputs {live['inputs_sha256'][:12]}")
