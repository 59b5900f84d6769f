"""The memory/feasibility planner behind `hpcr1 plan`: for each stage of a config and each GPU
count, the fastest layout that fits the cluster's nodes, its memory per GPU and host memory per
node (analysis/memory.py's formulas) and the verdict, in three tiers:

- fits: within usable memory, with room to spare, and no offload;
- fits with caveat: it fits, but only with CPU offload (configured or searched: PCIe traffic every
  step), or above HEADROOM of usable GPU or host memory (an estimate that close can be off), or
  with what no config field sets yet (SFT's recomputation and offload); each caveat is named;
- does not fit: above usable memory, or refused (the engine's own checks, or our commands').

Usable memory is a fixed share of the machine's, GPU_USABLE of a GPU and HOST_USABLE of a node:
the formulas leave out the caching allocator's fragmentation, the CUDA context and NCCL's buffers
(and on the host the OS, the file system client and page cache), about a tenth.

Each GPU count is searched (analysis/plan_search.py): the candidates come most preferred first by
the engines' tuning guides, and the first that fits without caveat wins; else the first with a
caveat. A stage's `min_gpus` is the smallest count that fits without caveat. The configured
settings are judged as they are too, at the config's nproc, beside the planned ones there, which
`overrides` turns into `section.field=value` lines for `hpcr1 run` and `submit`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field, replace
from functools import partial

from analysis import plan_search
from analysis.memory import (
    Footprint,
    Layout,
    Site,
    grpo_footprint,
    rollout_terms,
    sft_footprint,
    synth_footprint,
)
from analysis.model_shape import LlamaShape
from analysis.plan_search import Candidate, engine_layout, with_settings
from core.cluster import ClusterProfile
from core.config import ConfigError, EvalConfig, GRPOStage, RunConfig, SFTStage

GIB = 1 << 30
# Of a GPU's memory, the caching allocator's fragmentation, the CUDA context and NCCL's buffers
# take roughly a tenth; of a node's, the OS, the file system client and page cache.
GPU_USABLE = 0.9
HOST_USABLE = 0.9
# Above this share of usable memory a plan fits with a caveat: the formulas are estimates.
HEADROOM = 0.9
# CUDA context, Python, torch, DeepSpeed and their pinned buffers, per rank in host memory.
RUNTIME_PER_RANK = 4e9
FITS, CAVEAT, NO_FIT = "fits", "fits with caveat", "does not fit"


@dataclass(frozen=True)
class Speed:
    """Datasheet rates, per second: what the split planner's roofline estimates use."""

    flops: float
    """Dense bf16 FLOP/s of one GPU."""
    memory_bandwidth: float
    """Bytes/s of one GPU's memory."""
    nic: float
    """Bytes/s of one network interface."""


@dataclass(frozen=True)
class Machine:
    """What one node offers, from the cluster profile."""

    name: str
    gpu_name: str
    gpu_bytes: float
    gpus_per_node: int
    host_bytes: float
    speed: Speed | None = None
    """The GPU's and the network's rates, where the profile gives them."""

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
        rates = (profile.gpu_bf16_tflops, profile.gpu_memory_bandwidth_gbs, profile.nic_gbs)
        speed = Speed(rates[0] * 1e12, rates[1] * 1e9, rates[2] * 1e9) if all(rates) else None
        return cls(
            profile.name, gpu_name, gib * GIB, profile.gpus_per_node, profile.host_memory_gib * GIB, speed
        )

    def nodes(self, gpus: int) -> int:
        return -(-gpus // self.gpus_per_node)

    @property
    def usable_gpu(self) -> float:
        return GPU_USABLE * self.gpu_bytes

    @property
    def usable_host(self) -> float:
        return HOST_USABLE * self.host_bytes


@dataclass(frozen=True)
class Option:
    """One GPU count of one stage: the layout, its footprint and the verdict."""

    layout: Layout
    footprint: Footprint
    verdict: str
    """FITS, CAVEAT or NO_FIT."""
    caveats: tuple[str, ...] = ()
    settings: dict[str, object] = field(default_factory=dict)
    """The config settings (inside the stage's section) that give this layout."""
    unsettable: tuple[str, ...] = ()
    """What the layout needs that no config field sets (SFT's recompute and offload)."""
    eval_settings: dict[str, object] = field(default_factory=dict)
    """The held-out eval's settings (inside `eval`) this option runs its final eval with."""

    @property
    def verdict_text(self) -> str:
        return f"{self.verdict}: {'; '.join(self.caveats)}" if self.caveats else self.verdict


@dataclass(frozen=True)
class StagePlan:
    stage_id: str
    kind: str
    """sft, grpo or generation."""
    engine: str
    """The engine and its configured settings, in words."""
    options: list[Option]
    """The planned layout at each planned GPU count, ascending."""
    configured: Option
    """The stage's own settings at the config's nproc."""
    planned: Option
    """The planned layout at the config's nproc."""
    search: str
    """Which of plan_search.ORDER's preference orders the search followed."""

    def min_gpus(self, caveat_ok: bool = False) -> int | None:
        """The smallest planned count that fits without caveat (with one, if `caveat_ok`)."""
        ok = (FITS, CAVEAT) if caveat_ok else (FITS,)
        return next((o.layout.gpus for o in self.options if o.verdict in ok), None)


def fits(fp: Footprint, machine: Machine) -> bool:
    """Within usable GPU and host memory, and not refused."""
    return not fp.refusals and fp.gpu_bytes() <= machine.usable_gpu and fp.host_bytes() <= machine.usable_host


def headroom_caveats(fp: Footprint, machine: Machine) -> tuple[str, ...]:
    shares = (("GPU", fp.gpu_bytes() / machine.usable_gpu), ("host", fp.host_bytes() / machine.usable_host))
    # rounded up, so that a caveat never reads "90%"
    return tuple(f"{math.ceil(100 * s)}% of usable {what} memory" for what, s in shares if s > HEADROOM)


def offload_caveats(layout: Layout) -> tuple[str, ...]:
    moved = [name for name, on in (("param", layout.param_offload), ("optimizer", layout.offload)) if on]
    return (f"{'+'.join(moved)} offload",) if moved else ()


def unsettable(stage, layout: Layout) -> tuple[str, ...]:
    """SFT's layout features that no config field sets: the SFT engine does none of them yet."""
    if not isinstance(stage, SFTStage):
        return ()
    needs = (("optimizer offload", layout.offload), ("recompute", layout.recompute))
    return tuple(name for name, on in needs if on)


def judge(stage, layout: Layout, fp: Footprint, machine: Machine) -> tuple[str, tuple[str, ...]]:
    """The verdict's tier and its caveats."""
    if not fits(fp, machine):
        return NO_FIT, ()
    needs = unsettable(stage, layout)  # SFT's offload among them
    offload = () if isinstance(stage, SFTStage) else offload_caveats(layout)
    needs = (f"{' and '.join(needs)} (no SFT option yet)",) if needs else ()
    caveats = offload + needs + headroom_caveats(fp, machine)
    return (CAVEAT if caveats else FITS), caveats


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


def evaluate(
    stage, shape: LlamaShape, site: Site, machine: Machine, gpus: int, cand: Candidate, eval_settings=None
) -> Option:
    """One candidate's footprint and verdict, its final eval (SFT's) run with `eval_settings`; our
    commands' refusals join the engine's."""
    st = with_settings(stage, cand.settings)
    layout = replace(engine_layout(st, gpus), **cand.extras)
    if eval_settings:
        site = replace(site, eval=with_settings(site.eval, eval_settings))
    fp = footprint_fn(st, shape, site)(layout)
    fp = replace(fp, refusals=fp.refusals + plan_search.refusals(st, layout, machine.gpus_per_node))
    verdict, caveats = judge(st, layout, fp, machine)
    return Option(layout, fp, verdict, caveats, cand.settings, unsettable(st, layout), eval_settings or {})


def planned_eval(e: EvalConfig, shape: LlamaShape, machine: Machine, gpus: int) -> dict[str, object]:
    """The held-out eval's vLLM settings an SFT stage plans at `gpus` (eval.engine verl): the first,
    in the rollout rules' order (smaller TP, within a node first; higher gpu_memory_utilization), that
    vLLM starts with and whose share of a GPU stays within HEADROOM of usable memory; none where
    nothing does (the configured ones are judged)."""
    if e.engine != "verl":
        return {}
    for tp in plan_search.rollout_tps(shape, gpus, machine.gpus_per_node):
        for gmu in plan_search.memory_shares(e.verl.gpu_memory_utilization):
            v = e.verl.model_copy(update={"rollout_tp": tp, "gpu_memory_utilization": gmu})
            budget, _, _, refused = rollout_terms(shape, v, machine.gpu_bytes, e.max_new_tokens)
            if not refused and budget.bytes <= HEADROOM * machine.usable_gpu:
                return {"verl.rollout_tp": tp, "verl.gpu_memory_utilization": gmu}
    return {}


def searched(groups: Iterable[plan_search.Group], judged) -> Iterator[Option]:
    """The candidates' options, most preferred first, less the groups whose floor does not fit."""
    for group in groups:
        floor = [judged(c) for c in group.floor]
        if all(o.verdict == NO_FIT for o in floor):
            yield from floor  # its leanest stand for the group where nothing fits
        else:
            yield from map(judged, group.candidates)


def choose(options: Iterable[Option]) -> Option:
    """The first option that fits without caveat (options come most preferred first); else the first
    that fits with one; else, of the options not refused (or all, if all are), the one needing the
    least GPU memory: how far from fitting the leanest layout is. Equal peaks are told apart by the
    other phases, highest first: a peak the micro-batch does not change (an optimizer step) leaves
    the leanest layout the one with the smallest micro-batch, as `searched` assumes when it keeps
    only a group's floor where nothing fits."""
    tried = []
    for option in options:
        if option.verdict == FITS:
            return option
        tried.append(option)
    with_caveat = [o for o in tried if o.verdict == CAVEAT]
    if with_caveat:
        return with_caveat[0]
    return min(tried, key=leanness)


def leanness(option: Option) -> tuple:
    """Not refused first, then the bytes of each phase, highest first (the peak, then the next)."""
    phases = sorted(option.footprint.phase_bytes().values(), reverse=True)
    return bool(option.footprint.refusals), phases


def engine_text(stage) -> str:
    """The engine and its configured settings, in words."""
    if isinstance(stage, SFTStage):
        return f"megatron+deepspeed {stage.dtype}"
    if stage.engine == "native":
        return "native" + (f" {stage.data_parallel}" if isinstance(stage, GRPOStage) else "")
    v = stage.verl
    text = f"verl {v.rollout} tp{v.rollout_tp} gmu{v.gpu_memory_utilization:g}"
    if not isinstance(stage, GRPOStage):
        return text
    offload = [name for name, on in (("param", v.param_offload), ("optimizer", v.optimizer_offload)) if on]
    backend = v.backend + (f" tp{v.megatron_tp} pp{v.megatron_pp}" if v.backend == "megatron" else "")
    micro = f"micro-batch {v.micro_batch_size_per_gpu}"
    if v.max_tokens_per_gpu is not None:
        micro = f"micro-batches of {v.max_tokens_per_gpu} tokens" + (", packed" if v.remove_padding else "")
    return f"verl {backend}, {text[5:]}, {micro}, offload: {'+'.join(offload) or 'none'}"


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
    judged = partial(evaluate, stage, shape, site, machine)

    def search(n: int) -> Option:
        final_eval = planned_eval(cfg.eval, shape, machine, n) if isinstance(stage, SFTStage) else {}
        judge_at_n = partial(judged, n, eval_settings=final_eval)
        return choose(searched(plan_search.groups(stage, shape, n, machine.gpus_per_node), judge_at_n))

    configured = judged(cfg.nproc, plan_search.configured(stage))
    options = [search(n) for n in gpus]
    planned = options[gpus.index(cfg.nproc)] if cfg.nproc in gpus else search(cfg.nproc)
    order = plan_search.order_key(stage)
    return StagePlan(stage_id, kind_of(stage), engine_text(stage), options, configured, planned, order)


def plan(
    cfg: RunConfig, shape: LlamaShape, machine: Machine, gpus: list[int], prompt_tokens: int
) -> list[StagePlan]:
    return [
        plan_stage(sid, stage, cfg, shape, machine, gpus, prompt_tokens)
        for sid, stage in cfg.stages().items()
    ]


def override_value(value) -> str:
    """As YAML reads it back (the config's override parser loads each value as YAML)."""
    return str(value).lower() if isinstance(value, bool) else str(value)


def overrides(plans: list[StagePlan], nproc: int) -> tuple[list[str], list[str]]:
    """`section.field=value` lines that run every stage as planned at `nproc`, and, for each stage
    left as configured, why."""
    lines, left = [f"nproc={nproc}"], []
    for p in plans:
        o = p.planned
        if o.verdict == NO_FIT:
            left.append(f"{p.stage_id}: does not fit at nproc={nproc}; left as configured")
        elif o.unsettable:
            left.append(
                f"{p.stage_id}: its plan at nproc={nproc} needs {' and '.join(o.unsettable)}, "
                "which no config field sets; left as configured"
            )
        else:
            lines += [line for line in setting_lines(p.stage_id, o) if line not in lines]
    return lines, left


def setting_lines(stage_id: str, option: Option) -> list[str]:
    lines = [f"{stage_id}.{key}={override_value(v)}" for key, v in option.settings.items()]
    return lines + [f"eval.{key}={override_value(v)}" for key, v in option.eval_settings.items()]


def changed_lines(p: StagePlan, e: EvalConfig) -> list[str]:
    """The planned settings at the config's nproc that differ from the stage's and `e`'s own."""
    own = setting_lines(p.stage_id, p.configured) + [
        f"eval.{key}={override_value(plan_search.setting(e, key))}" for key in p.planned.eval_settings
    ]
    return [line for line in setting_lines(p.stage_id, p.planned) if line not in own]


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
