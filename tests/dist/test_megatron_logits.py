"""megatron-core at TP=2 and at PP=2 on 2 real ranks, streaming its shard from a sharded HF
directory, computes Hugging Face's logits, loss and gradients on the same weights; gathering its
shards, and its streamed export, give back the HF weights bit for bit, and transformers loads the
export; and on CPU the RNG tracker's streams really switch. A model whose output layer is tied to
its embedding (Llama 3.2 1B/3B), read from a directory with no lm_head.weight as transformers
writes it, does the same at TP=2 and exports as tied; at PP=2 it is refused. One torchrun launch
checks every layout (start-up, mostly imports, is most of the time)."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_torchrun
from tests.dist.workers.results import read_results

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "megatron_logits.py"
LAYOUTS = ["tp2pp1", "tp1pp2", "tied-tp2pp1"]


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    """{(layout, check): [value reported by each rank that holds it]}."""
    out = run_torchrun(WORKER, 2, str(tmp_path_factory.mktemp("megatron"))).stdout
    found = {}
    for item in read_results(out):
        found.setdefault((item["layout"], item["check"]), []).append(item["value"])
    return found


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_logits_equal_hf_logits(results, layout):
    diffs = results[layout, "logits"]
    assert diffs and max(diffs) < 1e-4


@pytest.mark.parametrize("layout", LAYOUTS)
def test_megatron_loss_and_gradients_equal_hf(results, layout):
    assert max(results[layout, "loss"]) < 1e-5
    assert results[layout, "grads"] == [pytest.approx(0, abs=1e-4)]  # max |diff| / max |grad|, per tensor


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathered_shards_convert_back_to_the_exact_hf_weights(results, layout):
    assert results[layout, "gather_exact"] == [True]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_streamed_export_reads_back_as_the_exact_hf_weights(results, layout):
    assert results[layout, "export_exact"] == [True]


@pytest.mark.parametrize("layout", LAYOUTS)
def test_export_loads_in_transformers_tied_as_the_original(results, layout):
    (reload,) = results[layout, "hf_reload"]
    assert reload["tied"] == layout.startswith("tied") and reload["logits"] < 1e-6


def test_tied_embeddings_at_pp2_are_refused_naming_the_fields(results):
    messages = results["tied-tp1pp2", "refused"]  # on both ranks
    assert len(messages) == 2
    assert all("pp=2 with tie_word_embeddings=True is not supported" in m for m in messages)


def test_rng_tracker_streams_switch_on_cpu(results):
    assert results["tp2pp1", "rng"] == [{"tp_ranks_differ": True, "advances": True, "default_equal": True}]
