"""What the native engines hold on each GPU as they load today, before a single activation: a lower
bound that a GPU must exceed for the stage to have any chance, checked before any job is queued.

Native GRPO (stages/grpo): the actor's fp32 master weights, gradients and AdamW's two states
(engines/ddp.py, engines/fsdp2.py), whole on every rank under DDP or sharded over the N ranks under
FSDP2; the reference in the stage's dtype, likewise; the rollout's own whole copy in that dtype
(grpo/rollout.py); under FSDP2 the weight sync gathers every unit at once in the compute dtype
(fsdp2.gathered_parameters), a second whole copy for its duration. Native synthesis (stages/synth.py)
loads one whole copy a rank in its dtype. Native held-out eval (stages/eval.py, eval.engine
'native') loads the exported model whole on every rank, in the dtype it was saved in (the stage's).
A stage's dtype 'auto' is bf16 here: plans are for CUDA GPUs (stages/engines/precision.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from core.config import GRPOStage, RunConfig, SFTStage, SynthStage, engine_of

FP32 = 4
BF16 = 2
GiB = 2**30


@dataclass(frozen=True)
class Residency:
    stage_id: str
    formula: str
    """In P (parameters) and N (GPUs of the stage)."""
    bytes: float
    field: str
    """The config field to change."""
    instead: str
    """What the user can do when it does not fit."""


def actor_bytes(g: GRPOStage, P: int, N: int, gradients: bool = True) -> float:
    """The actor's fp32 weights and AdamW's two states (and its gradients, from an update's first
    backward to its step): whole on every rank under DDP, over the N ranks under FSDP2."""
    return (16 if gradients else 12) * P / (1 if g.data_parallel == "ddp" else N)


def held_width(stage: SFTStage | GRPOStage | SynthStage) -> int:
    """Bytes a value of what the stage computes and holds besides master weights: its dtype, 'auto'
    being bf16 on the CUDA GPUs a plan is for."""
    return FP32 if stage.dtype == "fp32" else BF16


def dtype_name(width: int) -> str:
    return "fp32" if width == FP32 else "bf16"


def grpo_residency(stage_id: str, g: GRPOStage, P: int, N: int) -> Residency:
    instead = f"set {stage_id}.engine=verl (vLLM rollout, sharded bf16 actor with offload)"
    actor, w = actor_bytes(g, P, N), held_width(g)
    if g.data_parallel == "ddp":  # actor 4+4+8, reference and rollout w each: all whole
        formula = f"{16 + 2 * w}·P (ddp: fp32 actor, gradients, AdamW; {dtype_name(w)} reference, rollout)"
        return Residency(stage_id, formula, actor + 2 * w * P, f"{stage_id}.engine", instead)
    # actor 4+4+8 and reference w over N; the rollout's copy and the sync's gathered copy whole, in w
    formula = (
        f"{16 + w}·P/N + {2 * w}·P (fsdp2: sharded fp32 actor and {dtype_name(w)} reference, "
        f"whole {dtype_name(w)} rollout and sync)"
    )
    return Residency(stage_id, formula, actor + w * P / N + 2 * w * P, f"{stage_id}.engine", instead)


def synth_residency(stage_id: str, st: SynthStage, P: int) -> Residency:
    instead = f"set {stage_id}.engine=verl (verl's generation server: vLLM replicas with tensor parallelism)"
    w = held_width(st)
    return Residency(stage_id, f"{w}·P (one whole {dtype_name(w)} copy a rank)", w * P, stage_id, instead)


def eval_residency(stage_id: str, stage: SFTStage | GRPOStage, P: int) -> Residency:
    width = held_width(stage)
    dtype = dtype_name(width)
    return Residency(
        stage_id,
        f"{width}·P (eval: the exported {dtype} model, whole on every rank)",
        width * P,
        "eval.engine",
        "set eval.engine=verl (verl's generation server answers the held-out prompts)",
    )


def native_residencies(cfg: RunConfig, P: int, stage_ids: list[str]) -> list[Residency]:
    """The native-engine stages and evals among `stage_ids`, with what each holds a GPU."""
    out = []
    for sid in stage_ids:
        stage = getattr(cfg, sid)
        if engine_of(stage) == "verl":
            continue  # verl's engines shard and offload: the planner's business
        if isinstance(stage, GRPOStage):
            out.append(grpo_residency(sid, stage, P, cfg.nproc))
        if isinstance(stage, SynthStage):
            out.append(synth_residency(sid, stage, P))
        elif cfg.eval.engine == "native":
            out.append(eval_residency(sid, stage, P))
    return out


def too_large(cfg: RunConfig, P: int, stage_ids: list[str], gpu_gib: float) -> list[Residency]:
    return [r for r in native_residencies(cfg, P, stage_ids) if r.bytes > gpu_gib * GiB]


def overflow_message(r: Residency, P: int, gpu_gib: float, profile_name: str) -> str:
    return (
        f"the native engine holds {r.bytes / GiB:.1f} GiB a GPU before any activation "
        f"({r.formula}, P = {P / 1e9:.2f}B), more than the {gpu_gib:g} GiB GPUs of cluster profile "
        f"{profile_name!r}: {r.instead}"
    )
