"""FSDP2 (`fully_shard`) for the GRPO roles: a Hugging Face causal LM sharded over all ranks, with
full-state-dict gathers (for the rollout's weight sync and the final export) and sharded step
checkpoints through torch.distributed.checkpoint.

Each decoder layer is its own FSDP unit, so only one layer's full parameters exist at a time in a
forward; the root unit holds the embeddings, the final norm and the head. The same code runs on
CPU (gloo, DeviceMesh "cpu") and on GPUs (NCCL).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_state_dict)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM

from stages.models.hf_files import save_hf_dir

TRAINER_STATE = "trainer_state.json"


def local_device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def load_sharded(hf_dir: Path, trainable: bool) -> torch.nn.Module:
    """The model of `hf_dir` in fp32, sharded over every rank (one FSDP unit per decoder layer)."""
    device = local_device()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).to(device)
    model.requires_grad_(trainable)
    model.train(trainable)
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def full_state_dict(model: torch.nn.Module, rank0_only: bool = False) -> dict[str, torch.Tensor]:
    """Unsharded parameters (an all-gather): on every rank, or only on rank 0 (in CPU memory,
    for export; the other ranks get an empty dict). Every rank must call it."""
    options = StateDictOptions(full_state_dict=True, cpu_offload=rank0_only)
    return get_model_state_dict(model, options=options)


def export_hf(model: torch.nn.Module, out_dir: Path, tokenizer_dir: Path) -> None:
    """Write a Hugging Face directory from rank 0 (safetensors, config.json, the tokenizer's files)."""
    state = full_state_dict(model, rank0_only=True)
    if dist.get_rank() == 0:
        save_hf_dir(state, model.config, out_dir, tokenizer_dir=tokenizer_dir)
    dist.barrier()


def save_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path,
                    trainer_state: dict) -> None:
    """Sharded model and optimizer state (each rank writes its own shards) plus the trainer state."""
    model_state, optim_state = get_state_dict(model, optimizer)
    dcp.save({"model": model_state, "optim": optim_state}, checkpoint_id=str(directory))
    if dist.get_rank() == 0:
        (directory / TRAINER_STATE).write_text(json.dumps(trainer_state))
    dist.barrier()


def load_checkpoint(model: torch.nn.Module, optimizer: torch.optim.Optimizer, directory: Path) -> dict:
    model_state, optim_state = get_state_dict(model, optimizer)
    state = {"model": model_state, "optim": optim_state}
    dcp.load(state, checkpoint_id=str(directory))
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    return json.loads((directory / TRAINER_STATE).read_text())
