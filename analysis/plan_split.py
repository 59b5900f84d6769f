"""`hpcr1 plan` for a GRPO stage's GPUs split between generation and training (`rollout_ranks`):
for each split of the config's nproc, the memory of each side and its verdict, a roofline estimate
of the step, and the split it would choose, or colocated, and why.

The estimate (SPLIT_ASSUMPTIONS): generation decodes max_new_tokens steps, each reading a replica's
weights and its sequences' KV cache from GPU memory or doing their FLOPs at peak, whichever is
slower (memory, at these batch sizes): on fewer GPUs each replica decodes more sequences for about
the same time a step, which is why a split can win. Training runs its passes (update, old
log-probs, reference) at TRAINING_MFU of peak and scales with its GPUs. A step is generation then
training colocated, and the slower of the two plus the weight hand-over split.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from analysis.memory import BF16, Footprint, Layout, Site, Term, kv_cache, rollout_terms
from analysis.model_shape import LlamaShape
from analysis.native_fit import held_width
from analysis.plan import NO_FIT, RUNTIME_PER_RANK, Machine, Option, Speed, evaluate, judge
from analysis.plan_search import Candidate, configured
from core.cluster import rollout_pool_problem, rollout_span_problem
from core.config import GRPOStage, RunConfig

# The update's, old log-probs' and reference's share of the GPUs' bf16 peak: what well-tuned FSDP
# and megatron training reach on A100s (about 40-50% MFU in their reports); an assumption.
TRAINING_MFU = 0.4
# What the rollout alone holds: none of it on a training GPU once the rollout has its own.
ROLLOUT_TERMS = ("rollout_budget", "rollout_weights", "rollout_min_kv", "kv_cache")
SPLIT_ASSUMPTIONS = (
    "Split (rollout_ranks): the training side is the stage's footprint at the training GPUs less the "
    "rollout's terms; the generation side is one vLLM instance's gmu·M (verl) or the whole model in the "
    "stage's dtype with the KV cache of its share of the step's sequences (native).",
    "Split timing is a roofline estimate from the profile's datasheet rates: a decode step reads "
    "a replica's bf16 weights and its sequences' KV cache (at the mean context, prompt + half the "
    "response) or does 2·P FLOPs a sequence at peak, whichever is slower, after a prefill at peak; "
    f"training does (6·epochs + 2 reference + 2 old log-probs)·P FLOPs a token at {TRAINING_MFU:.0%} "
    "of peak; the hand-over sends the bf16 weights through one NIC. Colocated, a step is generation "
    "then training (its in-GPU weight sync left out); split, the slower of the two plus the hand-over.",
)


@dataclass(frozen=True)
class Timing:
    generation: float
    training: float
    handover: float

    @property
    def split_step(self) -> float:
        return max(self.generation, self.training) + self.handover

    @property
    def colocated_step(self) -> float:
        """Generation on all the GPUs, then training on all (the in-GPU weight sync left out)."""
        return self.generation + self.training


@dataclass(frozen=True)
class SplitOption:
    rollout_gpus: int
    training: Option
    """The training side at the GPUs left, its verdict among them."""
    generation: Option
    """One generating GPU's footprint and verdict."""
    timing: Timing | None

    @property
    def feasible(self) -> bool:
        return NO_FIT not in (self.training.verdict, self.generation.verdict)


@dataclass(frozen=True)
class SplitPlan:
    gpus: int
    colocated: Timing | None
    """Generation on all the GPUs, then training on all: its step is their sum."""
    options: list[SplitOption]
    chosen: SplitOption | None
    """None: stay colocated (or no rates to tell)."""
    why: str


def plan_splits(
    cfg: RunConfig, shape: LlamaShape, machine: Machine, prompt_tokens: int
) -> dict[str, SplitPlan]:
    """Each GRPO stage's splits of the config's nproc."""
    site = Site(machine.gpu_bytes, machine.gpus_per_node, RUNTIME_PER_RANK, prompt_tokens, cfg.eval)
    return {
        sid: plan_split(stage, shape, site, machine, cfg.nproc)
        for sid, stage in cfg.stages().items()
        if isinstance(stage, GRPOStage)
    }


def plan_split(stage: GRPOStage, shape: LlamaShape, site: Site, machine: Machine, gpus: int) -> SplitPlan:
    settings = configured(stage).settings | ({"data_parallel": "ddp"} if stage.engine == "native" else {})
    colocated = timing(stage, shape, site, machine, gpus, gpus) if machine.speed else None
    options = [
        SplitOption(
            r,
            training_side(stage, shape, site, machine, gpus - r, Candidate(settings)),
            generation_side(stage, shape, site, machine, r),
            timing(stage, shape, site, machine, r, gpus - r) if machine.speed else None,
        )
        for r in rollout_counts(stage, gpus, machine.gpus_per_node)
    ]
    chosen, why = choose_split(options, colocated, gpus)
    return SplitPlan(gpus, colocated, options, chosen, why)


def rollout_counts(g: GRPOStage, gpus: int, gpus_per_node: int) -> list[int]:
    """The splits each engine can run: verl's rollout pool as `hpcr1 submit` accepts it
    (core.cluster.rollout_pool_problem), in whole replicas; the native engine's generators are at
    most half the ranks (core/config.py). The training GPUs hold whole megatron layouts."""
    if g.engine == "native":
        return list(range(1, gpus // 2 + 1))
    v = g.verl
    model_parallel = v.megatron_tp * v.megatron_pp if v.backend == "megatron" else 1
    return [
        r
        for r in range(1, gpus)
        if not rollout_pool_problem(r, gpus, gpus_per_node)
        and r % v.rollout_tp == 0
        and (gpus - r) % model_parallel == 0
    ]


def training_side(stage, shape, site, machine, gpus: int, cand: Candidate) -> Option:
    """The colocated footprint at `gpus` less the rollout: its terms, its generation phase, and the
    refusals that are about the rollout's GPUs (judged on the other side)."""
    colocated = evaluate(stage, shape, site, machine, gpus, cand)
    fp, w = colocated.footprint, held_width(stage)
    gpu = [t for t in fp.gpu if t.name not in ROLLOUT_TERMS]
    if stage.engine == "native":  # the trainers keep no rollout copy (build_roles' with_rollout)
        gpu = [without_rollout_copy(t, w, shape.params()) if t.name == "resident" else t for t in gpu]
    phases = {
        phase: tuple(n for n in names if n not in ROLLOUT_TERMS)
        for phase, names in fp.phases.items()
        if phase != "generation"
    }
    verl = stage.engine == "verl"
    rollout_refusals = (
        rollout_terms(shape, stage.verl, site.gpu_bytes, stage.max_new_tokens)[3] if verl else ()
    )
    refusals = tuple(r for r in fp.refusals if r not in rollout_refusals and not r.startswith("rollout_tp "))
    trained = Footprint(gpu, fp.host, phases, refusals)
    verdict, caveats = judge(stage, colocated.layout, trained, machine)
    return replace(colocated, footprint=trained, verdict=verdict, caveats=caveats)


def without_rollout_copy(resident, width: int, P: int):
    return replace(
        resident,
        formula=f"{resident.formula} - {width}·P (no rollout copy)",
        bytes=resident.bytes - width * P,
    )


def generation_side(stage: GRPOStage, shape: LlamaShape, site: Site, machine: Machine, gpus: int) -> Option:
    """One generating GPU: verl's vLLM instance (gmu·M, which vLLM must start in), or the native
    generator's whole model and the KV cache of its share of the step's sequences."""
    if stage.engine == "native":
        w, P = held_width(stage), shape.params()
        sequences = stage.prompts_per_step * stage.group_size / gpus
        length = site.prompt_tokens + stage.max_new_tokens
        kv = kv_cache(shape, sequences, "prompts_per_step·G/R", length, w)
        weights = Term("rollout_weights", f"P·{w} (whole model)", w * P)
        fp, layout = Footprint([weights, kv], []), Layout(gpus, 1, 0)
    else:
        v = stage.verl
        budget, _, _, refusals = rollout_terms(shape, v, site.gpu_bytes, stage.max_new_tokens)
        span = rollout_span_problem(v.rollout_tp, gpus, machine.gpus_per_node)
        refusals += (f"rollout_tp {span}",) if span else ()
        fp, layout = Footprint([budget], [], refusals=refusals), Layout(gpus, v.rollout_tp, 0)
    verdict, caveats = judge(stage, layout, fp, machine)
    return Option(layout, fp, verdict, caveats)


def timing(stage: GRPOStage, shape: LlamaShape, site: Site, machine: Machine, generating: int, training: int):
    speed = machine.speed
    return Timing(
        generation_seconds(stage, shape, site, speed, generating),
        training_seconds(stage, shape, site, speed, training),
        BF16 * shape.params() / speed.nic,
    )


def prompt_length(stage: GRPOStage, site: Site) -> int:
    return site.prompt_tokens if stage.engine == "native" else stage.verl.max_prompt_length


def generation_seconds(g: GRPOStage, m: LlamaShape, site: Site, speed: Speed, gpus: int) -> float:
    """The step's sequences over gpus/tp replicas: a prefill at peak, then max_new_tokens decode
    steps, each the slower of reading the replica's weights and KV cache and its FLOPs."""
    tp = 1 if g.engine == "native" else min(g.verl.rollout_tp, gpus)
    P, prompt = m.params(), prompt_length(g, site)
    sequences = math.ceil(g.prompts_per_step * g.group_size / (gpus // tp))
    context = prompt + g.max_new_tokens / 2
    kv = 2 * m.layers * m.kv_width * BF16 * context * sequences
    decode = max((BF16 * P + kv) / tp / speed.memory_bandwidth, 2 * P * sequences / tp / speed.flops)
    prefill = 2 * P * sequences * prompt / tp / speed.flops
    return prefill + g.max_new_tokens * decode


def training_seconds(g: GRPOStage, m: LlamaShape, site: Site, speed: Speed, gpus: int) -> float:
    tokens = g.prompts_per_step * g.group_size * (prompt_length(g, site) + g.max_new_tokens)
    passes = 6 * g.ppo_epochs + 2 * (g.kl_coef > 0) + 2 * (g.old_log_probs == "actor")
    return passes * m.params() * tokens / (gpus * speed.flops * TRAINING_MFU)


def choose_split(
    options: list[SplitOption], colocated: Timing | None, gpus: int
) -> tuple[SplitOption | None, str]:
    feasible = [o for o in options if o.feasible]
    if not options:
        return None, f"no split of {gpus} GPUs the engine can run"
    if not feasible:
        return None, "no split fits: each leaves one side out of memory"
    if colocated is None:
        return None, (
            "the profile gives no rates (gpu_bf16_tflops, gpu_memory_bandwidth_gbs, nic_gbs) to "
            "estimate a step with: the memory verdicts only"
        )
    best = min(feasible, key=lambda o: o.timing.split_step)
    colocated_step, t = colocated.colocated_step, best.timing
    if t.split_step >= colocated_step:
        return None, (
            f"colocated: {colocated_step:.1f} s a step (generation {colocated.generation:.1f} s then "
            f"training {colocated.training:.1f} s on all {gpus}), which no split beats (the best, "
            f"{best.rollout_gpus} generating, {t.split_step:.1f} s)"
        )
    return best, (
        f"{best.rollout_gpus} of {gpus} GPUs generating: {t.split_step:.1f} s a step against "
        f"{colocated_step:.1f} s colocated ({colocated_step / t.split_step:.2f}x); generation "
        f"{t.generation:.1f} s under training {t.training:.1f} s on {gpus - best.rollout_gpus}, "
        f"hand-over {t.handover:.1f} s"
    )
