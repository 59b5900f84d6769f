"""Before a stage evaluates final/ on the devices it trained on, its engine lets go of every model:
GRPO's actor, reference and rollout copies, and SFT's DeepSpeed engine with its optimizer states.
On a GPU whatever is still referenced stays resident beside the model eval loads."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch.distributed as dist

from core.config import GRPOStage, ParallelConfig, SFTStage
from stages.data.tokenizer import build_char_tokenizer
from stages.models.tiny import build_tiny_llama
from tests.conftest import free_port


@pytest.fixture
def one_rank(tmp_path, monkeypatch):
    tokenizer = build_char_tokenizer(tmp_path)
    build_tiny_llama(
        tmp_path,
        vocab_size=len(tokenizer),
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    # A torchrun's environment for this test alone: later tests and their subprocesses must not see one.
    for name, value in dict(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0"
    ).items():
        monkeypatch.setenv(name, value)
    dist.init_process_group("gloo", rank=0, world_size=1)
    yield tmp_path, tokenizer
    dist.destroy_process_group()


def weights_of(*models) -> list[weakref.ref]:
    return [weakref.ref(next(m.parameters())) for m in models]


@pytest.mark.parametrize("data_parallel", ["ddp", "fsdp2"])
def test_grpo_roles_free_every_model_on_close(one_rank, data_parallel):
    from stages.grpo.trainer import build_roles

    model_dir, tokenizer = one_rank
    roles = build_roles(model_dir, tokenizer, GRPOStage(data_parallel=data_parallel))
    held = weights_of(roles.actor.model, roles.reference.model, roles.rollout.model)
    roles.close()
    gc.collect()
    assert [ref() is None for ref in held] == [True, True, True]


def test_the_sft_engine_frees_its_model_and_optimizer_on_close(one_rank):
    from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine

    model_dir, _ = one_rank
    stage = SFTStage(global_batch_size=2, micro_batch_size=2, parallel=ParallelConfig(tp=1, zero_stage=1))
    engine = MegatronDeepSpeedEngine(model_dir, stage, seed=0)
    held = weights_of(engine.engine.module)
    engine.close()
    gc.collect()
    assert held[0]() is None


def test_the_sft_engine_creates_no_gloo_copies_of_megatrons_groups(one_rank):
    """On GPUs they would carry CPU-side traffic over whatever interface gloo picks."""
    from megatron.core import parallel_state

    from stages.engines.megatron_deepspeed import MegatronDeepSpeedEngine

    model_dir, _ = one_rank
    stage = SFTStage(global_batch_size=2, micro_batch_size=2, parallel=ParallelConfig(tp=1, zero_stage=1))
    engine = MegatronDeepSpeedEngine(model_dir, stage, seed=0)
    try:
        assert parallel_state._DATA_PARALLEL_GROUP_GLOO is None
        assert parallel_state._DATA_PARALLEL_GROUP_WITH_CP_GLOO is None
    finally:
        engine.close()
