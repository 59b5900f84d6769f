"""verl's FSDP checkpoint -> our final/: a checkpoint written by verl's own checkpoint manager on 2
real ranks, merged by verl's merger through verl_io.merge_to_final, gives a Hugging Face directory
whose logits equal those of the weights torch.distributed gathers independently (rounded to bf16,
the dtype verl's merger writes). The real runs (tests/slurm/test_slurm_verl.py) merge verl's
checkpoints too, but have no independent copy of the trained weights to compare with: this test
keeps that comparison. What the stage driver makes of verl's outputs (manifest, metrics, eval) is
checked on the real runs' outputs there."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.data.tokenizer import build_char_tokenizer
from stages.engines.verl_io import latest_step, merge_to_final
from stages.models.tiny import build_tiny_llama
from tests.conftest import REPO

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "verl_fsdp_checkpoint.py"


def test_verl_fsdp_checkpoint_merges_into_final_with_equal_logits(tmp_path, torchrun):
    init = tmp_path / "init"
    tokenizer = build_char_tokenizer(init)
    build_tiny_llama(
        init,
        vocab_size=128,
        hidden_size=32,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        ffn_hidden_size=64,
        seed=0,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    ckpt = tmp_path / "ckpt"
    torchrun(WORKER, 2, str(init), str(ckpt), "3", timeout=600)

    final = tmp_path / "stage" / "final"
    merge_to_final(ckpt, latest_step(ckpt), "fsdp", init, final)

    merged = AutoModelForCausalLM.from_pretrained(final, dtype=torch.float32).eval()
    reference = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).eval()
    initial_logits_model = AutoModelForCausalLM.from_pretrained(init, dtype=torch.float32).eval()
    # verl's merger stores bf16 (fsdp_model_merger casts every shard): the reference is rounded alike.
    reference.load_state_dict(
        {k: v.to(torch.bfloat16).float() for k, v in torch.load(ckpt / "expected.pt").items()}
    )
    ids = torch.tensor([tokenizer("12+34=<think>")["input_ids"]])
    with torch.no_grad():
        got, want, before = (m(ids).logits for m in (merged, reference, initial_logits_model))
    assert (want - before).abs().max() > 1e-3, "the saved weights must differ from the initial ones"
    assert torch.equal(got, want)
    assert (final / "tokenizer_config.json").is_file() and not final.with_name("final.tmp").exists()
