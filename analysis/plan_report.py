"""The planner's output: per stage, one table row per GPU count (terms, totals, verdict, layout),
the configured and the planned settings at the config's nproc, and the formulas behind the numbers,
rendered as text and Markdown from the same tables, and a JSON document (per stage: `min_gpus`, and
for each GPU count the verdict, its caveats and the layout)."""

from __future__ import annotations

from analysis.memory import ASSUMPTIONS, GB
from analysis.model_shape import LlamaShape
from analysis.plan import (
    CAVEAT,
    FITS,
    GPU_USABLE,
    HEADROOM,
    HOST_USABLE,
    NO_FIT,
    Machine,
    Option,
    StagePlan,
    overrides,
    setting_lines,
)
from analysis.plan_search import ORDER, REFERENCES
from analysis.plan_split import SPLIT_ASSUMPTIONS, SplitPlan
from analysis.tables import Table

SEARCH_ORDER = (
    "Search order, from the engines' tuning guides (the first candidate that fits without caveat wins; "
    "a rule only breaks the ties of the rules above it)"
)


def layout_text(kind: str, o: Option) -> str:
    """The layout and the settings that make it, in words."""
    layout, s = o.layout, o.settings
    extras = " +param_offload" * layout.param_offload + " +offload" * layout.offload
    extras += " +recompute" * layout.recompute
    rollout = f"rollout tp{s.get('verl.rollout_tp')} gmu{s.get('verl.gpu_memory_utilization')}"
    if kind == "sft":
        pp = f" pp{layout.pp}" * (layout.pp > 1)
        return f"tp{layout.tp}{pp} dp{layout.dp} zero{layout.zero} micro{s['micro_batch_size']}{extras}"
    if kind == "grpo" and "data_parallel" in s:  # the native engine
        reshard = ", no reshard" * (s.get("reshard_after_forward") is False)
        return f"native {s['data_parallel']} x{layout.gpus}{reshard}, micro{s['micro_batch_size']}"
    tokens = s.get("verl.max_tokens_per_gpu")
    micro = f" micro{s.get('verl.micro_batch_size_per_gpu')}" if tokens is None else f" tokens{tokens}"
    if kind == "grpo" and layout.megatron:
        return f"megatron tp{layout.tp} pp{layout.pp} dp{layout.dp}{extras}, {rollout}{micro}"
    if kind == "grpo":
        return f"fsdp{layout.gpus}{extras}, {rollout}{micro}"
    if "verl.rollout_tp" in s:
        return f"tp{layout.tp} x{layout.dp} replicas, gmu{s['verl.gpu_memory_utilization']}"
    return f"whole model x{layout.gpus}"


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def stage_table(p: StagePlan, machine: Machine) -> Table:
    names = [t.name for t in p.options[0].footprint.gpu]
    rows = [
        [
            str(o.layout.gpus),
            str(machine.nodes(o.layout.gpus)),
            layout_text(p.kind, o),
            *(gb(t.bytes) for t in o.footprint.gpu),
            gb(o.footprint.gpu_bytes()),
            gb(o.footprint.host_bytes()),
            o.verdict_text,
        ]
        for o in p.options
    ]
    header = ["GPUs", "nodes", "layout", *names, "GPU total", "host/node", "verdict"]
    return Table(f"{p.stage_id} ({p.kind}), GB per GPU and host GB per node", header, rows)


def formulas(option: Option) -> list[str]:
    """The formulas of one row, with its values."""
    fp = option.footprint
    gpu = [f"{t.name} = {t.formula} = {gb(t.bytes)} GB" for t in fp.gpu]
    phases = [
        f"phase {phase} = {' + '.join(fp.phases[phase])} = {gb(total)} GB"
        for phase, total in fp.phase_bytes().items()
        if fp.phases
    ]
    host = [f"host {t.name} = {t.formula} = {gb(t.bytes)} GB" for t in fp.host]
    return gpu + phases + host + [f"refused: {r}" for r in fp.refusals]


def shown_option(p: StagePlan) -> Option:
    """The row whose formulas are spelled out: the smallest that fits without caveat, else with one,
    else the largest planned."""
    fitting = (o for verdict in (FITS, CAVEAT) for o in p.options if o.verdict == verdict)
    return next(fitting, p.options[-1])


def option_line(p: StagePlan, o: Option, machine: Machine) -> str:
    """One option in a line: layout, verdict, GPU peak and host memory, and why it does not fit."""
    fp = o.footprint
    peak = f" (peak: {fp.peak_phase()})" if fp.phases else ""
    why = "".join(f"; {r}" for r in fp.refusals)
    if fp.host_bytes() > machine.usable_host:
        why += f"; host memory: more than the {gb(machine.usable_host)} GB usable a node"
    return (
        f"{layout_text(p.kind, o)}: {o.verdict_text} — {gb(fp.gpu_bytes())} GB per GPU{peak}, "
        f"{gb(fp.host_bytes())} GB host per node{why}"
    )


def summary_lines(p: StagePlan, machine: Machine) -> list[str]:
    n = p.configured.layout.gpus
    settings = " ".join(setting_lines(p.stage_id, p.planned)) or "none to choose"
    fewer = p.min_gpus(caveat_ok=True)
    with_caveat = f" (with a caveat: {fewer})" if fewer and fewer != p.min_gpus() else ""
    return [
        f"{p.stage_id} [{p.engine}]: min_gpus {p.min_gpus() or 'none planned'}{with_caveat}",
        f"  as configured at nproc={n}: {option_line(p, p.configured, machine)}",
        f"  planned at nproc={n}: {option_line(p, p.planned, machine)}",
        f"  planned settings (--write-overrides): {settings}",
    ]


def header_lines(name: str, shape: LlamaShape, machine: Machine) -> list[str]:
    m = shape
    return [
        f"Plan for {name}: P = {m.params():,} parameters (L={m.layers} h={m.hidden} a={m.heads} "
        f"kv={m.kv_heads}x{m.head_dim} f={m.ffn} V={m.vocab}, checkpoint {m.file_bytes} bytes/param)",
        f"Cluster {machine.name}: {machine.gpus_per_node}x {machine.gpu_name} a node, "
        f"{gb(machine.gpu_bytes)} GB per GPU, host {gb(machine.host_bytes)} GB per node",
        f"Usable: {GPU_USABLE:.0%} of a GPU ({gb(machine.usable_gpu)} GB; the allocator's fragmentation, "
        f"CUDA context and NCCL buffers are not in the formulas), {HOST_USABLE:.0%} of a node's host "
        f"memory ({gb(machine.usable_host)} GB)",
        f"Verdicts: fits; {CAVEAT} (CPU offload, a setting no config field sets, or above "
        f"{HEADROOM:.0%} of usable: {gb(HEADROOM * machine.usable_gpu)} GB a GPU, "
        f"{gb(HEADROOM * machine.usable_host)} GB a node); {NO_FIT}",
    ]


def order_lines(plans: list[StagePlan]) -> list[str]:
    """The search's preference rules of the engines in the plan, the first rule the strongest, and
    the documents they come from."""
    keys = list(dict.fromkeys(p.search for p in plans))
    lines = []
    for key in keys:
        lines.append(f"{key}:" + " planned as configured" * (not ORDER[key]))
        lines += [f"  {i}. {r.prefer}: {r.why} [{'; '.join(r.sources)}]" for i, r in enumerate(ORDER[key], 1)]
    cited = dict.fromkeys(s.split(":")[0] for key in keys for r in ORDER[key] for s in r.sources)
    return lines + ["references:", *(f"  [{tag}] {REFERENCES[tag]}" for tag in cited)]


def stage_parts(p: StagePlan, machine: Machine, markdown: bool) -> list[str]:
    """A stage's table, its summary and the formulas of its first row that fits."""
    shown = shown_option(p)
    table, summary, lines = stage_table(p, machine), summary_lines(p, machine), formulas(shown)
    if markdown:
        summary = [*(f"{line}  " for line in summary), ""]
        lines = ["", *(f"- `{f}`" for f in lines)]
    else:
        lines = [f"  {f}" for f in lines]
    heading = f"{'F' if markdown else 'f'}ormulas at {shown.layout.gpus} GPUs:"
    return [table.markdown() if markdown else table.text(), *summary, heading, *lines, ""]


def split_table(stage_id: str, sp: SplitPlan) -> Table:
    """Each split of the stage's GPUs: each side's GB a GPU and verdict, and the estimated seconds."""
    rows = []
    for o in sp.options:
        t = o.timing
        times = (
            [f"{t.generation:.1f}", f"{t.training:.1f}", f"{t.handover:.1f}", f"{t.split_step:.1f}"]
            if t
            else ["-"] * 4
        )
        rows.append([
            str(o.rollout_gpus), str(sp.gpus - o.rollout_gpus),
            gb(o.training.footprint.gpu_bytes()), verdict_and_refusal(o.training),
            gb(o.generation.footprint.gpu_bytes()), verdict_and_refusal(o.generation), *times,
        ])  # fmt: skip
    header = ["generating GPUs", "training GPUs", "training GB/GPU", "training verdict"]
    header += [
        "generating GB/GPU",
        "generating verdict",
        "generation s",
        "training s",
        "hand-over s",
        "step s",
    ]
    return Table(
        f"{stage_id}: its {sp.gpus} GPUs split between generation and training (rollout_ranks)", header, rows
    )


def verdict_and_refusal(o: Option) -> str:
    refused = o.footprint.refusals
    return f"{o.verdict_text}: {refused[0]}" if o.verdict == NO_FIT and refused else o.verdict_text


def split_parts(stage_id: str, sp: SplitPlan | None, markdown: bool) -> list[str]:
    if sp is None:
        return []
    chosen = f"rollout_ranks={sp.chosen.rollout_gpus}" if sp.chosen else "colocated (rollout_ranks=0)"
    line = f"{stage_id} split: {chosen}: {sp.why}"
    table = split_table(stage_id, sp)
    return [table.markdown() if markdown else table.text(), f"{line}  " if markdown else line, ""]


def render_text(
    name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan], splits: dict | None = None
) -> str:
    parts = ["\n".join(header_lines(name, shape, machine)), ""]
    for p in plans:
        parts += stage_parts(p, machine, markdown=False) + split_parts(
            p.stage_id, (splits or {}).get(p.stage_id), False
        )
    parts += [f"{SEARCH_ORDER}:", *order_lines(plans), ""]
    parts += ["Assumptions:", *(f"- {a}" for a in (*ASSUMPTIONS, *SPLIT_ASSUMPTIONS))]
    return "\n".join(parts) + "\n"


def render_markdown(
    name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan], splits: dict | None = None
) -> str:
    parts = [f"# Memory plan: {name}", "", *(f"{line}  " for line in header_lines(name, shape, machine)), ""]
    for p in plans:
        parts += stage_parts(p, machine, markdown=True) + split_parts(
            p.stage_id, (splits or {}).get(p.stage_id), True
        )
    parts += [
        "## Search order",
        "",
        f"{SEARCH_ORDER}.",
        "",
        *(f"    {line}" for line in order_lines(plans)),
        "",
    ]
    parts += ["## Assumptions", "", *(f"- {a}" for a in (*ASSUMPTIONS, *SPLIT_ASSUMPTIONS))]
    return "\n".join(parts) + "\n"


def option_json(kind: str, o: Option) -> dict:
    terms = lambda ts: [{"name": t.name, "formula": t.formula, "bytes": t.bytes} for t in ts]  # noqa: E731
    return {
        "gpus": o.layout.gpus,
        "verdict": o.verdict,
        "caveats": list(o.caveats),
        "layout": layout_text(kind, o),
        "settings": o.settings,
        "eval_settings": o.eval_settings,
        "unsettable": list(o.unsettable),
        "tp": o.layout.tp,
        "dp": o.layout.dp,
        "zero_stage": o.layout.zero,
        "offload": o.layout.offload,
        "recompute": o.layout.recompute,
        "param_offload": o.layout.param_offload,
        "pp": o.layout.pp,
        "gpu_bytes": o.footprint.gpu_bytes(),
        "host_bytes_per_node": o.footprint.host_bytes(),
        "phases": o.footprint.phase_bytes() if o.footprint.phases else {},
        "refusals": list(o.footprint.refusals),
        "gpu_terms": terms(o.footprint.gpu),
        "host_terms": terms(o.footprint.host),
    }


def stage_json(p: StagePlan) -> dict:
    return {
        "kind": p.kind,
        "engine": p.engine,
        "min_gpus": p.min_gpus(),
        "min_gpus_with_caveat": p.min_gpus(caveat_ok=True),
        "verdicts": {str(o.layout.gpus): o.verdict for o in p.options},
        "caveats": {str(o.layout.gpus): list(o.caveats) for o in p.options},
        "layouts": {str(o.layout.gpus): layout_text(p.kind, o) for o in p.options},
        "options": [option_json(p.kind, o) for o in p.options],
        "at_nproc": option_json(p.kind, p.configured),
        "planned_at_nproc": option_json(p.kind, p.planned),
    }


def split_json(sp: SplitPlan) -> dict:
    return {
        "gpus": sp.gpus,
        "chosen_rollout_ranks": sp.chosen.rollout_gpus if sp.chosen else 0,
        "why": sp.why,
        "colocated_step_s": sp.colocated.colocated_step if sp.colocated else None,
        "options": [
            {
                "rollout_ranks": o.rollout_gpus,
                "training": {"gpu_bytes": o.training.footprint.gpu_bytes(), "verdict": o.training.verdict},
                "generation": {
                    "gpu_bytes": o.generation.footprint.gpu_bytes(),
                    "verdict": o.generation.verdict,
                },
                "timing_s": vars(o.timing) | {"step": o.timing.split_step} if o.timing else None,
            }
            for o in sp.options
        ],
    }


def plan_json(
    name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan], splits: dict | None = None
) -> dict:
    nproc = plans[0].configured.layout.gpus if plans else None
    lines, left = overrides(plans, nproc) if plans else ([], [])
    return {
        "config": name,
        "params": shape.params(),
        "cluster": {
            "name": machine.name,
            "gpu": machine.gpu_name,
            "gpus_per_node": machine.gpus_per_node,
            "gpu_bytes": machine.gpu_bytes,
            "host_bytes": machine.host_bytes,
            "usable_gpu_bytes": machine.usable_gpu,
            "usable_host_bytes": machine.usable_host,
        },
        "stages": {p.stage_id: stage_json(p) for p in plans},
        "splits": {sid: split_json(sp) for sid, sp in (splits or {}).items()},
        "overrides": {"nproc": nproc, "lines": lines, "left_as_configured": left},
        "search_order": {key: [vars(r) for r in rules] for key, rules in ORDER.items()},
        "references": REFERENCES,
        "assumptions": [*ASSUMPTIONS, *SPLIT_ASSUMPTIONS],
    }
