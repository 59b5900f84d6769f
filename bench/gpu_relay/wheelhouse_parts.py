"""The wheelhouse as one tar cut into parts, and the manifest that lets the far side trust them.

A GPU machine with no network takes files only in calls of at most 64 MiB, so the wheelhouse
travels as `wheelhouse.tar.000`, `.001`, ... of at most PART_BYTES each, one or more a call, and
`manifest.json` beside them. The manifest holds the sha256 of every part, of the whole tar and of
every wheel in it: a part cut short or damaged on the way is named before anything is installed,
so that only that part is sent again. Standard library only: it runs on the GPU machine's Python
before any package has been installed there.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
from pathlib import Path

MIB = 2**20
# 60 MiB, not 64: the call also carries the repository's tracked files (~1.5 MiB) and the manifest.
PART_BYTES = 60 * MIB
MANIFEST = "manifest.json"
BUNDLE = "wheelhouse.tar"
CHUNK = 4 * MIB


class RelayError(Exception):
    """Something the user can act on (a missing or damaged part, a wrong machine): printed as one
    message, not a traceback."""


def pip_env() -> dict[str, str]:
    """The environment for pip without any pip configuration of the machine it runs on: on a
    development machine find-links, constraints or extra indexes would change what pip resolves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    return env


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def file_entry(path: Path) -> dict:
    return {"size": path.stat().st_size, "sha256": sha256_file(path)}


def make_bundle(files: list[Path], bundle: Path) -> None:
    """An uncompressed tar of `files`, flat, in name order, with owners and times zeroed: the same
    wheels give the same bytes. Uncompressed because wheels are zip files already (xz gains little
    and would cost minutes here and seconds of GPU time there)."""
    with tarfile.open(bundle, "w", format=tarfile.PAX_FORMAT) as tar:
        for path in sorted(files, key=lambda p: p.name):
            info = tar.gettarinfo(path, arcname=path.name)
            info.uid = info.gid = 0
            info.uname = info.gname = ""
            info.mtime = 0
            info.mode = 0o644
            with path.open("rb") as f:
                tar.addfile(info, f)


def split(bundle: Path, out_dir: Path, part_bytes: int = PART_BYTES) -> list[dict]:
    """Cuts `bundle` into out_dir/<name>.000, .001, ... of at most part_bytes each; their entries
    for the manifest, in order."""
    if part_bytes <= 0:
        raise ValueError(f"part size must be positive, got {part_bytes}")
    out_dir.mkdir(parents=True, exist_ok=True)
    for stale in out_dir.glob(f"{bundle.name}.[0-9][0-9][0-9]"):
        stale.unlink()
    parts = []
    with bundle.open("rb") as src:
        while data := src.read(part_bytes):
            part = out_dir / f"{bundle.name}.{len(parts):03d}"
            part.write_bytes(data)
            parts.append({"name": part.name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    return parts


def write_manifest(parts_dir: Path, manifest: dict) -> Path:
    path = parts_dir / MANIFEST
    path.write_text(json.dumps(manifest, indent=1, sort_keys=True) + "\n")
    return path


def read_manifest(parts_dir: Path) -> dict:
    path = parts_dir / MANIFEST
    if not path.is_file():
        raise RelayError(f"{path} is missing: send it with the parts")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise RelayError(f"{path} is not valid JSON ({e}): send it again") from None
    missing = {"parts", "bundle", "wheels"} - set(manifest)
    if missing:
        raise RelayError(f"{path} lacks {', '.join(sorted(missing))}: not written by build_wheelhouse.py")
    return manifest


def part_problems(parts_dir: Path, manifest: dict) -> list[str]:
    """One line per part that is missing, of the wrong size or with the wrong sha256; empty when
    every part is as the manifest says. Sizes first: cheap, and a cut-short copy shows there."""
    problems = []
    for part in manifest["parts"]:
        path = parts_dir / part["name"]
        if not path.is_file():
            problems.append(f"{part['name']}: missing")
        elif path.stat().st_size != part["size"]:
            problems.append(f"{part['name']}: {path.stat().st_size} bytes, the manifest says {part['size']}")
        elif sha256_file(path) != part["sha256"]:
            problems.append(f"{part['name']}: sha256 differs from the manifest's (damaged on the way)")
    return problems


def reassemble(parts_dir: Path, manifest: dict, bundle: Path) -> None:
    """Joins the parts into `bundle` after checking each, then checks the whole: raises RelayError
    naming every bad part, or a bundle whose sha256 is not the manifest's."""
    problems = part_problems(parts_dir, manifest)
    if problems:
        raise RelayError("parts not as the manifest says, send them again:\n  " + "\n  ".join(problems))
    bundle.parent.mkdir(parents=True, exist_ok=True)
    with bundle.open("wb") as out:
        for part in manifest["parts"]:
            with (parts_dir / part["name"]).open("rb") as src:
                while chunk := src.read(CHUNK):
                    out.write(chunk)
    if file_entry(bundle) != {k: manifest["bundle"][k] for k in ("size", "sha256")}:
        raise RelayError(f"{bundle}: the joined parts differ from the bundle the manifest describes")


def unpack(bundle: Path, manifest: dict, out_dir: Path) -> list[Path]:
    """Extracts the bundle's wheels into out_dir and checks each against the manifest: the tar must
    hold exactly the manifest's files, each with its sha256."""
    out_dir.mkdir(parents=True, exist_ok=True)
    with tarfile.open(bundle) as tar:
        names = tar.getnames()
        unexpected = sorted(set(names) ^ set(manifest["wheels"]))
        if unexpected or any("/" in n for n in names):
            raise RelayError(f"{bundle} does not hold the manifest's files: {unexpected[:5]}")
        tar.extractall(out_dir, filter="data")
    bad = [n for n, e in manifest["wheels"].items() if file_entry(out_dir / n) != e]
    if bad:
        raise RelayError(f"files whose sha256 differs from the manifest's: {', '.join(bad)}")
    return [out_dir / n for n in sorted(manifest["wheels"])]
