"""The verifiable reward: format (exactly <think>…</think> then <answer>…</answer>) and correctness
of the answer. Numbers are compared exactly (big integers and decimals, no floats); anything else
goes to `math_verify` (LaTeX, fractions, expressions) — never `eval`. Time is bounded: oversized
answers are not parsed, and math_verify's own timeouts (signal-based, so main thread only) are
replaced elsewhere by that size bound. `score` never raises."""
from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

FORMAT = re.compile(r"\s*<think>(?:(?!</?think>|</?answer>).)*</think>\s*<answer>(?:(?!</?think>|</?answer>).)*</answer>\s*",
                    re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)
NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)")
MAX_ANSWER_CHARS = 256      # longer "answers" are never parsed symbolically
MAX_NUMBER_DIGITS = 10_000  # exact comparison of longer digit strings is still cheap, but pointless


@dataclass(frozen=True)
class Score:
    format_ok: bool
    correct: bool
    reward: float


def extract_answer(response: str) -> str | None:
    found = ANSWER.findall(response)
    return found[-1].strip() if found else None


def score(response: str, answer: str, correct_weight: float = 1.0, format_weight: float = 0.1) -> Score:
    format_ok = FORMAT.fullmatch(response) is not None
    predicted = extract_answer(response)
    correct = predicted is not None and answers_match(predicted, str(answer))
    return Score(format_ok, correct, correct_weight * correct + format_weight * format_ok)


def answers_match(predicted: str, truth: str) -> bool:
    a, b = _as_number(predicted), _as_number(truth)
    if a is not None and b is not None:
        return a == b
    if len(predicted) > MAX_ANSWER_CHARS or len(truth) > MAX_ANSWER_CHARS:
        return predicted.strip() == truth.strip()
    return _math_verify(predicted, truth)


def _as_number(text: str) -> Decimal | None:
    text = text.strip().replace(",", "")
    if len(text) > MAX_NUMBER_DIGITS or not NUMBER.fullmatch(text):
        return None
    try:
        return Decimal(text)
    except InvalidOperation:
        return None


def _math_verify(predicted: str, truth: str) -> bool:
    from math_verify import parse, verify

    # Signal-based timeouts only work on the main thread; elsewhere the size bound above holds.
    timeout = 2 if threading.current_thread() is threading.main_thread() else None
    try:
        gold, guess = parse(f"${truth}$", parsing_timeout=timeout), parse(f"${predicted}$", parsing_timeout=timeout)
        return bool(gold) and bool(guess) and verify(gold, guess, timeout_seconds=timeout)
    except Exception:  # a malformed expression is a wrong answer, not a crash
        return False
