"""The verl engines' layout fields left 'auto' (rollout_tp; megatron_tp and megatron_pp), resolved
for a job's GPUs and the model: on a GPU profile the planner's choice at that GPU count (what `hpcr1
plan --write-overrides` writes); on the CPU test platform, which has no GPU memory to plan for, the
first layout the planner tries (the smallest). Explicit values are left as they are, and checked
where they always were."""

from __future__ import annotations

from analysis import plan_search
from analysis.memory import PROMPT_TOKENS
from analysis.model_shape import LlamaShape
from analysis.plan import NO_FIT, Machine, plan
from analysis.plan_search import with_settings
from core.cluster import ClusterProfile
from core.config import ConfigError, RunConfig

AUTO = "auto"
LAYOUT_FIELDS = ("rollout_tp", "megatron_tp", "megatron_pp")


def auto_fields(cfg: RunConfig) -> list[str]:
    """Every `section.verl.field` of LAYOUT_FIELDS set to 'auto'."""
    sections = {**cfg.stages(), "eval": cfg.eval}
    return [
        f"{sid}.verl.{name}"
        for sid, section in sections.items()
        if hasattr(section, "verl")
        for name in LAYOUT_FIELDS
        if getattr(section.verl, name, None) == AUTO
    ]


def smallest_layouts(cfg: RunConfig, shape: LlamaShape, gpus: int, gpus_per_node: int) -> dict[str, int]:
    """The first layout the planner's search tries for each 'auto' field (plan_search's order)."""
    chosen = {}
    for key in auto_fields(cfg):
        sid, _, name = key.split(".")
        if name == "rollout_tp":
            tps = plan_search.rollout_tps(shape, gpus, gpus_per_node)
            if not tps:
                raise ConfigError(
                    key, f"no rollout layout of the model spans {gpus} GPUs of {gpus_per_node} a node"
                )
            chosen[key] = tps[0]
        else:
            stage = getattr(cfg, sid)
            actor = plan_search.actor_parallel(stage, shape, gpus, gpus_per_node)[0]
            chosen[key] = actor.get(f"verl.{name}", 1)
    return chosen


def resolve_auto_layouts(
    cfg: RunConfig, shape: LlamaShape, profile: ClusterProfile, gpus: int, prompt_tokens: int = PROMPT_TOKENS
) -> tuple[RunConfig, list[str]]:
    """`cfg` with its 'auto' fields set for a job of `gpus` GPUs, and a line for each: what it became
    and who chose it."""
    keys = auto_fields(cfg)
    if not keys:
        return cfg, []
    gpus_per_node = profile.verl_gpus_per_node()
    smallest = smallest_layouts(cfg, shape, gpus, gpus_per_node)
    provisional = with_settings(cfg, smallest)  # what the planner evaluates as "configured"
    if not profile.gpus_per_node or not profile.gpu_memory_gib:
        why = f"the smallest layout of {gpus} GPUs (profile {profile.name!r} has no GPU memory to plan for)"
        return provisional, [f"{key}=auto -> {value}: {why}" for key, value in smallest.items()]
    planned = _planned_settings(provisional, shape, Machine.from_profile(profile), gpus, prompt_tokens)
    chosen, lines = {}, []
    for key in keys:
        if key in planned:
            chosen[key] = planned[key]
            lines.append(f"{key}=auto -> {planned[key]}: planned for {gpus} GPUs (hpcr1 plan)")
        else:
            chosen[key] = smallest[key]
            lines.append(f"{key}=auto -> {smallest[key]}: no plan fits {gpus} GPUs, the smallest layout")
    return with_settings(cfg, chosen), lines


def _planned_settings(cfg: RunConfig, shape, machine: Machine, gpus: int, prompt_tokens: int) -> dict:
    """{section.field: value} of the planner's choice at `gpus` for every stage that fits (the held-out
    eval's from the first stage that plans it)."""
    planned = {}
    for p in plan(cfg.model_copy(update={"nproc": gpus}), shape, machine, [gpus], prompt_tokens):
        if p.planned.verdict == NO_FIT:
            continue
        planned.update({f"{p.stage_id}.{k}": v for k, v in p.planned.settings.items()})
        for k, v in p.planned.eval_settings.items():
            planned.setdefault(f"eval.{k}", v)
    return planned
