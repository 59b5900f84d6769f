"""What kind of mistakes does each stage's model make on the arithmetic task, and could sampling
find the right answer? For every stage's final model in a run directory, the greedy answers to the
validation problems, sorted into: right; no working (an empty <think>) right or wrong; working with a
wrong column (the first wrong column counted); working all right but the answer wrong (the sum
read back from the columns wrongly); malformed. For the last kind, the probability the model gives
the right digit where its answer first goes wrong, at the rollout temperature: GRPO learns only
where its samples differ, so a right digit the model almost never samples cannot be reinforced.

    python bench/error_kinds.py RUN_DIR [--split validation|eval] [--temperature 0.7]

Reads the run's own task files (RUN_DIR/inputs/data) and each stage's `final/` model; arithmetic only.
"""

from __future__ import annotations

import argparse
import collections
import re
import statistics
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from core.rundir import RunDir  # noqa: E402
from stages.data.arithmetic import chain_of_thought  # noqa: E402
from stages.data.examples import Example, read_examples  # noqa: E402
from stages.data.tokenizer import encode_prompt, load_tokenizer  # noqa: E402
from stages.generation import generate_in_batches  # noqa: E402

STAGES = ("stage1_sft", "stage2_grpo", "stage3_sft", "stage4_grpo")
R1_ANSWER = re.compile(r"<think>(.*?)</think><answer>(.*?)</answer>", re.S)
MAX_NEW_TOKENS = 64
BATCH = 100


def kind_of(example: Example, response: str) -> tuple[str, int | None]:
    """(the mistake's kind, where the answer first goes wrong when the working was right)."""
    found = R1_ANSWER.search(response)
    if not found:
        return "malformed", None
    thought, answer = found.groups()
    if not thought:
        return ("right, no working" if answer == example.answer else "wrong, no working"), None
    if answer == example.answer:
        return "right", None
    operands = tuple(int(x) for x in example.prompt.rstrip("=").split("+"))
    gold_steps = chain_of_thought(operands, len(example.prompt.split("+")[0]))[0].split(" ")
    steps = thought.split(" ")
    wrong = [i for i, (a, b) in enumerate(zip(gold_steps, steps)) if a != b]
    if wrong or len(steps) != len(gold_steps):
        return f"wrong column {wrong[0] + 1 if wrong else len(gold_steps)}", None
    digit = next((i for i, (a, b) in enumerate(zip(answer, example.answer)) if a != b), None)
    if digit is None or len(answer) != len(example.answer):
        return "right working, answer's length wrong", None
    return "right working, answer wrong", found.start(2) + digit


@torch.no_grad()
def right_digit_probability(
    model, tokenizer, example: Example, response: str, cut: int, temperature: float
) -> float:
    """The probability of the right digit at `cut` in `response`, given what comes before it."""
    reply = tokenizer(response[:cut], add_special_tokens=False).input_ids
    ids = torch.tensor([encode_prompt(tokenizer, example.prompt) + reply])
    probs = torch.softmax(model(ids).logits[0, -1] / temperature, dim=-1)
    wrong_from = cut - R1_ANSWER.search(response).start(2)
    right = tokenizer(example.answer[wrong_from], add_special_tokens=False).input_ids[-1]
    return probs[right].item()


def stage_report(
    model_dir: Path, examples: list[Example], temperature: float
) -> tuple[collections.Counter, list[float]]:
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompts = [ex.prompt for ex in examples]
    responses = generate_in_batches(model, tokenizer, prompts, MAX_NEW_TOKENS, 0.0, BATCH)
    kinds, probabilities = collections.Counter(), []
    for example, response in zip(examples, responses, strict=True):
        kind, cut = kind_of(example, response)
        kinds[kind] += 1
        if cut is not None:
            probabilities.append(
                right_digit_probability(model, tokenizer, example, response, cut, temperature)
            )
    return kinds, probabilities


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--split", choices=("validation", "eval"), default="validation")
    parser.add_argument("--temperature", type=float, default=0.7)
    args = parser.parse_args()
    run = RunDir(args.run_dir)
    task_file = run.task_file(args.split)
    if not task_file.is_file():
        sys.exit(f"error: {task_file} not found: is {args.run_dir} a run directory with a {args.split} set?")
    examples = read_examples(task_file)
    torch.set_num_threads(1)
    for stage in STAGES:
        model_dir = run.stage(stage) / "final"
        if not model_dir.is_dir():
            print(f"{stage}: no final model")
            continue
        kinds, probabilities = stage_report(model_dir, examples, args.temperature)
        counts = ", ".join(f"{kind} {n}" for kind, n in sorted(kinds.items()))
        line = f"{stage} ({len(examples)} problems, greedy): {counts}"
        if probabilities:
            q = statistics.quantiles(probabilities, n=4) if len(probabilities) > 1 else probabilities * 3
            line += (
                f"; p(right digit) at T={args.temperature} where the answer first goes wrong:"
                f" quartiles {q[0]:.3f} / {q[1]:.3f} / {q[2]:.3f}"
            )
        print(line, flush=True)


if __name__ == "__main__":
    main()
