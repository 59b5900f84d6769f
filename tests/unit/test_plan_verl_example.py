"""The plan of verl's published 70B GRPO example, on the GPUs it was published for.

verl lists the least hardware that GRPO of Qwen2-70B ran on as 32 H800 (80 GB) GPUs, with
examples/tuning/70b/qwen2-70b_grpo_32_h800_fsdp_vllm.sh (volcengine/verl, added by commit
c62e7ac7bc4469c49a3db8b94f9e436d3bf05a13, PR #983; last changed by
a31a8f251faacb38404fa0af7603c00f64a667bb, the same at b178a3cd56f58b2d502255daba591e92833930a7;
docs/perf/device_tuning.rst, "70B", tag MIN). Its settings: Qwen/Qwen2-72B-Instruct, the FSDP
backend with actor_rollout_ref.actor.fsdp_config.param_offload and optimizer_offload True (the
reference's param_offload too), gradient checkpointing, vLLM rollout with tensor_model_parallel_size
16 and gpu_memory_utilization 0.6, rollout.n 5, data.train_batch_size 1024 prompts of at most
max_prompt_length 512 tokens with max_response_length 512, ppo_mini_batch_size 256 (4 mini-batches),
use_kl_loss with kl_loss_coef 0.001 (low_var_kl), use_dynamic_bsz with ppo_max_token_len_per_gpu
24000, trainer.nnodes 4 x n_gpus_per_node 8.

Our config has no token-budgeted micro-batches: micro_batch_size_per_gpu counts sequences, and the
plan takes each as long as the longest prompt and response (1024 tokens). The example's micro-batch
holds at most 24000 tokens: 23 such sequences at worst. The plan fits 32 GPUs up to 18 of them
(18,432 tokens, 75.7 GB a GPU); 23 need 84.7 GB, more than the 90% the plan allows of an 80 GiB
GPU (77.3 GB) though less than the GPU. So the example fits as long as its micro-batches hold at
most 18,432 tokens: each GPU's share of a mini-batch is 256 x 5 / 32 = 40 sequences, one
micro-batch when they average at most 460 tokens. (In verl's own image the example also had
flash-attn's in-place cross-entropy and remove-padding, which our verl_trainer cannot turn on: its
logits would be 2 bytes a vocabulary entry where ours are the logits and the response rows'
log-softmax.) Before the plan counted verl's logits as our SFT engine's (an fp32 copy and its
gradient, 10 bytes an entry) and one recomputed layer on top of them, the update needed 117.8 GB at
23 sequences and fitted at most 10.
"""

from __future__ import annotations

import json

import pytest

from analysis.memory import Site, grpo_footprint
from analysis.model_shape import shape_from_hf_config
from analysis.plan import GIB, GPU_USABLE, Machine, engine_layout, fits
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


def example_stage(micro_batch_size_per_gpu: int) -> GRPOStage:
    verl = VerlConfig(
        backend="fsdp",
        rollout="vllm",
        rollout_tp=16,
        gpu_memory_utilization=0.6,
        max_prompt_length=512,
        param_offload=True,
        optimizer_offload=True,
        micro_batch_size_per_gpu=micro_batch_size_per_gpu,
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
def plan_at(tmp_path_factory):
    """(micro-batch, GPUs) -> the example's footprint."""
    path = tmp_path_factory.mktemp("qwen2-72b") / "config.json"
    path.write_text(json.dumps(QWEN2_72B))
    shape = shape_from_hf_config(path)
    assert round(shape.params() / 1e9, 1) == 72.7  # Qwen2-72B's published size
    site = Site(NODE.gpu_bytes, NODE.gpus_per_node, runtime_per_rank=4e9)

    def plan(micro: int, gpus: int = GPUS):
        stage = example_stage(micro)
        return grpo_footprint(shape, stage, engine_layout(stage, gpus), site)

    return plan


def test_the_example_fits_32_gpus_of_80_gb_with_micro_batches_of_up_to_18_full_sequences(plan_at):
    fp = plan_at(18)
    assert fits(fp, NODE) and not fp.refusals
    assert fp.peak_phase() == "training"
    assert fp.gpu_bytes() / 1e9 == pytest.approx(75.66, abs=0.01)
    assert not fits(plan_at(19), NODE)


def test_its_token_budgets_worst_case_needs_more_than_the_plan_allows_less_than_the_gpu(plan_at):
    """23 sequences of 1024 tokens (23,552 of the 24,000): every phase fits but the update's."""
    fp = plan_at(23)
    phases = fp.phase_bytes()
    assert GPU_USABLE * NODE.gpu_bytes < phases["training"] < NODE.gpu_bytes
    assert phases["training"] / 1e9 == pytest.approx(84.71, abs=0.01)
    assert all(b <= GPU_USABLE * NODE.gpu_bytes for p, b in phases.items() if p != "training")


def test_it_does_not_fit_16_gpus(plan_at):
    """verl lists 32 GPUs as the least: on 16 the actor's fp32 states and gradients alone, 16 bytes
    a parameter over 16 GPUs, are 73 GB of the 77 GB."""
    assert not fits(plan_at(1, gpus=16), NODE)
