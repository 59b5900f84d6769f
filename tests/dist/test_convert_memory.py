"""Streaming conversion keeps a rank's host memory at the size of its shard, not of the model:
on a ~350 MB fp32 Llama (built here from a seed, saved by transformers as several files), 2 real
ranks load it into megatron at TP=2 and TP=1, and rank 0 exports it back, layer by layer. The
whole-tensor loader it replaced is measured too: it breaks the TP=2 bound, so the bound is one a
loader can fail. The same holds for the GRPO roles' FSDP2 load of a bf16 checkpoint into fp32
(measured on 2 ranks: 173 MB a rank streamed, 357 MB whole then sharded, for a 334 MB fp32 model).
How memory is measured, and why anonymous memory: the worker's docstring."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from stages.models.hf_files import HFCheckpoint
from tests.conftest import REPO, run_torchrun
from tests.dist.workers.results import read_results

pytestmark = [pytest.mark.dist, pytest.mark.slow]
WORKER = REPO / "tests" / "dist" / "workers" / "convert_memory.py"
# 87.6 M parameters; 6 layers of 11.8 M (13.5% of the model each), embedding and head 8.4 M each.
CONFIG = LlamaConfig(
    vocab_size=8192,
    hidden_size=1024,
    num_hidden_layers=6,
    num_attention_heads=16,
    num_key_value_heads=8,
    intermediate_size=2816,
    max_position_embeddings=256,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
    dtype="float32",
)
MB = 2**20


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("big")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = LlamaForCausalLM(CONFIG)
    model.save_pretrained(out / "hf", max_shard_size="100MB")
    # As real checkpoints ship: bf16, read into fp32. (An fp32 file loaded as fp32 can stay in
    # the page cache as it is, shared by the ranks, so it does not show what loading costs.)
    model.to(torch.bfloat16).save_pretrained(out / "hf-bf16", max_shard_size="100MB")
    return out


@pytest.fixture(scope="module")
def results(hf_dir) -> dict:
    """{(check, tp, rank): {shard_bytes, anon, file}} as the ranks measured them."""
    out = run_torchrun(
        WORKER,
        2,
        str(hf_dir / "hf"),
        str(hf_dir),
        str(hf_dir / "hf-bf16"),
        env={"MALLOC_MMAP_THRESHOLD_": "131072"},
    ).stdout
    found = {}
    for item in read_results(out):
        found[item.pop("check"), item.pop("tp"), item.pop("rank")] = item
    print(
        f"model {model_bytes(hf_dir) / MB:.0f} MB:",  # the figures, seen with pytest -s
        {
            " ".join(map(str, k)): {n: round(v / MB) if n != "seconds" else round(v, 1) for n, v in r.items()}
            for k, r in found.items()
        },
    )
    return found


def model_bytes(hf_dir) -> int:
    return sum(p.stat().st_size for p in (hf_dir / "hf").glob("*.safetensors"))


@pytest.mark.parametrize("rank", [0, 1])
def test_tp2_load_grows_a_rank_by_its_shard_not_the_model(results, hf_dir, rank):
    r, model = results["stream_load", 2, rank], model_bytes(hf_dir)
    assert r["shard_bytes"] == pytest.approx(model / 2, rel=0.02)
    assert r["anon"] < 0.65 * model
    assert r["anon"] < r["shard_bytes"] + 0.1 * model


@pytest.mark.parametrize("rank", [0, 1])
def test_tp1_load_grows_a_rank_by_the_whole_model(results, hf_dir, rank):
    """The measurement sees the weights a rank keeps: at TP=1 they are the model."""
    assert 0.95 < results["stream_load", 1, rank]["anon"] / model_bytes(hf_dir) < 1.15


@pytest.mark.parametrize("rank", [0, 1])
def test_whole_tensor_loader_breaks_the_tp2_bound(results, hf_dir, rank):
    assert results["whole_load", 2, rank]["anon"] > 0.65 * model_bytes(hf_dir)


@pytest.mark.parametrize("rank", [0, 1])
def test_grpo_roles_fsdp2_load_grows_a_rank_by_its_shard_and_the_whole_model_load_does_not(
    results, hf_dir, rank
):
    model = model_bytes(hf_dir)  # in fp32, as the roles hold it
    streamed, whole = results["fsdp2_load", 2, rank], results["fsdp2_whole_load", 2, rank]
    assert streamed["shard_bytes"] == pytest.approx(model / 2, rel=0.02)
    assert streamed["anon"] < min(0.65 * model, streamed["shard_bytes"] + 0.1 * model)
    assert whole["anon"] > 0.65 * model


def test_export_grows_the_writer_by_about_a_layer(results, hf_dir):
    """The writer holds the other rank's half of one layer and a tensor or two of its HF form;
    the whole-model gather it replaced held the model twice (shards, then HF tensors)."""
    layer = sum(p.numel() * 4 for p in LlamaDecoderLayer(CONFIG, layer_idx=0).parameters())
    assert results["export", 2, 0]["anon"] < 2 * layer < 0.3 * model_bytes(hf_dir)


def test_export_is_bit_exact_and_sharded(results, hf_dir):
    original, exported = HFCheckpoint(hf_dir / "hf"), HFCheckpoint(hf_dir / "export")
    assert len(exported.files) == 4 and (hf_dir / "export" / "model.safetensors.index.json").exists()
    assert set(exported) == set(original)
    for name in original:
        assert torch.equal(exported[name], original[name]), name
