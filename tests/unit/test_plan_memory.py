"""The planner's training-memory formulas: against the peak resident memory of real AdamW steps of
a Llama-shaped model on this CPU (fp32, one rank), measured in a fresh process; and DeepSpeed's and
verl's FSDP phases against hand-computed figures, with DeepSpeed's defaults they rest on read from
DeepSpeed itself. (Against the engines on the emulated accelerator: bench/plan_vs_engines.py and
tests/dist/test_plan_vs_engines.py.)"""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from analysis.memory import (
    DEEPSPEED_BUCKET,
    FP32,
    Layout,
    Site,
    activations,
    grpo_footprint,
    reduce_buffers,
    sft_footprint,
    sft_stage_footprint,
    stage_params,
    training_states,
)
from analysis.model_shape import LlamaShape
from core.config import GRPOStage, SFTStage, VerlConfig

MODEL = {
    "vocab_size": 32000,
    "hidden_size": 512,
    "num_hidden_layers": 8,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "intermediate_size": 1408,
    "tie_word_embeddings": False,
}
SHAPE = LlamaShape(
    layers=8,
    hidden=512,
    heads=8,
    kv_heads=4,
    head_dim=64,
    ffn=1408,
    vocab=32000,
    tied_embeddings=False,
    rope_theta=10000.0,
    rope_scaling=None,
    file_bytes=4,
)
BATCH, SEQ = 8, 256
TOLERANCE = 0.25


def measure() -> dict:
    script = Path(__file__).with_name("measure_train_step.py")
    out = subprocess.run(
        [sys.executable, str(script), json.dumps(MODEL), str(BATCH), str(SEQ)],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(out.stdout)


def test_states_and_step_peaks_match_the_formulas_within_25_percent():
    measured = measure()
    assert measured["params"] == SHAPE.params()  # the formula's P is the model's own count
    states = sum(t.bytes for t in training_states(SHAPE.params(), FP32, Layout(gpus=1, tp=1, zero=0)))
    step = (
        states
        + activations(SHAPE, BATCH, SEQ, FP32.compute, tp=1, attention_scores=False, recompute=False).bytes
    )
    for name, formula in (("states_peak_bytes", states), ("step_peak_bytes", step)):
        ratio = measured[name] / formula
        print(
            f"{name}: measured {measured[name] / 1e6:.0f} MB, "
            f"formula {formula / 1e6:.0f} MB, ratio {ratio:.3f}"
        )
        assert abs(ratio - 1) <= TOLERANCE, (name, ratio)


P = SHAPE.params()  # 56.4M: fewer gradients than a DeepSpeed bucket holds
B = 500_000_000  # DeepSpeed's reduce_bucket_size
SITE = Site(gpu_bytes=80e9, gpus_per_node=4, runtime_per_rank=0.0)


def sft_phases(dtype: str, zero: int, gpus: int = 4, offload: bool = False, shape=SHAPE) -> dict[str, float]:
    stage = SFTStage(dtype=dtype, micro_batch_size=1, max_seq_len=64, parallel={"zero_stage": zero})
    fp = sft_footprint(shape, stage, Layout(gpus, 1, zero, offload), SITE)
    terms = {t.name: t.bytes for t in fp.gpu}
    return {**fp.phase_bytes(), **terms}


@pytest.mark.parametrize(
    "zero, training_beside_weights_and_states, step_beside_weights_and_states",
    [
        # whole bf16 gradients, the all-reduce's flat copy of them; the step: every parameter's bf16
        # gradient, its fp32 copy, AdamW's sqrt(v) (6 + 4 bytes)
        (0, 2 * P + 2 * P, 10 * P),
        # whole bf16 gradients, the 5e8-element bf16 bucket; the step on a quarter of them
        (1, 2 * P + 2 * B, 10 * P / 4),
        # a quarter of the bf16 gradients, the bucket and its flat copy of every gradient
        (2, 2 * P / 4 + 2 * B + 2 * P, 10 * P / 4),
    ],
)
def test_deepspeed_bf16_phases_hold_its_buckets_and_its_step_partitions(
    zero, training_beside_weights_and_states, step_beside_weights_and_states
):
    found = sft_phases("bf16", zero)
    weights_and_states = 2 * P + 12 * P / (4 if zero else 1)  # fp32 master + m + v, over dp from ZeRO-1
    assert found["weights"] + found["optimizer"] == pytest.approx(weights_and_states)
    training = weights_and_states + training_beside_weights_and_states + found["activations"]
    assert found["training"] == pytest.approx(training)
    assert found["optimizer_step"] == pytest.approx(weights_and_states + step_beside_weights_and_states)


def test_deepspeed_fp32_keeps_a_master_partition_of_its_own_from_zero_1():
    zero0, zero1 = sft_phases("fp32", 0), sft_phases("fp32", 1)
    # ZeRO-0 is torch's AdamW on the weights (m, v); ZeRO-1 steps its own fp32 partition
    assert (zero0["optimizer"], zero1["optimizer"]) == (pytest.approx(8 * P), pytest.approx(12 * P / 4))
    # ZeRO-0's step holds the fp32 gradients and sqrt(v); ZeRO-1's the partition's gradients, their
    # flat copy and sqrt(v)
    assert zero0["optimizer_step"] == pytest.approx(4 * P + 8 * P + 4 * P + 4 * P)
    assert zero1["optimizer_step"] == pytest.approx(4 * P + 12 * P / 4 + 12 * P / 4)
    assert zero1["reduce_buffers"] == 4 * B  # the bucket is in the gradients' dtype


def test_a_model_larger_than_a_bucket_reduces_bucket_by_bucket():
    big = LlamaShape(**{**SHAPE.__dict__, "layers": 400})  # 1.2B parameters, more than 5e8
    assert big.params() > B
    assert sft_phases("bf16", 0, shape=big)["reduce_buffers"] == 2 * B  # a flat copy of one chunk
    assert sft_phases("bf16", 2, shape=big)["reduce_buffers"] == 2 * B + 2 * B  # the bucket, its copy


def test_deepspeed_offload_steps_on_the_host():
    found = sft_phases("bf16", 2, offload=True)
    assert found["optimizer"] == found["step_gradients"] == found["step_temporary"] == 0
    assert found["optimizer_step"] == found["weights"]


def test_the_deepspeed_the_model_assumes_is_the_one_our_engine_configures():
    """The bucket size, overlap and gradient dtype are DeepSpeed's defaults, which our
    deepspeed_config leaves alone."""
    from deepspeed.runtime.engine import MEMORY_OPT_ALLREDUCE_SIZE
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from stages.engines.megatron_deepspeed import deepspeed_config

    assert DEEPSPEED_BUCKET == B == MEMORY_OPT_ALLREDUCE_SIZE
    for zero in (1, 2):
        defaults = DeepSpeedZeroConfig(stage=zero)
        assert defaults.reduce_bucket_size == B and defaults.contiguous_gradients
        assert not defaults.overlap_comm and defaults.use_multi_rank_bucket_allreduce
    config = deepspeed_config(SFTStage(dtype="bf16", micro_batch_size=1, global_batch_size=2), dp_size=2)
    assert config["zero_optimization"] == {"stage": 1, "overlap_comm": False} and "data_types" not in config


@pytest.mark.parametrize("zero, added", [(0, 0), (1, 2 * B), (2, 2 * B)])
def test_overlap_comm_adds_deepspeeds_second_gradient_bucket_under_zero_1_and_2(zero, added):
    """setup_buckets allocates buf_1 of B elements beside buf_0 when overlap_comm is on (bf16: 2 bytes)."""
    grads = 3 * B  # more gradients than a bucket: the flattened copy is a whole bucket too
    plain, overlapped = (reduce_buffers(grads, 2, zero, overlap).bytes for overlap in (False, True))
    assert overlapped - plain == added


def pipeline_phases(pp: int, stage: int, micro_steps: int) -> dict[str, float]:
    """bf16 ZeRO-1 SFT on pp GPUs (dp = 1), micro_steps micro-batches of one 64-token sequence a step."""
    sft = SFTStage(dtype="bf16", micro_batch_size=1, global_batch_size=micro_steps, max_seq_len=64)
    fp = sft_stage_footprint(SHAPE, sft, Layout(pp, 1, 1, pp=pp), SITE, stage)
    return {**fp.phase_bytes(), **{t.name: t.bytes for t in fp.gpu}}


def test_pipeline_stages_hold_their_layers_and_1f1b_keeps_the_first_stage_busiest():
    """Each stage L/pp layers, the embedding on the first, the output layer and final norm on the
    last; 1F1B keeps min(pp - stage, M) micro-batches' activations in flight, the logits on the last
    stage only; without a contiguous bucket ZeRO-1 reduces a flat copy and steps a flat fp32 copy."""
    layer, vh = SHAPE.layer_params(), SHAPE.vocab * SHAPE.hidden
    assert [stage_params(SHAPE, 4, i) for i in range(4)] == [
        2 * layer + vh,
        2 * layer,
        2 * layer,
        2 * layer + vh + 512,
    ]
    assert sum(stage_params(SHAPE, 8, i) for i in range(8)) == stage_params(SHAPE, 1, 0) == P
    one = activations(SHAPE, 1, 64, 2, 1, True, False, held=(1, "1"), logits=False).bytes
    logits = activations(SHAPE, 1, 64, 2, 1, True, False, megatron_loss=True).bytes - SHAPE.layers * one
    first, last = pipeline_phases(4, 0, 8), pipeline_phases(4, 3, 8)
    assert first["activations"] == pytest.approx(4 * 2 * one)  # pp micro-batches of 2 layers
    assert last["activations"] == pytest.approx(2 * one + logits)
    assert pipeline_phases(4, 0, 3)["activations"] == pytest.approx(3 * 2 * one)  # M < pp
    Pf = 2 * layer + vh
    assert first["reduce_buffers"] == 2 * Pf and first["step_gradients"] == 4 * Pf
    # the plan counts the heavier stage: here the last, whose logits outweigh 3 more micro-batches
    sft = SFTStage(dtype="bf16", micro_batch_size=1, global_batch_size=8, max_seq_len=64)
    planned = sft_footprint(SHAPE, sft, Layout(4, 1, 1, pp=4), SITE)
    assert last["training"] > first["training"] and planned.phase_bytes()["training"] == last["training"]


def test_pipeline_stages_run_deepspeed_without_contiguous_gradients_as_the_model_assumes():
    from stages.engines.megatron_deepspeed import deepspeed_config

    stage = SFTStage(micro_batch_size=1, global_batch_size=2, parallel={"pp": 2, "zero_stage": 1})
    assert deepspeed_config(stage, dp_size=1)["zero_optimization"]["contiguous_gradients"] is False


def test_verl_fsdp_optimizer_step_holds_the_actor_states_and_adams_temporary():
    """fp32 weights, gradients, m and v, and sqrt(v), all over N; loaded back for it when offloaded."""
    n = 8
    for offload in (False, True):
        verl = VerlConfig(rollout_tp=4, param_offload=offload, optimizer_offload=offload)
        layout = Layout(n, 1, 3, offload, True, offload)
        fp = grpo_footprint(SHAPE, GRPOStage(engine="verl", verl=verl), layout, SITE)
        assert fp.phase_bytes()["optimizer_step"] == pytest.approx((4 + 4 + 8 + 4) * P / n)


def test_verl_fsdp_activations_keep_layer_inputs_and_the_larger_of_a_layer_and_the_logits():
    """Each layer's input in bf16; the padded bf16 logits, the copy of the sequences' rows verl
    takes log-probabilities of and their log-softmax (3·s rows a full-length sequence) outweigh one
    recomputed layer for this vocabulary."""
    b, prompt, r = 4, 256, 256
    s = prompt + r
    verl = VerlConfig(rollout_tp=4, max_prompt_length=prompt, micro_batch_size_per_gpu=b)
    fp = grpo_footprint(SHAPE, GRPOStage(engine="verl", max_new_tokens=r, verl=verl), Layout(8, 1, 3), SITE)
    found = {t.name: t.bytes for t in fp.gpu}["activations"]
    layer_inputs = 8 * b * s * 2 * 512
    one_layer = b * s * 2 * (6 * 512 + 2 * 256 + 4 * 1408)
    logits = 3 * b * s * 32000 * 2
    assert logits > one_layer
    assert found == layer_inputs + logits


def test_an_unpacked_token_budget_is_planned_at_its_worst_padding():
    """Without packing, a micro-batch of at most T tokens is padded to its longest sequence: at worst
    one of s tokens beside T - s one-token ones, b = T - s + 1 rows of s (capped by the GPU's share
    of a mini-batch); the logits' rows verl takes log-probabilities of are the T real tokens."""
    prompt, r, T = 256, 256, 1024
    s = prompt + r
    verl = VerlConfig(rollout_tp=4, max_prompt_length=prompt, max_tokens_per_gpu=T)
    stage = GRPOStage(engine="verl", max_new_tokens=r, prompts_per_step=512, group_size=8, verl=verl)
    fp = grpo_footprint(SHAPE, stage, Layout(8, 1, 3), SITE)
    b = T - s + 1  # 513 rows; the share is 512 / 2 x 8 / 8 = 256 sequences
    b = min(b, 256)
    padded = b * s
    expected = 8 * padded * 2 * 512 + max(
        padded * 2 * (6 * 512 + 2 * 256 + 4 * 1408), (padded + 2 * T) * 32000 * 2
    )
    assert {t.name: t.bytes for t in fp.gpu}["activations"] == expected
    packed = stage.model_copy(update={"verl": verl.model_copy(update={"remove_padding": True})})
    fp = grpo_footprint(SHAPE, packed, Layout(8, 1, 3), SITE)
    assert {t.name: t.bytes for t in fp.gpu}["activations"] == 8 * T * 2 * 512 + max(
        T * 2 * (6 * 512 + 2 * 256 + 4 * 1408), T * 32000 * 2
    )
