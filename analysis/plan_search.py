"""What `hpcr1 plan` tries for a stage at a GPU count: the settings the engines' tuning guides vary,
in the order of preference the guides give (the cheapest in time first), and the checks our own
commands make before they start a stage.

A candidate is a set of config settings (`field=value` inside the stage's section, what `hpcr1 run`
and `submit` take as overrides; SFT's pipeline parallelism among them) and, for SFT, layout
features no config field sets yet (recomputation, CPU offload). Candidates come most preferred
first: the rules of an engine are nested loops, the first rule the outermost, so a later rule only
breaks ties of the earlier ones.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from analysis.memory import Layout
from analysis.model_shape import LlamaShape
from core.cluster import rollout_span_problem
from core.config import GRPOStage, SFTStage, SynthStage

# The documents each rule comes from, by the tag the rules cite.
REFERENCES = {
    "verl-tuning": "verl, Performance Tuning Guide: https://verl.readthedocs.io/en/latest/perf/perf_tuning.html",
    "verl-practices": "verl, LLM Best Practices: https://verl.readthedocs.io/en/latest/perf/best_practices.html",
    "hf-deepspeed": "Hugging Face Transformers, DeepSpeed integration, 'How to Choose Which ZeRO Stage and "
    "Offloads To Use For Best Performance': https://huggingface.co/docs/transformers/v4.30.0/main_classes/deepspeed",
    "megatron-sc21": "Narayanan et al., Efficient Large-Scale Language Model Training on GPU Clusters Using "
    "Megatron-LM (SC21), takeaway 1: https://arxiv.org/abs/2104.04473",
    "recompute": "Korthikanti et al., Reducing Activation Recomputation in Large Transformer Models: "
    "https://arxiv.org/abs/2205.05198",
    "config": "core/config.py: GRPOStage.data_parallel and reshard_after_forward",
}

# verl: "a value between 0.5 and 0.7 often strikes a good balance" without offload, "0.8-0.9 is
# common" with it (verl-tuning, verl-practices); 0.4 for GPUs the actor's states crowd.
GPU_MEMORY_UTILIZATION = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
# (param_offload, optimizer_offload): none, then the optimizer's states alone (moved for the update
# only), then the parameters (moved around every phase), then both.
VERL_OFFLOADS = ((False, False), (False, True), (True, False), (True, True))


@dataclass(frozen=True)
class Rule:
    prefer: str
    why: str
    sources: tuple[str, ...]
    """REFERENCES' tags (a section named after a colon)."""


ROLLOUT_TP_RULE = Rule(
    "smaller rollout TP, within a node before whole nodes",
    "more vLLM replicas, and data parallelism yields more throughput than TP; TP across nodes "
    "all-reduces every layer's activations over the network",
    ("verl-tuning: Rollout Generation Tuning",),
)
GMU_RULE = Rule(
    "higher gpu_memory_utilization, 0.9 down to 0.4",
    "a larger KV cache keeps more sequences decoding at once",
    ("verl-tuning: Rollout Generation Tuning", "verl-practices"),
)

ORDER: dict[str, tuple[Rule, ...]] = {
    "sft": (
        Rule(
            "no CPU offload of the optimizer",
            "ZeRO-Offload runs Adam on the CPU and moves the gradients over PCIe every step",
            ("hf-deepspeed",),
        ),
        Rule(
            "smaller pipeline parallel",
            "TP within a node first, PP only when necessary: pipeline bubbles idle every stage, and "
            "pp > 1 runs ZeRO 0 or 1 only",
            ("megatron-sc21",),
        ),
        Rule(
            "smaller tensor parallel, within a node",
            "TP all-reduces activations in every layer's forward and backward; across nodes it is slowest",
            ("megatron-sc21",),
        ),
        Rule(
            "no activation recomputation",
            "it runs each layer's forward twice: about a third more compute",
            ("recompute",),
        ),
        Rule(
            "larger micro_batch_size",
            "larger matrix multiplies, fewer accumulation steps: raise it as far as memory allows",
            ("hf-deepspeed",),
        ),
        Rule(
            "lower ZeRO stage",
            "speed: stage 0 (DDP) > 1 > 2 > 3; each stage adds collectives",
            ("hf-deepspeed",),
        ),
    ),
    "grpo verl": (
        Rule(
            "no CPU offload, else the optimizer's states, then the parameters, then both",
            "offloaded states cross PCIe every step (the optimizer's for the update only, the "
            "parameters around every phase); verl offloads when GPU memory is insufficient",
            ("verl-practices: Megatron-related parameters", "hf-deepspeed"),
        ),
        Rule(
            "megatron: smaller PP, then smaller TP",
            "TP within a node first, PP only when necessary: pipeline bubbles idle every stage",
            ("verl-practices: Megatron parallelism parameters", "megatron-sc21"),
        ),
        ROLLOUT_TP_RULE,
        Rule(
            "larger micro_batch_size_per_gpu, up to a GPU's share of a mini-batch",
            "fewer, larger forward and backward passes",
            ("verl-tuning: Batch Size Tuning",),
        ),
        GMU_RULE,
    ),
    "grpo native": (
        Rule(
            "data_parallel ddp before fsdp2", "DDP all-reduces the gradients and gathers nothing", ("config",)
        ),
        Rule("reshard_after_forward false before true", "no repeated all-gathers of the layers", ("config",)),
        Rule(
            "larger micro_batch_size",
            "fewer forward and backward passes",
            ("verl-tuning: Batch Size Tuning",),
        ),
    ),
    "generation verl": (ROLLOUT_TP_RULE, GMU_RULE),
    "generation native": (),
}


@dataclass(frozen=True)
class Candidate:
    settings: dict[str, object]
    """Config field (dotted, inside the stage's section) -> value."""
    extras: dict[str, bool] = field(default_factory=dict)
    """Layout features no config field sets (SFT's recomputation and CPU offload)."""


@dataclass(frozen=True)
class Group:
    """Candidates that differ only in the micro-batch and the settings after it in the order. Memory
    grows with the micro-batch and nothing refuses one: if no candidate of `floor` (those of the
    smallest micro-batch) fits, none of the group does, and the search skips the rest."""

    candidates: list[Candidate]
    floor: list[Candidate]


def order_key(stage) -> str:
    if isinstance(stage, SFTStage):
        return "sft"
    return f"{'grpo' if isinstance(stage, GRPOStage) else 'generation'} {stage.engine}"


def groups(stage, shape: LlamaShape, gpus: int, gpus_per_node: int) -> Iterator[Group]:
    """Everything the search tries for `stage` on `gpus` GPUs, most preferred first."""
    key = order_key(stage)
    if key == "sft":
        return sft_groups(stage, shape, gpus, gpus_per_node)
    if key == "grpo verl":
        return verl_grpo_groups(stage, shape, gpus, gpus_per_node)
    if key == "grpo native":
        return native_grpo_groups(stage, gpus)
    if key == "generation verl":
        return verl_generation_groups(stage, shape, gpus, gpus_per_node)
    return iter([whole([Candidate({})])])  # native synthesis: one whole model a rank, nothing to vary


def whole(candidates: list[Candidate]) -> Group:
    """A group with no micro-batch to prune by."""
    return Group(candidates, candidates)


def by_micro(micros: list[int], inner: list, make) -> Group:
    """micro-batch (largest first) x the settings after it; `make(micro, setting)` -> Candidate."""
    return Group([make(m, x) for m in micros for x in inner], [make(micros[-1], x) for x in inner])


def sft_groups(s: SFTStage, shape: LlamaShape, gpus: int, gpus_per_node: int) -> Iterator[Group]:
    # megatron splits heads, KV heads, the vocabulary and the FFN; DeepSpeed's offload needs ZeRO >= 1
    tps = tp_sizes(gpus, gpus_per_node, (shape.heads, shape.kv_heads, shape.vocab, shape.ffn))
    for offload in (False, True):
        for pp in pipeline_sizes(shape, gpus):
            yield from sft_tp_groups(s, gpus, tps, offload, pp)


def pipeline_sizes(shape: LlamaShape, gpus: int) -> list[int]:
    """Pipeline-parallel sizes, smallest first: powers of two dividing the layers and the GPUs; 1
    alone for tied embeddings, which the SFT engine cannot split."""
    if shape.tied_embeddings:
        return [1]
    return [
        p for p in (1 << i for i in range(shape.layers.bit_length())) if not shape.layers % p and not gpus % p
    ]


def sft_zero_stages(offload: bool, pp: int) -> list[int]:
    """DeepSpeed's offload needs ZeRO >= 1; pipeline stages run ZeRO 0 or 1 (core/config.py)."""
    return [z for z in (0, 1, 2) if (z >= 1 or not offload) and (z <= 1 or pp == 1)]


def sft_tp_groups(s: SFTStage, gpus: int, tps: list[int], offload: bool, pp: int) -> Iterator[Group]:
    # overlap_comm runs in DeepSpeed's backward, which pipeline stages do not run: off where pp > 1
    no_overlap = {"parallel.overlap_comm": False} if pp > 1 and s.parallel.overlap_comm else {}
    for tp in tps:
        if gpus % (tp * pp):
            continue
        micros = divisors_down(s.global_batch_size, gpus // (tp * pp)) or [s.micro_batch_size]
        for recompute in (False, True):
            extras = {"offload": offload, "recompute": recompute}

            def make(micro: int, zero: int, tp=tp, extras=extras) -> Candidate:
                parallel = {"parallel.tp": tp, "parallel.pp": pp, "parallel.zero_stage": zero, **no_overlap}
                return Candidate({**parallel, "micro_batch_size": micro}, extras)

            yield by_micro(micros, sft_zero_stages(offload, pp), make)


def verl_grpo_groups(g: GRPOStage, shape: LlamaShape, gpus: int, gpus_per_node: int) -> Iterator[Group]:
    shares = memory_shares(g.verl.gpu_memory_utilization)
    for param, optimizer in VERL_OFFLOADS:
        for actor in actor_parallel(g, shape, gpus, gpus_per_node):
            dp = gpus // (actor.get("verl.megatron_tp", 1) * actor.get("verl.megatron_pp", 1))
            key, micros = micro_batches(g, dp)
            for rollout_tp in rollout_tps(shape, gpus, gpus_per_node):
                outer = {"verl.param_offload": param, "verl.optimizer_offload": optimizer, **actor}
                outer["verl.rollout_tp"] = rollout_tp

                def make(micro: int, gmu: float, outer=outer) -> Candidate:
                    return Candidate({**outer, key: micro, "verl.gpu_memory_utilization": gmu})

                yield by_micro(micros, shares, make)


def micro_batches(g: GRPOStage, dp: int) -> tuple[str, list[int]]:
    """The setting that sizes verl's micro-batches and its values, largest first: sequences that
    divide a GPU's share of a mini-batch, or, with a token budget, as many full-length sequences'
    tokens (and the configured budget, where the share is larger)."""
    micros = divisors_down(g.prompts_per_step // g.mini_batches * g.group_size, dp)
    budget = g.verl.max_tokens_per_gpu
    if budget is None:
        return micro_batch_key(g), micros or [g.verl.micro_batch_size_per_gpu]
    s = g.verl.max_model_len(g.max_new_tokens)
    budgets = {min(budget, micros[0] * s)} if micros else {budget}
    return micro_batch_key(g), sorted(budgets | {m * s for m in micros}, reverse=True)


def micro_batch_key(g: GRPOStage) -> str:
    """The setting that sizes verl's micro-batches: sequences, or a token budget where one is set."""
    return "verl.micro_batch_size_per_gpu" if g.verl.max_tokens_per_gpu is None else "verl.max_tokens_per_gpu"


def actor_parallel(g: GRPOStage, shape: LlamaShape, gpus: int, gpus_per_node: int) -> list[dict]:
    """verl's megatron actor: (tp, pp) with TP within a node dividing the KV heads and PP the layers,
    smaller PP first, then smaller TP; FSDP has nothing to choose."""
    if g.verl.backend != "megatron":
        return [{}]
    tps = tp_sizes(gpus, gpus_per_node, (shape.kv_heads,))
    pps = [p for p in range(1, shape.layers + 1) if shape.layers % p == 0]
    return [{"verl.megatron_tp": t, "verl.megatron_pp": p} for p in pps for t in tps if gpus % (t * p) == 0]


def native_grpo_groups(g: GRPOStage, gpus: int) -> Iterator[Group]:
    # a micro-batch larger than a rank's rows of a mini-batch changes nothing (native_grpo_footprint)
    rows = -(-g.prompts_per_step * g.group_size // gpus // g.mini_batches)
    micros = sorted({rows, *(1 << i for i in range(rows.bit_length()) if 1 << i < rows)}, reverse=True)
    for data_parallel, reshard in (("ddp", None), ("fsdp2", False), ("fsdp2", True)):
        outer = {"data_parallel": data_parallel}
        if reshard is not None:  # FSDP2's alone
            outer["reshard_after_forward"] = reshard

        def make(micro: int, _, outer=outer) -> Candidate:
            return Candidate({**outer, "micro_batch_size": micro})

        yield by_micro(micros, [None], make)


def verl_generation_groups(
    st: SynthStage, shape: LlamaShape, gpus: int, gpus_per_node: int
) -> Iterator[Group]:
    shares = memory_shares(st.verl.gpu_memory_utilization)
    for tp in rollout_tps(shape, gpus, gpus_per_node):
        yield whole([Candidate({"verl.rollout_tp": tp, "verl.gpu_memory_utilization": g}) for g in shares])


def setting_keys(stage) -> list[str]:
    """The config fields (inside the stage's section) the search varies for this stage's engine."""
    key = order_key(stage)
    if key == "sft":
        return ["parallel.tp", "parallel.pp", "parallel.zero_stage", "micro_batch_size"]
    if key == "grpo verl":
        actor = ["verl.megatron_tp", "verl.megatron_pp"] * (stage.verl.backend == "megatron")
        offload = ["verl.param_offload", "verl.optimizer_offload"]
        return [*offload, *actor, "verl.rollout_tp", micro_batch_key(stage), "verl.gpu_memory_utilization"]
    if key == "grpo native":
        reshard = ["reshard_after_forward"] * (stage.data_parallel == "fsdp2")
        return ["data_parallel", *reshard, "micro_batch_size"]
    if key == "generation verl":
        return ["verl.rollout_tp", "verl.gpu_memory_utilization"]
    return []


def configured(stage) -> Candidate:
    """The stage's own values of the settings the search varies."""
    return Candidate({key: setting(stage, key) for key in setting_keys(stage)})


def setting(stage, key: str):
    for name in key.split("."):
        stage = getattr(stage, name)
    return stage


def with_settings(stage, settings: dict[str, object]):
    """The stage with `settings` applied and validated, as the config's own overrides are."""
    if not settings:
        return stage
    data = stage.model_dump()
    for key, value in settings.items():
        *parents, leaf = key.split(".")
        node = data
        for name in parents:
            node = node[name]
        node[leaf] = value
    return type(stage).model_validate(data)


def engine_layout(stage, gpus: int) -> Layout:
    """The layout a stage's settings give on `gpus` GPUs."""
    if isinstance(stage, SFTStage):
        p = stage.parallel
        return Layout(gpus, p.tp, p.zero_stage, pp=p.pp)
    v = stage.verl
    if stage.engine == "native":  # one whole model a rank (synth, ddp) or FSDP2 over all
        zero = 3 if isinstance(stage, GRPOStage) and stage.data_parallel == "fsdp2" else 0
        return Layout(gpus, 1, zero)
    if isinstance(stage, SynthStage):
        return Layout(gpus, v.rollout_tp, 0)
    if v.backend == "megatron":  # megatron's distributed optimizer: ZeRO-1 over dp = N/(tp·pp)
        return Layout(
            gpus, v.megatron_tp, 1, v.optimizer_offload, False, v.param_offload, v.megatron_pp, megatron=True
        )
    # verl's actor: FSDP over all, gradient checkpointing on (its default)
    return Layout(gpus, v.rollout_tp, 3, v.optimizer_offload, True, v.param_offload)


def refusals(stage, layout: Layout, gpus_per_node: int) -> tuple[str, ...]:
    """What our own commands refuse before a stage starts, beyond the memory model's refusals:
    `hpcr1 submit`'s rollout and batch-split checks, the config's batch checks."""
    if isinstance(stage, SFTStage):
        dp, gbs, micro = layout.dp, stage.global_batch_size, stage.micro_batch_size
        bad = bool(gbs % (micro * dp))
        return (f"global_batch_size {gbs} is not a multiple of micro_batch_size·dp ({micro}·{dp})",) * bad
    if stage.engine == "native":
        return native_batch_refusals(stage, layout.gpus) if isinstance(stage, GRPOStage) else ()
    problem = rollout_span_problem(stage.verl.rollout_tp, layout.gpus, gpus_per_node)
    span = (f"rollout_tp {problem} (hpcr1 submit refuses it)",) if problem else ()
    split = verl_batch_refusals(stage, layout) if isinstance(stage, GRPOStage) else ()
    return span + split


def verl_batch_refusals(g: GRPOStage, layout: Layout) -> tuple[str, ...]:
    """stages/engines/verl_trainer.py _check_batch_split: every mini-batch's responses split evenly
    over the data-parallel GPUs."""
    if g.prompts_per_step % g.mini_batches:
        return (f"mini_batches {g.mini_batches} does not divide prompts_per_step ({g.prompts_per_step})",)
    responses = g.prompts_per_step // g.mini_batches * g.group_size
    dp = layout.dp if layout.megatron else layout.gpus  # FSDP's layout.tp is the rollout's
    if responses % dp:
        return (f"a mini-batch of {responses} responses does not split over {dp} data-parallel GPUs",)
    return ()


def native_batch_refusals(g: GRPOStage, gpus: int) -> tuple[str, ...]:
    """core/config.py _check_grpo_stage: the prompts split over the ranks, then into mini-batches."""
    if g.prompts_per_step % gpus:
        return (f"prompts_per_step {g.prompts_per_step} is not a multiple of {gpus} ranks",)
    if g.prompts_per_step // gpus % g.mini_batches:
        return (f"mini_batches {g.mini_batches} does not divide the prompts per rank",)
    return ()


def tp_sizes(gpus: int, gpus_per_node: int, split: tuple[int, ...]) -> list[int]:
    """Tensor-parallel sizes within a node that divide the GPU count and every dimension in `split`."""
    sizes = [1 << i for i in range(gpus_per_node.bit_length()) if gpus_per_node % (1 << i) == 0]
    return [t for t in sizes if gpus % t == 0 and all(d % t == 0 for d in split)]


def rollout_tps(shape: LlamaShape, gpus: int, gpus_per_node: int) -> list[int]:
    """vLLM splits the attention heads; a replica spans part of a node or, where one node cannot
    hold it, whole nodes (core.cluster.rollout_span_problem), smaller first (ROLLOUT_TP_RULE)."""
    across = [n * gpus_per_node for n in range(2, gpus // gpus_per_node + 1)]
    spans = [t for t in across if not rollout_span_problem(t, gpus, gpus_per_node) and shape.heads % t == 0]
    return tp_sizes(gpus, gpus_per_node, (shape.heads,)) + spans


def memory_shares(configured_share: float) -> list[float]:
    return sorted({*GPU_MEMORY_UTILIZATION, configured_share}, reverse=True)


def divisors_down(total: int, parts: int) -> list[int]:
    """The divisors of total/parts, largest first; none when `parts` does not divide `total`."""
    if total % parts:
        return []
    share = total // parts
    return [d for d in range(share, 0, -1) if share % d == 0]
