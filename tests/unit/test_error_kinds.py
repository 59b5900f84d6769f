"""bench/error_kinds.py's sorting of one answer, on answers written by hand from the task's own
working: each kind, and where a wrong answer first goes wrong."""

from __future__ import annotations

import sys

import pytest

from stages.data.arithmetic import generate_arithmetic
from tests.conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
from error_kinds import kind_of  # noqa: E402

EXAMPLE = generate_arithmetic(0, 1, "validation")[0]


def with_answer(thought: str, answer: str) -> str:
    return f"<think>{thought}</think><answer>{answer}</answer>"


def gold_thought() -> str:
    return EXAMPLE.response.split("<think>")[1].split("</think>")[0]


def test_the_solution_is_right_and_a_bare_answer_has_no_working():
    assert kind_of(EXAMPLE, EXAMPLE.response) == ("right", None)
    assert kind_of(EXAMPLE, with_answer("", EXAMPLE.answer)) == ("right, no working", None)
    assert kind_of(EXAMPLE, with_answer("", "1")) == ("wrong, no working", None)
    assert kind_of(EXAMPLE, "the answer is 7") == ("malformed", None)


def test_the_first_wrong_column_is_named():
    steps = gold_thought().split(" ")
    steps[2] = steps[2].rsplit("=", 1)[0] + "=99"
    kind, cut = kind_of(EXAMPLE, with_answer(" ".join(steps), EXAMPLE.answer[:-1] + "x"))
    assert (kind, cut) == ("wrong column 3", None)


@pytest.mark.parametrize("digit", [0, 1, -1])
def test_right_working_with_a_wrong_digit_points_at_that_digit(digit):
    answer = list(EXAMPLE.answer)
    answer[digit] = "0" if answer[digit] != "0" else "1"
    response = with_answer(gold_thought(), "".join(answer))
    kind, cut = kind_of(EXAMPLE, response)
    assert kind == "right working, answer wrong"
    assert cut == response.index("<answer>") + len("<answer>") + digit % len(answer)
