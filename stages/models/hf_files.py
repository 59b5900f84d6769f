"""Hugging Face model directories on disk: reading tensors, or rows/columns of them, from the
memory-mapped safetensors files (one file, or several listed by model.safetensors.index.json), and
writing them one tensor at a time into size-capped shards, so neither side ever holds the model.

A safetensors file is an 8-byte little-endian header length, a JSON header naming each tensor's
dtype, shape and byte range, then the raw bytes; knowing every tensor's shape up front, the writer
lays out the header first and then places each tensor's bytes wherever they belong as it arrives.
"""

from __future__ import annotations

import copy
import hashlib
import json
import os
import shutil
import struct
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from core.atomic import atomic_write_text, file_sha256

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
# HF's Llama checkpoints come in ~5 GB files: small enough for any file system, few enough to open.
MAX_SHARD_BYTES = 5 * 10**9
# Files of an HF model directory that are not weights or config.json: the tokenizer's, and the
# generation defaults (eos/pad ids) that `generate` reads.
SIDE_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "tokenizer.model",
    "generation_config.json",
)
DTYPE_NAMES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16", torch.float64: "F64"}


class HFCheckpoint(Mapping):
    """The tensors of an HF safetensors directory, memory-mapped: `ckpt[name]` reads one whole
    tensor, `read_rows`/`read_columns` only a range of it (the bytes of the other rows are never
    copied)."""

    def __init__(self, hf_dir: Path):
        hf_dir = Path(hf_dir)
        if (hf_dir / INDEX).exists():
            weight_map = json.loads((hf_dir / INDEX).read_text())["weight_map"]
            self.file_of = {name: hf_dir / file for name, file in weight_map.items()}
        else:
            self.file_of = {}
            for path in sorted(hf_dir.glob("*.safetensors")):
                with safe_open(path, "pt") as f:
                    self.file_of.update(dict.fromkeys(f.keys(), path))
        if not self.file_of:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir}")
        self.files = {path: safe_open(path, "pt") for path in set(self.file_of.values())}

    def _slice(self, name: str):
        return self.files[self.file_of[name]].get_slice(name)

    def read_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[start:stop]

    def read_columns(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._slice(name)[:, start:stop]

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.files[self.file_of[name]].get_tensor(name)

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    return dict(HFCheckpoint(hf_dir))


def weights_sha256(hf_dir: Path) -> str:
    """The weights' identity: model.safetensors' sha256, or, for a sharded directory, the sha256 of
    the index followed by each file's sha256 in order."""
    hf_dir = Path(hf_dir)
    if not (hf_dir / INDEX).exists():
        return file_sha256(hf_dir / SINGLE)
    files = sorted(set(json.loads((hf_dir / INDEX).read_text())["weight_map"].values()))
    digests = [file_sha256(hf_dir / INDEX), *(file_sha256(hf_dir / name) for name in files)]
    return hashlib.sha256("".join(digests).encode()).hexdigest()


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    @property
    def nbytes(self) -> int:
        return torch.Size(self.shape).numel() * self.dtype.itemsize


def plan_files(specs: list[TensorSpec], max_shard_bytes: int) -> list[list[TensorSpec]]:
    """Consecutive tensors grouped into files of at most max_shard_bytes (a bigger tensor gets a
    file of its own), as save_pretrained does."""
    files, size = [[]], 0
    for spec in specs:
        if files[-1] and size + spec.nbytes > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(spec)
        size += spec.nbytes
    return files


class _SafetensorsFile:
    """One safetensors file whose header is written first; tensors then land at their offsets."""

    def __init__(self, path: Path, specs: list[TensorSpec]):
        header, offset = {"__metadata__": {"format": "pt"}}, 0
        self.slots = {}
        for spec in specs:
            header[spec.name] = {
                "dtype": DTYPE_NAMES[spec.dtype],
                "shape": list(spec.shape),
                "data_offsets": [offset, offset + spec.nbytes],
            }
            self.slots[spec.name] = (spec, offset)
            offset += spec.nbytes
        text = json.dumps(header, separators=(",", ":")).encode()
        text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as safetensors writes it
        self.data_start = 8 + len(text)
        self.file = open(path, "wb")
        self.file.write(struct.pack("<Q", len(text)) + text)
        self.file.truncate(self.data_start + offset)

    def write(self, name: str, tensor: torch.Tensor) -> None:
        spec, offset = self.slots[name]
        if tuple(tensor.shape) != spec.shape or tensor.dtype != spec.dtype:
            raise ValueError(
                f"{name}: got {tuple(tensor.shape)} {tensor.dtype}, planned {spec.shape} {spec.dtype}"
            )
        self.file.seek(self.data_start + offset)
        self.file.write(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().data)

    def close(self) -> None:
        self.file.flush()
        os.fsync(self.file.fileno())
        self.file.close()


class HFDirWriter:
    """Writes the tensors of `specs` into out_dir as they come, in any order: one model.safetensors,
    or model-0000i-of-0000N.safetensors files with their index when they exceed max_shard_bytes.
    `finish` checks every tensor came and adds config.json and the tokenizer's files. The caller
    writes into a staging directory and renames it (stages/training_loop.finish): a crash leaves no
    half-written model where a model is expected."""

    def __init__(self, out_dir: Path, specs: list[TensorSpec], max_shard_bytes: int = MAX_SHARD_BYTES):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        groups = plan_files(specs, max_shard_bytes)
        names = (
            [SINGLE]
            if len(groups) == 1
            else [f"model-{i:05d}-of-{len(groups):05d}.safetensors" for i in range(1, len(groups) + 1)]
        )
        self.file_of, self.pending = {}, {spec.name for spec in specs}
        for name, group in zip(names, groups):
            f = _SafetensorsFile(self.out_dir / name, group)
            self.file_of.update(dict.fromkeys(f.slots, (name, f)))
        self.total_size = sum(spec.nbytes for spec in specs)
        self.dtype = specs[0].dtype

    def write(self, name: str, tensor: torch.Tensor) -> None:
        if name not in self.pending:
            raise ValueError(f"{name}: not a planned tensor, or written twice")
        self.file_of[name][1].write(name, tensor)
        self.pending.discard(name)

    def finish(self, hf_config, tokenizer_dir: Path | None = None) -> None:
        if self.pending:
            raise ValueError(f"tensors never written: {sorted(self.pending)[:5]}")
        files = {name: f for name, f in self.file_of.values()}
        for f in files.values():
            f.close()
        if len(files) > 1:
            index = {
                "metadata": {"total_size": self.total_size},
                "weight_map": {tensor: name for tensor, (name, _) in self.file_of.items()},
            }
            atomic_write_text(self.out_dir / INDEX, json.dumps(index, indent=2))
        config = copy.deepcopy(hf_config)
        config.dtype = self.dtype
        config.save_pretrained(self.out_dir)
        for name in SIDE_FILES if tokenizer_dir else ():
            if (Path(tokenizer_dir) / name).exists():
                shutil.copy2(Path(tokenizer_dir) / name, self.out_dir / name)


def specs_of(tensors: Iterable[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(name, tuple(t.shape), t.dtype) for name, t in tensors]


def save_hf_dir(
    hf_state: dict[str, torch.Tensor],
    hf_config,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """safetensors (sharded past max_shard_bytes) + config.json (+ the tokenizer's and generation
    files of tokenizer_dir), loadable by AutoModelForCausalLM; config.json's dtype is the weights'."""
    writer = HFDirWriter(out_dir, specs_of(hf_state.items()), max_shard_bytes)
    for name, tensor in hf_state.items():
        writer.write(name, tensor)
    writer.finish(hf_config, tokenizer_dir)
