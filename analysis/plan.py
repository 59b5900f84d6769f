"""The memory/feasibility planner behind `hpcr1 plan`: for each stage of a config and each GPU
count, its layout on the cluster's nodes, memory per GPU and host memory per node
(analysis/memory.py's formulas), and the verdict.

A GRPO or synthesis stage is planned as its engine is configured (verl's rollout_tp, offload flags,
micro-batch and, on the megatron backend, its tp and pp; the native engines' one layout), at every
GPU count. SFT's layout is searched:
the smallest tensor-parallel size that fits wins (TP traffic is the costliest and stays
within a node), then no activation recomputation (it costs a third more compute), then the lowest
ZeRO stage (fewer collectives); CPU offload only when nothing fits without it. A stage's `min_gpus`
is the smallest count planned at which it fits without offload.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import partial

from analysis.memory import Footprint, Layout, Site, grpo_footprint, sft_footprint, synth_footprint
from analysis.model_shape import LlamaShape
from core.cluster import ClusterProfile
from core.config import ConfigError, GRPOStage, RunConfig, SFTStage, SynthStage

GIB = 1 << 30
# Of a GPU's memory, the caching allocator's fragmentation, the CUDA context and NCCL's buffers
# take roughly a tenth; of a node's, the OS, the file system client and page cache.
GPU_USABLE = 0.9
HOST_USABLE = 0.9
# CUDA context, Python, torch, DeepSpeed and their pinned buffers, per rank in host memory.
RUNTIME_PER_RANK = 4e9
FITS, OFFLOAD, NO_FIT = "fits", "fits only with CPU offload", "does not fit"


@dataclass(frozen=True)
class Machine:
    """What one node offers, from the cluster profile."""

    name: str
    gpu_name: str
    gpu_bytes: float
    gpus_per_node: int
    host_bytes: float

    @classmethod
    def from_profile(cls, profile: ClusterProfile, gpu_memory_gib: float | None = None) -> Machine:
        gib = gpu_memory_gib or profile.gpu_memory_gib
        if not profile.gpus_per_node or not gib or not profile.host_memory_gib:
            raise ConfigError(
                "--cluster",
                f"profile {profile.name!r} gives no GPUs per node, GPU memory "
                "(gpu_memory_gib) or host memory (host_memory_gib) to plan for",
            )
        gpu_name = profile.gpu_name or "GPU"
        if gpu_memory_gib:  # say so: the profile's GPU name may give another memory size
            gpu_name += f" (taken as {gpu_memory_gib:g} GiB each)"
        return cls(profile.name, gpu_name, gib * GIB, profile.gpus_per_node, profile.host_memory_gib * GIB)

    def nodes(self, gpus: int) -> int:
        return -(-gpus // self.gpus_per_node)


@dataclass(frozen=True)
class Option:
    """One GPU count of one stage: the chosen layout, its footprint and the verdict."""

    layout: Layout
    footprint: Footprint
    verdict: str


@dataclass(frozen=True)
class StagePlan:
    stage_id: str
    kind: str
    """sft, grpo or generation."""
    engine: str
    """The engine and its configured settings, in words."""
    options: list[Option]
    """One per planned GPU count, ascending."""
    configured: Option
    """At the config's nproc, with the stage's own layout where it has one (SFT's tp and ZeRO stage)."""

    def min_gpus(self, verdict: str = FITS) -> int | None:
        return next((o.layout.gpus for o in self.options if o.verdict == verdict), None)


def fits(fp: Footprint, machine: Machine) -> bool:
    return (
        not fp.refusals
        and fp.gpu_bytes() <= GPU_USABLE * machine.gpu_bytes
        and fp.host_bytes() <= HOST_USABLE * machine.host_bytes
    )


def tp_sizes(gpus: int, machine: Machine, split: tuple[int, ...]) -> list[int]:
    """Tensor-parallel sizes within a node that divide the GPU count and every dimension in `split`."""
    sizes = [1 << i for i in range(machine.gpus_per_node.bit_length()) if 1 << i <= machine.gpus_per_node]
    return [t for t in sizes if gpus % t == 0 and all(d % t == 0 for d in split)]


def candidates(stage, shape: LlamaShape, gpus: int, machine: Machine) -> list[Layout]:
    """Layouts to try, most preferred first: SFT's that megatron can build, else the configured one."""
    if isinstance(
        stage, SFTStage
    ):  # megatron splits heads, KV heads, the vocabulary and the FFN; ZeRO-3 is refused
        tps = tp_sizes(gpus, machine, (shape.heads, shape.kv_heads, shape.vocab, shape.ffn))
        return [Layout(gpus, t, zero, recompute=r) for t in tps for r in (False, True) for zero in (0, 1, 2)]
    return [engine_layout(stage, gpus)]


def engine_layout(stage, gpus: int) -> Layout:
    """The layout a GRPO or synthesis stage's engine is configured with, on `gpus` GPUs."""
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


def engine_text(stage) -> str:
    if isinstance(stage, SFTStage):
        return f"megatron+deepspeed {stage.dtype}"
    if stage.engine == "native":
        return "native" + (f" {stage.data_parallel}" if isinstance(stage, GRPOStage) else "")
    v = stage.verl
    text = f"verl {v.rollout} tp{v.rollout_tp} gmu{v.gpu_memory_utilization:g}"
    if isinstance(stage, SynthStage):
        return text
    offload = [name for name, on in (("param", v.param_offload), ("optimizer", v.optimizer_offload)) if on]
    backend = v.backend + (f" tp{v.megatron_tp} pp{v.megatron_pp}" if v.backend == "megatron" else "")
    return (
        f"verl {backend}, {text[5:]}, micro-batch {v.micro_batch_size_per_gpu}, "
        f"offload: {'+'.join(offload) or 'none'}"
    )


def choose(layouts: list[Layout], footprint, machine: Machine, can_offload: bool) -> Option:
    """The first layout that fits; else the first that fits with offload; else the smallest on the GPU."""
    options = [Option(layout, footprint(layout), FITS) for layout in layouts]
    for option in options:
        if fits(option.footprint, machine):
            return option
    for layout in layouts if can_offload else []:
        if layout.zero >= 1 and fits(fp := footprint(replace(layout, offload=True)), machine):
            return Option(replace(layout, offload=True), fp, OFFLOAD)
    smallest = min(options, key=lambda o: o.footprint.gpu_bytes())
    return replace(smallest, verdict=NO_FIT)


def footprint_fn(stage, shape: LlamaShape, site: Site):
    """layout -> Footprint for this stage."""
    builder = (
        sft_footprint
        if isinstance(stage, SFTStage)
        else grpo_footprint
        if isinstance(stage, GRPOStage)
        else synth_footprint
    )
    return partial(builder, shape, stage, site=site)


def kind_of(stage) -> str:
    return "sft" if isinstance(stage, SFTStage) else "grpo" if isinstance(stage, GRPOStage) else "generation"


def plan_stage(
    stage_id: str,
    stage,
    cfg: RunConfig,
    shape: LlamaShape,
    machine: Machine,
    gpus: list[int],
    prompt_tokens: int,
) -> StagePlan:
    site = Site(machine.gpu_bytes, machine.gpus_per_node, RUNTIME_PER_RANK, prompt_tokens, cfg.eval)
    kind, footprint, sft = kind_of(stage), footprint_fn(stage, shape, site), isinstance(stage, SFTStage)

    def at(n: int) -> Option:
        return choose(candidates(stage, shape, n, machine), footprint, machine, can_offload=sft)

    # SFT's own layout is judged as configured (no offload, no recomputation: the config cannot ask for them).
    configured = (
        choose([Layout(cfg.nproc, stage.parallel.tp, stage.parallel.zero_stage)], footprint, machine, False)
        if sft
        else at(cfg.nproc)
    )
    return StagePlan(stage_id, kind, engine_text(stage), [at(n) for n in gpus], configured)


def plan(
    cfg: RunConfig, shape: LlamaShape, machine: Machine, gpus: list[int], prompt_tokens: int
) -> list[StagePlan]:
    return [
        plan_stage(sid, stage, cfg, shape, machine, gpus, prompt_tokens)
        for sid, stage in cfg.stages().items()
    ]


def parse_gpus(text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; anything else is a ConfigError naming --gpus."""
    try:
        counts = sorted({int(part) for part in text.split(",")})
    except ValueError:
        raise ConfigError(
            "--gpus", f"{text!r} is not a comma-separated list of GPU counts (e.g. 1,2,4,8)"
        ) from None
    if counts[0] < 1:
        raise ConfigError("--gpus", f"GPU counts must be at least 1 (got {counts[0]})")
    return counts
