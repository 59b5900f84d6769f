"""GRPO on real ranks: one update on 2 ranks changes the weights as on 1 rank, given the same
global rollout batch (fed fixed, since sampling is per rank)."""
from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import REPO

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "grpo_step.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo-model")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                 num_key_value_heads=2, intermediate_size=64, pad_token_id=0, eos_token_id=1,
                                 bos_token_id=None)).save_pretrained(path)
    return path


def test_grpo_step_on_two_ranks_matches_one_rank(model_dir, tmp_path, torchrun):
    results = {}
    for nproc in (1, 2):
        out = tmp_path / f"ranks{nproc}.pt"
        torchrun(WORKER, nproc, str(model_dir), str(out), timeout=300)
        results[nproc] = torch.load(out)
    initial = LlamaForCausalLM.from_pretrained(model_dir).state_dict()
    one, two = results[1]["weights"], results[2]["weights"]
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert moved > 1e-3, "the update must change the weights for the comparison to mean anything"
    print(f"max |2 ranks - 1 rank| = {diff:.2e}; max |update| = {moved:.2e}")
    assert diff < 1e-4, (diff, moved)
    for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm"):
        assert results[1]["stats"][key] == pytest.approx(results[2]["stats"][key], abs=1e-5), key
