"""Held-out metrics: mean@k of a fixed set of answers is the mean over problems of each one's share of
correct answers, counted here independently of the reward's scoring; and the one-line summary says
greedy and mean@k for the held-out and the validation set."""

from __future__ import annotations

import random
from fractions import Fraction

import pytest

from core.manifest import describe_eval
from stages.data.arithmetic import generate_arithmetic
from stages.eval import accuracy_of, mean_at_k, tally


def answers_for(problems, k: int, seed: int):
    """k answers a problem, laid out as `evaluate` samples them (each problem's k side by side):
    problem i has i % (k + 1) right answers, the others wrong in varied ways. Returns the rows, the
    answers, and each problem's share of right answers counted from how they were made."""
    rng = random.Random(seed)
    rows, answers, shares = [], [], []
    for i, ex in enumerate(problems):
        right = [True] * (i % (k + 1)) + [False] * (k - i % (k + 1))
        rng.shuffle(right)
        for ok in right:
            wrong = rng.choice(
                [
                    f"<think>1+2+3+0=6</think><answer>{int(ex.answer) + 1}</answer>",  # well formed, wrong
                    f"the sum is {ex.answer}",  # right number, but no <answer>: not an answer at all
                    f"<think></think><answer>{ex.answer}0</answer>",  # a digit too many
                ]
            )
            rows.append(ex)
            answers.append(f"<think>x</think><answer>{ex.answer}</answer>" if ok else wrong)
        shares.append(Fraction(sum(right), k))
    return rows, answers, shares


@pytest.mark.parametrize("k", [1, 4, 5])
def test_mean_at_k_of_fixed_answers_is_the_mean_of_each_problems_share_right(k):
    problems = generate_arithmetic(0, 23, "validation")
    rows, answers, shares = answers_for(problems, k, seed=k)
    result = mean_at_k(tally(rows, answers), k)
    expected = sum(shares) / len(shares)
    assert result["mean_at_k"] == pytest.approx(float(expected), abs=1e-12)
    assert result["k"] == k
    # and it is not the greedy figure of the same counts: that one counts every answer as a problem
    assert accuracy_of(tally(rows, answers))["n"] == len(problems) * k


def test_mean_at_k_counted_in_parts_adds_up_as_ranks_and_batches_sum_their_counts():
    problems = generate_arithmetic(1, 40, "eval")
    rows, answers, shares = answers_for(problems, 4, seed=9)
    # two ranks, each its own batches of 6 answers (a batch may split a problem's k answers)
    parts = [(rows[r::2], answers[r::2]) for r in (0, 1)]
    counts = [0, 0, 0]
    for part_rows, part_answers in parts:
        for i in range(0, len(part_rows), 6):
            counts = [a + b for a, b in zip(counts, tally(part_rows[i : i + 6], part_answers[i : i + 6]))]
    assert mean_at_k(counts, 4)["mean_at_k"] == pytest.approx(float(sum(shares) / len(shares)), abs=1e-12)


def test_answers_that_are_not_k_a_problem_are_refused():
    with pytest.raises(ValueError, match="k = 4"):
        mean_at_k([3, 5, 10], 4)


def test_the_progress_line_gives_greedy_and_mean_at_k_of_both_sets():
    evaluation = {
        "accuracy": 0.47,
        "n": 200,
        "mean_at_k": 0.43125,
        "k": 4,
        "validation": {"accuracy": 0.5, "n": 200, "mean_at_k": 0.4, "k": 4},
    }
    assert describe_eval(evaluation) == (
        "held-out 0.470 greedy, 0.431 mean@4 (n=200); validation 0.500 greedy, 0.400 mean@4 (n=200)"
    )
    # greedy alone (samples 0, or verl's evaluation)
    assert describe_eval({"accuracy": 0.25, "n": 8}) == "held-out 0.250 greedy (n=8)"
