"""GRPO updates on a fixed rollout batch (the same global batch whatever the number of ranks; with
old_log_probs=rollout, holding the starting model's log-probs as the rollout's), one a case, each from
the same starting model, in this one process group (the ranks' start-up paid once):
argv = MODEL_DIR OUT_DIR CASES_JSON, CASES_JSON {name: ["KEY=VALUE", ...]} (settings of the stage, YAML
values). Rank 0 saves each case's updated full weights, with its statistics and the all-gathers its
update made, to OUT_DIR/NAME.pt."""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from transformers import AutoModelForCausalLM
from verl.protocol import DataProto

from core.config import GRPOStage
from launch.worker import leave_now
from runtime.comm_profiler import CommProfiler
from runtime.dist import shutdown_distributed
from stages.grpo.actor import Actor
from stages.grpo.logprobs import response_log_probs
from stages.grpo.prompts import rank_share
from stages.grpo.reference import Reference
from stages.grpo.reward import RuleReward
from stages.grpo.rollout import sequences
from stages.grpo.trainer import Roles, learn_from

PAD, EOS, VOCAB = 0, 1, 32
STAGE = GRPOStage(
    prompts_per_step=8, group_size=4, mini_batches=2, ppo_epochs=2, lr=1e-2, kl_coef=0.1, clip_ratio=0.2
)


def fixed_global_batch() -> DataProto:
    """Random prompts of different lengths (left-padded), responses ending at random eos positions,
    and texts whose rewards differ within every group."""
    g = torch.Generator().manual_seed(1234)
    rows = STAGE.prompts_per_step * STAGE.group_size
    lengths = torch.randint(2, 6, (STAGE.prompts_per_step,), generator=g).repeat_interleave(STAGE.group_size)
    prompt = torch.randint(2, VOCAB, (rows, 6), generator=g)
    prompt_mask = (torch.arange(6) >= 6 - lengths[:, None]).long()
    prompt = prompt * prompt_mask  # left padding
    responses = torch.randint(2, VOCAB, (rows, 7), generator=g)
    ends = torch.randint(1, 7, (rows,), generator=g)
    for row, end in enumerate(ends.tolist()):
        responses[row, end] = EOS
        responses[row, end + 1 :] = PAD
    texts = ["<think>x</think><answer>1</answer>", "<answer>1</answer>", "<answer>2</answer>", "1"]
    non_tensors = {
        "uid": np.array([f"p{r // STAGE.group_size}" for r in range(rows)], dtype=object),
        "answer": np.array(["1"] * rows, dtype=object),
        "response_text": np.array([texts[r % len(texts)] for r in range(rows)], dtype=object),
    }
    return DataProto.from_dict(
        tensors=sequences(prompt, prompt_mask, responses, EOS),
        non_tensors=non_tensors,
        meta_info={"temperature": 1.0},
    )


def with_rollout_log_probs(batch: DataProto, model_dir: Path) -> DataProto:
    """The batch as a rollout recording its log-probs would give it: those of the starting model,
    here from a plain forward of the whole model (no FSDP)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        log_probs, entropy = response_log_probs(model, batch, with_entropy=True)
    return batch.union(DataProto.from_dict(tensors={"rollout_log_probs": log_probs, "entropy": entropy}))


def main(model_dir: Path, out_dir: Path, cases: dict[str, list[str]]) -> None:
    dist.init_process_group("gloo")
    for name, settings in cases.items():
        run_case(model_dir, out_dir / f"{name}.pt", settings)
        gc.collect()  # the case's sharded models and their process-group state, before the next
    shutdown_distributed()


def run_case(model_dir: Path, out_file: Path, settings: list[str]) -> None:
    updates = {key: yaml.safe_load(value) for key, value in (s.split("=", 1) for s in settings)}
    stage = GRPOStage.model_validate({**STAGE.model_dump(), **updates})
    torch.manual_seed(0)
    prompts = rank_share(
        list(range(STAGE.prompts_per_step)), dist.get_rank(), dist.get_world_size(), STAGE.mini_batches
    )
    mine = fixed_global_batch().select_idxs(
        [p * STAGE.group_size + k for p in prompts for k in range(STAGE.group_size)]
    )
    if stage.old_log_probs == "rollout":
        mine = with_rollout_log_probs(mine, model_dir)
    roles = Roles(
        actor=Actor(model_dir, stage),
        reference=Reference(model_dir, stage),
        rollout=None,
        reward=RuleReward(STAGE.format_reward),
    )
    profile = out_file.with_suffix(".profile")
    with CommProfiler(profile, "test", dist.get_rank()):
        stats = learn_from(roles, mine, iteration=1)
    with roles.actor.gathered_weights() as gathered:
        weights = {name: tensor.detach().clone() for name, tensor in gathered.items()}
    if dist.get_rank() == 0:
        events = [json.loads(line) for line in (profile / "rank-00000.jsonl").read_text().splitlines()]
        update_gathers = sum(
            e["phase"] == "policy_update" and e["op"].startswith("all_gather") for e in events
        )
        torch.save({"weights": weights, "stats": stats, "update_all_gathers": update_gathers}, out_file)


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]), json.loads(sys.argv[3]))
    leave_now(0)
