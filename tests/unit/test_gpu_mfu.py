"""bench/gpu_mfu.py where there is no GPU: it says it needs CUDA and exits 1 (after checking its
arguments: a bad one exits 2); its FLOP count agrees with the parameters of the real HF model."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import AutoConfig, LlamaForCausalLM

from tests.conftest import REPO

BENCH = REPO / "bench" / "gpu_mfu.py"
LLAMA_8B = REPO / "configs" / "models" / "llama-3.1-8b" / "config.json"


def run_bench(*args):
    return subprocess.run([sys.executable, str(BENCH), *args], capture_output=True, text=True, timeout=120)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_without_cuda_it_exits_1_saying_it_needs_gpus():
    out = run_bench("--layers", "2")
    assert out.returncode == 1
    assert "needs CUDA GPUs" in out.stderr


def test_a_missing_model_config_exits_2_naming_the_flag(tmp_path):
    out = run_bench("--model-config", str(tmp_path / "nope.json"))
    assert out.returncode == 2
    assert "--model-config" in out.stderr


def test_flops_per_token_count_the_hf_models_matmul_parameters():
    sys.path.insert(0, str(REPO / "bench"))
    from gpu_mfu import flops_per_token

    from analysis.model_shape import shape_from_hf_config

    config = AutoConfig.from_pretrained(LLAMA_8B.parent)
    config.num_hidden_layers = 2
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    matmul_params = sum(p.numel() for name, p in model.named_parameters() if "embed_tokens" not in name)
    shape = shape_from_hf_config(LLAMA_8B)
    shape = type(shape)(**{**shape.__dict__, "layers": 2})
    attention = 12 * 2 * 4096 * config.num_attention_heads * config.head_dim
    # the final RMSNorm's weight is no matmul: within 4096 x 6 of the count
    assert flops_per_token(shape, 4096) == pytest.approx(6 * matmul_params + attention, abs=6 * 4096)
