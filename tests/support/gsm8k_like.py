"""GSM8K-shaped word problems made up locally: {"question", "answer"} rows whose answer is worked
steps with GSM8K's calculator annotations ("<<3*4=12>>") and a final "#### N" line."""

from __future__ import annotations

import json
import random
from pathlib import Path

NAMES = ("Tom", "Ana", "Raj", "Mia", "Lee", "Zoe")


def _boxes(r: random.Random, name: str) -> tuple[str, list[str], int]:
    boxes, per_box, lost = r.randint(2, 9), r.randint(2, 9), r.randint(1, 5)
    total = boxes * per_box
    question = (
        f"{name} is packing pens for the school fair. {name} has {boxes} boxes with {per_box} pens in "
        f"each box, and gives away {lost} pens to friends before the fair starts. How many pens does "
        f"{name} have left for the fair?"
    )
    steps = [
        f"{name} had {boxes} * {per_box} = <<{boxes}*{per_box}={total}>>{total} pens.",
        f"{name} has {total} - {lost} = <<{total}-{lost}={total - lost}>>{total - lost} pens left.",
    ]
    return question, steps, total - lost


def _wages(r: random.Random, name: str) -> tuple[str, list[str], int]:
    earned, spent, weeks = r.randint(20, 60), r.randint(5, 19), r.randint(2, 6)
    saved = earned - spent
    question = (
        f"{name} works at a bakery after school and earns ${earned} every week. Each week {name} spends "
        f"${spent} on bus tickets and lunch and saves the rest. How many dollars does {name} save in "
        f"{weeks} weeks?"
    )
    steps = [
        f"{name} saves {earned} - {spent} = <<{earned}-{spent}={saved}>>{saved} dollars a week.",
        f"In {weeks} weeks that is {saved} * {weeks} = <<{saved}*{weeks}={saved * weeks}>>{saved * weeks}.",
    ]
    return question, steps, saved * weeks


def gsm8k_like(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    rows = []
    for i in range(n):
        question, steps, final = (_boxes, _wages)[i % 2](r, NAMES[i % len(NAMES)])
        rows.append({"question": question, "answer": "\n".join([*steps, f"#### {final}"])})
    return rows


def write_gsm8k_like(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path
