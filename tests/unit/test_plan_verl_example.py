"""The plan of verl's published 70B GRPO example, on the GPUs it was published for.

verl lists the least hardware that GRPO of Qwen2-70B ran on as 32 H800 (80 GB) GPUs, with
examples/tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh (volcengine/verl, added by commit
c62e7ac7bc4469c49a3db8b94f9e436d3bf05a13, PR #983; last changed by
a31a8f251faacb38404fa0af7603c00f64a667bb, the same at b178a3cd56f58b2d502255daba591e92833930a7;
docs/perf/device_tuning.rst, "70B", tag MIN). Its settings: Qwen/Qwen2-72B-Instruct, the FSDP
backend with actor_rollout_ref.actor.fsdp_config.param_offload and optimizer_offload True (the
reference's param_offload too), gradient checkpointing, use_remove_padding True (flash-attn), vLLM
rollout with tensor_model_parallel_size 16 and gpu_memory_utilization 0.6, rollout.n 5,
data.train_batch_size 1024 prompts of at most max_prompt_length 512 tokens with
max_response_length 512, ppo_mini_batch_size 256 (4 mini-batches), use_kl_loss with kl_loss_coef
0.001 (low_var_kl), use_dynamic_bsz with ppo_max_token_len_per_gpu 24000, trainer.nnodes 4 x
n_gpus_per_node 8. Ours: verl.max_tokens_per_gpu 24000 and verl.remove_padding true.

A GPU's share of a mini-batch is 256 x 5 / 32 = 40 sequences of at most 1024 tokens; verl packs
them into the fewest balanced micro-batches of at most 24,000 tokens, so at worst one micro-batch
holds 24,000. Then the update needs 82.7 GB a GPU: less than the 85.9 GB of an 80 GiB GPU, more
than the 90% the plan calls usable (77.3 GB). With a budget of 20,480 tokens the example's own
settings fit (76.9 GB, with the offload caveat); GSM8K's 40 sequences of a few hundred tokens each
stay below that, which is why the example runs with 24,000. The plan at 32 GPUs for the example's
model and batch fits without a caveat: no offload, vLLM over 8 GPUs at gmu 0.4, 10,240 tokens.
"""

from __future__ import annotations

import json
from functools import partial

import pytest

from analysis import plan_search
from analysis.memory import Site, grpo_footprint
from analysis.model_shape import shape_from_hf_config
from analysis.plan import (
    CAVEAT,
    FITS,
    GIB,
    GPU_USABLE,
    NO_FIT,
    RUNTIME_PER_RANK,
    Machine,
    Option,
    choose,
    engine_layout,
    evaluate,
    searched,
)
from core.config import GRPOStage, VerlConfig

# Qwen/Qwen2-72B-Instruct's config.json, the fields the plan reads (its QKV biases, 0.8M
# parameters, are not counted).
QWEN2_72B = {
    "architectures": ["Qwen2ForCausalLM"],
    "hidden_size": 8192,
    "intermediate_size": 29568,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "vocab_size": 152064,
    "max_position_embeddings": 32768,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}
# 80 GiB GPUs, 4 a node; host memory as the example's 8-GPU H800 nodes have (rank 0 builds the
# whole fp32 model, 291 GB, before sharding it: the first node needs 452 GB).
NODE = Machine("h800-4", "H800", 80 * GIB, 4, 1024 * GIB)
GPUS = 32


def example_stage(max_tokens_per_gpu: int = 24000) -> GRPOStage:
    verl = VerlConfig(
        backend="fsdp",
        rollout="vllm",
        rollout_tp=16,
        gpu_memory_utilization=0.6,
        max_prompt_length=512,
        param_offload=True,
        optimizer_offload=True,
        max_tokens_per_gpu=max_tokens_per_gpu,
        remove_padding=True,
    )
    return GRPOStage(
        engine="verl",
        verl=verl,
        prompts_per_step=1024,
        group_size=5,
        max_new_tokens=512,
        mini_batches=4,
        kl_coef=0.001,
        kl_type="low_var_kl",
    )


@pytest.fixture(scope="module")
def shape(tmp_path_factory):
    path = tmp_path_factory.mktemp("qwen2-72b") / "config.json"
    path.write_text(json.dumps(QWEN2_72B))
    shape = shape_from_hf_config(path)
    assert round(shape.params() / 1e9, 1) == 72.7  # Qwen2-72B's published size
    return shape


SITE = Site(NODE.gpu_bytes, NODE.gpus_per_node, runtime_per_rank=RUNTIME_PER_RANK)


def footprint(shape, stage: GRPOStage, gpus: int = GPUS):
    return grpo_footprint(shape, stage, engine_layout(stage, gpus), SITE)


def hand_update_bytes(shape, tokens: int, gpus: int = GPUS) -> float:
    """The update written out: the fp32 actor's weights, gradients and Adam states loaded back
    (16 bytes a parameter over the GPUs), the gathered root unit (both embeddings and one layer, in
    bf16), each layer's bf16 input for `tokens` packed tokens, and the larger of one layer
    recomputed and the packed logits (flash-attn's cross-entropy keeps no gradient of its own)."""
    h, V, L = QWEN2_72B["hidden_size"], QWEN2_72B["vocab_size"], QWEN2_72B["num_hidden_layers"]
    kv = QWEN2_72B["num_key_value_heads"] * h // QWEN2_72B["num_attention_heads"]
    f = QWEN2_72B["intermediate_size"]
    layer_params = h * h * 2 + h * kv * 2 + 3 * h * f + 2 * h
    gathered = (2 * V * h + layer_params) * 2
    one_layer = tokens * 2 * (6 * h + 2 * kv + 4 * f)
    activations = L * tokens * 2 * h + max(one_layer, tokens * V * 2)
    return 16 * shape.params() / gpus + gathered + activations


def test_at_its_budgets_worst_case_the_example_needs_more_than_usable_less_than_the_gpu(shape):
    """24,000 packed tokens in one micro-batch: every phase fits but the update's."""
    fp = footprint(shape, example_stage())
    phases = fp.phase_bytes()
    assert fp.peak_phase() == "training" and not fp.refusals
    assert phases["training"] == pytest.approx(hand_update_bytes(shape, 24000), rel=1e-9)
    assert phases["training"] / 1e9 == pytest.approx(82.68, abs=0.01)
    assert GPU_USABLE * NODE.gpu_bytes < phases["training"] < NODE.gpu_bytes
    assert all(b <= GPU_USABLE * NODE.gpu_bytes for p, b in phases.items() if p != "training")


def test_a_budget_above_the_gpus_share_of_a_mini_batch_packs_only_that_share(shape):
    """40 sequences of 1024 tokens are 40,960: a budget of 50,000 holds no more than that."""
    assert footprint(shape, example_stage(50000)).phase_bytes()["training"] == pytest.approx(
        hand_update_bytes(shape, 40960), rel=1e-9
    )


def searched_at(shape, stage: GRPOStage, gpus: int) -> Option:
    """What `hpcr1 plan` chooses for the stage at `gpus` (plan.plan_stage's search)."""
    judged = partial(evaluate, stage, shape, SITE, NODE, gpus)
    return choose(searched(plan_search.groups(stage, shape, gpus, NODE.gpus_per_node), judged))


def test_the_plan_for_the_examples_model_and_batch_fits_32_gpus_of_80_gb(shape):
    """The search keeps the example's model, batch and 32 GPUs and varies what verl's tuning guides
    vary: without offload, with vLLM over 8 GPUs at gmu 0.4 and micro-batches of 10,240 tokens,
    every phase stays within 90% of usable memory."""
    option = searched_at(shape, example_stage(), GPUS)
    assert option.verdict == FITS and not option.caveats
    settings = option.settings
    assert not settings["verl.param_offload"] and not settings["verl.optimizer_offload"]
    assert settings["verl.max_tokens_per_gpu"] == 10 * 1024
    assert option.footprint.phase_bytes()["training"] == pytest.approx(
        hand_update_bytes(shape, 10240), rel=1e-9
    )


def test_with_the_examples_own_offload_and_rollout_a_budget_of_20_whole_sequences_fits(shape):
    """Only the token budget lowered from 24,000 to 20,480: within usable, above 90% of it, and
    the example's offload: fits with both caveats."""
    stage = example_stage(20 * 1024)
    option = evaluate(stage, shape, SITE, NODE, GPUS, plan_search.configured(stage))
    assert option.verdict == CAVEAT
    assert option.caveats == ("param+optimizer offload", "100% of usable GPU memory")
    assert option.footprint.gpu_bytes() == pytest.approx(hand_update_bytes(shape, 20480), rel=1e-9)


def test_it_does_not_fit_16_gpus(shape):
    """verl lists 32 GPUs as the least: on 16 the actor's fp32 states and gradients alone, 16 bytes
    a parameter over 16 GPUs, are 73 GB of the 77 GB, and one sequence's activations do not fit
    beside them."""
    assert searched_at(shape, example_stage(), 16).verdict == NO_FIT
