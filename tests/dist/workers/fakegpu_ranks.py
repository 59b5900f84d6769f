"""Worker: 2 ranks on the emulated accelerator (installed at startup by fakegpu.child_env), each
on the device of its local rank with the device's default backend, as runtime/dist.py sets a GPU
rank up. Checks the fakeccl group against NCCL's behaviour, then DDP against a CPU reference,
FSDP2 against DDP, DeepSpeed ZeRO-1 against torch's AdamW and megatron-core at TP=2 against TP=1.
Each rank prints its findings as `RESULT {json}` lines."""

import os

import deepspeed
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.nn.parallel import DistributedDataParallel

from tests.dist.workers.results import print_result

LR = 1e-2


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + rank)
    return torch.randn(5, 8, generator=g), torch.randn(5, 4, generator=g)


def loss_of(m, x, y) -> torch.Tensor:
    return (m(x) - y).square().mean()


def max_diff(tensors, references) -> float:
    return max((t.cpu() - r).abs().max().item() for t, r in zip(tensors, references, strict=True))


def reference() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """On the CPU, in this process: the gradients averaged over both ranks' batches, and the weights
    after one AdamW step with them."""
    m = model()
    loss = sum(loss_of(m, *batch(r)) for r in range(2)) / 2
    loss.backward()
    grads = [p.grad.clone() for p in m.parameters()]
    torch.optim.AdamW(m.parameters(), lr=LR).step()
    return grads, [p.detach().clone() for p in m.parameters()]


def setup(rank: int) -> torch.device:
    torch.accelerator.set_device_index(rank)
    device = torch.accelerator.current_accelerator()
    dist.init_process_group(dist.get_default_backend_for_device(device))
    return torch.device(device.type, torch.accelerator.current_device_index())


def collectives(device: torch.device, rank: int) -> dict:
    found = {"backend": dist.get_backend()}
    try:
        dist.all_reduce(torch.ones(3))
    except RuntimeError as e:
        found["cpu_refused"] = str(e)
    for op in ("SUM", "AVG", "MAX", "MIN"):
        t = torch.full((2,), float(rank + 1), device=device)
        dist.all_reduce(t, op=getattr(dist.ReduceOp, op))
        found[op] = [str(t.device), *t.cpu().tolist()]
    gathered = [None, None]
    dist.all_gather_object(gathered, rank)  # object collectives travel on the device, as on nccl
    found["objects"] = gathered
    found["other_ops"] = other_collectives(device, rank)
    return found


def other_collectives(device: torch.device, rank: int) -> dict:
    """What each of the other collectives gives on this rank; rank r contributes values plus 10 r."""

    def mine(*values):
        return torch.tensor(values, device=device) + 10.0 * rank

    out = {"broadcast": mine(1.0), "reduce": mine(1.0), "reduce_scatter": mine(0.0), "scatter": mine(0.0)}
    dist.broadcast(out["broadcast"], src=1)
    dist.reduce(out["reduce"], dst=0)
    dist.reduce_scatter(out["reduce_scatter"], [mine(1.0), mine(2.0)])
    dist.scatter(out["scatter"], [mine(1.0), mine(2.0)] if rank == 0 else None, src=0)
    out["all_to_all_single"] = mine(0.0, 0.0)
    dist.all_to_all_single(out["all_to_all_single"], mine(1.0, 2.0))
    out["gather"] = [mine(0.0), mine(0.0)] if rank == 0 else []
    dist.gather(mine(1.0), out["gather"] or None, dst=0)
    out["send_recv"] = mine(1.0)
    (dist.send if rank == 0 else dist.recv)(out["send_recv"], 1 - rank)
    return {name: [x.cpu().tolist() for x in (t if isinstance(t, list) else [t])] for name, t in out.items()}


def ddp_grads(device: torch.device, rank: int) -> list[torch.Tensor]:
    ddp = DistributedDataParallel(model().to(device))
    x, y = (t.to(device) for t in batch(rank))
    loss_of(ddp, x, y).backward()
    return [p.grad for p in ddp.parameters()]


def fsdp2_grads(device: torch.device, rank: int) -> list[torch.Tensor]:
    """Gradients of FSDP2 (each layer a unit), gathered whole; the model handed to it on the CPU
    (FSDP2 moves it to the mesh's device)."""
    m = model()
    for layer in (m[0], m[2], m):
        fully_shard(layer, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    x, y = (t.to(device) for t in batch(rank))
    loss_of(m, x, y).backward()
    return [p.grad.full_tensor() for p in m.parameters()]


def fsdp2_memory(device: torch.device) -> list[float]:
    """Device memory of two bias-free 256x256 layers under FSDP2, in units of one whole weight
    (rounded to a tenth: the activations are 1/64 each): after sharding, after the forward and after
    the backward. Each unit's unsharded weight is freed once used, as FSDP2 frees it on a GPU."""
    x = torch.randn(4, 256, device=device)
    start, unit = torch.fakegpu.memory_allocated(), 256 * 256 * 4
    seen = []

    def note():
        seen.append(round((torch.fakegpu.memory_allocated() - start) / unit, 1))

    torch.manual_seed(0)
    m = torch.nn.Sequential(*(torch.nn.Linear(256, 256, bias=False) for _ in range(2))).to(device)
    for layer in (m[0], m[1], m):
        fully_shard(layer, mesh=init_device_mesh(device.type, (dist.get_world_size(),)))
    note()
    loss = m(x).square().sum()
    note()
    loss.backward()
    del loss
    note()
    return seen


def zero1_weights(device: torch.device, rank: int, on_device_first: bool) -> list[torch.Tensor]:
    """The weights after one ZeRO-1 step; the model handed to DeepSpeed on the device, or on the CPU
    (DeepSpeed moves it, after the optimizer was made: the optimizer must still hold its parameters)."""
    m = model().to(device) if on_device_first else model()
    config = {
        "train_micro_batch_size_per_gpu": 5,
        "gradient_accumulation_steps": 1,
        "zero_optimization": {"stage": 1},
        "zero_allow_untested_optimizer": True,
    }
    engine, *_ = deepspeed.initialize(
        model=m, optimizer=torch.optim.AdamW(m.parameters(), lr=LR), config=config
    )
    x, y = (t.to(device) for t in batch(rank))
    engine.backward(loss_of(engine, x, y))
    engine.step()
    return list(engine.module.parameters())


def megatron_loss(device: torch.device, tp: int) -> dict:
    """A megatron-core GPT (local spec, RMSNorm, RoPE, GQA) built on the CPU and moved to the device,
    through the project's CPU shim (which the harness points at the device): its mean token loss at
    tensor-parallel size `tp`, and what token ids left on the CPU meet at the embedding."""
    import torch.nn.functional as F
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig

    from stages.engines.cpu_shim import apply_cpu_shim

    apply_cpu_shim()
    parallel_state.initialize_model_parallel(tensor_model_parallel_size=tp)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    config = TransformerConfig(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=64,
        normalization="RMSNorm",
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=True,
        tensor_model_parallel_size=tp,
    )
    torch.manual_seed(0)
    gpt = GPTModel(
        config, get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=64, max_sequence_length=16
    )
    gpt = gpt.to(device)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(16).expand(2, 16)
    labels = ids.roll(-1, dims=1)
    loss = gpt(ids.to(device), positions.to(device), None, labels=labels.to(device)).mean()
    loss.backward()
    found = {"loss": loss.item(), "grad_device": str(next(gpt.parameters()).grad.device)}
    try:
        gpt(ids, positions.to(device), None)
    except RuntimeError as e:
        found["cpu_ids"] = str(e)
    parallel_state.destroy_model_parallel()
    return found


def main() -> None:
    rank = int(os.environ["LOCAL_RANK"])
    device = setup(rank)
    ref_grads, ref_weights = reference()
    found = {"device": str(device), "grad_device": None, **collectives(device, rank)}
    ddp = ddp_grads(device, rank)
    found["grad_device"] = str(ddp[0].device)
    found["ddp_vs_cpu"] = max_diff(ddp, ref_grads)
    found["fsdp2_vs_ddp"] = max_diff(fsdp2_grads(device, rank), [g.cpu() for g in ddp])
    found["fsdp2_memory"] = fsdp2_memory(device)
    weights = zero1_weights(device, rank, on_device_first=True)
    found["zero1_vs_adamw"] = max_diff(weights, ref_weights)
    found["zero1_moved"] = max_diff(weights, list(model().parameters()))
    found["zero1_moved_by_deepspeed_vs_adamw"] = max_diff(zero1_weights(device, rank, False), ref_weights)
    for tp in (1, 2):
        found[f"megatron_tp{tp}"] = megatron_loss(device, tp)
    for check, value in found.items():
        print_result({"rank": rank, "check": check, "value": value})
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
