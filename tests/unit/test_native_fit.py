"""`hpcr1 submit` refuses, before anything is written or queued, a native-engine stage whose weights
and states alone exceed a GPU of the cluster profile; the shipped 8B config (GRPO on verl) passes.
What the formula counts is checked against the bytes the native GRPO roles really hold."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist

from analysis.native_fit import grpo_residency, synth_residency
from core.config import GRPOStage, SynthStage
from pipeline.cli import main
from stages.engines.precision import DTYPES
from stages.models.tiny import build_tiny_llama
from tests.conftest import REPO, free_port

CONFIG_8B = REPO / "configs" / "llama-3.1-8b.yaml"


@pytest.fixture
def data_files(tmp_path):
    rows = [
        {"question": f"What is {i} plus {i}?", "answer": f"{i} plus {i} is {2 * i}.\n#### {2 * i}"}
        for i in range(8)
    ]
    for name in ("sft", "prompts", "eval"):
        (tmp_path / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return [f"data.{name}_file={tmp_path / name}.jsonl" for name in ("sft", "prompts", "eval")]


def submit_8b(tmp_path, data_files, *overrides):
    argv = ["submit", str(CONFIG_8B), "--cluster", "perlmutter", "--nodes", "4", "--dry-run"]
    argv += ["--run-dir", str(tmp_path / "run"), f"model.path={REPO / 'configs' / 'models' / 'llama-3.1-8b'}"]
    return main([*argv, *data_files, *overrides])


def test_native_grpo_of_8b_on_40gb_gpus_is_refused_before_anything_is_written(tmp_path, data_files, capsys):
    rc = submit_8b(tmp_path, data_files, "stage2_grpo.engine=native", "stage2_grpo.dtype=fp32")
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert "stage2_grpo.engine: the native engine holds 69.2 GiB a GPU" in err
    assert "40 GiB GPUs of cluster profile 'perlmutter'" in err and "stage2_grpo.engine=verl" in err
    assert not (tmp_path / "run").exists()


def test_the_shipped_8b_config_passes(tmp_path, data_files, capsys):
    assert submit_8b(tmp_path, data_files) == 0, capsys.readouterr().err
    assert (tmp_path / "run" / "stage2_grpo" / "logs" / "stage2_grpo.sbatch").is_file()


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_ddp_formula_counts_what_the_native_roles_hold(tmp_path, monkeypatch, dtype):
    """Actor (weights, gradients, AdamW after a step), reference and rollout, loaded by the native
    engine's own loaders on one gloo rank in the stage's dtype: their tensors' bytes are the
    formula's (24·P in fp32, 20·P in bf16 over fp32 master weights)."""
    from stages.engines.ddp import load_replicated

    build_tiny_llama(
        tmp_path, vocab_size=64, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2, ffn_hidden_size=64
    )
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        actor = load_replicated(tmp_path, trainable=True, compute_dtype=DTYPES[dtype])
        optimizer = torch.optim.AdamW(actor.parameters())
        actor(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
        optimizer.step()
        frozen = [load_replicated(tmp_path, False, DTYPES[dtype]) for _ in ("reference", "rollout")]
    finally:
        dist.destroy_process_group()
    params = list(actor.parameters())
    P = sum(p.numel() for p in params)
    held = sum(p.nbytes + p.grad.nbytes for p in params)
    held += sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim() > 0)
    held += sum(p.nbytes for m in frozen for p in m.parameters())
    assert held == grpo_residency("stage2_grpo", GRPOStage(data_parallel="ddp", dtype=dtype), P, 1).bytes
    synth = synth_residency("stage3_synth", SynthStage(dtype=dtype), P)
    assert synth.bytes == sum(p.nbytes for p in frozen[0].parameters())
