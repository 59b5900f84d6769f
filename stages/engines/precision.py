"""Number formats of the native engines: the config's dtype names, what 'auto' resolves to on a
rank's device, and TF32 for the matmuls left in fp32 on CUDA.

The GRPO actor keeps fp32 master weights and optimizer states and computes in the stage's dtype
(FSDP2's MixedPrecisionPolicy, or autocast under DDP: stages/engines/fsdp2.py, ddp.py); the frozen
reference and the rollout's and the synthesis's copies are held in that dtype; final/ is written in
it. Logits are cast to fp32 before any log-softmax or sampling."""

from __future__ import annotations

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def compute_dtype(setting: str, device: torch.device) -> torch.dtype:
    """The dtype a stage's `dtype` setting names on `device`. 'auto' is bf16 on CUDA (tensor cores;
    fp32 master weights keep the update exact enough) and fp32 elsewhere: on the CPU ranks bf16 was
    measured slower, and log-probs move (bench/RESULTS.md, "GRPO precision on the CPU")."""
    if setting == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if setting not in DTYPES:
        raise ValueError(f"dtype: expected one of auto, {', '.join(DTYPES)}; got {setting!r}")
    return DTYPES[setting]


def enable_tf32(device: torch.device) -> None:
    """Let CUDA run fp32 matmuls and convolutions on TF32 tensor cores (10-bit mantissa inputs, fp32
    accumulation): what remains fp32 in a bf16 run, and all of an fp32 one. No effect elsewhere.
    (`allow_tf32`, not `fp32_precision`: the GPU lock's torch 2.11 knows only the former.)"""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
