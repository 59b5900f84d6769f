"""HF <-> megatron conversion: exact round trips for every layout, and megatron's logits equal
Hugging Face's on the same weights (an independent implementation of the same Llama)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from stages.models.convert import hf_to_megatron, megatron_to_hf, stream_shard
from stages.models.hf_files import INDEX, HFCheckpoint, HFDirWriter, TensorSpec, read_hf_weights, save_hf_dir
from stages.models.megatron_llama import transformer_config_from_hf, validate_parallel_layout
from stages.models.tiny import build_tiny_llama
from tests.conftest import free_port
from tests.support.llama_configs import GQA_LLAMA, GQA_LLAMA_TIED, llama3_rope

CONFIG, TIED = GQA_LLAMA, GQA_LLAMA_TIED
LLAMA3_ROPE = llama3_rope(8192)


def random_llama(config: LlamaConfig) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def hf_model():
    return random_llama(CONFIG)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1), (1, 4)])
def test_round_trip_is_bit_exact(hf_model, tp, pp):
    hf = hf_model.state_dict()
    shards = [[hf_to_megatron(hf, CONFIG, t, tp, p, pp) for t in range(tp)] for p in range(pp)]
    back = megatron_to_hf(shards, CONFIG)
    assert back.keys() == hf.keys()
    for key, value in hf.items():
        assert torch.equal(back[key], value), key


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_tied_round_trip_has_no_head_of_its_own(tp, tmp_path):
    hf = random_llama(TIED)
    hf.save_pretrained(tmp_path)  # what a tied checkpoint holds: no lm_head.weight
    saved = read_hf_weights(tmp_path)
    assert "lm_head.weight" not in saved
    shards = [[hf_to_megatron(saved, TIED, t, tp, 0, 1) for t in range(tp)]]
    assert all("output_layer.weight" not in shard for shard in shards[0])
    back = megatron_to_hf(shards, TIED)
    assert back.keys() == saved.keys() and all(torch.equal(back[k], v) for k, v in saved.items())


@pytest.fixture(scope="module", params=["one_file", "sharded"])
def hf_dir(request, hf_model, tmp_path_factory):
    """hf_model saved as one model.safetensors, or as several files with an index (each file a
    few tensors: 20 KB caps)."""
    out = tmp_path_factory.mktemp(request.param)
    cap = {"max_shard_bytes": 20_000} if request.param == "sharded" else {}
    save_hf_dir(hf_model.state_dict(), CONFIG, out, **cap)
    assert (out / INDEX).exists() == (request.param == "sharded")
    return out


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2), (2, 2), (4, 1)])
def test_streamed_shards_equal_the_whole_tensor_reference(hf_model, hf_dir, tp, pp):
    hf, ckpt = hf_model.state_dict(), HFCheckpoint(hf_dir)
    for p in range(pp):
        for t in range(tp):
            streamed = dict(stream_shard(ckpt, CONFIG, t, tp, p, pp))
            reference = hf_to_megatron(hf, CONFIG, t, tp, p, pp)
            assert streamed.keys() == reference.keys()
            for key, value in reference.items():
                assert torch.equal(streamed[key], value), (t, p, key)


def test_sharded_save_loads_with_transformers_bit_exactly(hf_model, tmp_path):
    hf = hf_model.state_dict()
    save_hf_dir(hf, CONFIG, tmp_path, max_shard_bytes=100_000)
    files = sorted(p.name for p in tmp_path.glob("*.safetensors"))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).state_dict()
    assert loaded.keys() == hf.keys() and all(torch.equal(loaded[k], v) for k, v in hf.items())
    bf16 = {k: v.to(torch.bfloat16) for k, v in hf.items()}
    save_hf_dir(bf16, CONFIG, tmp_path / "bf16")
    assert AutoConfig.from_pretrained(tmp_path / "bf16").dtype == torch.bfloat16
    assert all(torch.equal(read_hf_weights(tmp_path / "bf16")[k], v) for k, v in bf16.items())


def test_writer_refuses_wrong_shapes_and_missing_tensors(tmp_path):
    writer = HFDirWriter(
        tmp_path, [TensorSpec("a", (2, 3), torch.float32), TensorSpec("b", (4,), torch.float32)]
    )
    with pytest.raises(ValueError, match=r"a: got \(3, 2\)"):
        writer.write("a", torch.zeros(3, 2))
    writer.write("b", torch.zeros(4))
    with pytest.raises(ValueError, match="b: not a planned tensor, or written twice"):
        writer.write("b", torch.zeros(4))
    with pytest.raises(ValueError, match=r"never written: \['a'\]"):
        writer.finish(CONFIG)


def test_shards_have_megatron_shapes_and_local_layer_numbers(hf_model):
    shard = hf_to_megatron(hf_model.state_dict(), CONFIG, tp_rank=1, tp_size=2, pp_rank=1, pp_size=2)
    d = 64 // 8
    assert shard["decoder.layers.0.self_attention.linear_qkv.weight"].shape == ((8 + 2 * 4) * d // 2, 64)
    assert shard["decoder.layers.0.self_attention.linear_proj.weight"].shape == (64, 8 * d // 2)
    assert shard["decoder.layers.0.mlp.linear_fc1.weight"].shape == (96, 64)  # gate and up halves
    assert shard["output_layer.weight"].shape == (64, 64)
    assert (
        "embedding.word_embeddings.weight" not in shard
        and "decoder.layers.2.input_layernorm.weight" not in shard
    )


def test_layout_problems_name_the_dimension_that_does_not_split(hf_model):
    assert validate_parallel_layout(CONFIG, tp=4, pp=2) == []
    assert validate_parallel_layout(CONFIG, tp=8, pp=1) == ["tp=8 does not divide num_key_value_heads=4"]
    problems = "\n".join(validate_parallel_layout(CONFIG, tp=3, pp=3))
    for named in ("num_attention_heads=8", "num_key_value_heads=4", "vocab_size=128", "num_hidden_layers=4"):
        assert named in problems
    assert "intermediate_size" not in problems  # 96 splits in 3
    assert validate_parallel_layout(TIED, tp=4, pp=1) == []
    assert validate_parallel_layout(TIED, tp=1, pp=2) == [
        "pp=2 with tie_word_embeddings=True is not supported: use pp=1"
    ]
    with pytest.raises(ValueError, match="num_key_value_heads"):
        hf_to_megatron(hf_model.state_dict(), CONFIG, tp_rank=0, tp_size=8, pp_rank=0, pp_size=1)


@pytest.mark.parametrize(
    "change,message",
    [
        ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}}, "RoPE scaling"),
    ],
)
def test_unsupported_configs_are_rejected_clearly(change, message):
    with pytest.raises(ValueError, match=message):
        transformer_config_from_hf(LlamaConfig(**{**CONFIG.to_dict(), **change}))


def test_tied_embeddings_are_no_longer_refused():
    assert transformer_config_from_hf(TIED).num_layers == 4


@pytest.fixture(scope="module")
def single_rank_megatron():
    from megatron.core import parallel_state, tensor_parallel

    from stages.engines.cpu_shim import apply_cpu_shim

    created = not dist.is_initialized()
    if created:
        with pytest.MonkeyPatch.context() as env:  # read at init only: later tests must not see it
            env.setenv("MASTER_ADDR", "127.0.0.1")
            env.setenv("MASTER_PORT", str(free_port()))
            dist.init_process_group("gloo", rank=0, world_size=1)
    apply_cpu_shim()
    parallel_state.initialize_model_parallel(1, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    yield
    parallel_state.destroy_model_parallel()
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    "change",
    [{}, {"rope_parameters": LLAMA3_ROPE, "max_position_embeddings": 131072}, {"tie_word_embeddings": True}],
    ids=["default_rope", "llama3_rope", "tied"],
)
def test_megatron_logits_equal_hf_logits_at_non_pad_positions(tmp_path, single_rank_megatron, change):
    from stages.models.convert import load_hf_into_megatron
    from stages.models.megatron_llama import build_megatron_llama

    config = LlamaConfig(**{**CONFIG.to_dict(), **change})
    hf_model = random_llama(config)
    # A tied model's state dict names the embedding twice: the directory then also holds an
    # lm_head.weight, equal to it, which loading ignores.
    save_hf_dir(hf_model.state_dict(), config, tmp_path)
    model = build_megatron_llama(config).eval()
    load_hf_into_megatron(model, tmp_path)
    # Short inputs barely turn the low frequencies that Llama 3 rescales: compare them directly.
    assert torch.allclose(
        model.rotary_pos_emb.inv_freq, hf_model.model.rotary_emb.inv_freq, rtol=1e-6, atol=0
    )
    ids = torch.randint(0, 128, (3, 20), generator=torch.Generator().manual_seed(1))
    lengths = [20, 13, 7]  # right padding: compare only real positions
    mask = torch.tensor([[1] * n + [0] * (20 - n) for n in lengths])
    with torch.no_grad():
        ours = model(ids, torch.arange(20).expand(3, 20), None)  # None: megatron's causal mask
        theirs = hf_model(input_ids=ids, attention_mask=mask).logits
    for row, n in enumerate(lengths):
        assert (ours[row, :n] - theirs[row, :n]).abs().max() < 1e-4


def test_tiny_llama_depends_only_on_its_seed(tmp_path):
    for name, seed in (("a", 7), ("b", 7), ("c", 8)):
        build_tiny_llama(
            tmp_path / name,
            vocab_size=32,
            hidden_size=32,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            ffn_hidden_size=64,
            seed=seed,
        )
    a, b, c = (load_file(tmp_path / name / "model.safetensors") for name in "abc")
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert not torch.equal(a["lm_head.weight"], c["lm_head.weight"])
    assert {v.dtype for v in a.values()} == {torch.float32}
    config = AutoConfig.from_pretrained(tmp_path / "a")
    assert config.num_key_value_heads == 2 and not config.tie_word_embeddings


def test_saved_dir_loads_with_transformers_and_generates(tmp_path):
    from stages.data.tokenizer import build_char_tokenizer

    base = tmp_path / "base"
    tokenizer = build_char_tokenizer(base)
    build_tiny_llama(
        base,
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    weights = read_hf_weights(base)
    save_hf_dir(weights, AutoConfig.from_pretrained(base), tmp_path / "out", tokenizer_dir=base)

    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in weights.items())
    tokenizer = AutoTokenizer.from_pretrained(tmp_path / "out")
    prompt = torch.tensor([tokenizer("12+34=")["input_ids"]])
    out = loaded.generate(prompt, max_new_tokens=5, do_sample=False, min_new_tokens=5)
    assert out.shape == (1, prompt.shape[1] + 5)


def test_weights_sha256_is_the_file_hash_or_covers_every_shard(hf_model, tmp_path):
    from core.atomic import file_sha256
    from stages.models.hf_files import weights_sha256

    hf = hf_model.state_dict()
    save_hf_dir(hf, CONFIG, tmp_path / "one")
    assert weights_sha256(tmp_path / "one") == file_sha256(tmp_path / "one" / "model.safetensors")
    save_hf_dir(hf, CONFIG, tmp_path / "a", max_shard_bytes=100_000)
    save_hf_dir(
        {**hf, "lm_head.weight": hf["lm_head.weight"] + 1}, CONFIG, tmp_path / "b", max_shard_bytes=100_000
    )
    assert weights_sha256(tmp_path / "a") != weights_sha256(tmp_path / "b")  # the change is in the last file
