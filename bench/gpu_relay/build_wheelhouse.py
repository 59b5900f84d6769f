"""Builds what the GPU relay carries: requirements-gpu.lock's pins as CPython 3.12 manylinux x86_64
wheels, less what the GPU machine's image already holds (image.txt), as parts of at most 60 MiB.

    .venv/bin/python bench/gpu_relay/build_wheelhouse.py --build-python PYTHON3.12

Writes, under --out (default .relay/, ignored by git):
  wheels/          the wheels; kept between runs, pip does not fetch again what is there
  wheelhouse.tar   all of them in one tar
  parts/           wheelhouse.tar.000, .001, ... and manifest.json: what travels to the GPU machine
Then bench/gpu_relay/install_and_run.py there. Needs PyPI. pip runs without this machine's pip
configuration (its find-links, constraints and extra indexes are this machine's, not the lock's).
Pins with no wheel at all on PyPI (sdists only) are built into wheels with --build-python, which
must be CPython 3.12 and must give a pure-Python wheel: a compiled one built here would not be the
manylinux wheel the GPU machine needs.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from importlib.metadata import version as installed_version
from pathlib import Path

from packaging.utils import canonicalize_name, parse_sdist_filename, parse_wheel_filename
from packaging.version import Version
from wheelhouse_parts import (
    BUNDLE,
    MIB,
    PART_BYTES,
    RelayError,
    file_entry,
    make_bundle,
    pip_env,
    split,
    write_manifest,
)

REPO = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(?P<extras>\[[^\]]*\])?==(?P<version>\S+)$")
INDEX = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
# manylinux_2_17, _2_12 and _2_5 have older names that many wheels still carry.
LEGACY_MANYLINUX = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}


def read_lock(path: Path) -> dict[str, tuple[str, Version]]:
    """The lock's pins by canonical name: (the line as pip takes it, the version)."""
    pins = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        match = PIN.match(line)
        if not match:
            raise RelayError(f"{path}:{number}: not a `name==version` pin: {line}")
        pins[canonicalize_name(match["name"])] = (line, Version(match["version"]))
    return pins


def read_overrides(path: Path, pins: dict) -> dict[str, tuple[str, Version]]:
    """Pins for the target Python that replace the lock's (py312.txt says why each); each must
    replace one, or it would add a package the lock's resolution never saw."""
    overrides = read_lock(path)
    unknown = [n for n in overrides if n not in pins]
    if unknown:
        raise RelayError(f"{path}: replaces no pin of the lock: {', '.join(unknown)}")
    return overrides


def read_image(path: Path, pins: dict) -> dict[str, Version]:
    """image.txt's names with the lock's versions: a name the lock does not pin is a mistake in
    the list (it would hide nothing, or hide a package under another spelling)."""
    names = [canonicalize_name(line.split("#", 1)[0].strip()) for line in path.read_text().splitlines()]
    names = [n for n in names if n]
    unknown = [n for n in names if n not in pins]
    if unknown:
        raise RelayError(f"{path}: not pinned in the lock: {', '.join(unknown)}")
    return {n: pins[n][1] for n in names}


def platforms(glibc: str) -> list[str]:
    """pip matches manylinux tags exactly, so every glibc from `glibc` down is named."""
    major, minor = (int(x) for x in glibc.split("."))
    if major != 2 or minor < 5:
        raise RelayError(f"--glibc {glibc}: expected 2.N with N >= 5")
    tags = []
    for m in range(minor, 4, -1):
        tags.append(f"manylinux_2_{m}_x86_64")
        if m in LEGACY_MANYLINUX:
            tags.append(f"{LEGACY_MANYLINUX[m]}_x86_64")
    return tags


def run_pip(python: str, *argv: str) -> None:
    cmd = [python, "-m", "pip", *argv, "--index-url", INDEX, "--disable-pip-version-check", "-q"]
    out = subprocess.run(cmd, env=pip_env(), capture_output=True, text=True)
    if out.returncode != 0:
        raise RelayError(f"pip {argv[0]} failed:\n{out.stderr.strip()[-3000:]}")


def download(requirements: list[str], wheels: Path, args) -> None:
    """The pins' files, without their dependencies (the lock holds them all). With --no-deps pip
    allows sdists for a foreign platform: a pin with no matching wheel comes as its sdist."""
    req_file = wheels.parent / "download.txt"
    req_file.write_text("".join(r + "\n" for r in requirements))
    target = ["--python-version", args.python_version, "--implementation", "cp"]
    target += ["--abi", "cp" + args.python_version.replace(".", "")]
    for platform in platforms(args.glibc):
        target += ["--platform", platform]
    run_pip(sys.executable, "download", "--no-deps", *target, "-d", str(wheels), "-r", str(req_file))


def build_sdists(wheels: Path, wanted: dict[str, Version], args) -> list[str]:
    """Builds each wanted pin that came as an sdist into a wheel with --build-python, which must be
    the target Python: setup.py may choose dependencies by the interpreter it runs under. Only
    pure-Python wheels are accepted. The sdist stays, so that pip does not fetch it again, and a
    wheel built by an earlier run is kept: the same bytes, the same manifest. Returns the pins."""
    sdists = {}
    for path in wheels.iterdir():
        if path.name.endswith((".tar.gz", ".zip")):
            name, version = parse_sdist_filename(path.name)
            if wanted.get(name) == version:
                sdists[name] = path
    todo = [p for n, p in sdists.items() if not any(wheel_of(wheels, n, wanted[n]))]
    if todo:
        check_build_python(args.build_python, args.python_version, todo)
    for sdist in todo:
        run_pip(args.build_python, "wheel", "--no-deps", "-w", str(wheels), str(sdist))
    for name, sdist in sdists.items():
        for wheel in wheel_of(wheels, name, wanted[name]):
            if any(tag.platform != "any" for tag in parse_wheel_filename(wheel.name)[3]):
                raise RelayError(
                    f"{sdist.name} built a compiled wheel here, {wheel.name}: not a manylinux one"
                )
    return sorted(f"{n}=={wanted[n]}" for n in sdists)


def wheel_of(wheels: Path, name: str, version: Version) -> list[Path]:
    return [w for w in wheels.glob("*.whl") if parse_wheel_filename(w.name)[:2] == (name, version)]


def check_build_python(build_python: str, python_version: str, sdists: list[Path]) -> None:
    ask = "import sys; print('{}.{}'.format(*sys.version_info))"
    found = subprocess.run([build_python, "-c", ask], capture_output=True, text=True)
    have = found.stdout.strip() if found.returncode == 0 else "not runnable"
    if have != python_version:
        raise RelayError(
            f"{', '.join(p.name for p in sdists)}: no wheels on the index, so they are built here, with "
            f"Python {python_version}; --build-python {build_python} is {have}"
        )


def select(wheels: Path, wanted: dict[str, Version]) -> dict[str, Path]:
    """The one wheel of each wanted pin in `wheels` (other files there are from earlier runs with
    another lock or --glibc, and stay out of the bundle)."""
    found: dict[str, list[Path]] = {}
    for path in wheels.glob("*.whl"):
        name, version, _, _ = parse_wheel_filename(path.name)
        if wanted.get(name) == version:
            found.setdefault(name, []).append(path)
    missing = sorted(set(wanted) - set(found))
    several = {n: [p.name for p in ps] for n, ps in found.items() if len(ps) > 1}
    if missing or several:
        raise RelayError(f"wheels missing: {missing}; several for one pin (clear {wheels}): {several}")
    return {n: ps[0] for n, ps in found.items()}


def glibc_needed(files: list[Path]) -> str:
    """The newest glibc any chosen wheel asks for, from its manylinux tags (a wheel with several
    tags needs only the oldest of them)."""
    legacy = {f"{v}_x86_64": k for k, v in LEGACY_MANYLINUX.items()}
    needed = 0
    for path in files:
        minors = []
        for tag in parse_wheel_filename(path.name)[3]:
            match = re.match(r"manylinux_2_(\d+)_", tag.platform)
            minors.append(int(match[1]) if match else legacy.get(tag.platform, 0))
        needed = max(needed, min(minors))
    return f"2.{needed}"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--lock", type=Path, default=REPO / "requirements-gpu.lock")
    p.add_argument("--image", type=Path, default=HERE / "image.txt", help="what the image holds, by name")
    p.add_argument("--overrides", type=Path, default=HERE / "py312.txt", help="pins replacing the lock's")
    p.add_argument("--out", type=Path, default=REPO / ".relay")
    p.add_argument("--python-version", default="3.12", help="the GPU machine's Python")
    p.add_argument(
        "--glibc",
        default="2.31",
        help="the newest manylinux glibc a wheel may ask for (default 2.31: llguidance 1.7.6 has no older)",
    )
    p.add_argument("--build-python", default="python3.12", help="CPython of --python-version, for sdists")
    p.add_argument("--part-mib", type=int, default=PART_BYTES // MIB)
    args = p.parse_args(argv)
    try:
        build(args)
    except RelayError as e:
        print(f"build_wheelhouse: {e}", file=sys.stderr)
        return 1
    return 0


def build(args) -> None:
    started = time.monotonic()
    locked = read_lock(args.lock)
    overrides = read_overrides(args.overrides, locked)
    pins = {**locked, **overrides}
    image = read_image(args.image, pins)
    carried = {n: v for n, (_, v) in pins.items() if n not in image}
    pip_version = installed_version("pip")
    wheels = args.out / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    download([f"{n}=={v}" for n, v in carried.items()] + [f"pip=={pip_version}"], wheels, args)
    wanted = {**carried, "pip": Version(pip_version)}
    built = build_sdists(wheels, wanted, args)
    chosen = select(wheels, wanted)
    files = list(chosen.values())
    bundle = args.out / BUNDLE
    make_bundle(files, bundle)
    parts = split(bundle, args.out / "parts", args.part_mib * MIB)
    manifest = {
        "lock": args.lock.name,
        "lock_sha256": file_entry(args.lock)["sha256"],
        "python": args.python_version,
        "glibc": glibc_needed(files),
        "pip": pip_version,
        "image": {n: str(v) for n, v in image.items()},
        "overrides": {n: f"{locked[n][1]} -> {v}" for n, (_, v) in overrides.items()},
        # torch's pin stays: pip must find the image's torch to be the lock's.
        "install": [line for n, (line, _) in pins.items() if n not in image or n == "torch"],
        "built_from_sdist": built,
        "wheels": {f.name: file_entry(f) for f in files},
        "bundle": {"name": BUNDLE, **file_entry(bundle)},
        "parts": parts,
    }
    write_manifest(args.out / "parts", manifest)
    print(summary(manifest, files, time.monotonic() - started))


def summary(manifest: dict, files: list[Path], seconds: float) -> str:
    largest = max(files, key=lambda f: f.stat().st_size)
    total = manifest["bundle"]["size"]
    built = ", ".join(manifest["built_from_sdist"]) or "none"
    return "\n".join(
        [
            f"wheels: {len(files)}, built here from sdists: {built}",
            f"left to the image: {len(manifest['image'])} pins; for Python {manifest['python']}: "
            + (", ".join(f"{n} {change}" for n, change in manifest["overrides"].items()) or "no pin changed"),
            f"largest: {largest.name}, {largest.stat().st_size / MIB:.1f} MiB",
            f"bundle: {total / MIB:.1f} MiB; {len(manifest['parts'])} parts of at most "
            f"{max(p['size'] for p in manifest['parts']) / MIB:.1f} MiB: one device call each",
            f"glibc needed: {manifest['glibc']}; Python {manifest['python']}; took {seconds:.0f} s",
        ]
    )


if __name__ == "__main__":
    sys.exit(main())
