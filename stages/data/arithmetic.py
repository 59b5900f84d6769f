"""The embedded default task: add zero-padded numbers, with a column-by-column chain of thought.

    0030+8494+5673=  ->  <think>0+4+3+0=7 3+9+7+0=19 0+4+6+1=11 0+8+5+1=14</think><answer>14197</answer>

Each column, from the least significant, lists its digits, the carry coming in, and the column sum.
Generated from a seed: the same (seed, split, n) always gives the same list and a smaller n gives a
prefix of it. The splits never share a problem: a hash of the operands assigns every problem to
exactly one split, and each split's generator keeps only its own problems.

`worked_fraction` below 1 leaves the working out of some solutions, which then give the answer
alone (`<think></think><answer>14197</answer>`), as many scraped datasets do. Which ones is drawn
from its own stream, so the problems are the same whatever the fraction.
"""

from __future__ import annotations

import hashlib
import itertools
import random

from stages.data.examples import Example

# Validation takes a sixteenth of what was the train split's share: prompts and held-out (eval) keep
# their problems, and in every problem space as small as the tests' (100 problems) they keep their size.
SPLIT_PERCENT = {"train": 75, "validation": 5, "prompts": 10, "eval": 10}
EXACT_COUNT_LIMIT = 10_000  # problem spaces up to this size have their split sizes counted exactly


def generate_arithmetic(
    seed: int, n: int, split: str, num_operands: int = 3, digits: int = 4, worked_fraction: float = 1.0
) -> list[Example]:
    if split not in SPLIT_PERCENT:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_PERCENT)}")
    if num_operands < 1 or digits < 1 or n < 0:
        raise ValueError(f"need num_operands >= 1, digits >= 1, n >= 0 (got {num_operands}, {digits}, {n})")
    if n > max_problems(split, num_operands, digits):
        raise ValueError(
            f"the {split} split does not have {n} distinct problems of {num_operands} {digits}-digit numbers"
        )
    if not 0 <= worked_fraction <= 1:
        raise ValueError(f"worked_fraction must be within [0, 1] (got {worked_fraction})")
    rng = random.Random(f"{seed}-{split}")  # a string seed is hashed with SHA-512: stable across runs
    shows_working = random.Random(f"{seed}-{split}-worked")
    examples, seen = [], set()
    while len(examples) < n:
        operands = tuple(rng.randrange(10**digits) for _ in range(num_operands))
        if operands in seen or split_of(operands) != split:
            continue
        seen.add(operands)
        thought, answer = chain_of_thought(operands, digits)
        if shows_working.random() >= worked_fraction:
            thought = ""
        prompt = "+".join(f"{x:0{digits}d}" for x in operands) + "="
        examples.append(
            Example(
                f"arith-{split}-{len(examples):06d}",
                prompt,
                answer,
                f"<think>{thought}</think><answer>{answer}</answer>",
            )
        )
    return examples


def chain_of_thought(operands: tuple[int, ...], digits: int) -> tuple[str, str]:
    """(the <think> body, the answer) of the column-by-column sum."""
    padded = [f"{x:0{digits}d}" for x in operands]
    steps, carry = [], 0
    for col in range(digits - 1, -1, -1):
        column = [p[col] for p in padded]
        total = sum(map(int, column)) + carry
        steps.append("+".join(column) + f"+{carry}={total}")
        carry = total // 10
    return " ".join(steps), str(sum(operands))


def split_of(operands: tuple[int, ...]) -> str:
    """The one split a problem belongs to, from a hash of its operands (the same on every machine)."""
    percentile = int.from_bytes(hashlib.sha256(repr(operands).encode()).digest()[:8], "big") * 100 >> 64
    edge = 0
    for split, percent in SPLIT_PERCENT.items():  # the percents sum to 100 > percentile
        edge += percent
        if percentile < edge:
            return split


def max_problems(split: str, num_operands: int, digits: int) -> int:
    """How many problems `split` can give: all of them where the space is small enough to count,
    else half its expected share (rejection sampling would crawl when close to exhausting it)."""
    space = 10 ** (digits * num_operands)
    if space <= EXACT_COUNT_LIMIT:
        return sum(
            split_of(ops) == split for ops in itertools.product(range(10**digits), repeat=num_operands)
        )
    return space * SPLIT_PERCENT[split] // 200
