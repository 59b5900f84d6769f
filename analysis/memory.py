"""Memory per GPU and host memory per node of each stage, as formulas over the model's shape, the
stage's batch settings and a parallel layout. Every term keeps the formula it was computed with,
so the plan can show where each number comes from.

Symbols: P parameters, L layers, h hidden, kv key/value width (KV heads x head_dim), f FFN width,
a query heads, V vocabulary, b sequences per micro-batch, s tokens per sequence, tp tensor-parallel
size, dp data-parallel size, N GPUs of the stage; w/g/o bytes per parameter of weights, gradients
and optimizer states, c bytes per activation element.

What each stage is assumed to run is ASSUMPTIONS, printed with every plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from analysis.model_shape import LlamaShape
from core.config import GRPOStage, SFTStage, SynthStage

GB = 1e9
BF16 = 2


@dataclass(frozen=True)
class Precision:
    weight: int
    """Bytes per parameter of the weights a GPU holds."""
    grad: int
    """Bytes per gradient element."""
    optimizer: int
    """Bytes per parameter of the optimizer: Adam's m and v in fp32, plus an fp32 master copy
    when the weights are not fp32."""
    compute: int
    """Bytes per activation element."""


FP32 = Precision(weight=4, grad=4, optimizer=8, compute=4)
BF16_MIXED = Precision(weight=2, grad=2, optimizer=12, compute=2)
# FSDP with mixed precision keeps the sharded parameters in fp32 (they are the master copy) and
# casts the gathered ones to bf16 for compute: 16 bytes a parameter, as BF16_MIXED, all sharded.
FSDP_MIXED = Precision(weight=4, grad=4, optimizer=8, compute=2)
SFT_PRECISION = {"fp32": FP32, "bf16": BF16_MIXED}

ASSUMPTIONS = (
    "SFT: megatron-core with TP within a node (no PP: not implemented) and DeepSpeed ZeRO 0-2 over "
    "dp = N/tp, in the stage's dtype (bf16: fp32 master weights and Adam states, 12 bytes a parameter), "
    "megatron's local (unfused) attention.",
    "GRPO: actor, reference and rollout colocated on the same N GPUs, all resident at once. Actor: FSDP "
    "over N (ZeRO-3), fp32 parameters, gradients and Adam states sharded, bf16 compute. Reference: "
    "frozen bf16, sharded over N. Rollout: its own bf16 copy of the policy, TP within a node (vLLM's "
    "layout), and the KV cache of the whole rollout batch. Prompts are --prompt-tokens long.",
    "Generation (synth): bf16 weights, TP within a node, the KV cache of one batch "
    "(batch_size x samples_per_prompt sequences) per TP group.",
    "Host memory per node: each rank reads only its own shard of the checkpoint. SFT's and GRPO's "
    "loaders do (memory-mapped slices of the rank's TP / FSDP shard; SFT's export gathers one layer "
    "at a time on rank 0); today's synth loader still reads the whole model in fp32 on every rank "
    "(4·P bytes each), so its host figure holds only once it streams too.",
    "CPU offload moves the optimizer states (with bf16, the fp32 master weights) to host memory; "
    "recompute is full activation recomputation. Neither is a config option yet: a plan that needs "
    "them says so in its layout (+offload, +recompute).",
)


@dataclass(frozen=True)
class Term:
    name: str
    """What the memory holds (weights, gradients, optimizer, activations, kv_cache, ...)."""
    formula: str
    """How it is computed, in the module's symbols."""
    bytes: float


@dataclass(frozen=True)
class Layout:
    gpus: int
    """N: GPUs of the stage."""
    tp: int
    """Tensor-parallel size (SFT) or the rollout's/generator's tensor-parallel size."""
    zero: int
    """ZeRO stage over the data-parallel group (3 for FSDP)."""
    offload: bool = False
    """Optimizer states live in host memory (DeepSpeed offload_optimizer, FSDP CPU offload)."""
    recompute: bool = False
    """Full activation recomputation: only each layer's input is kept for backward (megatron's
    recompute_granularity=full, Hugging Face gradient checkpointing)."""

    @property
    def dp(self) -> int:
        return self.gpus // self.tp


@dataclass(frozen=True)
class Footprint:
    gpu: list[Term]
    """Per GPU."""
    host: list[Term]
    """Per node."""

    def gpu_bytes(self) -> float:
        return sum(t.bytes for t in self.gpu)

    def host_bytes(self) -> float:
        return sum(t.bytes for t in self.host)


def _shard(zero: int, at_least: int, dp: int) -> tuple[str, int]:
    """ZeRO stage >= at_least divides this state over the data-parallel group."""
    return ("/dp", dp) if zero >= at_least else ("", 1)


def training_states(P: int, prec: Precision, layout: Layout) -> list[Term]:
    """Weights, gradients and optimizer states of one GPU under TP and ZeRO (offloaded optimizer
    states are 0 here: they are counted in host memory)."""
    t, dp, z = layout.tp, layout.dp, layout.zero
    tp = "/tp" if t > 1 else ""
    (wd, wn), (gd, gn), (od, on) = _shard(z, 3, dp), _shard(z, 2, dp), _shard(z, 1, dp)
    optimizer = 0.0 if layout.offload else P * prec.optimizer / (t * on)
    return [
        Term("weights", f"P·{prec.weight}{tp}{wd}", P * prec.weight / (t * wn)),
        Term("gradients", f"P·{prec.grad}{tp}{gd}", P * prec.grad / (t * gn)),
        Term("optimizer", "0 (offloaded)" if layout.offload else f"P·{prec.optimizer}{tp}{od}", optimizer),
    ]


def layer_activation_bytes(m: LlamaShape, b: int, s: int, c: int, tp: int, attention_scores: bool) -> float:
    """Saved for backward by one decoder layer: the two norms' inputs and outputs (4h, replicated
    over TP); Q, K, V, the attention output (2h + 2kv) and the MLP's gate, up, SiLU and product
    (4f), split over TP; with unfused attention also its scores and probabilities (2·a·s)."""
    split = 2 * m.hidden + 2 * m.kv_width + 4 * m.ffn + (2 * m.heads * s if attention_scores else 0)
    return b * s * c * (4 * m.hidden + split / tp)


def activations(
    m: LlamaShape, b: int, s: int, c: int, tp: int, attention_scores: bool, recompute: bool
) -> Term:
    """All layers' saved activations (with recomputation: each layer's input, plus one layer's
    activations while it is recomputed) and the logits: the model's (c bytes), their fp32 copy for
    the loss and its gradient (8 bytes), split over TP by the vocabulary-parallel output layer."""
    scores = " + 2·a·s" if attention_scores else ""
    div = "/tp" if tp > 1 else ""
    layer = f"b·s·c·(4h + (2h + 2kv + 4f{scores}){div})" if tp > 1 else f"b·s·c·(6h + 2kv + 4f{scores})"
    saved = f"L·b·s·c·h + {layer}" if recompute else f"L·{layer}"
    formula = f"{saved} + b·s·V·(c+8){div}  [b={b}, s={s}, c={c}]"
    one_layer = layer_activation_bytes(m, b, s, c, tp, attention_scores)
    kept = m.layers * b * s * c * m.hidden + one_layer if recompute else m.layers * one_layer
    return Term("activations", formula, kept + b * s * m.vocab * (c + 8) / tp)


def kv_cache(m: LlamaShape, sequences: float, per_gpu: str, s: int, c: int) -> Term:
    """Keys and values of every layer for the `sequences` (of s tokens) whose cache one GPU holds;
    `per_gpu` says how that number is made."""
    return Term("kv_cache", f"2·L·kv·s·c·{per_gpu}  [s={s}]", 2 * m.layers * m.kv_width * s * c * sequences)


def node_ranks(layout: Layout, gpus_per_node: int) -> int:
    return min(layout.gpus, gpus_per_node)


def host_terms(
    m: LlamaShape,
    loaded_fraction: str,
    loaded_params: float,
    offloaded: float,
    ranks: int,
    runtime_per_rank: float,
) -> list[Term]:
    """Per node: each rank's runtime (CUDA context, Python, libraries), the weights each rank
    reads from the checkpoint files, and the optimizer states offloaded to host memory."""
    return [
        Term("runtime", f"ranks·{runtime_per_rank / GB:g} GB", ranks * runtime_per_rank),
        Term(
            "loading",
            f"ranks·{loaded_fraction}·{m.file_bytes} (file dtype)",
            ranks * loaded_params * m.file_bytes,
        ),
        Term("offloaded", "ranks·optimizer per GPU" if offloaded else "0", ranks * offloaded),
    ]


def sft_footprint(
    m: LlamaShape, s: SFTStage, layout: Layout, gpus_per_node: int, runtime_per_rank: float
) -> Footprint:
    P, prec, t = m.params(), SFT_PRECISION[s.dtype], layout.tp
    gpu = [
        *training_states(P, prec, layout),
        activations(m, s.micro_batch_size, s.max_seq_len, prec.compute, t, True, layout.recompute),
    ]
    offloaded = P * prec.optimizer / (t * layout.dp) if layout.offload else 0.0
    host = host_terms(m, "P/tp", P / t, offloaded, node_ranks(layout, gpus_per_node), runtime_per_rank)
    return Footprint(gpu, host)


def grpo_footprint(
    m: LlamaShape,
    g: GRPOStage,
    layout: Layout,
    prompt_tokens: int,
    gpus_per_node: int,
    runtime_per_rank: float,
) -> Footprint:
    """`layout.tp` is the rollout's tensor-parallel size; the actor and reference shard over all N
    (data_parallel fsdp2) or are whole on each (ddp)."""
    P, N, tr = m.params(), layout.gpus, layout.tp
    s = prompt_tokens + g.max_new_tokens
    rollout_seqs = g.prompts_per_step * g.group_size / N
    update_seqs = math.ceil(rollout_seqs / g.mini_batches)
    replicated = g.engine == "native" and g.data_parallel == "ddp"  # verl's trainer always shards
    if replicated:  # whole on every rank: nothing sharded, nothing gathered
        actor = training_states(P, FSDP_MIXED, Layout(N, 1, zero=0))
        gathered = Term("actor_gathered", "0 (data_parallel: ddp)", 0.0)
        reference = Term("reference_weights", "P·2 (data_parallel: ddp)", P * BF16)
        offloaded = 0.0
    else:
        actor = training_states(P, FSDP_MIXED, Layout(N, 1, zero=3, offload=layout.offload))
        gathered, reference = fsdp_gathered_weights(m, g, N)
        offloaded = P * FSDP_MIXED.optimizer / N if layout.offload else 0.0
    gpu = [
        *(Term(f"actor_{t.name}", t.formula.replace("/dp", "/N"), t.bytes) for t in actor),
        gathered,
        reference,
        Term("rollout_weights", "P·2/tp", P * BF16 / tr),
        activations(m, update_seqs, s, BF16, 1, False, layout.recompute),
        kv_cache(m, rollout_seqs, "prompts_per_step·G/N", s, BF16),
    ]
    # The largest thing a rank loads: the whole actor under ddp, else its rollout shard (the actor's is P/N).
    fraction, loaded = ("P", P) if replicated else ("P/tp", P / tr)
    host = host_terms(m, fraction, loaded, offloaded, node_ranks(layout, gpus_per_node), runtime_per_rank)
    return Footprint(gpu, host)


def fsdp_gathered_weights(m: LlamaShape, g: GRPOStage, N: int) -> tuple[Term, Term]:
    """Under FSDP2: the actor's gathered weights at their most, and the reference's weights."""
    P = m.params()
    if g.reshard_after_forward and g.fsdp_units == "layer":
        # FSDP gathers one unit at a time, but the root unit (embeddings, output layer) stays
        # gathered through forward and backward.
        gathered = Term(
            "actor_gathered", "(embeddings + 1 layer)·2", (m.embedding_params() + m.layer_params()) * BF16
        )
    elif g.reshard_after_forward:  # one unit: the whole model gathered for each forward and backward
        gathered = Term("actor_gathered", "P·2 (fsdp_units: model)", P * BF16)
    else:  # every layer stays gathered from its forward to its backward
        gathered = Term("actor_gathered", "P·2 (reshard_after_forward: false)", P * BF16)
    if g.reshard_after_forward:  # gathered only while it forwards, when the actor's are not
        reference = Term("reference_weights", "P·2/N", P * BF16 / N)
    else:  # gathered for good
        reference = Term("reference_weights", "P·2 (reshard_after_forward: false)", P * BF16)
    return gathered, reference


def synth_footprint(
    m: LlamaShape,
    st: SynthStage,
    layout: Layout,
    prompt_tokens: int,
    gpus_per_node: int,
    runtime_per_rank: float,
) -> Footprint:
    """A tensor-parallel group of `layout.tp` GPUs generates one batch at a time."""
    P, t = m.params(), layout.tp
    seqs = st.batch_size * st.samples_per_prompt / t
    gpu = [
        Term("weights", "P·2/tp", P * BF16 / t),
        kv_cache(m, seqs, "batch_size·samples_per_prompt/tp", prompt_tokens + st.max_new_tokens, BF16),
    ]
    host = host_terms(m, "P/tp", P / t, 0.0, node_ranks(layout, gpus_per_node), runtime_per_rank)
    return Footprint(gpu, host)
