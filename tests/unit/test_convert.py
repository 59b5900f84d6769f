"""HF <-> megatron conversion: exact round trips for every layout, and megatron's logits equal
Hugging Face's on the same weights (an independent implementation of the same Llama)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from stages.models.convert import hf_to_megatron, megatron_to_hf, read_hf_weights, save_hf_dir

CONFIG = LlamaConfig(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=8,
                     num_key_value_heads=4, intermediate_size=96, max_position_embeddings=64,
                     tie_word_embeddings=False, rms_norm_eps=1e-5)


@pytest.fixture(scope="module")
def hf_model():
    torch.manual_seed(0)
    return LlamaForCausalLM(CONFIG).eval()


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_round_trip_is_bit_exact(hf_model, tp, pp):
    hf = hf_model.state_dict()
    shards = [[hf_to_megatron(hf, CONFIG, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    back = megatron_to_hf(shards, CONFIG)
    assert back.keys() == hf.keys()
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


def test_shards_have_megatron_shapes(hf_model):
    shard = hf_to_megatron(hf_model.state_dict(), CONFIG, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    d = 64 // 8
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 4) * d // 2, 64)
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # gate and up halves
    assert shard["output_layer.weight"].shape == (64, 64)
    assert "embedding.word_embeddings.weight" not in shard and "decoder.layers.2.input_layernorm.weight" not in shard


@pytest.fixture(scope="module")
def single_rank_megatron():
    from megatron.core import parallel_state, tensor_parallel

    from stages.engines.cpu_shim import apply_cpu_shim

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    if not dist.is_initialized():
        dist.init_process_group("gloo", rank=0, world_size=1)
    apply_cpu_shim()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()


def test_megatron_logits_equal_hf_logits(hf_model, tmp_path, single_rank_megatron):
    from stages.models.convert import load_hf_into_megatron
    from stages.models.megatron_llama import build_megatron_llama

    save_hf_dir(hf_model.state_dict(), CONFIG, tmp_path)
    model = build_megatron_llama(CONFIG).eval()
    load_hf_into_megatron(model, tmp_path, CONFIG)
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    lengths = [20, 13, 7]  # right padding: compare only real positions
    mask = torch.tensor([[1] * n + [0] * (20 - n) for n in lengths])
    with torch.no_grad():
        ours = model(ids, torch.arange(20).expand(3, 20), None)
        theirs = hf_model(input_ids=ids, attention_mask=mask).logits
    for row, n in enumerate(lengths):
        assert (ours[row, :n] - theirs[row, :n]).abs().max() < 1e-4


def test_saved_dir_loads_with_transformers_and_generates(hf_model, tmp_path):
    save_hf_dir(hf_model.state_dict(), CONFIG, tmp_path)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    for key, value in read_hf_weights(tmp_path).items():
        assert torch.equal(value, hf_model.state_dict()[key])
    out = loaded.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert out.shape == (1, 8)
