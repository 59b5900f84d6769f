"""Device memory per GPU as analysis/memory.py predicts it, against what the real engines hold, on
2 ranks of the emulated accelerator (tests/fakegpu), whose ledger counts the device's live storages
apart from host memory, so that CPU offload shows as device memory no longer there. The cases run
one after the other in one torchrun, each measured from what the device held before it.

    python bench/plan_vs_engines.py                     # every case: the table, exit 1 if one is off
    python bench/plan_vs_engines.py --case ds-bf16-z2   # some cases (repeat --case)
    python bench/plan_vs_engines.py --json out.json     # the figures, for a test to read

Per case, predicted and measured:
- states: what stays on the device after an optimizer step (weights and optimizer states; the
  gradients are freed by then), and for the offloaded case what went to host memory instead;
- peak: the most the device held while the engine was built and took two steps.
A case fails when a measurement is more than 10% off its prediction (a prediction of 0 bytes: more
than 10% of the predicted peak).

The models are Llama-shaped with random bf16 weights (MODELS): "wide", the tiny model's
architecture widened until its states dominate a micro-batch's activations (63M parameters, 16
tokens a micro-batch: the backward of bf16 matmuls is most of the bench's time on CPUs without bf16
instructions, and at 64 tokens every state and peak measured the same within 0.1%); "vocab", narrow
(4M parameters) with a 32000-token vocabulary, where the logits of a 4 x 512-token micro-batch
dominate. The cases:
- ds-*: our SFT engine itself (stages/engines/megatron_deepspeed.py: megatron-core, DeepSpeed ZeRO
  with its deepspeed_config), train_step of one micro-batch per step; predicted by sft_footprint.
- ds-pp2-*: the same engine with parallel.pp=2 over the 2 ranks (dp 1): megatron's 1F1B schedule
  over 2 micro-batches a step (stage 0 keeps both in flight), each rank its stage (rank 0 the
  embedding and 4 layers, rank 1 4 layers, the final norm and the output layer), measured and
  predicted per stage (sft_stage_footprint), rows case/stageN. ds-pp2-logits: the "vocab" model
  with 16 x 128-token micro-batches, whose logits make the last stage far the heavier. (Its
  sequences are short on purpose: at 4 x 512 tokens stage 0 measured 16% over its prediction, which
  counts the unfused attention's scores and probabilities at c bytes each, where megatron's bf16
  path saves fp32 probabilities and their bf16 copy: not modelled yet.)
- fsdp2, fsdp2-offload: the actor as verl 0.9.1 shards it with strategy fsdp2 (verl's own
  apply_fsdp2: fp32 shards, bf16 compute, a unit per decoder layer and per embedding), gradient
  checkpointing, torch's AdamW; with offload, verl's own offload functions move the parameters and
  the optimizer states to host memory after each update and back before the next, as
  param_offload and optimizer_offload do; predicted by grpo_footprint (engine verl, backend fsdp).
  The loss is verl's: log-probabilities of the response half of each sequence, taken as verl
  0.9.1's engine takes them on its no-remove-padding path (which our verl_trainer sets unless
  remove_padding): from a copy of every sequence's rows of the logits, with verl's own
  logprobs_from_logits. fsdp2-logits: the same on the "vocab" model. (The plan counts the gathered
  weights as FSDP1 gathers them, verl's default strategy: the embeddings with one layer, where
  apply_fsdp2 makes each embedding a unit of its own; a few MiB over here.)
- grpo-micro1, -micro2, -micro4: our native GRPO actor (stages/grpo/actor.py, the default FSDP2
  layout) updating one mini-batch of 4 rows a rank of the "vocab" model, 128 prompt and 128
  response tokens, in micro-batches of 1, 2 and 4 rows; predicted by native_fit's actor states, the
  gathered unit and native_activations of one micro-batch: the peak grows with the micro-batch.
  grpo-micro2-bf16: micro-batches of 2 in bf16 over fp32 master weights (the stage's dtype on GPUs).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass, replace
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from analysis.memory import Footprint, Layout, Site, grpo_footprint, sft_stage_footprint  # noqa: E402
from analysis.model_shape import LlamaShape, shape_from_hf_config  # noqa: E402
from analysis.native_fit import actor_bytes  # noqa: E402
from core.config import GRPOStage, SFTStage, VerlConfig  # noqa: E402

MODELS = {
    "wide": {
        "vocab_size": 8192,
        "hidden_size": 768,
        "intermediate_size": 2048,
        "num_hidden_layers": 8,
        "num_attention_heads": 12,
        "num_key_value_heads": 4,
    },
    "vocab": {
        "vocab_size": 32000,
        "hidden_size": 64,
        "intermediate_size": 176,
        "num_hidden_layers": 2,
        "num_attention_heads": 1,
        "num_key_value_heads": 1,
    },
}
RANKS, STEPS = 2, 2
TOLERANCE = 0.10
MIB = 2**20
GPU_BYTES = 80 * 2**30  # what the emulated device reports (tests/fakegpu/device.py TOTAL_MEMORY)


@dataclass(frozen=True)
class Case:
    engine: str
    """deepspeed (our SFT engine) or fsdp2 (verl's FSDP2 actor)."""
    dtype: str = "bf16"
    zero: int = 1
    offload: bool = False
    model: str = "wide"
    batch: int = 1
    """Sequences a micro-batch (one a step)."""
    seq: int = 16
    """Tokens a sequence; under fsdp2 the second half is the response."""
    pp: int = 1
    """Pipeline stages (deepspeed): dp = RANKS/pp, each stage measured and predicted on its own."""
    micro_steps: int = 1
    """Micro-batches a rank and step (deepspeed): 1F1B keeps min(pp - stage, micro_steps) in flight."""
    micro: int = 0
    """native: the stage's micro_batch_size, over the `batch` rows a rank of its one mini-batch."""


CASES = {
    "ds-bf16-z0": Case("deepspeed", zero=0),
    "ds-bf16-z1": Case("deepspeed", zero=1),
    "ds-bf16-z2": Case("deepspeed", zero=2),
    "ds-fp32-z1": Case("deepspeed", dtype="fp32", zero=1),
    "ds-pp2-bf16-z0": Case("deepspeed", zero=0, pp=2, micro_steps=2),
    "ds-pp2-bf16-z1": Case("deepspeed", zero=1, pp=2, micro_steps=2),
    "ds-pp2-fp32-z1": Case("deepspeed", dtype="fp32", zero=1, pp=2, micro_steps=2),
    "ds-pp2-logits": Case("deepspeed", zero=1, model="vocab", batch=16, seq=128, pp=2, micro_steps=2),
    "fsdp2": Case("fsdp2", zero=3),
    "fsdp2-offload": Case("fsdp2", zero=3, offload=True),
    "fsdp2-logits": Case("fsdp2", zero=3, model="vocab", batch=4, seq=512),
    **{
        f"grpo-micro{k}": Case("native", dtype="fp32", zero=3, model="vocab", batch=4, seq=256, micro=k)
        for k in (1, 2, 4)
    },
    "grpo-micro2-bf16": Case("native", zero=3, model="vocab", batch=4, seq=256, micro=2),
}


# -- prediction ---------------------------------------------------------------------------------------
def sft_stage(case: Case) -> SFTStage:
    """micro_steps micro-batches a rank and step."""
    return SFTStage(
        dtype=case.dtype,
        micro_batch_size=case.batch,
        global_batch_size=case.batch * case.micro_steps * RANKS // case.pp,
        max_seq_len=case.seq,
        parallel={"tp": 1, "pp": case.pp, "zero_stage": case.zero},
    )


def predict(case: Case, shape: LlamaShape, stage: int = 0) -> dict[str, float]:
    """states (on the device between steps), host (offloaded, a rank) and peak, as the planner says;
    for a rank of pipeline stage `stage` (deepspeed)."""
    site = Site(gpu_bytes=GPU_BYTES, gpus_per_node=RANKS, runtime_per_rank=0.0)
    if case.engine == "deepspeed":
        layout = Layout(RANKS, 1, case.zero, pp=case.pp)
        fp = sft_stage_footprint(shape, sft_stage(case), layout, site, stage)
        return figures(fp, resident=("weights", "optimizer"), steps=("training", "optimizer_step"))
    if case.engine == "native":
        return predict_native(case, shape, site)
    o, response = case.offload, case.seq // 2
    verl = VerlConfig(
        max_prompt_length=case.seq - response,
        micro_batch_size_per_gpu=case.batch,
        rollout_tp=1,
        param_offload=o,
        optimizer_offload=o,
    )
    stage = GRPOStage(engine="verl", max_new_tokens=response, verl=verl)
    fp = grpo_footprint(shape, stage, Layout(RANKS, 1, 3, o, True, o), site)
    # outside its use the actor keeps on the device what the generation phase holds beside vLLM
    resident = tuple(name for name in fp.phases["generation"] if name != "rollout_budget")
    return figures(fp, resident, steps=("training", "optimizer_step"))


def predict_native(case: Case, shape: LlamaShape, site: Site) -> dict[str, float]:
    """The actor's share of the native footprint (the bench runs no reference and no rollout): its
    states (native_fit), its gathered FSDP2 unit and one micro-batch's activations."""
    stage, P = native_stage(case), shape.params()
    site = replace(site, prompt_tokens=case.seq - stage.max_new_tokens)
    by_name = {t.name: t.bytes for t in grpo_footprint(shape, stage, Layout(RANKS, 1, 3), site).gpu}
    peak = actor_bytes(stage, P, RANKS) + by_name["actor_gathered"] + by_name["activations"]
    return {"states": actor_bytes(stage, P, RANKS, gradients=False), "host": 0.0, "peak": peak}


def figures(fp: Footprint, resident: tuple[str, ...], steps: tuple[str, ...]) -> dict[str, float]:
    by_name, phases = {t.name: t.bytes for t in fp.gpu}, fp.phase_bytes()
    offloaded = {t.name: t.bytes for t in fp.host}["offloaded"] / RANKS  # the node's, RANKS ranks
    return {
        "states": sum(by_name[n] for n in resident),
        "host": offloaded,
        "peak": max(phases[p] for p in steps),
    }


# -- measurement (the worker, one a rank) -------------------------------------------------------------
def worker(names: list[str], models: Path) -> None:
    """Every case in turn in this one process (the ranks' start-up paid once). The few KiB a case
    leaves on the device (DeepSpeed's and megatron's globals) stay live through the next one and
    are taken off its figures: the ledger counts live storages, so that is exact."""
    import gc

    import torch

    from runtime.dist import init_distributed, shutdown_distributed
    from tests.dist.workers.results import print_result

    init_distributed()
    train = {"deepspeed": train_deepspeed, "fsdp2": train_fsdp2, "native": train_native}
    for name in names:
        gc.collect()
        held = torch.accelerator.memory_allocated()
        torch.accelerator.reset_peak_memory_stats()
        case = CASES[name]
        measured = train[case.engine](case, models / case.model)
        measured["states"] -= held
        measured["peak"] = torch.accelerator.max_memory_allocated() - held
        print_result({"case": name, "rank": int(os.environ["RANK"]), "held_before": held, **measured})
    shutdown_distributed()


def random_batches(case: Case, device, count: int = STEPS):
    """`count` micro-batches of random token ids, the same on every rank."""
    import torch

    g = torch.Generator().manual_seed(1)
    vocab = MODELS[case.model]["vocab_size"]
    return [torch.randint(0, vocab, (case.batch, case.seq), generator=g).to(device) for _ in range(count)]


def train_deepspeed(case: Case, model_dir: Path) -> dict:
    """STEPS steps of our SFT engine (its own train_step), micro_steps micro-batches of one shape (as
    pipeline stages need) a rank and step; with the rank's pipeline stage."""
    import torch
    from megatron.core import parallel_state

    from stages.data.sft_batches import MicroBatch
    from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine

    engine = MegatronDeepSpeedEngine(model_dir, sft_stage(case), seed=0)
    positions = torch.arange(case.seq).expand(case.batch, case.seq)
    ids = random_batches(case, "cpu", STEPS * case.micro_steps)
    batches = [MicroBatch(t, t.roll(-1, 1), torch.ones(t.shape), positions) for t in ids]
    tokens = case.batch * case.seq * case.micro_steps * RANKS // case.pp  # the step's, every replica's
    for step in range(STEPS):
        engine.train_step(batches[step * case.micro_steps : (step + 1) * case.micro_steps], tokens)
    measured = {"states": torch.accelerator.memory_allocated(), "host": 0}
    measured["stage"] = parallel_state.get_pipeline_model_parallel_rank()
    engine.close()
    return measured


def train_fsdp2(case: Case, model_dir: Path) -> dict:
    """STEPS updates of the actor as verl builds it with strategy fsdp2 (workers/engine/fsdp/
    transformer_impl.py: MixedPrecisionPolicy bf16/fp32, apply_fsdp2), its log-probs taken with
    verl's own function; with offload, verl's offload and load functions around each update."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy
    from transformers import AutoConfig, AutoModelForCausalLM
    from verl.utils.fsdp_utils import (
        apply_fsdp2,
        load_fsdp_optimizer,
        offload_fsdp2_model_to_cpu,
        offload_fsdp_optimizer,
    )
    from verl.utils.torch_functional import logprobs_from_logits

    from runtime.dist import rank_device

    device = rank_device()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        AutoConfig.from_pretrained(model_dir), dtype=torch.float32, attn_implementation="sdpa"
    )
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    mp = MixedPrecisionPolicy(
        param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=True
    )
    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    apply_fsdp2(
        model, {"mesh": mesh, "mp_policy": mp, "offload_policy": None, "reshard_after_forward": True}, {}
    )
    model.to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.01)

    def offload():  # what verl does after an update with param_offload and optimizer_offload
        offload_fsdp2_model_to_cpu(model, empty_cache=False)
        offload_fsdp_optimizer(optimizer)

    def load():  # before the next one (load_fsdp2_model_to_gpu moves the model to verl's device)
        model.to(device)
        load_fsdp_optimizer(optimizer, device)

    def policy_loss(ids):
        """verl 0.9.1's engine without remove-padding (transformer_impl.py prepare_model_outputs):
        the padded logits, a copy of every sequence's real rows (here all of them), the log-prob
        of each next token taken from that copy, of which the loss reads the response's."""
        response = case.seq // 2
        logits = model(input_ids=ids, use_cache=False).logits
        rows = torch.cat(list(logits.unbind()))
        labels = torch.roll(ids, shifts=-1, dims=1).reshape(-1)
        logp = logprobs_from_logits(rows, labels).view(ids.shape)
        return -logp[:, -response - 1 : -1].mean()

    for step, ids in enumerate(random_batches(case, device)):
        if case.offload and step:
            load()
        policy_loss(ids).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if case.offload:
            offload()
    return {"states": torch.accelerator.memory_allocated(), "host": host_bytes(model, optimizer)}


def native_stage(case: Case) -> GRPOStage:
    """One mini-batch of `batch` rows a rank (groups of 4), the second half of each sequence the
    response; the default FSDP2 layout (each row forwarded whole); no reference (kl_coef 0)."""
    group = 4
    return GRPOStage(
        prompts_per_step=case.batch * RANKS // group,
        group_size=group,
        mini_batches=1,
        micro_batch_size=case.micro,
        max_new_tokens=case.seq // 2,
        kl_coef=0.0,
        dtype=case.dtype,
    )


def train_native(case: Case, model_dir: Path) -> dict:
    """STEPS updates of our GRPO actor (stages/grpo/actor.py) on one rollout batch of random tokens,
    every response as long as max_new_tokens, its old log-probabilities the update's own (on policy)."""
    import numpy as np
    import torch
    from verl.protocol import DataProto

    from runtime.dist import rank_device
    from stages.grpo.actor import Actor
    from stages.grpo.rollout import sequences

    stage, device = native_stage(case), rank_device()
    actor = Actor(model_dir, stage)
    [ids] = random_batches(case, "cpu", 1)
    response = stage.max_new_tokens
    prompt, responses = ids[:, :-response], ids[:, -response:]
    tensors = sequences(prompt, torch.ones_like(prompt), responses, eos_id=-1)  # no eos: full length
    nan = torch.full(responses.shape, float("nan"))
    signs = torch.randn(case.batch, 1, generator=torch.Generator().manual_seed(2))
    advantages = signs.expand(responses.shape)
    tensors |= {"old_log_probs": nan, "entropy": nan.clone(), "advantages": advantages.contiguous()}
    uid = np.array([f"p{row // stage.group_size}" for row in range(case.batch)], dtype=object)
    batch = DataProto.from_dict(
        tensors={k: v.to(device) for k, v in tensors.items()},
        non_tensors={"uid": uid},
        meta_info={"temperature": 1.0},
    )
    for step in range(STEPS):
        actor.update(batch, iteration=step + 1)
    return {"states": torch.accelerator.memory_allocated(), "host": 0}


def host_bytes(model, optimizer) -> int:
    """Bytes of this rank's parameter shards and optimizer states that are in host memory."""
    import torch

    def local(t):
        return t.to_local() if hasattr(t, "to_local") else t

    tensors = [local(p) for p in model.parameters()]
    tensors += [local(v) for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    return sum(t.numel() * t.element_size() for t in tensors if t.device.type == "cpu")


# -- the parent: model, ranks, table ------------------------------------------------------------------
def write_model(directory: Path, spec: dict) -> LlamaShape:
    """A Llama of `spec` with random weights, as a Hugging Face directory (bf16 safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**spec, rms_norm_eps=1e-5, max_position_embeddings=1024, tie_word_embeddings=False)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    return shape_from_hf_config(directory / "config.json")


def measure(names: list[str], models: Path) -> dict[str, list[dict]]:
    """The cases on RANKS ranks of the emulated device, in one torchrun: {case: each rank's
    measurements}."""
    from tests import fakegpu
    from tests.conftest import free_port
    from tests.dist.workers.results import read_results

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={RANKS}"]
    cmd += [f"--master-port={free_port()}", __file__, "--models", str(models)]
    cmd += [arg for name in names for arg in ("--worker", name)]
    env = fakegpu.child_env({**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO)})
    proc = subprocess.run(
        cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=120 + 120 * len(names)
    )
    by_case = {name: [r for r in read_results(proc.stdout) if r["case"] == name] for name in names}
    if proc.returncode != 0 or any(len(ranks) != RANKS for ranks in by_case.values()):
        raise RuntimeError(
            f"{names} failed (rc={proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
        )
    return by_case


def compare_case(name: str, shape: LlamaShape, ranks: list[dict]) -> list[dict]:
    """One comparison: each measurement's largest over the ranks; with pipeline stages, one a stage
    (their ranks hold different parts of the model)."""
    case = CASES[name]
    if case.pp == 1:
        largest = {key: max(r[key] for r in ranks) for key in ("states", "host", "peak")}
        return [compare(name, predict(case, shape), largest)]
    by_stage = sorted(ranks, key=lambda r: r["stage"])
    return [compare(f"{name}/stage{r['stage']}", predict(case, shape, r["stage"]), r) for r in by_stage]


def deviation(measured: float, predicted: float, scale: float) -> float:
    """How far off a prediction is: relative to itself, or to `scale` where it is 0 bytes."""
    return abs(measured - predicted) / (predicted or scale)


def compare(name: str, predicted: dict, measured: dict) -> dict:
    keys = ("states", "peak") + (("host",) if predicted["host"] else ())
    rows = {
        key: {
            "predicted": predicted[key],
            "measured": measured[key],
            "ratio": measured[key] / predicted[key] if predicted[key] else None,
            "off": deviation(measured[key], predicted[key], predicted["peak"]),
        }
        for key in keys
    }
    return {"case": name, "ok": all(r["off"] <= TOLERANCE for r in rows.values()), "figures": rows}


def print_table(results: list[dict]) -> None:
    print(f"{'case':<21} {'what':<7} {'predicted MiB':>14} {'measured MiB':>13} {'ratio':>7}  verdict")
    for result in results:
        for key, r in result["figures"].items():
            ratio = "-" if r["ratio"] is None else f"{r['ratio']:.3f}"
            verdict = "ok" if r["off"] <= TOLERANCE else f"OFF by {r['off']:.0%}"
            row = f"{r['predicted'] / MIB:14.1f} {r['measured'] / MIB:13.1f} {ratio:>7}  {verdict}"
            print(f"{result['case']:<21} {key:<7} {row}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", action="append", choices=sorted(CASES), help="default: every case")
    parser.add_argument("--json", type=Path, help="also write the figures here")
    parser.add_argument("--worker", action="append", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--models", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        worker(args.worker, args.models)
        return 0
    names = args.case or list(CASES)
    with tempfile.TemporaryDirectory(prefix="plan-vs-engines-") as tmp:
        models = {CASES[n].model for n in names}
        shapes = {m: write_model(Path(tmp) / m, MODELS[m]) for m in sorted(models)}
        measured = measure(names, Path(tmp))
        results = [r for n in names for r in compare_case(n, shapes[CASES[n].model], measured[n])]
    print_table(results)
    if args.json:
        params = {m: shape.params() for m, shape in shapes.items()}
        args.json.write_text(json.dumps({"params": params, "results": results}, indent=1))
    return 0 if all(r["ok"] for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
