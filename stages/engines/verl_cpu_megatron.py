"""verl's megatron backend (`model_engine=megatron`) on the CPU platform (stages/engines/verl_cpu.py).

verl 0.9.1 builds the megatron actor and reference through Megatron-Bridge (`AutoBridge`) on
megatron-core; both assume CUDA and Transformer Engine where a CPU has neither. verl_cpu.py imports
this module only in a process that imports verl's megatron engine (a rank of the actor/reference
worker), so the FSDP path and every other process never pay for it. Each patch names the line of
the installed version (verl 0.9.1, megatron-core 0.18.2, Megatron-Bridge 0.5.1) it works around.

What stays megatron's own: the model (the local layer spec: megatron-core's own attention, norms
and linear layers in place of Transformer Engine's), tensor and pipeline parallelism over gloo,
megatron's DDP buffers, its distributed optimizer (bf16 parameters, fp32 main parameters) and grad
clipping, Bridge's weight conversion for the rollout's weight sync and the checkpoint.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import threading

import torch

from stages.engines import cpu_shim

# megatron-core modules beyond cpu_shim's that make CUDA calls on the megatron backend's path:
MEGATRON_CUDA_MODULES = (
    # param_and_grad_buffer.py:1101-1125 allocate the DDP buffers on torch.cuda.current_device()
    "megatron.core.distributed.param_and_grad_buffer",
    # optimizer.py:501-513,935 (loss scale, found_inf) with device='cuda', :1177 on current_device()
    "megatron.core.optimizer.optimizer",
    # distrib_optimizer.py:944 shards on torch.cuda.current_device()
    "megatron.core.optimizer.distrib_optimizer",
    # clip_grads.py:96,109,121,184,233 norm and counters with device='cuda'
    "megatron.core.optimizer.clip_grads",
    # Bridge's TP-replicated HF weights go to torch.cuda.current_device() (param_mapping.py:1288-1289)
    "megatron.bridge.models.conversion.param_mapping",
    # DDP is wrapped on a side CUDA stream (megatron/training/models/dist_utils.py:246-248,294)
    "megatron.training.models.dist_utils",
    # verl saves and loads the optimizer and RNG states with megatron's dist_checkpointing
    # (verl/utils/megatron/dist_checkpointing.py), which synchronizes CUDA and exchanges on it:
    "megatron.core.dist_checkpointing.strategies.filesystem_async",  # :248 synchronize
    "megatron.core.dist_checkpointing.strategies.fully_parallel",  # :280,289 synchronize
    "megatron.core.dist_checkpointing.strategies.async_utils",  # :224,273,698
    "megatron.core.dist_checkpointing.strategies.state_dict_saver",  # :204,252 flags on cuda
    "megatron.core.dist_checkpointing.exchange_utils",  # :103,109,329 buffers made on cuda
)


class _NoStream:
    """A CUDA stream on the CPU: one queue, nothing to wait for."""

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, other) -> None:
        pass

    def synchronize(self) -> None:
        pass


_TYPE_LOCK = threading.RLock()
_tensor_type = torch.Tensor.type


def _cuda_type(self, dtype=None, non_blocking=False, **kwargs):
    """Tensor.type() answering for a CPU tensor the name of its CUDA twin ('torch.cuda.FloatTensor')."""
    if dtype is None and not kwargs and self.device.type == "cpu":
        return _tensor_type(self).replace("torch.", "torch.cuda.", 1)
    return _tensor_type(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def _cuda_type_names():
    with _TYPE_LOCK:
        torch.Tensor.type = _cuda_type
        try:
            yield
        finally:
            torch.Tensor.type = _tensor_type


def _with_cuda_type_names(fn):
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with _cuda_type_names():
            return fn(*args, **kwargs)

    return wrapper


def patch_megatron() -> None:
    """Patches to megatron-core and Megatron-Bridge, applied once in a process that builds a
    megatron model on the CPU platform (before it builds one)."""
    if getattr(patch_megatron, "done", False):
        return
    patch_megatron.done = True
    # cpu_shim.py: rotary tables, causal masks, the pipeline schedules' p2p and counters, the RNG
    # tracker; then the same for the DDP buffers and the optimizer.
    cpu_shim.apply_cpu_shim()
    proxy = importlib.import_module("megatron.core.tensor_parallel.random").torch
    proxy.empty_like = cpu_shim._on_cpu(torch.empty_like)
    proxy.cuda.Stream = _NoStream
    proxy.cuda.current_stream = lambda device=None: _NoStream()
    proxy.cuda.stream = lambda stream=None: contextlib.nullcontext()
    for name in MEGATRON_CUDA_MODULES:
        importlib.import_module(name).torch = proxy

    # megatron-core asserts its parameters' and gradients' CUDA type names, which a CPU tensor's
    # type() never is: distrib_optimizer.py:378,443,733 and optimizer.py:699-727 (which parameters
    # get fp32 main copies), clip_grads.py:178 (each step's clipping).
    from megatron.core.optimizer import clip_grads, distrib_optimizer, optimizer

    for cls in (optimizer.Float16OptimizerWithFloat16Params, distrib_optimizer.DistributedOptimizer):
        cls.__init__ = _with_cuda_type_names(cls.__init__)
    clip_grads.clip_grad_by_total_norm_fp32 = _with_cuda_type_names(clip_grads.clip_grad_by_total_norm_fp32)
    optimizer.clip_grad_by_total_norm_fp32 = clip_grads.clip_grad_by_total_norm_fp32

    _patch_bridge_provider()
    _patch_local_attention()
    _patch_fresh_optimizer_state_dict(distrib_optimizer)


def _patch_fresh_optimizer_state_dict(distrib_optimizer) -> None:
    """Without Apex or Transformer Engine the distributed optimizer wraps torch's Adam, and its
    state_dict() reads the step from the per-parameter state, which a never-stepped optimizer has
    not got (distrib_optimizer.py:791-793, `assert len(steps) == 1`). Loading a checkpoint calls it
    on exactly such an optimizer (sharded_state_dict(is_loading=True), distrib_optimizer.py:1476,
    from verl's megatron_checkpoint_manager.py:408 on resume): it is then the state at step 0,
    which the loaded state replaces."""
    DistributedOptimizer = distrib_optimizer.DistributedOptimizer
    state_dict = DistributedOptimizer.state_dict

    @functools.wraps(state_dict)
    def state_dict_from_step_0(self):
        if distrib_optimizer.HAVE_APEX_OR_TE or len(self.optimizer.state) > 0:
            return state_dict(self)
        inner = self.optimizer.state_dict()
        groups = [{**{k: v for k, v in g.items() if k != "params"}, "step": 0} for g in inner["param_groups"]]
        fresh = {"optimizer": {**{k: v for k, v in inner.items() if k != "state"}, "param_groups": groups}}
        if self.grad_scaler:
            fresh["grad_scaler"] = self.grad_scaler.state_dict()
        return fresh

    DistributedOptimizer.state_dict = state_dict_from_step_0


def _patch_local_attention() -> None:
    """verl hands the model a [batch, seq] mask of the tokens to keep (bshd, right-padded:
    verl/models/mcore/util.py:708-716, model_forward.py:453), which Transformer Engine's causal
    attention ignores; megatron-core's local attention would apply it as a [b, 1, sq, sk] mask of
    the positions to drop (dot_product_attention.py:210, fused_softmax.py:329). As on a GPU, causal
    attention alone then: the padding follows every sequence's tokens."""
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType

    forward = DotProductAttention.forward

    @functools.wraps(forward)
    def forward_causal(self, query, key, value, attention_mask, attn_mask_type=None, *args, **kwargs):
        causal = (attn_mask_type or self.attn_mask_type) == AttnMaskType.causal
        if causal and attention_mask is not None and attention_mask.dim() == 2:
            attention_mask = None
        return forward(self, query, key, value, attention_mask, attn_mask_type, *args, **kwargs)

    DotProductAttention.forward = forward_causal


def _patch_bridge_provider() -> None:
    """Megatron-Bridge's GPT provider builds Transformer Engine layers (gpt_provider.py:119-123,
    default_layer_spec, whatever TE's availability): the local spec (gpt_provider.py:82) instead."""
    from megatron.bridge.models import gpt_provider

    te_specs = {
        gpt_provider.default_layer_spec,
        gpt_provider.transformer_engine_layer_spec,
        gpt_provider.transformer_engine_full_layer_spec,
    }
    provide = gpt_provider.GPTModelProvider.provide

    @functools.wraps(provide)
    def provide_local(self, *args, **kwargs):
        if self.transformer_layer_spec in te_specs:
            self.transformer_layer_spec = gpt_provider.local_layer_spec
        return provide(self, *args, **kwargs)

    gpt_provider.GPTModelProvider.provide = provide_local

    # verl builds the model with provide_distributed_model() (utils/megatron_utils.py:474) without
    # use_cpu_initialization, and Bridge's get_model() sets the config's flag from that argument
    # (model_provider.py:589): megatron-core then makes every parameter on torch.cuda.current_device()
    # (tensor_parallel/layers.py:272) and Bridge moves the model to CUDA (model_provider.py:625-632).
    from megatron.bridge.models import model_provider

    provide_distributed = model_provider.ModelProviderMixin.provide_distributed_model

    @functools.wraps(provide_distributed)
    def provide_distributed_on_cpu(self, *args, **kwargs):
        kwargs["use_cpu_initialization"] = True
        return provide_distributed(self, *args, **kwargs)

    model_provider.ModelProviderMixin.provide_distributed_model = provide_distributed_on_cpu
