"""GRPO log-prob passes with each distinct prompt forwarded once (shared) against every row forwarded
whole, on the embedded default's shapes, in one process and one thread: its tiny Llama, one rank's
share of a step (8 prompts x G responses), 17-token prompts, response lengths drawn uniformly from 10
to max_new_tokens, its micro-batch size. Times `response_log_probs` without gradient (the reference's
and the old log-probs' pass) and with its backward (the update's); calls alternate between the two
ways, so that other load on the machine hits both alike. Prints the medians, the ratio whole / shared
last.

    python bench/shared_prompts.py [--reps 15] [--seed 0]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import LlamaForCausalLM

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from verl.protocol import DataProto  # noqa: E402

from core.config import load_config  # noqa: E402
from stages.grpo.logprobs import response_log_probs  # noqa: E402
from stages.grpo.rollout import sequences  # noqa: E402
from stages.inputs import TINY_VOCAB_SIZE  # noqa: E402
from stages.models.tiny import build_tiny_llama  # noqa: E402

PROMPTS, PROMPT_TOKENS, MIN_LENGTH, PAD, EOS = 8, 17, 10, 0, 1


def embedded_default():
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", [])
    with tempfile.TemporaryDirectory() as out:
        build_tiny_llama(
            out, vocab_size=TINY_VOCAB_SIZE, pad_token_id=PAD, eos_token_id=EOS, **cfg.model.tiny.model_dump()
        )
        return LlamaForCausalLM.from_pretrained(out), cfg.stage2_grpo


def rollout_batch(group_size: int, max_new_tokens: int, temperature: float, seed: int) -> DataProto:
    g = torch.Generator().manual_seed(seed)
    rows = PROMPTS * group_size
    prompt = torch.randint(2, TINY_VOCAB_SIZE, (PROMPTS, PROMPT_TOKENS), generator=g).repeat_interleave(
        group_size, 0
    )
    responses = torch.randint(2, TINY_VOCAB_SIZE, (rows, max_new_tokens), generator=g)
    for row, length in enumerate(
        torch.randint(MIN_LENGTH, max_new_tokens + 1, (rows,), generator=g).tolist()
    ):
        responses[row, length - 1 : length] = EOS
        responses[row, length:] = PAD
    return DataProto.from_dict(
        tensors=sequences(prompt, torch.ones_like(prompt), responses, EOS),
        meta_info={"temperature": temperature},
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    torch.set_num_threads(1)
    model, stage = embedded_default()
    batch = rollout_batch(stage.group_size, stage.max_new_tokens, stage.temperature, args.seed)
    mask = batch.batch["response_mask"]

    def forward(share_prompts: bool) -> None:
        with torch.no_grad():
            response_log_probs(model, batch, True, stage.micro_batch_size, share_prompts=share_prompts)

    def forward_backward(share_prompts: bool) -> None:
        log_probs, _ = response_log_probs(
            model, batch, True, stage.micro_batch_size, share_prompts=share_prompts
        )
        (log_probs * mask).sum().backward()
        model.zero_grad(set_to_none=True)

    print(
        f"{len(batch)} rows ({PROMPTS} prompts x {stage.group_size}), "
        f"prompts {PROMPT_TOKENS} tokens, responses "
        f"{mask.sum(1).float().mean():.1f} tokens on average, micro-batches of {stage.micro_batch_size}"
    )
    for name, run in (("forward", forward), ("forward+backward", forward_backward)):
        times = {True: [], False: []}
        for rep in range(args.reps + 1):  # the first round warms up
            for share_prompts in (False, True):
                start = time.perf_counter()
                run(share_prompts)
                if rep:
                    times[share_prompts].append(time.perf_counter() - start)
        whole, shared = (statistics.median(times[s]) * 1e3 for s in (False, True))
        print(
            f"{name}: whole rows {whole:.1f} ms, shared prompts {shared:.1f} ms, "
            f"whole / shared {whole / shared:.2f}"
        )


if __name__ == "__main__":
    main()
