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
    HEADROOM,
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


def activations(b: int, s: int, c: int, scores: bool, recompute: bool, per_logit: int | None = None) -> float:
    """TP 1: saved per layer (6h + 2kv + 4f, with unfused attention's 2·a·s), or with recomputation
    each layer's input and one layer's; the logits with their fp32 copy and gradient (c + 8 bytes;
    `per_logit` where the loss holds otherwise: megatron's c + 4)."""
    layer = b * s * c * (6 * H + 2 * KV + 4 * F + (2 * A * s if scores else 0))
    kept = L * b * s * c * H + layer if recompute else L * layer
    return kept + b * s * V * (per_logit or c + 8)


# SFT: bf16 (2-byte weights and gradients, 12 bytes of fp32 master and Adam a parameter), TP 1,
# ZeRO-1 over dp = 4, and DeepSpeed's gradient bucket of 5e8 bf16 elements, whatever the model's
# size (ZeRO-1: the flattened copy takes the room of the gradients moved into it). Its optimizer
# step (weights, master and Adam, the partition's bf16 gradients, their fp32 copy and AdamW's
# sqrt(v): 2 + 4 + 4 bytes a stepped parameter, P/4 of them) and its native final eval (2·P and one
# short sequence's KV) are far smaller.
SFT = SFTStage(
    dtype="bf16",
    micro_batch_size=2,
    global_batch_size=8,
    max_seq_len=64,
    parallel=ParallelConfig(tp=1, zero_stage=1),
)
SFT_EVAL = EvalConfig(batch_size=1, max_new_tokens=8)
BUCKET = 5e8 * 2
SFT_PEAK = 2 * P + 2 * P + 12 * P / GPUS + BUCKET + activations(2, 64, 2, True, False, per_logit=2 + 4)
SFT_STEP = 2 * P + 12 * P / GPUS + (2 + 4 + 4) * P / GPUS


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_sft_tiers(share, verdict, caveats):
    option = judged(SFT, gpu_for(SFT_PEAK, share), eval_cfg=SFT_EVAL)
    assert option.footprint.peak_phase() == "training"
    assert option.footprint.gpu_bytes() == pytest.approx(SFT_PEAK, rel=1e-12)
    assert option.footprint.phase_bytes()["optimizer_step"] == pytest.approx(SFT_STEP, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


# Offload pays only where the states outweigh the 5e8-element gradient bucket that ZeRO 1-2 (which
# DeepSpeed's offload needs) allocate whatever the model's size: the tiny model's ZeRO-0 is leaner
# than any offload. So this test takes two layers of a wider Llama, P = 553.7M.
BL, BH, BA, B_KV_HEADS, BD, BF, BV = 2, 4096, 32, 8, 128, 8192, 32768
BKV = B_KV_HEADS * BD
B_LAYER = 2 * BH * BA * BD + 2 * BH * BKV + 3 * BH * BF + 2 * BH
BP = BL * B_LAYER + 2 * BV * BH + BH
BIG = LlamaShape(BL, BH, BA, B_KV_HEADS, BD, BF, BV, False, 1e4, None, file_bytes=2)


def test_sft_fits_only_with_offload_where_no_layout_without_it_fits():
    """SFT's config cannot ask for offload: the search finds it and names it a caveat. On 2 GPUs
    with a global batch of 2, every layout without offload has an optimizer step of at least 12·P:
    at TP 2 (dp 1) the weights P, master and Adam 6·P, the stepped bf16 gradients with their fp32
    copy 3·P and AdamW's sqrt(v) 2·P; at TP 1 more (13·P under ZeRO-1 over dp 2, 24·P under
    ZeRO-0). The first with offload is TP 1, ZeRO-1 over dp 2: 2·P + 2·P, the 5e8 bf16 bucket, one
    sequence's activations and no optimizer on the GPU, in training and in its (host) step."""
    stage = SFT.model_copy(update={"global_batch_size": 2, "micro_batch_size": 1})
    s, c = 64, 2
    assert BIG.params() == BP == 553_668_608
    leanest = 12 * BP
    layer = s * c * (6 * BH + 2 * BKV + 4 * BF + 2 * BA * s)
    offloaded = 4 * BP + BUCKET + BL * layer + s * BV * (c + 4)
    assert offloaded < leanest
    usable = (offloaded + leanest) / 2
    assert offloaded / usable < HEADROOM
    cfg = RunConfig(name="hand", nproc=2, eval=SFT_EVAL, stage1_sft=stage)
    machine = Machine("hand", "GPU", usable / GPU_USABLE, PER_NODE, ROOMY_HOST)
    option = plan_stage("stage1_sft", stage, cfg, BIG, machine, [2], PROMPT).options[0]
    assert option.layout.offload and (option.layout.tp, option.layout.zero) == (1, 1)
    assert option.footprint.peak_phase() == "training"
    assert option.footprint.gpu_bytes() == pytest.approx(offloaded, rel=1e-12)
    assert verdict_of(option) == (CAVEAT, ("optimizer offload (no SFT option yet)",))
    # a little more memory and the leanest layout without offload fits: TP 2, ZeRO-0, whose step is
    # its peak whatever its activations, so without recomputation and with 2 sequences (9·P and
    # theirs in training); a caveat only for the headroom
    roomier = Machine("hand", "GPU", 1.01 * leanest / GPU_USABLE, PER_NODE, ROOMY_HOST)
    option = plan_stage("stage1_sft", stage, cfg, BIG, roomier, [2], PROMPT).options[0]
    layout = option.layout
    assert not layout.offload and not layout.recompute
    assert (layout.tp, layout.zero, option.settings["micro_batch_size"]) == (2, 0, 2)
    assert option.footprint.peak_phase() == "optimizer_step"
    assert option.footprint.gpu_bytes() == pytest.approx(leanest, rel=1e-12)
    assert verdict_of(option) == (CAVEAT, (f"{math.ceil(100 / 1.01)}% of usable GPU memory",))


# GRPO on verl's FSDP backend: fp32 actor 4 + 4 + 8 bytes a parameter over N, the gathered root unit
# (embeddings and one layer in bf16), verl's gradient checkpointing for 16 sequences of 128 tokens
# (a GPU's share of a mini-batch: 64 prompts / 2 x 2 / 4 GPUs) in bf16: each layer's input, and the
# larger of one layer recomputed and the logits with their rows' copy and log-softmax (3 x b·s·V).
# Its optimizer step (the states and AdamW's sqrt(v), 20·P/N) is smaller; with gmu 0.1 the
# rollout's share stays below the update's peak.
GATHERED = (2 * V * H + LAYER) * 2
VERL = VerlConfig(rollout_tp=1, gpu_memory_utilization=0.1, micro_batch_size_per_gpu=16, max_prompt_length=64)
VERL_GRPO = GRPOStage(engine="verl", verl=VERL, max_new_tokens=64, prompts_per_step=64, group_size=2)


def verl_activations(b: int, s: int) -> float:
    c = 2
    return L * b * s * c * H + max(b * s * c * (6 * H + 2 * KV + 4 * F), 3 * b * s * V * c)


VERL_PEAK = 16 * P / GPUS + GATHERED + verl_activations(16, 128)
VERL_STEP = 20 * P / GPUS


def with_verl(stage: GRPOStage, **settings) -> GRPOStage:
    return stage.model_copy(update={"verl": stage.verl.model_copy(update=settings)})


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_grpo_on_verl_fsdp_tiers(share, verdict, caveats):
    option = judged(VERL_GRPO, gpu_for(VERL_PEAK, share))
    assert option.footprint.peak_phase() == "training" and not option.footprint.refusals
    assert option.footprint.gpu_bytes() == pytest.approx(VERL_PEAK, rel=1e-12)
    assert option.footprint.phase_bytes()["optimizer_step"] == pytest.approx(VERL_STEP, rel=1e-12)
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
    """The update loads the offloaded states back: the same peak, half of usable, and the caveat;
    its optimizer step too."""
    option = judged(with_verl(VERL_GRPO, **settings), gpu_for(VERL_PEAK, 0.5))
    assert option.footprint.gpu_bytes() == pytest.approx(VERL_PEAK, rel=1e-12)
    assert option.footprint.phase_bytes()["optimizer_step"] == pytest.approx(VERL_STEP, rel=1e-12)
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


# Native GRPO in fp32 (FSDP2 over 4 ranks, layers resharded): native_fit's 20·P/N + 8·P, the gathered root
# unit, fp32 activations of 4 rows (16 prompts x 2 / 4 ranks / 2 mini-batches) of 8 + 64 tokens (the
# logits of every position and three fp32 copies of the 64 response positions'), the fp32 KV cache
# of the rank's 8 sequences; all at once. It has no offload: no offload tier.
NATIVE_GRPO = GRPOStage(prompts_per_step=16, group_size=2, mini_batches=2, micro_batch_size=16, dtype="fp32")
NATIVE_S = PROMPT + 64
NATIVE_PEAK = (
    20 * P / GPUS
    + 8 * P
    + (2 * V * H + LAYER) * 2
    + L * 4 * NATIVE_S * 4 * (6 * H + 2 * KV + 4 * F)
    + 4 * V * 4 * (NATIVE_S + 3 * 64)
    + 2 * L * KV * NATIVE_S * 4 * 8
)


@pytest.mark.parametrize("share, verdict, caveats", TIERS)
def test_native_grpo_tiers(share, verdict, caveats):
    option = judged(NATIVE_GRPO, gpu_for(NATIVE_PEAK, share))
    assert option.footprint.gpu_bytes() == pytest.approx(NATIVE_PEAK, rel=1e-12)
    assert verdict_of(option) == (verdict, caveats)


# Native synthesis in fp32: one whole fp32 copy a rank and the fp32 KV cache of 2 x 4 sequences of 8 + 64.
NATIVE_SYNTH = SynthStage(batch_size=2, samples_per_prompt=4, max_new_tokens=64, dtype="fp32")
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
