"""Run in a fresh process by test_plan_memory.py: peak resident memory of AdamW training steps of
a Llama-shaped fp32 model, relative to the process before the model exists (VmHWM minus VmRSS).

argv: JSON of LlamaConfig fields, then the batch size and sequence length of the second step.
The first step (one 16-token sequence: activations are negligible) peaks when Adam's states are
created: weights + gradients + optimizer states. The second (the given batch) runs with all of
those alive and adds its activations. Prints JSON: params, states_peak_bytes, step_peak_bytes.
"""

import json
import sys
from pathlib import Path

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def status_kib(field: str) -> int:
    line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field + ":"))
    return int(line.split()[1])


def reset_peak() -> None:
    Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS (Linux)


def train_step(model, optimizer, batch: int, seq: int) -> None:
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def build(fields: dict):
    model = LlamaForCausalLM(LlamaConfig(**fields, attn_implementation="sdpa", dtype="float32"))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=False)


def main() -> None:
    fields, batch, seq = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    # A step of a minute model first, so the kernels' code is paged in before measuring.
    train_step(
        *build(
            {**fields, "vocab_size": 64, "hidden_size": 16, "intermediate_size": 16, "num_hidden_layers": 1}
        ),
        1,
        16,
    )
    reset_peak()
    before = status_kib("VmRSS")
    model, optimizer = build(fields)
    train_step(model, optimizer, 1, 16)
    states_peak = status_kib("VmHWM") - before
    train_step(model, optimizer, batch, seq)
    step_peak = status_kib("VmHWM") - before
    print(
        json.dumps(
            {
                "params": sum(p.numel() for p in model.parameters()),
                "states_peak_bytes": states_peak * 1024,
                "step_peak_bytes": step_peak * 1024,
            }
        )
    )


if __name__ == "__main__":
    main()
