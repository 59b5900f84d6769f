"""The GPU relay's parts (bench/gpu_relay/wheelhouse_parts.py): a bundle cut into parts and joined
again is the same bytes, and a part that is missing, cut short or damaged on the way is named
before anything is joined or installed; so is a wheel that differs from the manifest's."""

from __future__ import annotations

import hashlib
import io
import sys
import tarfile

import pytest

from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench" / "gpu_relay"))
from wheelhouse_parts import (  # noqa: E402
    RelayError,
    file_entry,
    make_bundle,
    part_problems,
    read_manifest,
    reassemble,
    split,
    unpack,
    write_manifest,
)

PART = 1000  # bytes: small parts, so that a few KiB of files make several


@pytest.fixture
def relay(tmp_path):
    """Three files bundled and cut into parts of PART bytes, with their manifest. Returns the
    parts' folder, the manifest and the original bundle's bytes."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    for i, size in enumerate((2500, 10, 1700)):
        (wheels / f"pkg{i}-1.0-py3-none-any.whl").write_bytes(bytes((i * 7 + j) % 251 for j in range(size)))
    bundle = tmp_path / "wheelhouse.tar"
    make_bundle(sorted(wheels.iterdir()), bundle)
    parts_dir = tmp_path / "parts"
    manifest = {
        "wheels": {w.name: file_entry(w) for w in wheels.iterdir()},
        "bundle": {"name": bundle.name, **file_entry(bundle)},
        "parts": split(bundle, parts_dir, PART),
    }
    write_manifest(parts_dir, manifest)
    return parts_dir, read_manifest(parts_dir), bundle.read_bytes()


def test_parts_are_at_most_the_part_size_and_join_to_the_same_bytes(relay, tmp_path):
    parts_dir, manifest, original = relay
    sizes = [p["size"] for p in manifest["parts"]]
    assert len(sizes) == -(-len(original) // PART) and max(sizes) == PART and sum(sizes) == len(original)
    for part in manifest["parts"]:
        assert hashlib.sha256((parts_dir / part["name"]).read_bytes()).hexdigest() == part["sha256"]
    assert part_problems(parts_dir, manifest) == []
    joined = tmp_path / "gpu" / "wheelhouse.tar"
    reassemble(parts_dir, manifest, joined)
    assert joined.read_bytes() == original
    wheels = unpack(joined, manifest, tmp_path / "gpu" / "wheels")
    assert [w.name for w in wheels] == sorted(manifest["wheels"])
    assert (tmp_path / "gpu" / "wheels" / "pkg1-1.0-py3-none-any.whl").read_bytes() == bytes(range(7, 17))


def test_the_same_files_give_the_same_bundle(relay, tmp_path):
    """Owners and times are zeroed: building twice does not change the manifest's sha256."""
    _, manifest, original = relay
    again = tmp_path / "again.tar"
    make_bundle(sorted((tmp_path / "wheels").iterdir()), again)
    assert again.read_bytes() == original


@pytest.mark.parametrize(
    "damage, says",
    [
        (lambda p: p.unlink(), "missing"),
        (lambda p: p.write_bytes(p.read_bytes()[:-1]), "bytes, the manifest says"),
        (lambda p: p.write_bytes(b"\0" + p.read_bytes()[1:]), "damaged on the way"),
    ],
    ids=["missing", "cut-short", "corrupted"],
)
def test_a_bad_part_is_named_and_nothing_is_joined(relay, tmp_path, damage, says):
    parts_dir, manifest, _ = relay
    bad = manifest["parts"][1]["name"]
    damage(parts_dir / bad)
    assert [p.split(":")[0] for p in part_problems(parts_dir, manifest)] == [bad]
    joined = tmp_path / "gpu" / "wheelhouse.tar"
    with pytest.raises(RelayError, match=rf"{bad}: .*{says}"):
        reassemble(parts_dir, manifest, joined)
    assert not joined.exists()


def test_intact_parts_joined_in_the_wrong_order_are_refused(relay, tmp_path):
    """Each part matches its own entry, but the order is not the bundle's: its sha256 catches it."""
    parts_dir, manifest, _ = relay
    manifest["parts"][0], manifest["parts"][1] = manifest["parts"][1], manifest["parts"][0]
    assert part_problems(parts_dir, manifest) == []
    with pytest.raises(RelayError, match="joined parts differ"):
        reassemble(parts_dir, manifest, tmp_path / "joined.tar")


def test_a_wheel_that_differs_from_the_manifest_is_named(relay, tmp_path):
    parts_dir, manifest, _ = relay
    joined = tmp_path / "joined.tar"
    reassemble(parts_dir, manifest, joined)
    manifest["wheels"]["pkg2-1.0-py3-none-any.whl"]["sha256"] = "0" * 64
    with pytest.raises(RelayError, match="pkg2-1.0-py3-none-any.whl"):
        unpack(joined, manifest, tmp_path / "wheels-out")


def test_a_bundle_with_a_file_the_manifest_lacks_is_refused(relay, tmp_path):
    _, manifest, _ = relay
    extra = tmp_path / "extra.tar"
    with tarfile.open(extra, "w") as tar:
        info = tarfile.TarInfo("surprise.whl")
        info.size = 3
        tar.addfile(info, io.BytesIO(b"abc"))
    with pytest.raises(RelayError, match="surprise.whl"):
        unpack(extra, manifest, tmp_path / "wheels-out")


def test_a_missing_or_foreign_manifest_says_so(tmp_path):
    with pytest.raises(RelayError, match="manifest.json is missing"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text('{"parts": []}')
    with pytest.raises(RelayError, match="lacks bundle, wheels"):
        read_manifest(tmp_path)
