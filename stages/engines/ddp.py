"""DistributedDataParallel for the GRPO roles, for models that fit whole on a rank several times
over: every rank holds the whole model (the actor also its gradients and optimizer state), torch's
DDP averages the actor's gradients over the ranks in its backward, and nothing else communicates:
no all-gather before a forward or at the rollout's weight sync, and the clip and the optimizer step
run on plain tensors, not through DTensor's dispatch. The frozen reference is a plain module.
Checkpoints and the final export: stages/engines/state_dicts.py, as for FSDP2.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.nn.parallel import DistributedDataParallel
from transformers import AutoModelForCausalLM

from runtime.dist import rank_device, training_group

# torch 2.13 renamed the switch (the old name is deprecated); the GPU lock's torch 2.11 (vLLM's
# pin) knows only the old one.
NO_BUFFER_SYNC = (
    {"forward_sync_buffers": False}
    if "forward_sync_buffers" in inspect.signature(DistributedDataParallel).parameters
    else {"broadcast_buffers": False}
)


def load_replicated(
    hf_dir: Path, trainable: bool, compute_dtype: torch.dtype = torch.float32
) -> torch.nn.Module:
    """The model of `hf_dir` whole on this rank. Frozen (also the rollout's and the synthesis's
    copy), in `compute_dtype`. Trainable, wrapped in DDP (which starts every rank from rank 0's
    weights), its parameters fp32 master weights and its forward autocast to `compute_dtype`."""
    device = rank_device()
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32 if trainable else compute_dtype)
    model = model.to(device)
    model.requires_grad_(trainable)
    model.train(trainable)
    if not trainable:
        return model
    if compute_dtype != torch.float32:
        # torch's mixed precision for DDP: autocast around the forward only (the backward follows the
        # forward's dtypes), gradients and the all-reduce in the parameters' fp32. Wrapping the
        # module's own forward autocasts every caller's.
        model.forward = torch.autocast(device.type, dtype=compute_dtype)(model.forward)
    # The only buffers are the rotary embedding's frequencies, computed from the config on every
    # rank: broadcasting them before every forward (DDP's default) would be a collective a forward.
    return DistributedDataParallel(model, process_group=training_group(), **NO_BUFFER_SYNC)


def unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face module inside a DDP wrapper (or the module itself)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


@contextmanager
def gathered_parameters(model: torch.nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """fsdp2.gathered_parameters' counterpart: the parameters are whole already."""
    yield dict(unwrapped(model).named_parameters())
