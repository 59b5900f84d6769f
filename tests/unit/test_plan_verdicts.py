"""`hpcr1 plan`'s three verdict tiers on hand-computed small cases, one engine at a time: the bytes
of a tiny Llama's stage are written out here from the formulas' terms (ASSUMPTIONS), and the GPU's
memory is placed so that the peak fills half of usable memory (fits), 94.5% of it (fits with a
caveat: above 90%), or 105% (does not fit); a configured offload is a caveat at any size.

Usable memory is GPU_USABLE of the GPU; host memory is made large enough not to matter, except where
a test is about it."""

import math

import pytest

from analysis import plan_search
from analysis.memory import Site
from analysis.model_shape import LlamaShape
from analysis.plan import (
    CAVEAT,
    FITS,
    GPU_USABLE,
    HOST_USABLE,
    NO_FIT,
    RUNTIME_PER_RANK,
    Machine,
    Option,
    evaluate,
    plan_stage,
)
from core.config import (
    EvalConfig,
    GRPOStage,
    ParallelConfig,
    RunConfig,
    SFTStage,
    SynthStage,
    VerlConfig,
    VerlRolloutConfig,
)

L, H, A, KV_HEADS, D, F, V = 2, 64, 4, 2, 16, 128, 256
KV = KV_HEADS * D
LAYER = 2 * H * A * D + 2 * H * KV + 3 * H * F + 2 * H  # q, o; k, v; gate, up, down; two norms
P = L * LAYER + 2 * V * H + H  # layers, input and output embeddings, the final norm
SHAPE = LlamaShape(L, H, A, KV_HEADS, D, F, V, False, 1e4, None, file_bytes=2)
GPUS, PER_NODE, PROMPT = 4, 4, 8
ROOMY_HOST = 1e15
# (share of usable GPU memory the peak fills, verdict, caveats)
TIERS = [
    (0.5, FITS, ()),
    (0.945, CAVEAT, ("95% of usable GPU memory",)),  # rounded up: never "90%"
    (1.05, NO_FIT, ()),
]


def gpu_for(peak: float, share: float) -> float:
    """The GPU memory whose usable part `peak` fills to `share`."""
    return peak / (GPU_USABLE * share)


def judged(stage, gpu_bytes: float, host_bytes: float = ROOMY_HOST, eval_cfg=None) -> Option:
    """The stage as configured, on GPUS GPUs of `gpu_bytes` each."""
    machine = Machine("hand", "GPU", gpu_bytes, PER_NODE, host_bytes)
    site = Site(gpu_bytes, PER_NODE, RUNTIME_PER_RANK, PROMPT, eval_cfg or EvalConfig())
    return evaluate(stage, SHAPE, site, machine, GPUS, plan_search.configured(stage))


def verdict_of(option: Option) -> tuple[str, tuple[str, ...]]:
    return option.verdict, option.caveats


def test_the_hand_computed_parameter_count_is_the_shapes():
    assert SHAPE.params() == P == 106_816


def activations(b: int, s: int, c: int, scores: bool, recompute: bool) -> float:
    """TP 1: saved per layer (6h + 2kv + 4f, with unfused attention's 2·a·s), or with recomputation
    each layer's input and one layer's; the logits with their fp32 copy and gradient (c + 8)."""
    layer = b * s * c * (6 * H + 2 * KV + 4 * F + (2 * A * s if scores else 0))
    kept = L * b * s * c * H + layer if recompute else L * layer
    return kept + b * s * V * (c + 8)


# SFT: bf16 (2-byte weights and gradients, 12 bytes of fp32 master and Adam a parameter), TP 1,
# ZeRO-1 over dp = 4; its native final eval (2·P and one short sequence's KV) is far smaller.
SFT = SFTStage(
    dtype="bf16",
    micro_batch_size=2,
    global_batch_size=8,
    max_seq_len=64,
    parallel=ParallelConfig(tp=1, zero_stage=1),
)
SFT_EVAL = EvalConfig(batch_size=1, max_new_tokens=8)
SFT_PEAK = 2 * P + 2 * P + 12 * P / GPUS + activations(2, 64, 2, scores=True, recompute=False)


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_sft_tiers(share, verdict, caveats):
    option = judged(SFT, gpu_for(SFT_PEAK, share), eval_cfg=SFT_EVAL)
    assert option.footprint.peak_phase() == "training"
    assert option.footprint.gpu_bytes() == pytest.approx(SFT_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


def test_sft_fits_only_with_offload_where_no_layout_without_it_fits():
    """SFT's config cannot ask for offload: the search finds it and names it a caveat. On 2 GPUs
    with a global batch of 2, the leanest layout without offload is TP 2 (dp 1) with recomputation,
    one sequence: P (weights) + P (gradients) + 6·P (optimizer, 12·P/tp) + each layer's input, one
    layer's activations at TP 2 and half the logits. The first with offload is TP 1, ZeRO-1 over
    dp 2: 2·P + 2·P and no optimizer on the GPU, one sequence's activations."""
    stage = SFT.model_copy(update={"global_batch_size": 2, "micro_batch_size": 1})
    s, c = 64, 2
    tp2_layer = s * c * (4 * H + (2 * H + 2 * KV + 4 * F + 2 * A * s) / 2)
    leanest = 8 * P + L * s * c * H + tp2_layer + s * V * (c + 8) / 2
    offloaded = 4 * P + activations(1, s, c, scores=True, recompute=False)
    assert offloaded < leanest
    usable = (offloaded + leanest) / 2
    cfg = RunConfig(name="hand", nproc=2, eval=SFT_EVAL, stage1_sft=stage)
    machine = Machine("hand", "GPU", usable / GPU_USABLE, PER_NODE, ROOMY_HOST)
    option = plan_stage("stage1_sft", stage, cfg, SHAPE, machine, [2], PROMPT).options[0]
    assert option.layout.offload and (option.layout.tp, option.layout.zero) == (1, 1)
    assert option.footprint.gpu_bytes() == pytest.approx(offloaded, rel=1e-12)
    share = offloaded / usable
    assert verdict_of(option) == (
        CAVEAT,
        ("optimizer offload (no SFT option yet)", f"{math.ceil(100 * share)}% of usable GPU memory"),
    )
    # a little more memory and the leanest layout without offload fits: recomputation, a caveat too
    roomier = Machine("hand", "GPU", 1.01 * leanest / GPU_USABLE, PER_NODE, ROOMY_HOST)
    option = plan_stage("stage1_sft", stage, cfg, SHAPE, roomier, [2], PROMPT).options[0]
    assert not option.layout.offload and option.layout.recompute
    assert option.caveats[0] == "recompute (no SFT option yet)"


# GRPO on verl's FSDP backend: fp32 actor 4 + 4 + 8 bytes a parameter over N, the gathered root unit
# (embeddings and one layer in bf16), verl's gradient checkpointing for 16 sequences of 128 tokens.
# With gmu 0.1 the rollout's share stays below the update's peak.
GATHERED = (2 * V * H + LAYER) * 2
VERL = VerlConfig(rollout_tp=1, gpu_memory_utilization=0.1, micro_batch_size_per_gpu=16, max_prompt_length=64)
VERL_GRPO = GRPOStage(engine="verl", verl=VERL, max_new_tokens=64, prompts_per_step=16, group_size=2)
VERL_PEAK = 16 * P / GPUS + GATHERED + activations(16, 128, 2, scores=False, recompute=True)


def with_verl(stage: GRPOStage, **settings) -> GRPOStage:
    return stage.model_copy(update={"verl": stage.verl.model_copy(update=settings)})


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_grpo_on_verl_fsdp_tiers(share, verdict, caveats):
    option = judged(VERL_GRPO, gpu_for(VERL_PEAK, share))
    assert option.footprint.peak_phase() == "training" and not option.footprint.refusals
    assert option.footprint.gpu_bytes() == pytest.approx(VERL_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


@pytest.mark.parametrize(
    "settings, caveat",
    [
        ({"optimizer_offload": True}, "optimizer offload"),
        ({"param_offload": True}, "param offload"),
        ({"param_offload": True, "optimizer_offload": True}, "param+optimizer offload"),
    ],
)
def test_grpo_on_verl_fsdp_with_offload_configured_fits_with_that_caveat(settings, caveat):
    """The update loads the offloaded states back: the same peak, half of usable, and the caveat."""
    option = judged(with_verl(VERL_GRPO, **settings), gpu_for(VERL_PEAK, 0.5))
    assert option.footprint.gpu_bytes() == pytest.approx(VERL_PEAK, rel=1e-12)
    assert verdict_of(option) == (CAVEAT, (caveat,))


# GRPO on verl's megatron backend at TP 2 x PP 2 (dp 1): bf16 parameters 2·P/4, fp32 gradients
# 4·P/4, the distributed optimizer's 12·P/4, the reference's bf16 2·P/4 kept on the GPU, every
# layer's activations (no recomputation) and the logits, split over TP by sequence parallelism.
MEGATRON_GRPO = with_verl(
    VERL_GRPO, backend="megatron", megatron_tp=2, megatron_pp=2, gpu_memory_utilization=0.05
)
MEGATRON_ACTIVATIONS = activations(16, 128, 2, scores=False, recompute=False) / 2
MEGATRON_PEAK = (2 + 4 + 12 + 2) * P / 4 + MEGATRON_ACTIVATIONS


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_grpo_on_verl_megatron_tiers(share, verdict, caveats):
    option = judged(MEGATRON_GRPO, gpu_for(MEGATRON_PEAK, share))
    assert option.layout.megatron and (option.layout.tp, option.layout.pp, option.layout.dp) == (2, 2, 1)
    assert option.footprint.peak_phase() == "training" and not option.footprint.refusals
    assert option.footprint.gpu_bytes() == pytest.approx(MEGATRON_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


def test_grpo_on_verl_megatron_with_param_offload_fits_with_that_caveat():
    """param_offload moves the reference's parameters off the GPU for the update, too."""
    peak = (2 + 4 + 12) * P / 4 + MEGATRON_ACTIVATIONS
    option = judged(with_verl(MEGATRON_GRPO, param_offload=True), gpu_for(peak, 0.5))
    assert option.footprint.gpu_bytes() == pytest.approx(peak, rel=1e-12)
    assert verdict_of(option) == (CAVEAT, ("param offload",))


# Native GRPO (FSDP2 over 4 ranks, layers resharded): native_fit's 20·P/N + 8·P, the gathered root
# unit, fp32 activations of 4 rows (16 prompts x 2 / 4 ranks / 2 mini-batches) of 8 + 64 tokens, the
# fp32 KV cache of the rank's 8 sequences; all at once. It has no offload: no offload tier.
NATIVE_GRPO = GRPOStage(prompts_per_step=16, group_size=2, mini_batches=2, micro_batch_size=16)
NATIVE_S = PROMPT + 64
NATIVE_PEAK = (
    20 * P / GPUS
    + 8 * P
    + (2 * V * H + LAYER) * 2
    + activations(4, NATIVE_S, 4, scores=False, recompute=False)
    + 2 * L * KV * NATIVE_S * 4 * 8
)


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_native_grpo_tiers(share, verdict, caveats):
    option = judged(NATIVE_GRPO, gpu_for(NATIVE_PEAK, share))
    assert option.footprint.gpu_bytes() == pytest.approx(NATIVE_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


# Native synthesis: one whole fp32 copy a rank and the fp32 KV cache of 2 x 4 sequences of 8 + 64.
NATIVE_SYNTH = SynthStage(batch_size=2, samples_per_prompt=4, max_new_tokens=64)
SYNTH_PEAK = 4 * P + 2 * L * KV * NATIVE_S * 4 * 8


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_native_synthesis_tiers(share, verdict, caveats):
    option = judged(NATIVE_SYNTH, gpu_for(SYNTH_PEAK, share))
    assert option.footprint.gpu_bytes() == pytest.approx(SYNTH_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_synthesis_on_verl_tiers_by_its_share_of_the_gpu(share, verdict, caveats):
    """vLLM takes gmu·M whatever M is: the share of usable memory is gmu / GPU_USABLE, so the tier
    moves with gmu, not with the GPU; no training states, so no offload tier either."""
    gmu = share * GPU_USABLE
    stage = SynthStage(engine="verl", verl=VerlRolloutConfig(rollout_tp=1, gpu_memory_utilization=gmu))
    option = judged(stage, 1e9)
    assert option.footprint.gpu_bytes() == pytest.approx(gmu * 1e9, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


def test_host_memory_above_90_percent_of_usable_is_a_caveat_and_beyond_usable_no_fit():
    """Native synthesis's node: 4 ranks' runtime and each rank's read of the whole checkpoint."""
    host = GPUS * RUNTIME_PER_RANK + GPUS * P * SHAPE.file_bytes
    gpu = gpu_for(SYNTH_PEAK, 0.5)
    assert verdict_of(judged(NATIVE_SYNTH, gpu, host / HOST_USABLE / 0.5)) == (FITS, ())
    near = judged(NATIVE_SYNTH, gpu, host / HOST_USABLE / 0.945)
    assert verdict_of(near) == (CAVEAT, ("95% of usable host memory",))
    assert verdict_of(judged(NATIVE_SYNTH, gpu, host / HOST_USABLE / 1.05)) == (NO_FIT, ())
