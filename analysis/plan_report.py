"""The planner's output: per stage, one table row per GPU count (terms, totals, verdict, layout)
and the formulas behind the numbers, rendered as text and Markdown from the same tables, and a
JSON document (per stage: the verdict for each GPU count and `min_gpus`)."""

from __future__ import annotations

from analysis.memory import ASSUMPTIONS, GB, Layout
from analysis.model_shape import LlamaShape
from analysis.plan import GPU_USABLE, HOST_USABLE, NO_FIT, OFFLOAD, Machine, Option, StagePlan
from analysis.tables import Table


def layout_text(kind: str, layout: Layout) -> str:
    extras = " +param_offload" * layout.param_offload + " +offload" * layout.offload
    extras += " +recompute" * layout.recompute
    if kind == "sft":
        return f"tp{layout.tp} dp{layout.dp} zero{layout.zero}{extras}"
    if kind == "grpo" and layout.megatron:
        return f"megatron tp{layout.tp} pp{layout.pp} dp{layout.dp}{extras}"
    if kind == "grpo":
        return f"fsdp{layout.gpus}{extras}, rollout tp{layout.tp}"
    return f"tp{layout.tp} x{layout.dp} replicas"


def gb(nbytes: float) -> str:
    return f"{nbytes / GB:.2f}"


def stage_table(p: StagePlan, machine: Machine) -> Table:
    names = [t.name for t in p.options[0].footprint.gpu]
    rows = [
        [
            str(o.layout.gpus),
            str(machine.nodes(o.layout.gpus)),
            layout_text(p.kind, o.layout),
            *(gb(t.bytes) for t in o.footprint.gpu),
            gb(o.footprint.gpu_bytes()),
            gb(o.footprint.host_bytes()),
            o.verdict,
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
    """The row whose formulas are spelled out: the smallest that fits, else the largest planned."""
    return next((o for o in p.options if o.verdict != NO_FIT), p.options[-1])


def summary_line(p: StagePlan, machine: Machine) -> str:
    c, fp = p.configured, p.configured.footprint
    peak = f" (peak: {fp.peak_phase()})" if fp.phases else ""
    why = "".join(f"; {r}" for r in fp.refusals)
    if fp.host_bytes() > HOST_USABLE * machine.host_bytes:
        why += f"; host memory: more than the {gb(HOST_USABLE * machine.host_bytes)} GB usable a node"
    return (
        f"{p.stage_id} [{p.engine}]: min_gpus {p.min_gpus() or 'none planned'} "
        f"(with CPU offload: {p.min_gpus(OFFLOAD) or '-'}); at nproc={c.layout.gpus} "
        f"({layout_text(p.kind, c.layout)}): {c.verdict}, {gb(fp.gpu_bytes())} GB per GPU{peak}, "
        f"{gb(fp.host_bytes())} GB host per node{why}"
    )


def header_lines(name: str, shape: LlamaShape, machine: Machine) -> list[str]:
    m = shape
    return [
        f"Plan for {name}: P = {m.params():,} parameters (L={m.layers} h={m.hidden} a={m.heads} "
        f"kv={m.kv_heads}x{m.head_dim} f={m.ffn} V={m.vocab}, checkpoint {m.file_bytes} bytes/param)",
        f"Cluster {machine.name}: {machine.gpus_per_node}x {machine.gpu_name} a node, "
        f"{gb(machine.gpu_bytes)} GB per GPU ({GPU_USABLE:.0%} usable), "
        f"host {gb(machine.host_bytes)} GB per node ({HOST_USABLE:.0%} usable)",
    ]


def render_text(name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan]) -> str:
    parts = ["\n".join(header_lines(name, shape, machine)), ""]
    for p in plans:
        shown = shown_option(p)
        parts += [
            stage_table(p, machine).text(),
            summary_line(p, machine),
            f"formulas at {shown.layout.gpus} GPUs:",
            *(f"  {f}" for f in formulas(shown)),
            "",
        ]
    parts += ["Assumptions:", *(f"- {a}" for a in ASSUMPTIONS)]
    return "\n".join(parts) + "\n"


def render_markdown(name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan]) -> str:
    parts = [f"# Memory plan: {name}", "", *(f"{line}  " for line in header_lines(name, shape, machine)), ""]
    for p in plans:
        shown = shown_option(p)
        parts += [
            stage_table(p, machine).markdown(),
            summary_line(p, machine),
            "",
            f"Formulas at {shown.layout.gpus} GPUs:",
            "",
            *(f"- `{f}`" for f in formulas(shown)),
            "",
        ]
    parts += ["## Assumptions", "", *(f"- {a}" for a in ASSUMPTIONS)]
    return "\n".join(parts) + "\n"


def option_json(kind: str, o: Option) -> dict:
    terms = lambda ts: [{"name": t.name, "formula": t.formula, "bytes": t.bytes} for t in ts]  # noqa: E731
    return {
        "gpus": o.layout.gpus,
        "verdict": o.verdict,
        "layout": layout_text(kind, o.layout),
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


def plan_json(name: str, shape: LlamaShape, machine: Machine, plans: list[StagePlan]) -> dict:
    return {
        "config": name,
        "params": shape.params(),
        "cluster": {
            "name": machine.name,
            "gpu": machine.gpu_name,
            "gpus_per_node": machine.gpus_per_node,
            "gpu_bytes": machine.gpu_bytes,
            "host_bytes": machine.host_bytes,
        },
        "stages": {
            p.stage_id: {
                "kind": p.kind,
                "engine": p.engine,
                "min_gpus": p.min_gpus(),
                "min_gpus_with_offload": p.min_gpus(OFFLOAD),
                "verdicts": {str(o.layout.gpus): o.verdict for o in p.options},
                "options": [option_json(p.kind, o) for o in p.options],
                "at_nproc": option_json(p.kind, p.configured),
            }
            for p in plans
        },
        "assumptions": list(ASSUMPTIONS),
    }
