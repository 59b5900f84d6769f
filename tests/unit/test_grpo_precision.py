"""The native GRPO roles in bf16 on one gloo rank: the actor keeps fp32 master weights, gradients
and AdamW states and computes in bf16 (FSDP2's gathered parameters, DDP's autocast), the reference
and the rollout hold bf16 copies, and final/ is written in the stage's dtype. 'auto' resolves per
device, and an fp32 stage is what it was."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from verl.protocol import DataProto

from core.config import GRPOStage
from stages.engines.precision import compute_dtype
from stages.grpo.actor import Actor
from stages.grpo.logprobs import response_log_probs
from stages.grpo.placement import role_dtype
from stages.grpo.reference import Reference
from stages.grpo.rollout import Rollout
from stages.models.hf_files import HFCheckpoint
from stages.models.tiny import build_tiny_llama
from tests.conftest import free_port


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    build_tiny_llama(
        tmp_path, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield tmp_path
    dist.destroy_process_group()


def batch(rows: int = 2, prompt: int = 3, response: int = 4) -> DataProto:
    ids = torch.randint(1, 64, (rows, prompt + response), generator=torch.Generator().manual_seed(0))
    ones = torch.ones_like(ids)
    tensors = {
        "input_ids": ids,
        "prompts": ids[:, :prompt],
        "attention_mask": ones,
        "position_ids": ones.cumsum(1) - 1,
        "responses": ids[:, prompt:],
        "response_mask": ones[:, prompt:],
    }
    return DataProto.from_dict(tensors=tensors, meta_info={"temperature": 1.0})


def linear_output_dtypes(model) -> tuple[set[torch.dtype], list]:
    """The dtypes the projection layers compute in, collected by hooks (and the hooks to remove)."""
    seen = set()
    handles = [
        m.register_forward_hook(lambda m, args, out: seen.add(out.dtype))
        for m in model.modules()
        if isinstance(m, torch.nn.Linear)
    ]
    return seen, handles


@pytest.mark.parametrize("data_parallel", ["fsdp2", "ddp"])
def test_a_bf16_actor_steps_fp32_master_weights_and_computes_in_bf16(one_rank, data_parallel):
    stage = GRPOStage(data_parallel=data_parallel, dtype="bf16", micro_batch_size=2)
    actor = Actor(one_rank, stage)
    seen, handles = linear_output_dtypes(actor.model)
    log_probs, _ = response_log_probs(actor.model, batch(), share_prompts=stage.shares_prompts)
    for h in handles:
        h.remove()
    assert seen == {torch.bfloat16}
    assert log_probs.dtype == torch.float32  # the loss reads fp32 log-probs
    log_probs.sum().backward()
    actor.optimizer.step()
    params = list(actor.model.parameters())
    assert {p.dtype for p in params} == {torch.float32}
    assert {p.grad.dtype for p in params} == {torch.float32}
    states = [t for s in actor.optimizer.state.values() for k, t in s.items() if k != "step"]
    assert states and {t.dtype for t in states} == {torch.float32}


def test_frozen_copies_are_bf16_and_the_rollout_takes_the_actors_weights_rounded(one_rank):
    stage = GRPOStage(data_parallel="fsdp2", dtype="bf16", micro_batch_size=2, kl_coef=0.1)
    actor, reference = Actor(one_rank, stage), Reference(one_rank, stage)
    rollout = Rollout(one_rank, None, 2, 4, 1.0, 1.0, dtype=role_dtype(stage))
    assert {p.dtype for p in reference.model.parameters()} == {torch.bfloat16}
    assert {p.dtype for p in rollout.model.parameters()} == {torch.bfloat16}
    with torch.no_grad():  # master weights off the bf16 grid, as training leaves them
        for p in actor.model.parameters():
            p.add_(torch.randn_like(p) * 1e-3)
    master = {name: p.full_tensor().detach().clone() for name, p in actor.model.named_parameters()}
    with actor.gathered_weights() as weights:
        rollout.load_weights(weights)
    for name, p in rollout.model.named_parameters():
        assert torch.equal(p, master[name].to(torch.bfloat16)), name


def test_the_export_is_written_in_the_stage_dtype(one_rank, tmp_path_factory):
    out = {}
    for dtype in ("bf16", "fp32"):
        actor = Actor(one_rank, GRPOStage(data_parallel="fsdp2", dtype=dtype))
        out[dtype] = tmp_path_factory.mktemp(dtype)
        actor.export_hf(out[dtype], one_rank)
    source, bf16, fp32 = (HFCheckpoint(d) for d in (one_rank, out["bf16"], out["fp32"]))
    for name in source:
        assert bf16[name].dtype == torch.bfloat16 and torch.equal(bf16[name], source[name].to(torch.bfloat16))
        assert fp32[name].dtype == torch.float32 and torch.equal(fp32[name], source[name])


def test_an_fp32_stage_holds_every_role_in_fp32(one_rank):
    stage = GRPOStage(data_parallel="ddp", dtype="fp32", kl_coef=0.1)
    assert {p.dtype for p in Reference(one_rank, stage).model.parameters()} == {torch.float32}
    actor = Actor(one_rank, stage)
    seen, handles = linear_output_dtypes(actor.model)
    response_log_probs(actor.model, batch(), share_prompts=stage.shares_prompts)
    for h in handles:
        h.remove()
    assert seen == {torch.float32}
    rollout = Rollout(one_rank, None, 2, 4, 1.0, 1.0)
    assert {p.dtype for p in rollout.model.parameters()} == {torch.float32}


def test_auto_is_bf16_on_cuda_and_fp32_elsewhere():
    assert compute_dtype("auto", torch.device("cuda", 0)) == torch.bfloat16
    assert compute_dtype("auto", torch.device("cpu")) == torch.float32
    assert compute_dtype("bf16", torch.device("cpu")) == torch.bfloat16
    assert compute_dtype("fp32", torch.device("cuda", 0)) == torch.float32
    with pytest.raises(ValueError, match="dtype"):
        compute_dtype("fp16", torch.device("cpu"))
