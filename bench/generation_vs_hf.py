"""Generation speed: our decode loop (stages/generation.py) against plain `transformers` `generate`,
in the same process, on the same model, prompts, batch sizes, sampling settings, thread count and
precision (fp32); prints the ratio ours / transformers (tokens per second) last.

    python bench/generation_vs_hf.py                       # the embedded default's base model
    python bench/generation_vs_hf.py --model runs/tiny-cpu/stage2_grpo/final   # a trained model

The prompts and settings are stage3_synth's in configs/tiny-cpu.yaml (its prompts, temperature,
top_p, max_new_tokens, samples_per_prompt); batch sizes are rows of one generate call: 8, 50, and
200 (stage3_synth's own call: 50 prompts x 4 samples). Both sides sample from the same seed in each
repetition, and draw the same tokens (`generate` with top_k=0, i.e. no top-k, as our loop), so they
generate the same number of tokens; tokens count up to and including each row's eos. Repetitions
alternate which side runs first; medians over repetitions are compared, in wall time and in CPU time
(the steadier figure on a machine shared with other work).

Where `generate`'s time went (tiny model, batch 50, 1 thread; cProfile and torch.profiler): ~9%
outside the model's forward (logits processors, stopping criteria, building the causal mask and
output dataclasses every step, `inspect.signature` at setup); inside it, nn.Module dispatch and
attribute lookups (~15%), RMSNorm as six separate ops, RoPE computed separately for queries and
keys with a `cat` each, a KV cache (DynamicCache) concatenated anew every step, separate q/k/v and
gate/up matmuls, and attention with one query per head (key/value heads copied per query head
when rows are padded). Our loop
does one op where `generate` does several, so it gains most where the per-op overhead dominates
(small batches); at 200 rows both are bound by the same matmuls and attention.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from core.config import load_config  # noqa: E402
from core.rundir import RunDir  # noqa: E402
from stages.data.tokenizer import encode_prompt  # noqa: E402
from stages.generation import generate_tokens, left_padded  # noqa: E402
from stages.inputs import load_task, prepare_inputs  # noqa: E402


def ours(model, tokenizer, prompt_ids, stage):
    return generate_tokens(
        model, tokenizer, prompt_ids, stage.max_new_tokens, stage.temperature, stage.top_p
    )[2]


def transformers_generate(model, tokenizer, prompt_ids, stage):
    input_ids, attention = left_padded(prompt_ids, tokenizer.pad_token_id)
    out = model.generate(
        input_ids=input_ids,
        attention_mask=attention,
        max_new_tokens=stage.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        do_sample=True,
        temperature=stage.temperature,
        top_p=stage.top_p,
        top_k=0,
    )
    return out[:, input_ids.shape[1] :]


def generated(new_tokens: torch.Tensor, eos_id: int) -> int:
    """Tokens up to and including each row's first eos."""
    is_eos = (new_tokens == eos_id).int()
    return int(((is_eos.cumsum(dim=1) - is_eos) == 0).sum())


def timed(side, model, tokenizer, prompt_ids, stage, seed: int) -> tuple[int, float, float]:
    """(tokens, wall seconds, CPU seconds) of one generate call from `seed`."""
    torch.manual_seed(seed)
    wall, cpu = time.perf_counter(), time.process_time()
    new_tokens = side(model, tokenizer, prompt_ids, stage)
    return (
        generated(new_tokens, tokenizer.eos_token_id),
        time.perf_counter() - wall,
        time.process_time() - cpu,
    )


def compare(model, tokenizer, prompt_ids, stage, repeats: int) -> dict[str, dict[str, float]]:
    """{"ours"|"transformers": {"wall"|"cpu": median tokens/s}} over `repeats` alternating pairs."""
    sides = {"ours": ours, "transformers": transformers_generate}
    for name, side in sides.items():  # warm-up
        timed(side, model, tokenizer, prompt_ids[:2], stage, seed=0)
    rates = {name: {"wall": [], "cpu": []} for name in sides}
    for rep in range(repeats):
        order = list(sides) if rep % 2 == 0 else list(reversed(sides))
        counts = {}
        for name in order:
            counts[name], wall, cpu = timed(sides[name], model, tokenizer, prompt_ids, stage, seed=rep)
            rates[name]["wall"].append(counts[name] / wall)
            rates[name]["cpu"].append(counts[name] / cpu)
        if counts["ours"] != counts["transformers"]:
            print(
                f"  note: repetition {rep} generated {counts['ours']} tokens (ours) "
                f"vs {counts['transformers']}"
            )
    return {name: {k: statistics.median(v) for k, v in r.items()} for name, r in rates.items()}


def load_model(args, cfg, task, scratch: Path):
    """--model, or the embedded default's base model built as `hpcr1 run` builds it."""
    model_dir = args.model
    if model_dir is None:
        run = RunDir(scratch / "run")
        prepare_inputs(cfg, run, task, REPO / "configs")
        model_dir = run.base_model
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval(), tokenizer, model_dir


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", default=str(REPO / "configs" / "tiny-cpu.yaml"))
    parser.add_argument(
        "--model", type=Path, help="a Hugging Face model directory (default: the config's base model)"
    )
    parser.add_argument("--batch-sizes", default="8,50,200", help="rows per generate call, comma separated")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads for both sides (1: as each of the stage's ranks runs)",
    )
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    cfg = load_config(args.config, ["data.arithmetic.sft_size=16"])
    stage = cfg.stage3_synth
    with tempfile.TemporaryDirectory(prefix="hpcr1-genbench-") as scratch:
        task = load_task(cfg, REPO / "configs")
        model, tokenizer, model_dir = load_model(args, cfg, task, Path(scratch))
        print(
            f"model {model_dir}, {torch.get_num_threads()} threads, fp32, temperature {stage.temperature}, "
            f"top_p {stage.top_p}, max_new_tokens {stage.max_new_tokens}, {args.repeats} repetitions"
        )
        ratios = {}
        for batch in [int(b) for b in args.batch_sizes.split(",")]:
            # as stage3_synth batches them: each prompt samples_per_prompt times in a row
            prompt_ids = [
                encode_prompt(tokenizer, task["prompts"][row // stage.samples_per_prompt].prompt)
                for row in range(batch)
            ]
            med = compare(model, tokenizer, prompt_ids, stage, args.repeats)
            ratios[batch] = med["ours"]["wall"] / med["transformers"]["wall"]
            print(
                f"batch {batch:4d}: tokens/s ours {med['ours']['wall']:8.0f} transformers "
                f"{med['transformers']['wall']:8.0f} (wall, ratio {ratios[batch]:.2f}); per CPU second "
                f"ours {med['ours']['cpu']:8.0f} transformers {med['transformers']['cpu']:8.0f} "
                f"(ratio {med['ours']['cpu'] / med['transformers']['cpu']:.2f})",
                flush=True,
            )
    print(
        "ours / transformers generate, tokens/s (wall): "
        + ", ".join(f"batch {b} {r:.2f}" for b, r in ratios.items())
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
