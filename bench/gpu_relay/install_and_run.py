"""The GPU machine's side of the relay: checks the parts that came, joins them, installs the
wheelhouse offline into a venv that sees the image's torch, and runs gpu_acceptance.py's verl check.

    python3 bench/gpu_relay/install_and_run.py --verify-only  # after a transfer: parts missing or bad
    python3 bench/gpu_relay/install_and_run.py                # join, install, the verl check on 1 GPU
    python3 bench/gpu_relay/install_and_run.py --dry-run      # join, pip install --dry-run (rehearsal)

Run it with the image's Python, the one that holds torch. Standard library only: nothing is installed
when it starts. It stops, before installing anything, on a Python, glibc or torch that is not the one
the wheelhouse was built for (manifest.json says which). The venv (--work/venv, ignored by git) is
kept: run again on a warm machine and the install is skipped when it came from the same bundle.
"""

from __future__ import annotations

import argparse
import os
import site
import subprocess
import sys
import sysconfig
from importlib import metadata
from pathlib import Path

from wheelhouse_parts import RelayError, part_problems, pip_env, read_manifest, reassemble, unpack

REPO = Path(__file__).resolve().parents[2]
RELAY = REPO / ".relay"
DONE = ".relay-done"


def check_machine(manifest: dict) -> list[str]:
    """Raises RelayError where the wheelhouse cannot work here; returns notes on image packages
    whose versions differ from the lock's (pip decides whether they matter)."""
    python = "{}.{}".format(*sys.version_info)
    if python != manifest["python"]:
        raise RelayError(f"the wheelhouse is for Python {manifest['python']}; {sys.executable} is {python}")
    libc = os.confstr("CS_GNU_LIBC_VERSION") or "unknown 0.0"
    if version_tuple(libc.split()[-1]) < version_tuple(manifest["glibc"]):
        raise RelayError(f"its wheels need glibc >= {manifest['glibc']}, this machine has {libc}")
    notes = []
    for name, wanted in manifest["image"].items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            have = None
        if name == "torch" and (have or "").split("+")[0] != wanted:
            raise RelayError(
                f"{sys.executable} has {f'torch {have}' if have else 'no torch'}, the wheelhouse needs "
                f"the image's torch {wanted}: run this with the Python that holds it"
            )
        if have is None or have.split("+")[0] != wanted:
            notes.append(f"image has {name} {have}, the lock {wanted}")
    return notes


def version_tuple(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(".") if x.isdigit())


def make_venv(venv: Path) -> Path:
    """A venv that sees this Python's packages behind its own. `--system-site-packages` shows only
    the base interpreter's; where this Python is itself a venv (the image's python3 is
    /opt/torch/.venv/bin/python3) a .pth file adds its site-packages, after the venv's own."""
    venv_args = ["--clear", "--system-site-packages", "--without-pip"]
    subprocess.run([sys.executable, "-m", "venv", *venv_args, str(venv)], check=True)
    python = venv / "bin" / "python"
    if sys.prefix != sys.base_prefix:
        purelib = subprocess.run(
            [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            check=True, capture_output=True, text=True,
        ).stdout.strip()  # fmt: skip
        dirs = dict.fromkeys([*site.getsitepackages(), sysconfig.get_paths()["purelib"]])
        Path(purelib, "_image_site_packages.pth").write_text("".join(d + "\n" for d in dirs))
    return python


def pip(python: Path, wheels: Path, *argv: str, capture: bool = False) -> subprocess.CompletedProcess:
    """pip offline, from the wheelhouse alone."""
    cmd = [str(python), "-m", "pip", "install", "--no-index", "--find-links", str(wheels), *argv]
    cmd += ["--disable-pip-version-check", "--no-compile"]
    out = subprocess.run(cmd, env=pip_env(), capture_output=capture, text=True)
    if out.returncode != 0:
        said = f":\n{out.stderr[-3000:]}" if capture else " (pip's output is above)"
        raise RelayError(f"pip install {' '.join(argv)} failed, exit {out.returncode}{said}")
    return out


def install(manifest: dict, parts: Path, work: Path, dry_run: bool) -> Path:
    """Joins and checks the parts, unpacks the wheels, makes the venv, installs the lock's pins.
    Returns the venv's python."""
    reassemble(parts, manifest, work / manifest["bundle"]["name"])
    wheels = work / "wheels"
    unpack(work / manifest["bundle"]["name"], manifest, wheels)
    print(f"install_and_run: {len(manifest['parts'])} parts joined, {len(manifest['wheels'])} wheels intact")
    python = make_venv(work / "venv")
    # pip from the wheelhouse first: the one the rehearsal resolved with, not whatever venv has.
    pip_wheel = next(wheels.glob(f"pip-{manifest['pip']}-*.whl"))
    bootstrap = [str(python), str(pip_wheel / "pip"), "install", "--no-index", "--find-links", str(wheels)]
    subprocess.run([*bootstrap, "-q", f"pip=={manifest['pip']}"], env=pip_env(), check=True)
    requirements = work / "install.txt"
    requirements.write_text("".join(line + "\n" for line in manifest["install"]))
    if dry_run:
        out = pip(python, wheels, "--dry-run", "-r", str(requirements), capture=True)
        (work / "pip-dry-run.log").write_text(out.stdout)
        would = next((line for line in out.stdout.splitlines() if line.startswith("Would install")), "")
        count = len(would.split()) - 2
        print(f"install_and_run: pip --dry-run resolved, {count} to install (log: {work}/pip-dry-run.log)")
    else:
        pip(python, wheels, "-q", "-r", str(requirements))
        (work / "venv" / DONE).write_text(manifest["bundle"]["sha256"] + "\n")
    return python


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", type=Path, default=RELAY / "parts", help="the parts and manifest.json")
    p.add_argument("--work", type=Path, default=RELAY / "gpu", help="where to join, unpack, make the venv")
    p.add_argument("--verify-only", action="store_true", help="only check the parts that came")
    p.add_argument("--dry-run", action="store_true", help="pip install --dry-run, then stop")
    p.add_argument("--install-only", action="store_true", help="install, but run no check")
    p.add_argument("--gpus", type=int, default=1)
    args = p.parse_args(argv)
    try:
        return relay(args)
    except RelayError as e:
        print(f"install_and_run: {e}", file=sys.stderr)
        return 1


def relay(args) -> int:
    manifest = read_manifest(args.parts)
    if args.verify_only:
        problems = part_problems(args.parts, manifest)
        print("\n".join(problems) or f"all {len(manifest['parts'])} parts present and intact")
        return 1 if problems else 0
    for note in check_machine(manifest):
        print(f"install_and_run: note: {note}")
    venv = args.work / "venv"
    done = venv / DONE
    if not args.dry_run and done.is_file() and done.read_text().strip() == manifest["bundle"]["sha256"]:
        print(f"install_and_run: {venv} already holds this bundle's packages")
        python = venv / "bin" / "python"
    else:
        python = install(manifest, args.parts, args.work, args.dry_run)
    if args.dry_run or args.install_only:
        return 0
    # gpu_acceptance.py runs its checks with the Python that runs it: the venv's.
    check = [str(python), str(REPO / "bench" / "gpu_acceptance.py"), "--gpus", str(args.gpus)]
    return subprocess.run([*check, "--only", "verl"], cwd=REPO).returncode


if __name__ == "__main__":
    sys.exit(main())
