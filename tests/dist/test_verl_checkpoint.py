"""verl's FSDP checkpoint -> our final/: a checkpoint written by verl's own checkpoint manager on 2
real ranks, merged by verl's merger through verl_io.merge_to_final, gives a Hugging Face directory
whose logits equal those of the weights torch.distributed gathers independently (rounded to bf16,
the dtype verl's merger writes)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from stages.data.tokenizer import build_char_tokenizer
from stages.engines.verl_io import latest_step, merge_to_final, next_metrics_file
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


def test_a_verl_stage_is_done_only_once_its_results_are_ours(tmp_path, torchrun):
    """The stage driver around a verl stage, with main_ppo's part played by what it leaves behind (a
    checkpoint written by verl's own manager on 2 ranks, verl's file-logger rows): the manifest
    records it done with final/'s checksums and the held-out accuracy verl measured, as any stage."""
    import json

    import yaml

    from core.config import load_config
    from core.manifest import Manifest
    from core.rundir import RunDir
    from launch.verl_job import finish_verl_stage
    from pipeline.driver import prepare_run, rerun_reason, run_stage
    from stages.engines.verl_trainer import verl_paths

    config = tmp_path / "verl.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "name": "verl",
                "nproc": 2,
                "wandb": {"mode": "disabled"},
                "model": {
                    "tiny": {
                        "hidden_size": 32,
                        "num_layers": 2,
                        "num_heads": 4,
                        "num_kv_heads": 2,
                        "ffn_hidden_size": 64,
                    }
                },
                "data": {"arithmetic": {"sft_size": 8, "prompts_size": 8, "eval_size": 4}},
                "eval": {"num_examples": 4},
                "stage2_grpo": {"engine": "verl", "init_from": "base", "steps": 2, "prompts_per_step": 4},
            }
        )
    )
    cfg = load_config(config)
    run = RunDir(tmp_path / "run")
    prepare_run(cfg, run, tmp_path)
    sid, manifest = "stage2_grpo", Manifest(run.root)

    def main_ppo_and_finish() -> int:
        paths = verl_paths(run, sid)
        torchrun(WORKER, 2, str(run.base_model), str(paths["ckpt"]), "2", timeout=600)
        next_metrics_file(paths["metrics"]).write_text(
            "".join(
                json.dumps({"step": s, "data": d}) + "\n"
                for s, d in [
                    (1, {"timing_s/gen": 1.5, "timing_s/update_actor": 0.5}),
                    (
                        2,
                        {
                            "timing_s/gen": 1.0,
                            "val-core/hpcr1/acc/mean@1": 0.75,
                            "val-aux/hpcr1/format_ok/mean@1": 1.0,
                        },
                    ),
                ]
            )
        )
        finish_verl_stage(cfg, run, sid)
        return 0

    run_stage(cfg, run, manifest, sid, main_ppo_and_finish)
    entry = Manifest(run.root).stage(sid)
    assert entry["state"] == "done" and entry["eval"] == {"accuracy": 0.75, "format_rate": 1.0, "n": 4}
    assert any(name.endswith(".safetensors") for name in entry["checksums"])
    assert [json.loads(line)["phase_time/rollout"] for line in run.metrics(sid).read_text().splitlines()] == [
        1.5,
        1.0,
    ]
    assert rerun_reason(cfg, run, Manifest(run.root), sid) is None  # done and current: skipped next time
