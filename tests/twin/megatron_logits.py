"""Logits of a Hugging Face directory's model built as verl's megatron engine builds it on the CPU
platform (Megatron-Bridge's provider, the CPU platform's patches, megatron-core's local layers),
in fp32 on one gloo rank, with Bridge loading the directory's weights as verl's checkpoint manager
does on resume (`load_hf_weights`). Run in a process of its own (megatron's global state):

    python -m tests.twin.megatron_logits HF_DIR OUT.pt TOKEN_IDS_JSON
"""

from __future__ import annotations

import json
import os
import sys

import torch


def megatron_logits(hf_dir: str, input_ids: torch.Tensor) -> torch.Tensor:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    import stages.engines.verl_cpu  # noqa: F401  (the CPU platform: Transformer Engine absent)
    from stages.engines.verl_cpu_megatron import patch_megatron

    torch.distributed.init_process_group("gloo", rank=0, world_size=1)
    from megatron.core import parallel_state as mpu
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer.enums import AttnBackend

    patch_megatron()
    mpu.initialize_model_parallel(1, 1)
    model_parallel_cuda_manual_seed(0)
    from megatron.bridge import AutoBridge

    bridge = AutoBridge.from_hf_pretrained(hf_dir)
    provider = bridge.to_megatron_provider(load_weights=False)
    provider.apply_overrides_and_finalize(
        dtype=torch.float32,
        overrides={
            "tensor_model_parallel_size": 1,
            "pipeline_model_parallel_size": 1,
            "attention_backend": AttnBackend.local,
            "apply_rope_fusion": False,
            "persist_layer_norm": False,
            "masked_softmax_fusion": False,
        },
    )
    model = provider.provide_distributed_model(wrap_with_ddp=False, fp16=False, bf16=False)
    bridge.load_hf_weights(model, hf_dir)
    model[0].eval()
    positions = torch.arange(input_ids.shape[1]).unsqueeze(0).expand_as(input_ids)
    with torch.no_grad():
        logits = model[0](input_ids=input_ids, position_ids=positions, attention_mask=None)
    torch.distributed.destroy_process_group()
    return logits.float()


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    hf_dir, out, ids = sys.argv[1:4]
    torch.save(megatron_logits(hf_dir, torch.tensor(json.loads(ids))), out)
