"""Worker: each rank loads HF model directories with fsdp2.load_sharded (reading only its own rows)
and compares with transformers' own from_pretrained of the whole model: the gathered weights bit for
bit, the logits, and which rows the rank read. Rank 0 prints every rank's findings as
`RESULT {json}` lines. argv: OUT_DIR"""

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from launch.worker import leave_now
from runtime.dist import init_distributed, shutdown_distributed
from stages.engines import fsdp2, state_dicts
from tests.dist.workers.results import print_result
from tests.support.llama_configs import llama3_rope

# Odd vocabulary and FFN sizes: dim 0 does not divide by 2 ranks, so the shards are uneven.
BASE = dict(
    vocab_size=37,
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    intermediate_size=97,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)
VARIANTS = {
    # one fp32 file, separate head
    "fp32-untied": (LlamaConfig(**BASE, tie_word_embeddings=False), torch.float32, "1GB"),
    # bf16 in several files with an index (as real checkpoints ship), head tied to the embedding,
    # Llama-3 RoPE scaling (its frequencies are rebuilt, not read)
    "bf16-tied-sharded": (
        LlamaConfig(
            **BASE,
            tie_word_embeddings=True,
            rope_parameters=llama3_rope(16),
        ),
        torch.bfloat16,
        "20KB",
    ),
}


def write_model(out: Path, config: LlamaConfig, dtype: torch.dtype, shard_size: str) -> None:
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(out, max_shard_size=shard_size)


def compare(name: str, model_dir: Path) -> list[dict]:
    streamed = fsdp2.load_sharded(model_dir, trainable=True)
    # Before any forward: FSDP2 leaves the root unit's parameters unsharded after one.
    local_rows = {
        k: p.to_local().shape[0] for k, p in streamed.named_parameters() if "embed" in k or "up_proj" in k
    }
    reference = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    gathered = state_dicts.full_state_dict(streamed)
    expected = reference.state_dict()
    ids = torch.randint(0, reference.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits_diff = (streamed(input_ids=ids).logits - reference(input_ids=ids).logits).abs().max().item()
    # After the forward the root unit is still gathered and the layers are not: both must come out
    # whole, named as the module's parameters (a tied head is its embedding).
    with fsdp2.gathered_parameters(streamed) as whole:
        unit_gathered_equal = set(whole) == {k for k, _ in reference.named_parameters()} and all(
            torch.equal(whole[k], expected[k]) for k in whole
        )
    resharded = all(isinstance(p, DTensor) for p in streamed.parameters())
    return [
        {"variant": name, "check": "files", "value": len(list(model_dir.glob("*.safetensors")))},
        {
            "variant": name,
            "check": "weights_equal",
            "value": all(torch.equal(gathered[k], expected[k]) for k in gathered)
            and set(gathered) <= set(expected),
        },
        {"variant": name, "check": "logits", "value": logits_diff},
        {"variant": name, "check": "unit_gathered_equal", "value": unit_gathered_equal},
        {"variant": name, "check": "resharded", "value": resharded},
        {"variant": name, "check": "local_rows", "value": local_rows},
    ]


def main(out_dir: str) -> None:
    init_distributed()
    for name, (config, dtype, shard_size) in VARIANTS.items():
        if dist.get_rank() == 0:
            write_model(Path(out_dir) / name, config, dtype, shard_size)
    dist.barrier()
    findings = [f for name in VARIANTS for f in compare(name, Path(out_dir) / name)]
    everyone = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(findings, everyone, dst=0)
    for rank, found in enumerate(everyone or []):
        for finding in found:
            print_result({**finding, "rank": rank})
    shutdown_distributed()


if __name__ == "__main__":
    main(sys.argv[1])
    leave_now(0)
