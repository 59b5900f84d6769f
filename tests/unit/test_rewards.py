"""The math reward: format and correctness judged right, and no response, however hostile, raises,
runs code or takes more than a second."""

from __future__ import annotations

import threading
import time

import pytest

from stages.rewards.math_reward import extract_answer, score

GOOD = "<think>0+4+3+0=7 3+9+7+0=19 0+4+6+1=11 0+8+5+1=14</think><answer>14197</answer>"
HUGE = "1" + "0" * 5000  # 10**5000, past int()'s 4300-digit string limit


def symbolic_worker_started():
    # A non-numeric comparison (re)starts math_verify's process when it is not running (the first
    # call, or the one after a timeout killed it): a one-off cost, not the scoring that is timed.
    assert score("<think></think><answer>\\frac{1}{2}</answer>", "0.5").correct


def timed_score(response: str, answer: str):
    symbolic_worker_started()
    start = time.perf_counter()
    result = score(response, answer)
    elapsed = time.perf_counter() - start
    # Scoring is bounded per symbolic comparison (SYMBOLIC_TIMEOUT_S); the wall-clock bound is loose
    # because a shared machine may give this process a fraction of a core. A hang still fails.
    assert elapsed < 10.0, f"scoring took {elapsed:.2f}s"
    return result


def test_well_formed_right_answer_gets_both_weights():
    s = score(GOOD, "14197", correct_weight=1.0, format_weight=0.1)
    assert (s.format_ok, s.correct, s.reward) == (True, True, pytest.approx(1.1))


def test_reward_is_the_weighted_sum():
    s = score("<answer>7</answer>", "7", correct_weight=2.0, format_weight=0.5)
    assert (s.format_ok, s.correct, s.reward) == (False, True, 2.0)
    s = score("<think>x</think><answer>8</answer>", "7", correct_weight=2.0, format_weight=0.5)
    assert (s.format_ok, s.correct, s.reward) == (True, False, 0.5)


@pytest.mark.parametrize(
    "response",
    [
        GOOD,
        f"  \n{GOOD}\n  ",
        "<think>a</think> \n <answer>1</answer>",
        "<think></think><answer></answer>",
    ],
)
def test_format_accepts_think_then_answer_with_only_whitespace_around(response):
    assert timed_score(response, "1").format_ok


@pytest.mark.parametrize(
    "response",
    [
        "14197",  # no tags
        "<answer>14197</answer>",  # no think
        "<think>x</think>",  # no answer
        "<answer>14197</answer><think>x</think>",  # wrong order
        "<think>x<answer>1</answer></think><answer>14197</answer>",  # nested
        "<think>a<think>b</think></think><answer>14197</answer>",  # nested think
        "<think>x</think><answer>1</answer><answer>14197</answer>",  # two answers
        "<think>x</think><think>y</think><answer>14197</answer>",  # two thinks
        "<think>x</think>so<answer>14197</answer>",  # text between
        "Sure! <think>x</think><answer>14197</answer>",  # text before
        "<think>x</think><answer>14197</answer> done",  # text after
        "<think>x<answer>14197</answer>",  # unclosed think
        "<think>x</think><answer>14197",  # unclosed answer
    ],
)
def test_format_rejects_anything_else(response):
    assert not timed_score(response, "14197").format_ok


@pytest.mark.parametrize(
    "response, expected",
    [
        (GOOD, "14197"),
        ("<answer> 42 \n</answer>", "42"),
        ("<answer>1</answer> then <answer>2</answer>", "2"),
        ("<answer>1</answer><answer>2", "1"),
        ("<answer>a<answer>b</answer>", "b"),
        ("no tags at all", None),
        ("</answer>3<answer>", None),
    ],
)
def test_extract_answer_takes_the_last_closed_answer(response, expected):
    assert extract_answer(response) == expected


@pytest.mark.parametrize(
    "predicted, truth, correct",
    [
        ("14197", "14197", True),
        ("14,197", "14197", True),
        ("1,234,567", "1234567", True),
        ("1,2,3", "123", False),  # not thousands separators
        ("007", "7", True),
        ("+7", "7", True),
        ("7.0", "7", True),
        ("0.50", ".5", True),
        ("-3", "3", False),
        ("14198", "14197", False),
        (HUGE, HUGE, True),
        (HUGE + "1", HUGE, False),
        (HUGE[:-1] + "1", HUGE, False),  # equal as floats, not as numbers
        ("9007199254740993", "9007199254740992", False),  # 2**53 + 1: float would say equal
    ],
)
def test_numbers_compare_exactly(predicted, truth, correct):
    assert timed_score(f"<think>x</think><answer>{predicted}</answer>", truth).correct is correct


@pytest.mark.parametrize(
    "predicted, truth, correct",
    [
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "\\frac{1}{2}", True),
        ("\\frac{2}{4}", "\\frac{1}{2}", True),
        ("\\sqrt{2}", "2^{1/2}", True),
        ("x+1", "1+x", True),
        ("\\boxed{3}", "3", True),
        ("\\frac{1}{3}", "0.5", False),
        ("\\pi", "3", False),
        ("banana", "3", False),
        ("", "3", False),
    ],
)
def test_latex_and_expressions_compare_by_value(predicted, truth, correct):
    assert timed_score(f"<think>x</think><answer>{predicted}</answer>", truth).correct is correct


@pytest.mark.parametrize(
    "predicted",
    [
        "9^{9^{9}}",  # sympy never finishes evaluating it
        "10^{10^{10}}",
        "2^{2^{2^{2^{2^{2}}}}}",
        "100000!",
    ],
)
def test_answers_too_costly_to_verify_score_incorrect_within_a_second(predicted):
    assert not timed_score(f"<think>x</think><answer>{predicted}</answer>", "1").correct


def test_comparisons_after_a_timeout_are_still_right():
    assert not score("<answer>9^{9^{9}}</answer>", "1").correct
    start = time.perf_counter()
    assert score("<answer>\\frac{3}{4}</answer>", "0.75").correct
    assert not score("<answer>\\frac{3}{5}</answer>", "0.75").correct
    assert time.perf_counter() - start < 10  # one restart of the worker


def test_time_bound_holds_off_the_main_thread():
    results = []
    thread = threading.Thread(
        target=lambda: results.append(timed_score("<think>x</think><answer>9^{9^{9}}</answer>", "1"))
    )
    thread.start()
    thread.join(timeout=5)
    assert not thread.is_alive() and len(results) == 1 and not results[0].correct


def test_scoring_from_several_threads_at_once_agrees_with_one_thread():
    cases = [("\\frac{1}{2}", "0.5"), ("\\frac{1}{3}", "0.5"), ("x+1", "1+x"), ("y", "x")] * 3
    expected = [score(f"<answer>{p}</answer>", t).correct for p, t in cases]
    got = [None] * len(cases)

    def work(i):
        got[i] = score(f"<answer>{cases[i][0]}</answer>", cases[i][1]).correct

    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=10)
    assert got == expected == [True, False, True, False] * 3


def test_code_in_the_answer_is_never_run(tmp_path):
    marker = tmp_path / "pwned"
    for code in (
        f"__import__('os').system('touch {marker}')",
        f"(lambda: __import__('os').system('touch {marker}'))()",
        f"$__import__('os').system('touch {marker}')$",
        f"open('{marker}', 'w')",
    ):
        s = timed_score(f"<think>x</think><answer>{code}</answer>", "0")
        assert not s.correct
    assert not marker.exists()


@pytest.mark.parametrize(
    "response, format_ok, correct",
    [
        ("x" * (1 << 20), False, False),
        ("<think>" + "x" * (1 << 20) + "</think><answer>1</answer>", True, True),
        ("<answer>" * (1 << 17), False, False),  # every opening unclosed
        ("<answer>" + "1" * (1 << 20) + "</answer>", False, False),  # a million-digit number
        ("<answer>" + "\\frac{" * 50_000 + "</answer>", False, False),
        ("<think>" * 50_000 + "</think>" * 50_000 + "<answer>1</answer>", False, True),
        (" " * (1 << 20) + "<think>", False, False),
        ("<think>x</think>" + " " * (1 << 20) + "<answer>1", False, False),
    ],
)
def test_megabyte_outputs_score_within_a_second(response, format_ok, correct):
    s = timed_score(response, "1")
    assert (s.format_ok, s.correct) == (format_ok, correct)


@pytest.mark.parametrize(
    "response",
    [
        "",
        "\x00",
        "\ud800",
        "<answer>\ud800</answer>",
        "<answer>\x00</answer>",
        "<answer>$$</answer>",
        "<answer>\\</answer>",
        "<answer>}{</answer>",
        "<answer>🙂</answer>",
        "<answer>1e99999999</answer>",
    ],
)
def test_odd_strings_never_raise(response):
    assert timed_score(response, "1").correct is False


def test_answer_is_compared_as_text_when_given_as_number():
    assert score("<think>x</think><answer>72</answer>", 72).correct


def test_the_early_started_worker_is_the_one_that_scores():
    from stages.rewards import math_reward

    math_reward._SYMBOLIC.stop()
    math_reward.start_symbolic_worker()
    started = math_reward._SYMBOLIC.proc
    math_reward.start_symbolic_worker()  # a second start while it runs starts nothing
    assert started is not None and math_reward._SYMBOLIC.proc is started
    assert score("<think></think><answer>\\frac{1}{2}</answer>", "0.5").correct
    assert math_reward._SYMBOLIC.proc is started and started.poll() is None


def test_a_checker_that_cannot_start_stops_the_scoring_with_the_reason(tmp_path, monkeypatch):
    """A broken math_verify install: every non-numeric answer would score wrong, a false reward.
    Numeric answers, which never need it, still score."""
    from stages.rewards import math_reward

    (tmp_path / "math_verify.py").write_text("raise ImportError('math_verify is broken here')\n")
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    monkeypatch.setattr(math_reward, "_SYMBOLIC", math_reward._SymbolicWorker())
    assert score(GOOD, "14197").correct
    for _ in range(2):  # the second call raises at once, without another start
        with pytest.raises(math_reward.AnswerCheckerError, match=r"did not start \(exit code 1"):
            score("<think></think><answer>\\frac{1}{2}</answer>", "0.5")
    assert math_reward._SYMBOLIC.proc is None
