"""On 2 gloo ranks: a tiny Llama sharded with FSDP2, nudged as an update would, then saved by verl's
own FSDPCheckpointManager exactly where verl's actor saves it (CKPT/global_step_N/actor), plus
`latest_checkpointed_iteration.txt`. Rank 0 also writes the full weights gathered by
torch.distributed's own API (expected.pt), the reference the merged final/ is compared with."""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from transformers import AutoModelForCausalLM, AutoTokenizer
from verl.utils.checkpoint.fsdp_checkpoint_manager import FSDPCheckpointManager

from launch.worker import leave_now
from runtime.dist import shutdown_distributed


def main(model_dir: str, ckpt_root: str, step: int) -> None:
    dist.init_process_group("gloo")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    # the mesh verl's FSDP engine builds (create_device_mesh): its merger reads the dimension name
    mesh = init_device_mesh("cpu", (dist.get_world_size(),), mesh_dim_names=("fsdp",))
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    torch.manual_seed(dist.get_rank())
    with torch.no_grad():  # each rank moves its own shard: the merger must put them back together
        for p in model.parameters():
            p.to_local().add_(0.05 * torch.randn_like(p.to_local()))
    expected = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    manager = FSDPCheckpointManager(
        model,
        optimizer=None,
        lr_scheduler=None,
        processing_class=AutoTokenizer.from_pretrained(model_dir),
        checkpoint_config=OmegaConf.create({"save_contents": ["model"], "load_contents": ["model"]}),
    )
    manager.save_checkpoint(str(Path(ckpt_root) / f"global_step_{step}" / "actor"), global_step=step)
    dist.barrier()
    if dist.get_rank() == 0:
        torch.save(expected, Path(ckpt_root) / "expected.pt")
        (Path(ckpt_root) / "latest_checkpointed_iteration.txt").write_text(str(step))
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    leave_now(0)
