"""Memory per GPU and host memory per node of each stage, as formulas over the model's shape, the
stage's batch settings and a parallel layout. Every term keeps the formula it was computed with,
so the plan can show where each number comes from.

Symbols: P parameters, L layers, h hidden, kv key/value width (KV heads x head_dim), f FFN width,
a query heads, V vocabulary, b sequences per micro-batch, s tokens per sequence, tp tensor-parallel
size, pp pipeline-parallel size, dp data-parallel size, N GPUs of the stage; w/g/o bytes per
parameter of weights, gradients and optimizer states, c bytes per activation element; P_first and
P_last the parameters of SFT's first and last pipeline stage, M the micro-batches of a step.

What each stage is assumed to run is ASSUMPTIONS, printed with every plan.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from analysis.model_shape import LlamaShape
from analysis.native_fit import grpo_residency, held_width, synth_residency
from core.cluster import rollout_span_problem
from core.config import EvalConfig, GRPOStage, SFTStage, SynthStage, VerlRolloutConfig

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
# megatron-core under verl: bf16 parameters in DDP's buffer, fp32 main gradients
# (grad_reduce_in_fp32), the distributed optimizer's fp32 master copy and Adam m, v.
MCORE_MIXED = Precision(weight=2, grad=4, optimizer=12, compute=2)
SFT_PRECISION = {"fp32": FP32, "bf16": BF16_MIXED}

# DeepSpeed ZeRO 1-2 as stages/engines/megatron_deepspeed.py deepspeed_config leaves it, at
# deepspeed/runtime/zero/config.py's defaults: contiguous_gradients true, use_multi_rank_bucket_allreduce
# true, and reduce_bucket_size elements of one gradient bucket, whatever the model's size; overlap_comm
# as the stage's parallel.overlap_comm says (DeepSpeed's default: false). ZeRO-0 all-reduces in
# chunks of as many elements (deepspeed/runtime/engine.py MEMORY_OPT_ALLREDUCE_SIZE).
DEEPSPEED_BUCKET = 500_000_000
B_TEXT = "5e8"
# torch's AdamW steps with its foreach kernels on a GPU (torch/optim/adam.py _multi_tensor_adam),
# which make sqrt(v) for every parameter stepped at once: fp32, 4 bytes a parameter.
ADAM_STEP_TEMPORARY = 4

ASSUMPTIONS = (
    "SFT: megatron-core with TP within a node and PP over pp stages, DeepSpeed ZeRO 0-2 over dp = "
    "N/(tp·pp), in the stage's dtype (bf16: fp32 master weights and Adam states, 12 bytes a parameter; "
    "fp32 under ZeRO 1-2: also 12, DeepSpeed steps an fp32 partition of its own), megatron's local "
    "(unfused) attention; the logits in the model's dtype beside megatron's fp32 copy for the loss, whose"
    " softmax becomes their gradient in place (c + 4 bytes a logit, 4 in fp32). DeepSpeed runs as our "
    "deepspeed_config leaves it, at ZeRO's defaults (deepspeed/runtime/zero/config.py): gradients in the "
    "model's dtype (no grad_accum_dtype, so not DeepSpeed's bf16 optimizer with fp32 gradient "
    "accumulation), ZeRO 1-2 fill one bucket of 5e8 gradient elements (1 GB in bf16; two with "
    "parallel.overlap_comm) and all-reduce a flattened copy of it; its optimizer step is a phase of its "
    "own, holding besides the weights and states the stepped gradients, their flat fp32 copy and AdamW's "
    "sqrt(v): 10 bytes a stepped parameter in bf16 (P/tp/dp of them under ZeRO 1-2). With pp > 1 (ZeRO 0 "
    "or 1 only, no overlap_comm, untied embeddings, pp dividing L: core/config.py) each rank builds its "
    "stage, L/pp layers, the embedding on the first stage (P_first) and the output layer and final norm "
    "on the last (P_last), whose weights, gradients and states replace P's; megatron's 1F1B schedule runs"
    " a step's M = global_batch_size/(micro_batch_size·dp) micro-batches, stage i keeping the activations"
    " of min(pp - i, M) of them (its L/pp layers each) and the last stage the logits of one; then "
    "DeepSpeed reduces the gradients without contiguous buckets (our deepspeed_config), ZeRO-1 as ZeRO-0 "
    "does, through flattened copies of up to 5e8 of them (counted with the activations: an overestimate, "
    "the reduction follows the schedule), and ZeRO-1's optimizer step frees them once flattened: it holds"
    " the flat fp32 copy and AdamW's sqrt(v), 8 bytes a stepped parameter. The plan counts the heavier of"
    " the first and last stage (the stages between hold less). Not counted: the CUDA context, NCCL's "
    "buffers and the allocator's fragmentation (the tenth of a GPU left unplanned), nor DeepSpeed's "
    "flattening of the weights at start, done on the GPU only when a second copy fits there. These terms "
    "are checked against the engines on the emulated accelerator by bench/plan_vs_engines.py. Its final "
    "eval is a phase of its own after training: eval.engine native loads the whole model in the stage's "
    "dtype on every rank (stages/eval.py) with the KV cache of eval.batch_size sequences; eval.engine "
    "verl is a vLLM server as synthesis's.",
    "GRPO on verl 0.9.1 (backend fsdp, hybrid engine: actor, reference and vLLM rollout colocated on "
    "each GPU), as its source does it: the actor is FSDP over N in fp32 (fsdp_config.model_dtype fp32, "
    "trainer/config/engine/fsdp.yaml), 4+4+8 bytes a parameter sharded; gradients exist only inside "
    "an update (zero_grad on leaving train mode, workers/engine/fsdp/transformer_impl.py), whose "
    "optimizer step also holds AdamW's sqrt(v), 4 bytes a parameter sharded; param_offload "
    "keeps parameters (and gradients) and optimizer_offload Adam's states in host memory outside their "
    "use (workers/engine/base.py BaseEngineCtx). The reference is forward-only and always CPU-offloaded "
    "by verl whatever param_offload says (transformer_impl.py: CPUOffload for forward_only; "
    "trainer/config/ref/dp_ref.yaml), fp32 shards in host memory. Gradient checkpointing is verl's "
    "default (model.enable_gradient_checkpointing true; our overrides leave it), so an update keeps "
    "each layer's input for its largest micro-batch: micro_batch_size_per_gpu sequences of "
    "max_prompt_length + max_new_tokens tokens, or with max_tokens_per_gpu verl's balanced split of a "
    "GPU's share of a mini-batch (use_dynamic_bsz: at worst one micro-batch of the whole budget, padded "
    "to its longest sequence unless packed), sdpa or flash-attn (no scores); and besides them either "
    "one layer recomputed or the logits, whichever is larger: unpacked, the padded bf16 logits, a copy "
    "of the real tokens' rows and their log-softmax saved for the backward "
    "(workers/engine/fsdp/transformer_impl.py prepare_model_outputs, utils/torch_functional.py "
    "logprobs_from_logits_v2); packed (remove_padding, which needs flash-attn), the logits alone, "
    "flash-attn's cross-entropy writing their gradient in place. "
    "The vLLM rollout takes gpu_memory_utilization x "
    "GPU memory while it generates and sleeps at level 2 (weights and KV freed, free_cache_engine and "
    "enable_sleep_mode true, workers/rollout/vllm_rollout/vllm_async_server.py) while the actor trains; "
    "its weights come back first for the weight sync (workers/engine_workers.py update_weights), when "
    "the actor's parameters are on the GPU and one tensor (the largest, the embedding) is gathered in "
    "bf16. The peak is the largest of these phases. Rank 0 loads the whole model in fp32 on the CPU "
    "before FSDP shards it (utils/fsdp_utils.py get_init_weight_context_manager), so the first node "
    "needs 4·P bytes of host memory at start.",
    "GRPO on verl 0.9.1's megatron backend (model_engine megatron; the same hybrid engine and phases), "
    "with verl's defaults (trainer/config/engine/megatron.yaml): the actor is megatron-core over "
    "tp·pp, bf16 parameters (dtype bfloat16) in DDP's buffer, P·2/tp/pp; fp32 main gradients "
    "(grad_reduce_in_fp32, workers/engine/megatron/transformer_impl.py _resolve_override_ddp_config), "
    "P·4/tp/pp on every data-parallel rank for the engine's life; the distributed optimizer "
    "(use_distributed_optimizer true) shards the fp32 master copy and Adam's m, v over dp = N/(tp·pp), "
    "P·12/tp/pp/dp. param_offload copies the parameters to pinned host memory and frees the gradient "
    "buffer without copying it; optimizer_offload moves the master copy and m, v to host memory "
    "(utils/megatron_utils.py offload_megatron_model_to_cpu, offload_megatron_optimizer), outside "
    "their use (workers/engine/base.py BaseEngineCtx). The reference is the same model forward-only, "
    "bf16 P·2/tp/pp, offloaded only with param_offload (its megatron.param_offload follows the "
    "actor's, trainer/config/ref/megatron_ref.yaml; transformer_impl.py initialize). No activation "
    "recomputation (override_transformer_config.recompute_granularity null; recompute_modules "
    "applies only to selective), flash attention, sequence parallel on: every layer's activations of "
    "micro_batch_size_per_gpu sequences, all split over TP; under 1F1B the first pipeline stage holds "
    "at most pp micro-batches of its L/pp layers (L layers' worth), the last stage the logits: both "
    "counted. The weight sync loads the actor's parameters without gradients (get_per_tensor_param) "
    "and gathers each tensor's TP shards, then concatenates them (Megatron-Bridge param_mapping.py "
    "megatron_to_hf): twice the largest tensor. Loading: verl reads the Hugging Face checkpoint "
    "through Megatron-Bridge (use_mbridge true, vanilla_mbridge false: bridge.load_hf_weights), where "
    "every rank fetches the whole checkpoint tensors of its own pipeline stage one at a time and TP "
    "rank 0 splits and scatters them (NVIDIA-NeMo/Megatron-Bridge models/conversion/model_bridge.py "
    "load_weights_hf_to_megatron; not installed here): P/pp a rank, counted as other loaders' reads "
    "are; no rank builds the whole model. Refused: tp·pp not dividing N, pp not dividing L, tp not "
    "dividing the KV heads.",
    "vLLM (verl's rollout and generation server) refuses to start unless gmu x GPU memory, less its "
    "weights, holds the KV cache of one max_model_len sequence (vllm/v1/core/kv_cache_utils.py "
    "check_enough_kv_cache_memory). Our overrides set max_model_len to the longest prompt and a "
    "whole response (unset, verl 0.9.1 passes the model's max_position_embeddings; longer than "
    "that, vLLM refuses). vLLM's own activations and CUDA graphs also come out of its budget; "
    "they are not counted, only the weights and that minimum KV cache.",
    "Native GRPO (engine native): what analysis/native_fit.py says it holds a GPU (fp32 actor master "
    "weights and states; reference and rollout in the stage's dtype, 'auto' being bf16 on GPUs), the "
    "gathered FSDP2 unit, the activations of one micro-batch in that dtype (the update differentiates "
    "each before it forwards the next: stages/grpo/actor.py), with the fp32 logits of every position "
    "its lm_head runs and three copies of the response's, and the rollout's KV cache of the rank's "
    "prompts_per_step·G/N sequences. Prompts are --prompt-tokens long.",
    "Native synthesis (engine native): one whole copy a rank in its dtype (native_fit) and the KV cache "
    "of one batch (batch_size x samples_per_prompt sequences). Synthesis on verl: vLLM replicas of "
    "rollout_tp GPUs, each GPU taking gmu x GPU memory.",
    "Host memory per node: SFT's and native GRPO's loaders read each rank's own shard or copy of the "
    "checkpoint (memory-mapped); today's native synth loader reads the whole model on every rank; vLLM "
    "reads its TP shard. Offloaded states are pinned host memory of every rank of the node.",
    "SFT's CPU offload moves the optimizer states (with bf16, the fp32 master weights) to host memory; "
    "recompute is full activation recomputation (each in-flight micro-batch keeps its layers' inputs). "
    "Neither is an SFT config option yet: a plan that needs them says so in its layout (+offload, "
    "+recompute).",
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
    """Optimizer states live in host memory (DeepSpeed offload_optimizer, verl optimizer_offload)."""
    recompute: bool = False
    """Full activation recomputation: only each layer's input is kept for backward (megatron's
    recompute_granularity=full, Hugging Face gradient checkpointing)."""
    param_offload: bool = False
    """Parameters (and gradients) live in host memory outside their use (verl param_offload)."""
    pp: int = 1
    """Pipeline-parallel size (SFT's megatron-core, verl's megatron actor)."""
    megatron: bool = False
    """GRPO on verl's megatron backend: tp and pp are the actor's (the rollout's TP is the stage's
    verl.rollout_tp), dp = N/(tp·pp)."""

    @property
    def dp(self) -> int:
        return self.gpus // (self.tp * self.pp)


@dataclass(frozen=True)
class Footprint:
    gpu: list[Term]
    """Per GPU."""
    host: list[Term]
    """Per node."""
    phases: dict[str, tuple[str, ...]] = field(default_factory=dict)
    """Phase -> the GPU terms resident during it, for engines that free memory between phases;
    empty: every term at once."""
    refusals: tuple[str, ...] = ()
    """Why the engine would refuse to start whatever the totals (the layout or vLLM's own checks)."""

    def phase_bytes(self) -> dict[str, float]:
        by_name = {t.name: t.bytes for t in self.gpu}
        phases = self.phases or {"all": tuple(by_name)}
        return {phase: sum(by_name[n] for n in names) for phase, names in phases.items()}

    def peak_phase(self) -> str:
        bytes_ = self.phase_bytes()
        return max(bytes_, key=bytes_.get)

    def gpu_bytes(self) -> float:
        return max(self.phase_bytes().values())

    def host_bytes(self) -> float:
        return sum(t.bytes for t in self.host)


# The native engines' prompt length a plan assumes where none is given (`hpcr1 plan --prompt-tokens`).
PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Site:
    """What a footprint needs besides the model, the stage and the layout."""

    gpu_bytes: float
    """M: memory of one GPU (vLLM's gpu_memory_utilization is a share of it)."""
    gpus_per_node: int
    runtime_per_rank: float
    """Host bytes of each rank's CUDA context, Python and libraries."""
    prompt_tokens: int = PROMPT_TOKENS
    """Prompt length of the native engines (verl's is its max_prompt_length)."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """The held-out eval that follows an SFT stage."""


def _shard(zero: int, at_least: int, dp: int) -> tuple[str, int]:
    """ZeRO stage >= at_least divides this state over the data-parallel group."""
    return ("/dp", dp) if zero >= at_least else ("", 1)


def model_split(layout: Layout) -> str:
    """How a rank's share of the model is written: /tp, /pp, both or neither."""
    return "/tp" * (layout.tp > 1) + "/pp" * (layout.pp > 1)


@dataclass(frozen=True)
class Share:
    """The parameters one rank holds before ZeRO divides their states: its pipeline stage's, split
    over TP."""

    params: float
    symbol: str
    """P, or P_first / P_last: the first or last pipeline stage's parameters."""
    split: str
    """/tp, /pp, both or neither."""

    def text(self, per_param: str | int = "") -> str:
        """`per_param` bytes a parameter of the share: P·2/tp/pp."""
        return f"{self.symbol}·{per_param}{self.split}" if per_param != "" else self.symbol + self.split


def uniform_share(P: float, layout: Layout) -> Share:
    """P split evenly over tp·pp (verl's megatron actor: its stages' embeddings not told apart)."""
    return Share(P / (layout.tp * layout.pp), "P", model_split(layout))


def training_states(P: int, prec: Precision, layout: Layout, share: Share | None = None) -> list[Term]:
    """Weights, gradients and optimizer states of one GPU under TP, PP and ZeRO (offloaded optimizer
    states are 0 here: they are counted in host memory); `share` the rank's parameters, P/tp/pp
    unless given."""
    share = share or uniform_share(P, layout)
    dp, z, n = max(layout.dp, 1), layout.zero, share.params
    (wd, wn), (gd, gn), (od, on) = _shard(z, 3, dp), _shard(z, 2, dp), _shard(z, 1, dp)
    optimizer = 0.0 if layout.offload else n * prec.optimizer / on
    held = f"{share.text(prec.optimizer)}{od}"
    return [
        Term("weights", f"{share.text(prec.weight)}{wd}", n * prec.weight / wn),
        Term("gradients", f"{share.text(prec.grad)}{gd}", n * prec.grad / gn),
        Term("optimizer", "0 (offloaded)" if layout.offload else held, optimizer),
    ]


def layer_activation_bytes(m: LlamaShape, b: int, s: int, c: int, tp: int, attention_scores: bool) -> float:
    """Saved for backward by one decoder layer: the two norms' inputs and outputs (4h, replicated
    over TP); Q, K, V, the attention output (2h + 2kv) and the MLP's gate, up, SiLU and product
    (4f), split over TP; with unfused attention also its scores and probabilities (2·a·s)."""
    split = 2 * m.hidden + 2 * m.kv_width + 4 * m.ffn + (2 * m.heads * s if attention_scores else 0)
    return b * s * c * (4 * m.hidden + split / tp)


def activations(
    m: LlamaShape,
    b: int,
    s: int,
    c: int,
    tp: int,
    attention_scores: bool,
    recompute: bool,
    held: tuple[float, str] | None = None,
    logits: bool = True,
    megatron_loss: bool = False,
) -> Term:
    """The saved activations of `held` layers (count, how it is written; all L by default): with
    recomputation each layer's input, plus one layer's activations while it is recomputed. With
    `logits`, also the logits (logit_bytes), split over TP by the vocabulary-parallel output layer."""
    layers, count = held or (m.layers, "L")
    scores = " + 2·a·s" if attention_scores else ""
    div = "/tp" if tp > 1 else ""
    layer = f"b·s·c·(4h + (2h + 2kv + 4f{scores}){div})" if tp > 1 else f"b·s·c·(6h + 2kv + 4f{scores})"
    saved = f"{count}·b·s·c·h + {layer}" if recompute else f"{count}·{layer}"
    per_logit, per_text = logit_bytes(c, megatron_loss)
    out = f" + b·s·V·{per_text}{div}" if logits else ""
    formula = f"{saved}{out}  [b={b}, s={s}, c={c}]"
    one_layer = layer_activation_bytes(m, b, s, c, tp, attention_scores)
    kept = layers * b * s * c * m.hidden + one_layer if recompute else layers * one_layer
    return Term("activations", formula, kept + logits * b * s * m.vocab * per_logit / tp)


def logit_bytes(c: int, megatron_loss: bool) -> tuple[int, str]:
    """Bytes a logit holds at the loss: the model's (c), their fp32 copy for the loss and its
    gradient (8). megatron's vocab-parallel cross-entropy (tensor_parallel/cross_entropy.py) takes
    its fp32 copy (in fp32, the logits themselves), exponentiates it in place, saves it and turns it
    into the gradient in place: c + 4, or 4 in fp32 (checked: bench/plan_vs_engines.py ds-pp2-logits)."""
    if not megatron_loss:
        return c + 8, "(c+8)"
    return (c + 4, "(c+4)") if c < 4 else (4, "4")


def kv_cache(m: LlamaShape, sequences: float, per_gpu: str, s: int, c: int) -> Term:
    """Keys and values of every layer for the `sequences` (of s tokens) whose cache one GPU holds;
    `per_gpu` says how that number is made."""
    return Term("kv_cache", f"2·L·kv·s·c·{per_gpu}  [s={s}]", 2 * m.layers * m.kv_width * s * c * sequences)


def node_ranks(layout: Layout, gpus_per_node: int) -> int:
    return min(layout.gpus, gpus_per_node)


def host_terms(
    m: LlamaShape, loaded_fraction: str, loaded_params: float, ranks: int, site: Site
) -> list[Term]:
    """Per node: each rank's runtime (CUDA context, Python, libraries) and the weights each rank
    reads from the checkpoint files."""
    return [
        Term("runtime", f"ranks·{site.runtime_per_rank / GB:g} GB", ranks * site.runtime_per_rank),
        Term(
            "loading",
            f"ranks·{loaded_fraction}·{m.file_bytes} (file dtype)",
            ranks * loaded_params * m.file_bytes,
        ),
    ]


def offloaded(formula: str, per_rank: float, ranks: int) -> Term:
    return Term("offloaded", f"ranks·({formula})" if per_rank else "0", ranks * per_rank)


def sft_footprint(m: LlamaShape, s: SFTStage, layout: Layout, site: Site) -> Footprint:
    """The footprint of the heavier of the first and the last pipeline stage, the one a plan must
    fit (the stages between hold less than the first: no embedding, fewer micro-batches in flight):
    the higher peak, then the higher next phase (a peak both share, the final eval, ties them);
    with pp = 1, the one stage's."""
    stages = (sft_stage_footprint(m, s, layout, site, i) for i in sorted({0, layout.pp - 1}))
    return max(stages, key=lambda fp: sorted(fp.phase_bytes().values(), reverse=True))


def sft_stage_footprint(m: LlamaShape, s: SFTStage, layout: Layout, site: Site, stage: int = 0) -> Footprint:
    """DeepSpeed's phases of a step on a rank of pipeline stage `stage`: forward and backward with
    the gradients' reduction, then the optimizer step; and the final eval."""
    prec = deepspeed_precision(s.dtype, layout.zero)
    share = stage_share(m, layout, stage)
    contiguous = layout.pp == 1  # deepspeed_config turns contiguous_gradients off under pp > 1
    overlap = s.parallel.overlap_comm
    train = [
        *training_states(m.params(), prec, layout, share),
        reduce_buffers(share.params, prec.grad, layout.zero, overlap, contiguous, share.text()),
        stage_activations(m, s, layout, prec.compute, stage),
    ]
    step = deepspeed_step(share, prec, layout, contiguous)
    evaluation, refusals = final_eval(m, site, prec.weight, layout.gpus)
    ranks = node_ranks(layout, site.gpus_per_node)
    moved = share.params * prec.optimizer / layout.dp if layout.offload else 0.0
    host = [*host_terms(m, share.text(), share.params, ranks, site)]
    host.append(offloaded("optimizer per GPU", moved, ranks))
    phases = {
        "training": tuple(x.name for x in train),
        "optimizer_step": ("weights", "optimizer", *(x.name for x in step)),
        "final_eval": tuple(x.name for x in evaluation),
    }
    return Footprint(train + step + evaluation, host, phases, refusals + sft_refusals(m, s, layout))


def stage_params(m: LlamaShape, pp: int, stage: int) -> int:
    """A pipeline stage's parameters: L/pp layers, the input embedding on the first stage, the
    output layer and the final norm on the last (with pp = 1, all P)."""
    output = m.embedding_params() - m.vocab * m.hidden  # 0 when tied (refused with pp > 1)
    first, last = stage == 0, stage == pp - 1
    return m.layers // pp * m.layer_params() + first * m.vocab * m.hidden + last * (output + m.hidden)


def stage_share(m: LlamaShape, layout: Layout, stage: int) -> Share:
    """A rank's parameters: its pipeline stage's (P_first, P_last, or P with pp = 1) over TP."""
    symbol = "P" if layout.pp == 1 else "P_first" if stage == 0 else "P_last"
    split = "/tp" if layout.tp > 1 else ""
    return Share(stage_params(m, layout.pp, stage) / layout.tp, symbol, split)


def stage_activations(m: LlamaShape, s: SFTStage, layout: Layout, c: int, stage: int) -> Term:
    """Under 1F1B, stage i runs min(pp - i, M) forwards (M micro-batches a step) before its first
    backward, and keeps each one's activations of its L/pp layers until that backward: the first
    stage the most; the last stage also the logits, of one micro-batch at a time."""
    b, seq, tp, recompute = s.micro_batch_size, s.max_seq_len, layout.tp, layout.recompute
    if layout.pp == 1:
        return activations(m, b, seq, c, tp, True, recompute, megatron_loss=True)
    M = max(1, s.global_batch_size // (b * layout.dp))
    k = min(layout.pp - stage, M)
    held = (k * (m.layers // layout.pp), f"{k}·L/pp")
    last = stage == layout.pp - 1
    term = activations(m, b, seq, c, tp, True, recompute, held, logits=last, megatron_loss=True)
    flight = f", {k} = min(pp - {stage}, M) in flight, M={M}"
    return replace(term, formula=term.formula[:-1] + flight + "]")


def sft_refusals(m: LlamaShape, s: SFTStage, layout: Layout) -> tuple[str, ...]:
    """core/config.py's checks of the layout: megatron's divisions, and what pp > 1 cannot run
    (its backward runs outside DeepSpeed's engine)."""
    checks = (
        (layout.zero > 1, f"ZeRO-{layout.zero} partitions gradients in a backward pp > 1 does not run"),
        (s.parallel.overlap_comm, "overlap_comm reduces in a backward pp > 1 does not run"),
        (m.tied_embeddings, "tied embeddings (the output layer is the embedding) are not split over pp > 1"),
    )
    pipeline = tuple(why for bad, why in checks if bad and layout.pp > 1)
    return megatron_refusals(m, layout) + pipeline


def deepspeed_precision(dtype: str, zero: int) -> Precision:
    """Bytes a parameter under DeepSpeed: ZeRO 1-2 step an fp32 partition of their own, a copy of
    the weights even when they are fp32 (deepspeed/runtime/zero/stage_1_and_2.py __init__,
    single_partition_of_fp32_groups), beside Adam's m and v; ZeRO-0 in fp32 steps the weights
    themselves with torch's AdamW; in bf16 its optimizer keeps fp32 copies of all of them
    (deepspeed/runtime/fp16/unfused_optimizer.py)."""
    prec = SFT_PRECISION[dtype]
    return replace(prec, optimizer=12) if dtype == "fp32" and zero >= 1 else prec


def reduce_buffers(
    grads: float, g: int, zero: int, overlap_comm: bool = False, contiguous: bool = True, text: str = "P/tp"
) -> Term:
    """What reducing `grads` gradient elements (`text`: P/tp) of g bytes holds besides the gradients.
    ZeRO 1-2 allocate one bucket of DEEPSPEED_BUCKET elements at the first gradient of a backward
    (stage_1_and_2.py setup_buckets) and all-reduce a flattened copy of each full bucket
    (allreduce_bucket: self.flatten). ZeRO-1 moves every gradient into the bucket before its
    reduction, so that copy takes the room the moved gradients leave; ZeRO-2 keeps the partition's
    gradients apart (grads_in_partition, the gradients term), so it counts. ZeRO-0 all-reduces
    flattened copies of up to DEEPSPEED_BUCKET gradients (engine.py buffered_allreduce_fallback), and
    so does ZeRO-1 without `contiguous` gradients (pp > 1: no bucket; reduce_ipg_grads'
    buffered_reduce_fallback). With overlap_comm, ZeRO 1-2 fill a second bucket while the first is
    reduced (setup_buckets' buf_1)."""
    buckets = 2 if overlap_comm and zero >= 1 else 1
    bucket, chunk = buckets * DEEPSPEED_BUCKET * g, min(DEEPSPEED_BUCKET, grads) * g
    b = f"{buckets}·B" if buckets > 1 else "B"
    copy = f"min(B, {text})·{g}"
    formula, held = {
        0: (f"{copy} (the all-reduce's flattened copy)", chunk),
        1: (f"{b}·{g} (the gradient bucket)", bucket),
    }.get(zero, (f"{b}·{g} + {copy} (the gradient bucket and its flattened copy)", bucket + chunk))
    if zero == 1 and not contiguous:
        formula, held = f"{copy} (the all-reduce's flattened copy; no bucket under pp > 1)", chunk
    return Term("reduce_buffers", f"{formula}  [B={B_TEXT}]", held)


def deepspeed_step(share: Share, prec: Precision, layout: Layout, contiguous: bool = True) -> list[Term]:
    """What DeepSpeed's optimizer step holds besides the weights and the optimizer states, for the
    parameters it steps (the rank's share, P/tp at pp = 1, over dp under ZeRO 1-2): their gradients
    in the model's dtype and the flat fp32 gradient it steps with, g + 4 bytes a parameter
    (stage_1_and_2.py step: the partition's gradients and single_grad_partition, a flattened fp32
    copy; unfused_optimizer.py step: fp32 copies of the bf16 gradients), and AdamW's sqrt(v). ZeRO-1
    without `contiguous` gradients (pp > 1) frees the gradients once flattened, before AdamW: 4 bytes
    (flattening held g + g, and 4 more in bf16: no more than the 4 + 4 of AdamW's moment). fp32
    ZeRO-0 is torch's AdamW alone, which steps the gradients themselves. With offload the step runs
    on the host (DeepSpeedCPUAdam)."""
    if layout.offload:
        return [Term("step_gradients", "0 (stepped on the host)", 0.0), Term("step_temporary", "0", 0.0)]
    stepped = layout.dp if layout.zero >= 1 else 1
    split = "/dp" * (layout.zero >= 1)
    wrapped = prec.grad != 4 or layout.zero >= 1  # DeepSpeed wraps torch's AdamW
    held = prec.grad + 4 if wrapped else prec.grad
    what = "the gradient partition and its flat fp32 copy" if wrapped else "the gradients"
    if layout.zero == 1 and not contiguous:
        held, what = 4, "the partition's flat fp32 copy; its gradients freed before AdamW"
    temp, n = ADAM_STEP_TEMPORARY, share.params / stepped
    return [
        Term("step_gradients", f"{share.text(held)}{split} ({what})", n * held),
        Term("step_temporary", f"{share.text(temp)}{split} (AdamW's sqrt(v))", n * temp),
    ]


def final_eval(m: LlamaShape, site: Site, weight_bytes: int, gpus: int) -> tuple[list[Term], tuple[str, ...]]:
    """The held-out eval after training: native loads the whole model in the stage's dtype on every
    rank and decodes eval.batch_size sequences; verl starts a vLLM server on the same GPUs."""
    e, P = site.eval, m.params()
    if e.engine == "verl":
        budget, weights, min_kv, refusals = rollout_terms(m, e.verl, site.gpu_bytes, e.max_new_tokens)
        span = rollout_span_problem(e.verl.rollout_tp, gpus, site.gpus_per_node)
        refusals += (f"eval.verl.rollout_tp {span} (hpcr1 submit refuses it)",) if span else ()
        return [replace(budget, name="eval_rollout_budget")], refusals
    kv = kv_cache(m, e.batch_size, "eval.batch_size", site.prompt_tokens + e.max_new_tokens, weight_bytes)
    whole = Term("eval_weights", f"P·{weight_bytes} (whole model in the stage's dtype)", P * weight_bytes)
    return [whole, replace(kv, name="eval_kv_cache")], ()


def rollout_terms(
    m: LlamaShape, v: VerlRolloutConfig, gpu_bytes: float, new_tokens: int
) -> tuple[Term, Term, Term, tuple[str, ...]]:
    """One vLLM instance's share of a GPU (gmu·M), the weights and the least KV cache vLLM starts
    with inside it, and why vLLM would refuse the layout."""
    P, t, gmu = m.params(), v.rollout_tp, v.gpu_memory_utilization
    max_len = v.max_model_len(new_tokens)  # what verl is told (stages/engines/verl_trainer.py)
    budget = Term("rollout_budget", f"gmu·M  [gmu={gmu:g}]", gmu * gpu_bytes)
    weights = Term("rollout_weights", "P·2/tp", P * BF16 / t)
    # past the KV heads, vLLM replicates them: a GPU holds at least one head's keys and values
    kv_split = min(t, m.kv_heads)
    per_gpu = "1/tp" if kv_split == t else f"1/{kv_split} (one KV head a GPU)"
    min_kv = replace(
        kv_cache(m, 1 / kv_split, f"{per_gpu} (one max_model_len sequence)", max_len, BF16),
        name="rollout_min_kv",
    )
    refusals = []  # how the instances tile the GPUs is plan_search.refusals' (hpcr1 submit's)
    if m.max_positions and max_len > m.max_positions:
        refusals.append(f"max_model_len {max_len} exceeds the model's {m.max_positions} positions")
    if weights.bytes >= budget.bytes:
        refusals.append(
            f"vLLM's weights ({weights.bytes / GB:.1f} GB) exceed gmu·M ({budget.bytes / GB:.1f} GB)"
        )
    elif weights.bytes + min_kv.bytes > budget.bytes:
        refusals.append(
            f"vLLM: gmu·M less its weights leaves {(budget.bytes - weights.bytes) / GB:.1f} GB, less "
            f"than the KV cache of one {max_len}-token max_model_len sequence ({min_kv.bytes / GB:.1f} GB)"
        )
    return budget, weights, min_kv, tuple(refusals)


def grpo_footprint(m: LlamaShape, g: GRPOStage, layout: Layout, site: Site) -> Footprint:
    if g.engine == "native":
        return native_grpo_footprint(m, g, layout, site)
    return (megatron_grpo_footprint if layout.megatron else verl_grpo_footprint)(m, g, layout, site)


def native_grpo_footprint(m: LlamaShape, g: GRPOStage, layout: Layout, site: Site) -> Footprint:
    """What the native engine holds (native_fit), its gathered FSDP2 unit, one micro-batch's
    activations (native_activations) and the rollout's KV cache of the rank's sequences, these in
    the stage's dtype. (The gathered unit is counted in bf16 whatever the dtype: fp32 gathers twice
    that, which the measured fp32 peaks do not show: bench/RESULTS.md.)"""
    P, N, w = m.params(), layout.gpus, held_width(g)
    held = grpo_residency("", g, P, N)
    s = site.prompt_tokens + g.max_new_tokens
    rollout_seqs = g.prompts_per_step * g.group_size / N
    micro = min(g.micro_batch_size, math.ceil(rollout_seqs / g.mini_batches))
    gathered = (
        Term("actor_gathered", "0 (data_parallel: ddp)", 0.0)
        if g.data_parallel == "ddp"
        else fsdp_gathered_weights(m, g, N)
    )
    gpu = [
        Term("resident", held.formula, held.bytes),
        gathered,
        native_activations(m, g, micro, site.prompt_tokens),
        kv_cache(m, rollout_seqs, "prompts_per_step·G/N", s, w),
    ]
    return Footprint(gpu, host_terms(m, "P", P, node_ranks(layout, site.gpus_per_node), site))


def native_activations(m: LlamaShape, g: GRPOStage, b: int, prompt: int) -> Term:
    """What the native update holds for one micro-batch of b rows (stages/grpo/actor.py: each is
    differentiated before the next is forwarded), no recomputation: every layer's activations of
    p + r positions in the stage's dtype (prompts shared: at most one prompt a row) and the fp32
    logits (the loss casts them; bf16 ones are transient), the
    lm_head's over the positions it runs (every one of a whole row, the response's where prompts
    are shared, each row then also a copy of its prompt's keys and values) and three r·V copies of
    the response's: scaled by the temperature (saved), their gradient and the logsumexp's."""
    r, c, f = g.max_new_tokens, held_width(g), FP32.compute
    s = prompt + r
    layers = m.layers * layer_activation_bytes(m, b, s, c, 1, False)
    head, head_text = (r, "r") if g.shares_prompts else (s, "s")
    kv = 2 * m.layers * m.kv_width * prompt * c * b if g.shares_prompts else 0
    kv_text = " + 2·L·kv·p·c·b" if g.shares_prompts else ""
    formula = f"L·b·s·c·(6h + 2kv + 4f) + b·V·4·({head_text} + 3r){kv_text}  [b={b}, s={s}, r={r}, c={c}]"
    return Term("activations", formula, layers + b * m.vocab * f * (head + 3 * r) + kv)


def verl_grpo_footprint(m: LlamaShape, g: GRPOStage, layout: Layout, site: Site) -> Footprint:
    """verl's hybrid engine, FSDP backend: the phases a step goes through (ASSUMPTIONS)."""
    P, N, v = m.params(), layout.gpus, g.verl
    budget, rollout_weights, min_kv, refusals = rollout_terms(m, v, site.gpu_bytes, g.max_new_tokens)
    gathered = fsdp_gathered_weights(m, g, N)
    gpu = [
        Term("actor_weights", "P·4/N", 4 * P / N),
        Term("actor_gradients", "P·4/N (in an update only)", 4 * P / N),
        Term("actor_optimizer", "P·8/N", 8 * P / N),
        Term("actor_step_temporary", "P·4/N (AdamW's sqrt(v), in the optimizer step)", 4 * P / N),
        gathered,
        replace(gathered, name="reference_gathered"),
        verl_activations(m, verl_micro_batch(g, N), v.remove_padding),
        budget,
        rollout_weights,
        min_kv,
        Term("sync_tensor", "V·h·2 (the largest tensor, gathered in bf16)", m.vocab * m.hidden * BF16),
    ]
    kept = ("actor_weights",) * (not layout.param_offload) + ("actor_optimizer",) * (not layout.offload)
    states = ("actor_weights", "actor_gradients", "actor_optimizer")
    phases = verl_phases(
        kept,
        reference=("reference_gathered",),
        training=(*states, "actor_gathered", "activations"),
        optimizer_step=(*states, "actor_step_temporary"),
    )
    return Footprint(gpu, verl_host(m, layout, site), phases, refusals)


@dataclass(frozen=True)
class MicroBatch:
    """The largest micro-batch of one GPU in verl's update, in tokens."""

    padded: float
    """Positions the model runs: b·s padded, or the packed tokens."""
    tokens: float
    """Prompt and response tokens in it: rows of the logits verl takes log-probabilities of."""
    formula: str


def verl_micro_batch(g: GRPOStage, gpus: int) -> MicroBatch:
    """A GPU's share of a mini-batch is n = prompts/mini_batches·G/N sequences of at most s tokens.
    Counted by sequences, a micro-batch holds b of them. With a token budget T (use_dynamic_bsz),
    verl splits the share into the fewest balanced micro-batches within T (seqlen_balancing.py
    rearrange_micro_batches): at worst one of min(T, n·s) tokens; packed that is all it runs,
    padded to its longest sequence it can be one of s tokens and T - s one-token ones."""
    v = g.verl
    s = v.max_model_len(g.max_new_tokens)
    share = g.prompts_per_step / g.mini_batches * g.group_size / gpus
    if v.max_tokens_per_gpu is None:
        b = min(v.micro_batch_size_per_gpu, math.ceil(share))
        return MicroBatch(b * s, b * s, f"b·s  [b={b}, s={s}]")
    T = v.max_tokens_per_gpu
    tokens = min(T, share * s)
    if v.remove_padding:
        return MicroBatch(tokens, tokens, f"t = min(T, n·s)  [T={T}, n={share:g}, s={s}]")
    b = min(math.ceil(share), T - s + 1)
    text = f"b·s, b = min(n, T - s + 1), t = min(T, n·s)  [T={T}, n={share:g}, s={s}]"
    return MicroBatch(b * s, tokens, text)


def verl_activations(m: LlamaShape, mb: MicroBatch, packed: bool) -> Term:
    """An update's activations in verl's FSDP actor (gradient checkpointing, bf16) for its largest
    micro-batch (p positions run, t tokens): each layer's input, kept to be recomputed (L·p·c·h);
    and at once either one layer recomputed in the backward, or the logits at the turn from forward
    to backward. Unpacked (sdpa, no flash-attn), workers/engine/fsdp/transformer_impl.py
    prepare_model_outputs cuts the padded logits (p·V) into a copy of the t sequences' rows and
    utils/torch_functional.py logprobs_from_logits_v2 saves each row's bf16 log-softmax: (p + 2t)·V·c.
    Packed, flash-attn's cross-entropy writes the gradient into the logits: t·V·c."""
    c, p, t = BF16, mb.padded, mb.tokens
    layer = p * c * (6 * m.hidden + 2 * m.kv_width + 4 * m.ffn)
    logits = (t if packed else p + 2 * t) * m.vocab * c
    what = "t·V·c" if packed else "(p + 2t)·V·c"
    formula = f"L·p·c·h + max(p·c·(6h + 2kv + 4f), {what}), p = {mb.formula}  [c={c}]"
    return Term("activations", formula, m.layers * p * c * m.hidden + max(layer, logits))


def verl_phases(
    kept: tuple[str, ...], reference: tuple[str, ...], training: tuple[str, ...], optimizer_step=()
) -> dict:
    """A hybrid-engine step's phases: each holds the terms it uses and those kept on the GPU
    outside their use (not offloaded). The weight sync holds the actor's parameters (no gradients),
    the rollout's weights and the tensor being sent; the optimizer step, where there is one of its
    own, the actor's states and the step's temporaries (activations and gathered units are gone)."""
    uses = {
        "generation": ("rollout_budget",),
        "weight_sync": ("rollout_weights", "sync_tensor", "actor_weights"),
        "reference": reference,
        "training": training,
        **({"optimizer_step": optimizer_step} if optimizer_step else {}),
    }
    return {phase: tuple(dict.fromkeys(names + kept)) for phase, names in uses.items()}


def megatron_grpo_footprint(m: LlamaShape, g: GRPOStage, layout: Layout, site: Site) -> Footprint:
    """verl's hybrid engine, megatron backend: the same phases as FSDP's (ASSUMPTIONS)."""
    v = g.verl
    budget, rollout_weights, min_kv, refusals = rollout_terms(m, v, site.gpu_bytes, g.max_new_tokens)
    weights, grads, optimizer = (
        replace(t, name=f"actor_{t.name}")
        for t in training_states(m.params(), MCORE_MIXED, replace(layout, offload=False))
    )
    s = v.max_model_len(g.max_new_tokens)
    gpu = [
        weights,
        replace(grads, formula=f"{grads.formula} (fp32 main gradients)"),
        optimizer,
        replace(weights, name="reference_weights"),
        pipelined_activations(m, verl_micro_batch(g, max(layout.dp, 1)).padded / s, s, layout.tp),
        budget,
        rollout_weights,
        min_kv,
        Term(
            "sync_tensor",
            "V·h·2·2 (the largest tensor's TP shards gathered, then concatenated)",
            4 * m.vocab * m.hidden,
        ),
    ]
    params_kept = ("actor_weights", "actor_gradients", "reference_weights") * (not layout.param_offload)
    kept = params_kept + ("actor_optimizer",) * (not layout.offload)
    phases = verl_phases(
        kept,
        reference=("reference_weights",),
        training=("actor_weights", "actor_gradients", "actor_optimizer", "activations"),
    )
    host = megatron_host(m, layout, site, weights, optimizer)
    return Footprint(gpu, host, phases, refusals + megatron_refusals(m, layout))


def pipelined_activations(m: LlamaShape, b: float, s: int, tp: int) -> Term:
    """verl's megatron actor saves every layer's activations (no recomputation), all split over TP
    by sequence parallelism; under 1F1B the first pipeline stage has at most pp micro-batches of its
    L/pp layers in flight, L layers' worth, the last stage the logits: both counted."""
    whole = activations(m, b, s, BF16, 1, False, False)
    return replace(whole, formula=f"({whole.formula})/tp  [sequence parallel, 1F1B]", bytes=whole.bytes / tp)


def megatron_refusals(m: LlamaShape, layout: Layout) -> tuple[str, ...]:
    tp, pp, n = layout.tp, layout.pp, layout.gpus
    checks = (
        (n % (tp * pp), f"megatron tp·pp ({tp * pp}) does not divide {n} GPUs"),
        (m.layers % pp, f"megatron pp {pp} does not divide the {m.layers} layers"),
        (m.kv_heads % tp, f"megatron tp {tp} does not divide the {m.kv_heads} KV heads"),
    )
    return tuple(why for bad, why in checks if bad)


def megatron_host(m: LlamaShape, layout: Layout, site: Site, weights: Term, optimizer: Term) -> list[Term]:
    """Per node: every rank reads the whole checkpoint tensors of its pipeline stage (TP rank 0
    splits and scatters them), then param_offload moves the actor's and the reference's bf16
    parameters and optimizer_offload the optimizer's states to host memory."""
    ranks = node_ranks(layout, site.gpus_per_node)
    moved = [t for t, on in ((weights, layout.param_offload), (optimizer, layout.offload)) if on]
    ref = layout.param_offload * weights.bytes
    return [
        *host_terms(m, "P/pp", m.params() / layout.pp, ranks, site),
        Term("reference", f"ranks·{weights.formula} (param_offload)" if ref else "0", ranks * ref),
        offloaded(" + ".join(t.formula for t in moved), sum(t.bytes for t in moved), ranks),
    ]


def verl_host(m: LlamaShape, layout: Layout, site: Site) -> list[Term]:
    """The first node's: rank 0's whole fp32 model at start, the reference's fp32 shards, offloads."""
    P, N, ranks = m.params(), layout.gpus, node_ranks(layout, site.gpus_per_node)
    moved = ("P·4/N",) * layout.param_offload + ("P·8/N",) * layout.offload
    per_rank = (4 * layout.param_offload + 8 * layout.offload) * P / N
    return [
        Term("runtime", f"ranks·{site.runtime_per_rank / GB:g} GB", ranks * site.runtime_per_rank),
        Term("loading", "P·4 (rank 0 builds the whole model in fp32)", 4 * P),
        Term("reference", "ranks·P·4/N (fp32, CPU-offloaded)", ranks * 4 * P / N),
        offloaded(" + ".join(moved), per_rank, ranks),
    ]


def fsdp_gathered_weights(m: LlamaShape, g: GRPOStage, N: int) -> Term:
    """The actor's weights gathered by FSDP at their most (bf16 compute copies)."""
    P = m.params()
    if g.reshard_after_forward and g.fsdp_units == "layer":
        # FSDP gathers one unit at a time, but the root unit (embeddings, output layer) stays
        # gathered through forward and backward.
        return Term(
            "actor_gathered", "(embeddings + 1 layer)·2", (m.embedding_params() + m.layer_params()) * BF16
        )
    if g.reshard_after_forward:  # one unit: the whole model gathered for each forward and backward
        return Term("actor_gathered", "P·2 (fsdp_units: model)", P * BF16)
    # every layer stays gathered from its forward to its backward
    return Term("actor_gathered", "P·2 (reshard_after_forward: false)", P * BF16)


def synth_footprint(m: LlamaShape, st: SynthStage, layout: Layout, site: Site) -> Footprint:
    P, ranks = m.params(), node_ranks(layout, site.gpus_per_node)
    if st.engine == "verl":  # replicas of rollout_tp GPUs, each GPU giving vLLM gmu·M
        budget, weights, min_kv, refusals = rollout_terms(m, st.verl, site.gpu_bytes, st.max_new_tokens)
        host = host_terms(m, "P/tp", P / st.verl.rollout_tp, ranks, site)
        return Footprint([budget, weights, min_kv], host, {"generation": ("rollout_budget",)}, refusals)
    held = synth_residency("", st, P)
    seqs = st.batch_size * st.samples_per_prompt
    s = site.prompt_tokens + st.max_new_tokens
    gpu = [
        Term("weights", held.formula, held.bytes),
        kv_cache(m, seqs, "batch_size·samples_per_prompt", s, held_width(st)),
    ]
    return Footprint(gpu, host_terms(m, "P", P, ranks, site))
