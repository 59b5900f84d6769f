"""The SFT engine: a megatron-core Llama (tensor and pipeline parallel) wrapped by DeepSpeed ZeRO
over the data-parallel group — the Megatron-DeepSpeed pattern. Weights come in and go out as
Hugging Face directories; everything in between is megatron layout.

With pipeline stages (pp > 1) megatron-core's 1F1B schedule runs the forward and backward of a
step's micro-batches (stages/engines/pipeline.py) and DeepSpeed then reduces the gradients over
the data-parallel group and steps, as DeepSpeed's own PipelineEngine does (ZeRO 0 or 1).

Loss normalisation: every rank divides its summed token losses by the token count of the whole
global batch (times the data-parallel size, which DeepSpeed's gradient averaging divides out), so
the loss and the gradients are those of one big batch whatever the DP/TP split or micro-batching.
"""

from __future__ import annotations

import math
import random
from pathlib import Path
from types import SimpleNamespace

import deepspeed
import numpy as np
import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from transformers import AutoConfig

from core.config import SFTStage
from runtime.dist import collective_timeout, rank_device
from runtime.phases import phase
from stages.data.sft_batches import MicroBatch
from stages.engines.cpu_shim import apply_cpu_shim
from stages.engines.pipeline import PhaseTimers, pipeline_step
from stages.engines.precision import DTYPES
from stages.models.convert import export_megatron_to_hf, load_hf_into_megatron
from stages.models.megatron_llama import build_megatron_llama


class MegatronMpu:
    """The model-parallel interface DeepSpeed asks for, answered by megatron-core's parallel_state.
    'Model parallel' is tensor x pipeline, as in Megatron-DeepSpeed: DeepSpeed sums the gradient
    norm over that group (counting a tensor-parallel replica once, by its tensor rank) and names
    checkpoint files by that rank, so each pipeline stage writes files of its own."""

    get_tensor_model_parallel_rank = staticmethod(parallel_state.get_tensor_model_parallel_rank)
    get_tensor_model_parallel_world_size = staticmethod(parallel_state.get_tensor_model_parallel_world_size)
    get_tensor_model_parallel_group = staticmethod(parallel_state.get_tensor_model_parallel_group)
    get_tensor_model_parallel_src_rank = staticmethod(parallel_state.get_tensor_model_parallel_src_rank)
    get_model_parallel_group = staticmethod(parallel_state.get_model_parallel_group)
    get_data_parallel_rank = staticmethod(parallel_state.get_data_parallel_rank)
    get_data_parallel_world_size = staticmethod(parallel_state.get_data_parallel_world_size)
    get_data_parallel_group = staticmethod(parallel_state.get_data_parallel_group)

    @staticmethod
    def get_model_parallel_rank() -> int:
        return dist.get_rank(parallel_state.get_model_parallel_group())

    @staticmethod
    def get_model_parallel_world_size() -> int:
        return dist.get_world_size(parallel_state.get_model_parallel_group())

    @staticmethod
    def get_sequence_parallel_world_size() -> int:
        return 1


def warmup_cosine(stage: SFTStage):
    """lr multiplier per step: linear warmup, then cosine decay to min_lr at the last step."""
    floor = stage.min_lr / stage.lr

    def factor(step: int) -> float:
        if step < stage.warmup_steps:
            return (step + 1) / stage.warmup_steps
        progress = min(1.0, (step - stage.warmup_steps) / max(1, stage.steps - stage.warmup_steps))
        return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def deepspeed_config(stage: SFTStage, dp_size: int) -> dict:
    micro_steps, p = stage.global_batch_size // (stage.micro_batch_size * dp_size), stage.parallel
    # Under pp > 1 the schedule runs backward, outside the engine: ZeRO-1 then reduces each
    # parameter's gradient at the step, without the contiguous buckets its backward would fill.
    pipelined = {"contiguous_gradients": False} if p.pp > 1 else {}
    return {
        "train_batch_size": stage.global_batch_size,
        "train_micro_batch_size_per_gpu": stage.micro_batch_size,
        "gradient_accumulation_steps": micro_steps,
        "gradient_clipping": stage.grad_clip,
        "zero_optimization": {"stage": p.zero_stage, "overlap_comm": p.overlap_comm, **pipelined},
        "zero_allow_untested_optimizer": True,
        "bf16": {"enabled": stage.dtype == "bf16"},
        "steps_per_print": 1 << 30,
        "wall_clock_breakdown": False,
    }


class MegatronDeepSpeedEngine:
    def __init__(self, hf_dir: Path, stage: SFTStage, seed: int):
        apply_cpu_shim()
        self.device = rank_device()
        p = stage.parallel  # zero_stage < 3, and < 2 with pp > 1: checked by the config
        # megatron gives its groups a timeout of its own (30 min): the stage's bound, where it has one.
        timeout = collective_timeout()
        # No gloo twins of the groups: only megatron's own distributed optimizer and checkpointing
        # use them (DeepSpeed holds ours), and on GPUs they would send CPU traffic over any interface.
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=p.tp,
            pipeline_model_parallel_size=p.pp,
            create_gloo_process_groups=False,
            **({} if timeout is None else {"distributed_timeout_minutes": timeout.total_seconds() / 60}),
        )
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        self.hf_config = AutoConfig.from_pretrained(hf_dir)
        # Initialised although every weight is overwritten: only megatron's init functions mark
        # the tensor-parallel weights, and the grad norm (clipping) sums the marked ones over the
        # TP ranks but counts an unmarked one once, as if it were replicated.
        self.pipelined = p.pp > 1
        # The schedule's loss is ours as it is (per token, scaled below), its timers our phases.
        schedule = {"calculate_per_token_loss": True, "timers": PhaseTimers()} if self.pipelined else {}
        model = build_megatron_llama(self.hf_config, params_dtype=DTYPES[stage.dtype], **schedule)
        load_hf_into_megatron(model, hf_dir, self.hf_config)
        decay, no_decay = _decay_groups(model)
        optimizer = torch.optim.AdamW(
            [
                {"params": decay, "weight_decay": stage.weight_decay},
                {"params": no_decay, "weight_decay": 0.0},
            ],
            lr=stage.lr,
        )
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(stage))
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.engine, *_ = deepspeed.initialize(
            args=device_args(self.device),
            model=model,
            optimizer=optimizer,
            lr_scheduler=scheduler,
            config=deepspeed_config(stage, self.dp_size),
            mpu=MegatronMpu(),
        )

    def train_step(self, micro_batches: list[MicroBatch], global_loss_tokens: int) -> dict:
        """Forward/backward every micro-batch of this rank, then one optimizer step."""
        if self.pipelined:
            loss_sum = self._pipelined_forward_backward(micro_batches, global_loss_tokens)
        else:
            loss_sum = self._forward_backward(micro_batches, global_loss_tokens)
        with phase("metrics"):
            dist.all_reduce(loss_sum, group=parallel_state.get_data_parallel_group())
            if self.pipelined:  # the loss is the last stage's: the others add zero
                dist.all_reduce(loss_sum, group=parallel_state.get_pipeline_model_parallel_group())
        return {
            "loss": loss_sum.item() / global_loss_tokens,
            "grad_norm": _as_float(self.engine.get_global_grad_norm()),
            "lr": self.engine.get_lr()[0],
        }

    def _forward_backward(self, micro_batches: list[MicroBatch], global_loss_tokens: int) -> torch.Tensor:
        loss_sum = torch.zeros((), device=self.device)
        for mb in (m.to(self.device) for m in micro_batches):
            with phase("forward"):
                token_losses = self.engine(
                    input_ids=mb.input_ids,
                    position_ids=mb.position_ids,
                    attention_mask=None,
                    labels=mb.labels,
                )
                local = (token_losses.float() * mb.loss_mask).sum()
            with phase("backward"):  # includes DeepSpeed's gradient reduction at the boundary
                self.engine.backward(local * (self.dp_size / global_loss_tokens), scale_wrt_gas=False)
            with phase("optimizer"):
                self.engine.step()  # DeepSpeed steps the optimizer only at the accumulation boundary
            loss_sum += local.detach()
        return loss_sum

    def _pipelined_forward_backward(self, micro_batches: list[MicroBatch], global_loss_tokens: int):
        loss_sum = pipeline_step(
            self.engine.module, micro_batches, self.device, self.dp_size / global_loss_tokens
        )
        self.engine.set_gradient_accumulation_boundary(True)
        with phase("backward"):  # the data-parallel reduction, where DeepSpeed's backward would do it
            self.engine.allreduce_gradients()
        with phase("optimizer"):
            self.engine.step()
        return loss_sum

    def save(self, directory: Path, trainer_state: dict) -> None:
        """Engine-native sharded checkpoint (model, optimizer, scheduler) plus this rank's RNG state
        and the trainer state; every rank calls it."""
        directory.mkdir(parents=True, exist_ok=True)
        self.engine.save_checkpoint(
            str(directory.parent), tag=directory.name, client_state=trainer_state, save_latest=False
        )
        torch.save(_rng_state(), directory / f"rng-rank-{dist.get_rank():05d}.pt")
        dist.barrier()

    def load(self, directory: Path) -> dict:
        _, client_state = self.engine.load_checkpoint(str(directory.parent), tag=directory.name)
        _set_rng_state(torch.load(directory / f"rng-rank-{dist.get_rank():05d}.pt", weights_only=False))
        return client_state

    def export_hf(self, out_dir: Path, tokenizer_dir: Path) -> None:
        """Write a Hugging Face directory from rank 0, gathering one layer at a time."""
        export_megatron_to_hf(self.engine.module, self.hf_config, out_dir, tokenizer_dir)

    def close(self) -> None:
        """Free the model, its gradients and the optimizer's states before final/ is evaluated on
        the same device."""
        self.engine.destroy()
        self.engine = None
        parallel_state.destroy_model_parallel()


def device_args(device: torch.device) -> SimpleNamespace | None:
    """DeepSpeed selects the device of LOCAL_RANK unless told which: where one GPU is bound to each
    task (`srun --gpus-per-task=1`) every rank's is index 0, and LOCAL_RANK's does not exist."""
    return None if device.index is None else SimpleNamespace(device_rank=device.index)


def _decay_groups(model: torch.nn.Module):
    decay, no_decay = [], []
    for name, param in model.named_parameters():
        (no_decay if param.ndim < 2 or "layernorm" in name or "norm" in name else decay).append(param)
    return decay, no_decay


def _as_float(value) -> float | None:
    return None if value is None else float(value)


def _rng_state() -> dict:
    state = {
        "python": random.getstate(),
        "numpy": np.random.get_state(),
        "torch": torch.get_rng_state(),
        "tracker": tensor_parallel.get_cuda_rng_tracker().get_states(),
    }
    return state


def _set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(state["tracker"])
