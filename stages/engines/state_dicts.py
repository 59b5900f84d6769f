"""The state of a GRPO role's model, sharded (FSDP2, stages/engines/fsdp2.py) or replicated (DDP,
stages/engines/ddp.py) alike, through torch.distributed.checkpoint's state-dict API: step checkpoints
(model and optimizer, each rank writing its own shards, a replicated tensor written once) and the
final Hugging Face export. The API strips DDP's `module.` prefix and gathers FSDP2's shards: the
parameter names are the Hugging Face module's under either engine.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)

from runtime.dist import training_group
from stages.engines.ddp import unwrapped
from stages.models.hf_files import save_hf_dir

TRAINER_STATE = "trainer_state.json"


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Whole parameters (for FSDP2, an all-gather): on every rank, or only on rank 0 (in CPU memory,
    for export; the other ranks get an empty dict). Every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return get_model_state_dict(model, options=options)


def export_hf(model: torch.nn.Module, out_dir: Path, tokenizer_dir: Path, dtype: torch.dtype) -> None:
    """Write a Hugging Face directory from rank 0 (safetensors, config.json, the tokenizer's files),
    the weights in `dtype` (the stage's: the master weights rounded as its compute rounds them)."""
    state = full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        state = {name: tensor.to(dtype) for name, tensor in state.items()}
        save_hf_dir(state, unwrapped(model).config, out_dir, tokenizer_dir=tokenizer_dir)
    dist.barrier(group=training_group())


def save_checkpoint(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path, trainer_state: dict
) -> None:
    """Sharded model and optimizer state (each rank writes its own shards) plus the trainer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save(
        {"model": model_state, "optim": optim_state},
        checkpoint_id=str(directory),
        process_group=training_group(),
    )
    if dist.get_rank() == 0:
        (directory / TRAINER_STATE).write_text(json.dumps(trainer_state))
    dist.barrier(group=training_group())


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory), process_group=training_group())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((directory / TRAINER_STATE).read_text())
