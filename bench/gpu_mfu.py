"""SFT model FLOP/s per GPU and MFU of our megatron + DeepSpeed SFT engine's model on NCCL, and the
GRPO compute / communication split of a profiled run. Needs CUDA GPUs: on a machine without them it
says so and exits 1.

    python bench/gpu_mfu.py                                   # one GPU
    torchrun --nproc-per-node 4 bench/gpu_mfu.py --tp 2       # one node
    srun -N 2 --ntasks-per-node 4 --gpus-per-node 4 python bench/gpu_mfu.py   # a Slurm allocation
    python bench/gpu_mfu.py --grpo-run runs/NAME              # also the split of its stage2_grpo

The model is Llama-shaped from a Hugging Face config.json (configs/models/*/config.json) with its
layer count cut to --layers so that it fits one GPU; weights are megatron's random initialisation
(the FLOP/s do not depend on them). A step is forward + backward + optimizer over random tokens, in
bf16 with DeepSpeed's fp32 master weights, with the engine's own DeepSpeed config and model builder.

Model FLOPs per token (PaLM's MFU convention): 6 x (decoder and output-layer parameters) + 12 x
layers x seq_len x (heads x head_dim) for attention, counted whole (not halved for causality).
MFU = model FLOP/s per GPU / the GPU's dense bf16 peak (PEAK_TFLOPS by device name, or --peak-tflops).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

# Dense (no sparsity) bf16 tensor-core peak, TFLOP/s, from the vendors' data sheets; the first
# name that occurs in torch.cuda.get_device_name() wins, so longer names come first.
PEAK_TFLOPS = {
    "H100 PCIe": 756.0,
    "H100 NVL": 835.0,
    "GH200": 989.0,
    "H200": 989.0,
    "H100": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "MI300X": 1307.0,
    "MI250X": 191.5,
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--model-config", type=Path, default=REPO / "configs" / "models" / "llama-3.1-8b" / "config.json"
    )
    p.add_argument(
        "--layers", type=int, default=4, help="decoder layers kept (the rest cut so one GPU holds it)"
    )
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per forward")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size")
    p.add_argument("--zero-stage", type=int, choices=[0, 1, 2], default=1)
    p.add_argument("--steps", type=int, default=10, help="timed steps (after --warmup untimed ones)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--peak-tflops", type=float, help="the GPU's dense bf16 peak (default: PEAK_TFLOPS by name)"
    )
    p.add_argument("--grpo-run", type=Path, help="a run directory whose GRPO stage's split to print")
    p.add_argument("--grpo-stage", default="stage2_grpo")
    args = p.parse_args(argv)
    if not args.model_config.is_file():
        p.error(f"--model-config: {args.model_config} is not a file")
    if args.grpo_run is not None and not (args.grpo_run / args.grpo_stage / "profile").is_dir():
        p.error(
            f"--grpo-run: {args.grpo_run / args.grpo_stage / 'profile'} does not exist (run the stage first)"
        )
    return args


def peak_tflops(device_name: str, given: float | None) -> float:
    if given is not None:
        return given
    for name, peak in PEAK_TFLOPS.items():
        if name in device_name:
            return peak
    print(f"error: no bf16 peak known for {device_name!r}; pass --peak-tflops", file=sys.stderr)
    sys.exit(2)


def flops_per_token(shape, seq_len: int) -> float:
    params = shape.layers * shape.layer_params() + shape.vocab * shape.hidden  # the output layer is a matmul
    return 6 * params + 12 * shape.layers * seq_len * shape.heads * shape.head_dim


def init_ranks():
    """NCCL process group from torchrun's or Slurm's environment (under bare srun the master is the
    allocation's first node, as the pipeline's own Slurm launcher sets it)."""
    from launch.slurm_launch import first_host, rendezvous_port
    from runtime.dist import init_distributed

    if "SLURM_JOB_NODELIST" in os.environ and "MASTER_ADDR" not in os.environ:
        os.environ["MASTER_ADDR"] = first_host(os.environ["SLURM_JOB_NODELIST"])
        os.environ["MASTER_PORT"] = str(rendezvous_port(os.environ["SLURM_JOB_ID"]))
    return init_distributed("nccl")


def build_engine(hf_config, args):
    """The SFT engine's model and DeepSpeed wrapping (stages/engines/megatron_deepspeed.py), from
    random initialisation instead of a checkpoint."""
    import deepspeed
    from megatron.core import parallel_state, tensor_parallel

    from core.config import ParallelConfig, SFTStage
    from stages.engines.megatron_deepspeed import MegatronMpu, deepspeed_config, device_args
    from stages.models.megatron_llama import build_megatron_llama

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tp, create_gloo_process_groups=False
    )
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    dp = parallel_state.get_data_parallel_world_size()
    stage = SFTStage(
        global_batch_size=args.micro_batch * args.grad_accum * dp,
        micro_batch_size=args.micro_batch,
        max_seq_len=args.seq_len,
        dtype="bf16",
        parallel=ParallelConfig(tp=args.tp, zero_stage=args.zero_stage),
    )
    model = build_megatron_llama(hf_config, params_dtype=torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
    engine, *_ = deepspeed.initialize(
        args=device_args(torch.device("cuda", torch.cuda.current_device())),
        model=model,
        optimizer=optimizer,
        config=deepspeed_config(stage, dp),
        mpu=MegatronMpu(),
    )
    return engine, dp


def measure_sft(args) -> dict:
    """Seconds per optimizer step (median over --steps) and the FLOP/s and MFU that follow."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from analysis.model_shape import shape_from_hf_config

    hf_config = AutoConfig.from_pretrained(args.model_config.parent)
    hf_config.num_hidden_layers = args.layers
    shape = dataclasses.replace(shape_from_hf_config(args.model_config), layers=args.layers)
    engine, dp = build_engine(hf_config, args)
    device = torch.device("cuda", torch.cuda.current_device())
    tokens = torch.randint(0, shape.vocab, (args.micro_batch, args.seq_len + 1), device=device)
    positions = torch.arange(args.seq_len, device=device).expand(args.micro_batch, -1)

    def step():
        for _ in range(args.grad_accum):
            losses = engine(
                input_ids=tokens[:, :-1], position_ids=positions, attention_mask=None, labels=tokens[:, 1:]
            )
            engine.backward(losses.float().mean())
            engine.step()

    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - started)
    seconds = statistics.median(times)
    world = dist.get_world_size()
    step_tokens = args.micro_batch * args.grad_accum * dp * args.seq_len
    flops_per_gpu = step_tokens * flops_per_token(shape, args.seq_len) / seconds / world
    peak = peak_tflops(torch.cuda.get_device_name(), args.peak_tflops)
    return {
        "gpus": world,
        "dp": dp,
        "tp": args.tp,
        "step_s": seconds,
        "tokens_per_s_per_gpu": step_tokens / seconds / world,
        "tflops_per_gpu": flops_per_gpu / 1e12,
        "peak_tflops": peak,
        "mfu": flops_per_gpu / 1e12 / peak,
        "max_memory_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def print_grpo_split(stage_dir: Path) -> None:
    """Per top-level phase on rank 0: wall, exposed communication and compute (analysis/breakdown)."""
    from analysis.breakdown import summarise_stage

    rows = summarise_stage(stage_dir).phase_split()
    wall, comm = sum(r[1] for r in rows), sum(r[2] for r in rows)
    print(f"\nGRPO split, {stage_dir} (rank 0, whole stage):")
    print(f"{'phase':24s} {'wall s':>9s} {'comm s':>9s} {'compute s':>10s}")
    for name, w, c, compute in rows:
        print(f"{name:24s} {w:9.2f} {c:9.2f} {compute:10.2f}")
    print(
        f"communication {comm:.2f} s of {wall:.2f} s ({100 * comm / max(wall, 1e-9):.1f}%), "
        f"compute {100 * (1 - comm / max(wall, 1e-9)):.1f}%"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print(
            "error: bench/gpu_mfu.py needs CUDA GPUs (torch.cuda.is_available() is False here); "
            "run it on a GPU node, e.g. under srun or torchrun",
            file=sys.stderr,
        )
        return 1
    info = init_ranks()
    result = measure_sft(args)
    if info.rank == 0:
        print(
            f"{args.model_config.parent.name} cut to {args.layers} layers, seq {args.seq_len}, micro-batch "
            f"{args.micro_batch} x {args.grad_accum}, {result['gpus']} GPUs "
            f"(tp {result['tp']}, dp {result['dp']}), "
            f"{torch.cuda.get_device_name()}: {result['step_s'] * 1e3:.1f} ms a step, "
            f"{result['tokens_per_s_per_gpu']:.0f} tokens/s per GPU, "
            f"peak memory {result['max_memory_gib']:.1f} GiB"
        )
        if args.grpo_run is not None:
            print_grpo_split(args.grpo_run / args.grpo_stage)
        print(
            f"SFT model FLOP/s per GPU: {result['tflops_per_gpu']:.1f} TFLOP/s, "
            f"MFU {100 * result['mfu']:.1f}% "
            f"of {result['peak_tflops']:.0f} TFLOP/s bf16"
        )
    from runtime.dist import shutdown_distributed

    shutdown_distributed()
    return 0


if __name__ == "__main__":
    sys.exit(main())
