"""bf16 against fp32 on this CPU, one thread (as one rank of the GRPO bench): the rollout's decode
loop (bf16 weights), the actor's forward and backward (autocast over fp32 weights, DDP's path; bf16
weights, FSDP2's compute) and how far bf16 log-probabilities fall from fp32's. What `dtype: auto`
resolves to on CPU ranks rests on it (stages/engines/precision.py).

    python bench/precision_cpu.py HF_DIR [--rows 64] [--new-tokens 64] [--reps 5]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from stages.data.tokenizer import encode_prompt, load_tokenizer  # noqa: E402
from stages.generation import generate_tokens  # noqa: E402

PROMPT = "What is 1234 + 5678 - 910?"


def median_seconds(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def token_log_probs(model, ids: torch.Tensor, precision) -> torch.Tensor:
    with precision():
        logits = model(input_ids=ids).logits
    return F.log_softmax(logits.float()[:, :-1], -1).gather(-1, ids[:, 1:, None])[..., 0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model")
    p.add_argument("--rows", type=int, default=64, help="a rank's rollout rows (tiny-cpu: 16 x 8 / 2)")
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args()
    torch.set_num_threads(1)
    tokenizer = load_tokenizer(args.model)
    fp32 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    bf16 = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    prompts = [encode_prompt(tokenizer, PROMPT)] * args.rows

    def decode(model):
        torch.manual_seed(0)
        with torch.no_grad():
            return generate_tokens(model, tokenizer, prompts, args.new_tokens, 0.7, 1.0)

    prompt, _, responses = decode(fp32)
    ids = torch.cat([prompt, responses.clamp(min=0)], dim=1)
    plain = contextlib.nullcontext
    autocast = lambda: torch.autocast("cpu", dtype=torch.bfloat16)  # noqa: E731

    def update(model, precision):
        model.zero_grad()
        token_log_probs(model, ids, precision).mean().backward()

    print(f"rows {args.rows}, sequence {ids.shape[1]} tokens, {torch.get_num_threads()} thread")
    print(f"decode s        fp32 {median_seconds(lambda: decode(fp32), args.reps):.3f}", end="  ")
    print(f"bf16 {median_seconds(lambda: decode(bf16), args.reps):.3f}")
    print(f"fwd+bwd s       fp32 {median_seconds(lambda: update(fp32, plain), args.reps):.3f}", end="  ")
    print(f"autocast-bf16 {median_seconds(lambda: update(fp32, autocast), args.reps):.3f}", end="  ")
    print(f"bf16-weights {median_seconds(lambda: update(bf16, plain), args.reps):.3f}")
    with torch.no_grad():
        exact = token_log_probs(fp32, ids, plain)
        for name, model, precision in (("autocast-bf16", fp32, autocast), ("bf16-weights", bf16, plain)):
            error = (token_log_probs(model, ids, precision) - exact).abs()
            print(f"{name}: |log p - log p fp32| mean {error.mean():.2e}, max {error.max():.2e}")


if __name__ == "__main__":
    main()
