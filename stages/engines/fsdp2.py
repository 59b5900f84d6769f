"""FSDP2 (`fully_shard`) for the GRPO roles: a Hugging Face causal LM sharded over all ranks, with
whole-parameter gathers for the rollout's weight sync (step checkpoints and the final export:
stages/engines/state_dicts.py).

Each decoder layer is its own FSDP unit, so only one layer's full parameters exist at a time in a
forward; the root unit holds the embeddings, the final norm and the head (or, for small models on
CPU ranks, the root unit holds everything: fewer collectives). The same code runs on
CPU (gloo, DeviceMesh "cpu") and on GPUs (NCCL).

Loading never holds the whole model on a rank: the model is built on the meta device, sharded,
and each rank reads from the safetensors files only the rows of its own shards (FSDP2 shards every
parameter on dim 0), so a node's host memory holds the model once over all its ranks, not once
per rank (a 70B model in fp32 is 280 GB). Precision: stages/engines/precision.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from transformers import AutoConfig, AutoModelForCausalLM

from runtime.dist import rank_device
from stages.models.hf_files import HFCheckpoint


def load_sharded(
    hf_dir: Path,
    trainable: bool,
    reshard_after_forward: bool = True,
    units: str = "layer",
    compute_dtype: torch.dtype = torch.float32,
) -> torch.nn.Module:
    """The model of `hf_dir` sharded over every rank (one FSDP unit per decoder layer, or with
    `units="model"` one for the whole model); each rank reads only its own rows of each tensor.
    Trainable, its shards are fp32 master weights that FSDP2 gathers in `compute_dtype` (and whose
    gradients it reduces in fp32); frozen, the shards themselves are in `compute_dtype`."""
    device = rank_device()
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(hf_dir), dtype=torch.float32 if trainable else compute_dtype
        )
    model.requires_grad_(trainable)
    model.train(trainable)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    shard = dict(
        mesh=mesh,
        reshard_after_forward=reshard_after_forward,
        mp_policy=MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32),
    )
    for layer in model.model.layers if units == "layer" else []:
        fully_shard(layer, **shard)
    fully_shard(model, **shard)
    model.to_empty(device=device)
    _read_own_rows(model, HFCheckpoint(hf_dir))
    _rebuild_rotary_buffers(model, device)
    return model


@torch.no_grad()
def _read_own_rows(model: torch.nn.Module, weights: HFCheckpoint) -> None:
    """Fill each parameter's local shard from the files. FSDP2 splits dim 0 as torch.chunk does:
    ceil(rows / world) rows a rank, the last ranks getting fewer (or none)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for name, param in model.named_parameters():  # a tied head is the embedding's parameter: read once
        local = param.to_local()
        per_rank = -(-param.shape[0] // world)
        start = min(rank * per_rank, param.shape[0])
        local.copy_(weights.read_rows(name, start, start + local.shape[0]))


def _rebuild_rotary_buffers(model: torch.nn.Module, device: torch.device) -> None:
    """Non-persistent buffers are not in the files, and to_empty left them uninitialised: the only
    ones a Llama has are its rotary embedding's frequencies, recomputed from the config."""
    for module in model.modules():
        if not module._non_persistent_buffers_set:
            continue
        if not type(module).__name__.endswith("RotaryEmbedding"):
            raise NotImplementedError(
                f"{type(module).__name__} has buffers {sorted(module._non_persistent_buffers_set)} "
                "that a sharded load cannot initialise"
            )
        fresh = type(module)(config=model.config, device=device)
        for buffer in module._non_persistent_buffers_set:
            setattr(module, buffer, getattr(fresh, buffer))


@contextmanager
def gathered_parameters(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """The parameters whole on every rank inside the block, by name (read them, do not keep them):
    each FSDP unit gathers all its parameters in one all-gather, where a full state dict gathers
    them one at a time. Every rank must enter it; leaving reshards every unit."""
    for unit in _units(model):
        unit.unshard()
    try:
        yield dict(model.named_parameters())
    finally:
        reshard(model)


def reshard(model: torch.nn.Module) -> None:
    """Free every unit's gathered parameters, leaving each rank its shards (every rank calls it)."""
    for unit in _units(model):
        unit.reshard()


def _units(model: torch.nn.Module) -> list[FSDPModule]:
    return [m for m in model.modules() if isinstance(m, FSDPModule)]
