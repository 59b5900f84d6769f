"""A verl stage's end, with main_ppo's part played by what it leaves behind: a checkpoint written by
verl's own checkpoint manager on 2 real ranks, and verl's file-logger rows. The stage driver merges
the checkpoint with verl's merger into final/, whose logits equal those of the weights
torch.distributed gathers independently (rounded to bf16, the dtype verl's merger writes), and
records the stage done with final/'s checksums and its held-out result, as any stage. verl's whole
trainer, its faults and its metrics: tests/slurm/test_slurm_verl.py."""

from __future__ import annotations

import json

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM, AutoTokenizer

from core.config import load_config
from core.manifest import Manifest
from core.rundir import RunDir
from launch.verl_job import finish_verl_stage
from pipeline.driver import prepare_run, rerun_reason, run_stage
from stages.engines.verl_io import next_metrics_file
from stages.engines.verl_trainer import verl_paths
from tests.conftest import REPO

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "verl_fsdp_checkpoint.py"
CONFIG = {
    "name": "verl",
    "nproc": 2,
    "wandb": {"mode": "disabled"},
    "model": {
        "tiny": {"hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2, "ffn_hidden_size": 64}
    },
    "data": {"arithmetic": {"sft_size": 8, "prompts_size": 8, "eval_size": 4}},
    "eval": {"num_examples": 4},
    "stage2_grpo": {"engine": "verl", "init_from": "base", "steps": 2, "prompts_per_step": 4},
}
# verl's file-logger rows of the two steps: timers each step, the validation at the last
VERL_ROWS = [
    (1, {"timing_s/gen": 1.5, "timing_s/update_actor": 0.5}),
    (2, {"timing_s/gen": 1.0, "timing_s/update_actor": 0.4}),
]
# what verl's replicas would score final/ at after the hand-over (launch.verl_job._evaluate_on_verl)
HELD_OUT = {"accuracy": 0.75, "format_rate": 1.0, "n": 4, "engine": "verl"}


def logits(model_dir, ids, state_dict=None) -> torch.Tensor:
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if state_dict is not None:
        model.load_state_dict(state_dict)
    with torch.no_grad():
        return model(ids).logits


def test_a_verl_stage_merges_its_checkpoint_into_final_and_is_done_once_its_results_are_ours(
    tmp_path, torchrun
):
    config = tmp_path / "verl.yaml"
    config.write_text(yaml.safe_dump(CONFIG))
    cfg = load_config(config)
    run = RunDir(tmp_path / "run")
    prepare_run(cfg, run, tmp_path)
    sid, manifest = "stage2_grpo", Manifest(run.root)
    paths = verl_paths(run, sid)

    def main_ppo_and_finish() -> int:
        torchrun(WORKER, 2, str(run.base_model), str(paths["ckpt"]), "2", timeout=600)
        next_metrics_file(paths["metrics"]).write_text(
            "".join(json.dumps({"step": step, "data": data}) + "\n" for step, data in VERL_ROWS)
        )
        finish_verl_stage(cfg, run, sid)
        run.eval_result(sid).write_text(json.dumps(HELD_OUT))
        return 0

    run_stage(cfg, run, manifest, sid, main_ppo_and_finish)

    final = run.root / sid / "final"
    ids = torch.tensor([AutoTokenizer.from_pretrained(final)("12+34=<think>")["input_ids"]])
    # verl's merger stores bf16 (fsdp_model_merger casts every shard): the reference is rounded alike.
    expected = {k: v.to(torch.bfloat16).float() for k, v in torch.load(paths["ckpt"] / "expected.pt").items()}
    got, want, before = logits(final, ids), logits(run.base_model, ids, expected), logits(run.base_model, ids)
    assert (want - before).abs().max() > 1e-3, "the saved weights must differ from the initial ones"
    assert torch.equal(got, want)
    assert not final.with_name("final.tmp").exists()

    entry = Manifest(run.root).stage(sid)
    assert entry["state"] == "done" and entry["eval"] == HELD_OUT
    assert {"model.safetensors", "tokenizer_config.json"} <= set(entry["checksums"])
    rollout = [json.loads(line)["phase_time/rollout"] for line in run.metrics(sid).read_text().splitlines()]
    assert rollout == [1.5, 1.0]
    assert rerun_reason(cfg, run, Manifest(run.root), sid) is None  # done and current: skipped next time
