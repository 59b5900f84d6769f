"""The verifiable reward of the R1 format: is the response exactly <think>…</think><answer>…</answer>,
and is its answer right.

Answers are compared cheaply first: the same text, or the same number (big integers and decimals
exactly, never through float). Anything else (LaTeX, fractions, expressions) goes to `math_verify`,
never to `eval`. math_verify's time is unbounded (sympy on 9^{9^{9}} never returns, and its own
SIGALRM timeouts work only on the main thread and cannot interrupt C code), so it runs in a child
process that the kernel ends when a comparison has used up its CPU time: the bound holds on any
thread, and it is CPU time, not wall-clock time, so that a busy machine does not turn right answers
into wrong ones (the same response must get the same reward in every run). `score` raises only
AnswerCheckerError, when math_verify's process cannot start: scoring every non-numeric answer as
wrong would train on a false reward.
"""

from __future__ import annotations

import atexit
import json
import logging
import re
import select
import subprocess
import sys
import threading
from dataclasses import dataclass
from decimal import Decimal
from pathlib import Path

R1_TAGS = ("<think>", "</think>", "<answer>", "</answer>")
# Checked after every tag is known to occur exactly once, so the two `.*` cannot backtrack badly.
R1_LAYOUT = re.compile(r"<think>.*</think>\s*<answer>.*</answer>", re.S)
PLAIN_NUMBER = re.compile(r"[+-]?(\d+\.?\d*|\.\d+)")
THOUSANDS = re.compile(r"[+-]?\d{1,3}(,\d{3})+(\.\d*)?")
MAX_NUMBER_CHARS = 10_000  # exact comparison of numbers this long still takes microseconds
MAX_SYMBOLIC_CHARS = 512  # longer answers are compared as text only, never parsed
SYMBOLIC_CPU_S = 0.5  # CPU time per math_verify comparison; a costlier one scores incorrect
# A worker that neither answers nor dies (its CPU budget ends any computation) is hung.
WORKER_HUNG_S = 600.0

log = logging.getLogger(__name__)


class AnswerCheckerError(RuntimeError):
    """math_verify's process did not start, so a non-numeric answer cannot be scored."""


@dataclass(frozen=True)
class Score:
    format_ok: bool  # exactly <think>...</think> then <answer>...</answer>, with only whitespace around
    correct: bool  # the extracted answer equals the ground truth
    reward: float  # correct_weight * correct + format_weight * format_ok


def score(response: str, answer: str, correct_weight: float = 1.0, format_weight: float = 0.1) -> Score:
    format_ok = is_well_formed(response)
    predicted = extract_answer(response)
    correct = predicted is not None and answers_match(predicted, str(answer))
    return Score(format_ok, correct, correct_weight * correct + format_weight * format_ok)


def is_well_formed(response: str) -> bool:
    text = response.strip()
    return all(text.count(tag) == 1 for tag in R1_TAGS) and R1_LAYOUT.fullmatch(text) is not None


def extract_answer(response: str) -> str | None:
    """The text of the last <answer>...</answer>, stripped. Found with rfind, not a regex: a lazy
    regex rescans the rest of the text from every unclosed <answer> (quadratic on hostile text)."""
    end = response.rfind("</answer>")
    start = response.rfind("<answer>", 0, end)
    if end < 0 or start < 0:
        return None
    return response[start + len("<answer>") : end].strip()


def answers_match(predicted: str, truth: str) -> bool:
    predicted, truth = predicted.strip(), truth.strip()
    if predicted == truth:
        return truth != ""
    a, b = _as_number(predicted), _as_number(truth)
    if a is not None and b is not None:
        return a == b
    if len(predicted) > MAX_SYMBOLIC_CHARS or len(truth) > MAX_SYMBOLIC_CHARS:
        return False
    return _SYMBOLIC.match(predicted, truth)


def _as_number(text: str) -> Decimal | None:
    # Decimal, not int: exact, and free of int()'s 4300-digit limit on string conversion.
    if len(text) > MAX_NUMBER_CHARS:
        return None
    if THOUSANDS.fullmatch(text):
        text = text.replace(",", "")
    return Decimal(text) if PLAIN_NUMBER.fullmatch(text) else None


class _SymbolicWorker:
    """math_verify in a child process (symbolic_worker.py), restarted after a timeout or a crash.
    One comparison at a time: callers on several threads take turns."""

    def __init__(self):
        self.lock = threading.Lock()
        self.proc: subprocess.Popen | None = None
        self.ready = False  # the child has said "ready" (after its imports and math_verify's set-up)
        self.failure: str | None = None  # why the child could not start; every later match raises it

    def start(self) -> None:
        """Start the child without waiting for it, so that its set-up overlaps the caller's."""
        with self.lock:
            if self.proc is None and self.failure is None:
                self._spawn()

    def match(self, predicted: str, truth: str) -> bool:
        with self.lock:
            if self.failure is None and self.proc is None:
                self._spawn()
            if self.failure is None and not self.ready:
                self._wait_ready()
            if self.failure is not None:
                raise AnswerCheckerError(self.failure)
            reply = self._ask(json.dumps([truth, predicted]) + "\n")
            if reply is None:
                self.stop()
            return reply == "1"

    def _spawn(self) -> None:
        script = Path(__file__).with_name("symbolic_worker.py")
        try:
            self.proc = subprocess.Popen(
                [sys.executable, str(script), str(SYMBOLIC_CPU_S)],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
            )
        except OSError as e:
            self.proc = None
            self.failure = f"the answer checker's process ({script}) could not be started: {e}"

    def _wait_ready(self) -> None:
        self.ready = self._ask("") == "ready"
        if not self.ready:
            self.proc.kill()
            code = self.proc.wait()
            self.stop()
            self.failure = (
                f"the answer checker (math_verify, in {Path(__file__).with_name('symbolic_worker.py').name}) "
                f"did not start (exit code {code}; its error is above in this log): non-numeric answers "
                "cannot be scored. Is math-verify installed in this Python?"
            )

    def _ask(self, request: str) -> str | None:
        """Send a request and read one line back, or None if the worker died (out of CPU time) or hung."""
        try:
            self.proc.stdin.write(request)
            self.proc.stdin.flush()
            ready, _, _ = select.select([self.proc.stdout], [], [], WORKER_HUNG_S)
            line = self.proc.stdout.readline() if ready else ""
        except (OSError, ValueError):  # a dead worker's pipes
            return None
        return line.strip() if line.endswith("\n") else None

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.communicate()  # reaps it and closes the pipes
            self.proc, self.ready = None, False


_SYMBOLIC = _SymbolicWorker()
atexit.register(_SYMBOLIC.stop)


def start_symbolic_worker() -> None:
    """Start math_verify's process now, in the background: a trainer calls this before loading its
    models, so that its first non-numeric answer does not wait for the process to start."""
    _SYMBOLIC.start()
