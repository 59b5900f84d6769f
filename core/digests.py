"""Content digests that are read once: a file's sha256 is trusted for as long as its stat (size,
modification time) is the one recorded beside it, and large files are digested in fixed-size pieces
so that ranks can share out the hashing of one file.

A piece is (path relative to the root, offset, length); a file's digest is the list of its pieces'
sha256 in order (a single piece with `chunk_bytes` 0: the whole file's sha256, the old format).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from core.atomic import atomic_write_text, file_sha256

# What a rank may still be hashing when the others are done: the bound on their wait.
CHUNK_BYTES = 64 << 20
BLOCK = 1 << 20

Piece = tuple[str, int, int]


def file_stats(root: Path, skip: frozenset[str] = frozenset()) -> dict[str, list[int]]:
    """{relative path: [size, mtime_ns]} of every file under root, except the names in `skip`."""
    root = Path(root)
    stats = {}
    for path in sorted(root.rglob("*")):
        rel = str(path.relative_to(root))
        if rel not in skip and path.is_file():
            stats[rel] = stat_of(path)
    return stats


def files_fingerprint(root: str | Path) -> list:
    """Path, size and modification time of every file: notices an edited or replaced model
    without reading tens of GB on every run (the stage outputs are checksummed instead)."""
    return [[rel, *stat] for rel, stat in file_stats(Path(root).resolve()).items()]


def stat_of(path: Path) -> list[int]:
    st = Path(path).stat()
    return [st.st_size, st.st_mtime_ns]


def pieces_of(sizes: dict[str, int], chunk_bytes: int) -> list[Piece]:
    """Each file cut into `chunk_bytes` pieces (0: one piece per file); an empty file is one piece."""
    pieces = []
    for rel, size in sorted(sizes.items()):
        step = chunk_bytes or max(size, 1)
        pieces += [(rel, offset, min(step, size - offset)) for offset in range(0, max(size, 1), step)]
    return pieces


def hash_piece(root: Path, piece: Piece, chunk_bytes: int) -> str:
    rel, offset, length = piece
    if not chunk_bytes:
        return file_sha256(Path(root) / rel)
    h = hashlib.sha256()
    with open(Path(root) / rel, "rb") as f:
        f.seek(offset)
        left = length
        while left:
            block = f.read(min(BLOCK, left))
            if not block:
                raise OSError(f"{rel} ended at {offset + length - left} bytes, expected {offset + length}")
            h.update(block)
            left -= len(block)
    return h.hexdigest()


def hash_pieces(root: Path, pieces: list[Piece], chunk_bytes: int) -> dict[Piece, str]:
    return {piece: hash_piece(root, piece, chunk_bytes) for piece in pieces}


def file_digests(hashed: dict[Piece, str]) -> dict[str, list[str]]:
    """{file: its pieces' digests in order} from the hashed pieces of all ranks together."""
    digests: dict[str, list[str]] = {}
    for (rel, _offset, _length), sha in sorted(hashed.items()):
        digests.setdefault(rel, []).append(sha)
    return digests


def cached_tree_sha256(root: Path, cache: Path) -> dict[str, str]:
    """sha256 of every file under root, read only for files whose stat is not the one `cache`
    (a JSON file of {path: [size, mtime_ns, sha256]}) recorded; the cache is updated."""
    try:
        known = json.loads(cache.read_text())
    except (OSError, ValueError):
        known = {}
    now = {}
    for rel, stat in file_stats(root).items():
        entry = known.get(rel)
        now[rel] = entry if entry and entry[:2] == stat else [*stat, file_sha256(Path(root) / rel)]
    if now != known:
        atomic_write_text(cache, json.dumps(now, indent=1))
    return {rel: entry[2] for rel, entry in now.items()}
