"""The embedded default task: add zero-padded numbers, with a column-by-column chain of thought.

    0030+8494+5673=  ->  <think>0+4+3+0=7 3+9+7+0=19 0+4+6+1=11 0+8+5+1=14</think><answer>14197</answer>

Each column lists its digits, the carry coming in, and the column sum. Generated from a seed:
the same (seed, split, n) always gives the same list, a smaller n gives a prefix, and the splits
never share a problem (each problem belongs to exactly one split by a hash of its operands).
"""
from __future__ import annotations

import hashlib
import random

from stages.data.examples import Example

SPLIT_SHARES = {"train": 0.8, "prompts": 0.1, "eval": 0.1}


def split_of(operands: tuple[int, ...]) -> str:
    digest = int.from_bytes(hashlib.sha256(repr(operands).encode()).digest()[:8], "big") / 2**64
    edge = 0.0
    for split, share in SPLIT_SHARES.items():
        edge += share
        if digest < edge:
            return split
    return split


def chain_of_thought(operands: tuple[int, ...], digits: int) -> tuple[str, str]:
    """(the <think> body, the answer) for the column-by-column sum."""
    padded = [f"{x:0{digits}d}" for x in operands]
    steps, carry = [], 0
    for col in range(digits - 1, -1, -1):
        column = [int(p[col]) for p in padded]
        total = sum(column) + carry
        steps.append("+".join(str(d) for d in column) + f"+{carry}={total}")
        carry = total // 10
    return " ".join(steps), str(sum(operands))


def generate_arithmetic(seed: int, n: int, split: str, num_operands: int = 3, digits: int = 4) -> list[Example]:
    if split not in SPLIT_SHARES:
        raise ValueError(f"unknown split {split!r}; expected one of {list(SPLIT_SHARES)}")
    if n > 0.5 * SPLIT_SHARES[split] * 10 ** (digits * num_operands):
        raise ValueError(f"{n} distinct {split} problems of {num_operands} {digits}-digit numbers do not exist")
    rng = random.Random(f"{seed}-{split}")
    examples, seen = [], set()
    while len(examples) < n:
        operands = tuple(rng.randrange(10 ** digits) for _ in range(num_operands))
        if operands in seen or split_of(operands) != split:
            continue
        seen.add(operands)
        thought, answer = chain_of_thought(operands, digits)
        prompt = "+".join(f"{x:0{digits}d}" for x in operands) + "="
        examples.append(Example(f"arith-{split}-{len(examples):06d}", prompt, answer,
                                f"<think>{thought}</think><answer>{answer}</answer>"))
    return examples
