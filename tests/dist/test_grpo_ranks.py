"""GRPO on real ranks: one update on 2 ranks changes the weights as on 1 rank, given the same
global rollout batch (fed fixed, since sampling is per rank), whether FSDP2 reshards after each
forward or keeps the layers gathered, whether each layer or the whole model is an FSDP unit, whether
DDP keeps the models whole on every rank instead, and whether the old log-probs are the actor's or
the rollout's (verl's bypass mode: equal values, so the same update)."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from tests.conftest import REPO, run_torchrun

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "grpo_step.py"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("grpo-model")
    torch.manual_seed(0)
    LlamaForCausalLM(
        LlamaConfig(
            vocab_size=32,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=64,
            pad_token_id=0,
            eos_token_id=1,
            bos_token_id=None,
        )
    ).save_pretrained(path)
    return path


# The 2-rank cases, {name: the stage's settings}, run in one torchrun (tests/dist/workers/grpo_step.py).
TWO_RANK_CASES = {
    "reshard-True": ["reshard_after_forward=true"],
    "reshard-False": ["reshard_after_forward=false"],
    "bypass": ["old_log_probs=rollout"],
    # the embedded default's settings: one unit, kept gathered, the rollout's log-probs
    "one-unit": ["fsdp_units=model", "reshard_after_forward=false", "old_log_probs=rollout"],
    "ddp": ["data_parallel=ddp", "old_log_probs=rollout"],
    "micro-True": ["micro_batch_size=1", "reshard_after_forward=true"],
    "micro-False": ["micro_batch_size=1", "reshard_after_forward=false"],
    "ddp-micro": ["data_parallel=ddp", "micro_batch_size=1"],
}


def run_cases(model_dir, directory, nproc: int, cases: dict[str, list[str]]) -> dict[str, dict]:
    run_torchrun(WORKER, nproc, str(model_dir), str(directory), json.dumps(cases), timeout=600)
    return {name: torch.load(directory / f"{name}.pt") for name in cases}


@pytest.fixture(scope="module")
def one_rank(model_dir, tmp_path_factory) -> dict:
    return run_cases(model_dir, tmp_path_factory.mktemp("one-rank"), 1, {"default": []})["default"]


@pytest.fixture(scope="module")
def two_ranks(model_dir, tmp_path_factory) -> dict[str, dict]:
    return run_cases(model_dir, tmp_path_factory.mktemp("two-ranks"), 2, TWO_RANK_CASES)


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_grpo_step_on_two_ranks_matches_one_rank(model_dir, one_rank, two_ranks, reshard_after_forward):
    assert_same_update(model_dir, one_rank, two_ranks[f"reshard-{reshard_after_forward}"])


def test_old_log_probs_from_the_rollout_give_the_update_the_actors_give(model_dir, one_rank, two_ranks):
    assert_same_update(model_dir, one_rank, two_ranks["bypass"])


def test_the_whole_model_as_one_fsdp_unit_gives_the_same_update(model_dir, one_rank, two_ranks):
    """With the embedded default's settings: one unit, kept gathered (shared prompts, no resharding
    between the backward's passes), the rollout's log-probs."""
    assert_same_update(model_dir, one_rank, two_ranks["one-unit"])


def test_ddp_gives_the_same_update(model_dir, one_rank, two_ranks):
    """With the embedded default's settings: actor and reference whole on each rank (DDP), the
    rollout's log-probs; the 1-rank reference is FSDP2's."""
    assert_same_update(model_dir, one_rank, two_ranks["ddp"])
    # nothing is gathered: only the gradients are all-reduced
    assert two_ranks["ddp"]["update_all_gathers"] == 0


@pytest.mark.parametrize("reshard_after_forward", [True, False])
def test_one_row_micro_batches_give_the_update_of_one_micro_batch(two_ranks, reshard_after_forward):
    """Each of a rank's 8 rows forwarded and differentiated on its own (gradients accumulated,
    FSDP2 reduce-scattering every backward) against one forward and backward of all 8: the same
    weights and statistics. With reshard_after_forward false, prompts are shared within a micro-batch
    and the layers stay gathered over the micro-batches."""
    whole, rows = (two_ranks[f"{kind}-{reshard_after_forward}"] for kind in ("reshard", "micro"))
    diff = max((whole["weights"][k] - rows["weights"][k]).abs().max().item() for k in whole["weights"])
    print(f"max |micro 1 - micro 16| = {diff:.2e}")
    assert diff < 1e-5, diff  # Adam (lr 1e-2) magnifies the rounding of its smallest gradients
    assert rows["stats"] == pytest.approx(whole["stats"], rel=1e-5, abs=1e-6)


def test_ddp_with_one_row_micro_batches_gives_the_same_update(model_dir, one_rank, two_ranks):
    """DDP skips the all-reduce (no_sync) in every micro-batch's backward but the last: the
    accumulated gradients are still averaged over the ranks, once."""
    assert_same_update(model_dir, one_rank, two_ranks["ddp-micro"])


def assert_same_update(model_dir, one_rank: dict, two_ranks: dict) -> None:
    results = {1: one_rank, 2: two_ranks}
    initial = LlamaForCausalLM.from_pretrained(model_dir).state_dict()
    one, two = results[1]["weights"], results[2]["weights"]
    moved = max((one[k] - initial[k]).abs().max().item() for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    assert moved > 1e-3, "the update must change the weights for the comparison to mean anything"
    print(f"max |2 ranks - 1 rank| = {diff:.2e}; max |update| = {moved:.2e}")
    assert diff < 1e-4, (diff, moved)
    for key in ("actor/pg_loss", "actor/kl", "actor/grad_norm"):
        assert results[1]["stats"][key] == pytest.approx(results[2]["stats"][key], abs=1e-5), key


def test_layers_kept_gathered_are_not_gathered_again_for_the_backward(two_ranks):
    resharding, keeping = (two_ranks[f"reshard-{r}"]["update_all_gathers"] for r in (True, False))
    print(f"all-gathers in the update: {resharding} resharding after forward, {keeping} keeping the layers")
    # Four forward+backward passes (2 epochs x 2 mini-batches): resharding gathers each layer again
    # for its backward; keeping them gathered does not.
    assert 0 < keeping < resharding, (keeping, resharding)
