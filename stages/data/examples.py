"""Task examples, and reading them from JSON Lines or Parquet files in the common shapes.

Each row becomes an `Example`; its shape is detected per row, the first match winning:
ours {prompt, answer, response?, id?}, GSM8K {question, answer: "... #### 72"}, MATH-like
{problem, solution?, answer}, or chat {messages: [{role, content}, ...], answer?}.
A malformed row is a `DataError` naming the file and the 1-based line (Parquet: row).
"""

from __future__ import annotations

import json
import math
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

from stages.rewards.math_reward import extract_answer

MAX_LINE_BYTES = 1 << 20
SHAPES = (
    "{prompt, answer, response?, id?}, {question, answer: '... #### N'} (GSM8K), "
    "{problem, answer, solution?} (MATH) or {messages: [{role, content}, ...]} (chat)"
)
TEXT_FIELDS = ("prompt", "question", "problem", "response", "solution")
TEXT_OR_NUMBER_FIELDS = ("id", "answer")  # {"answer": 72} and {"id": 5} are common; kept as text
GSM8K_CALCULATOR = re.compile(r"<<[^>]*>>")  # "<<48/2=24>>" annotations inside the reasoning


@dataclass(frozen=True)
class Example:
    id: str  # stable: "arith-train-000123", or "<file name>:<line>" for a row without one
    prompt: str  # the user's question, plain text (no chat template applied)
    answer: str  # ground-truth final answer, e.g. "14197"
    response: str | None  # "<think>...</think><answer>...</answer>"; None in prompt-only sets


class DataError(ValueError):
    """Bad input data, said in one sentence: "path:line: message" (no line when none applies)."""

    def __init__(self, path, line: int | None, message: str):
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


def read_examples(path) -> list[Example]:
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "not a regular file" if path.exists() else "file not found")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    examples = [_example(path, line, row) for line, row in rows]
    if not examples:
        raise DataError(path, None, "no examples (the file is empty or blank)")
    return examples


def write_examples(path, examples, extra: list[dict] | None = None) -> None:
    """JSON Lines, one example a line (plus that line's `extra` fields, e.g. provenance), written to
    a temporary file that replaces `path` only when complete."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for i, ex in enumerate(examples):
            f.write(json.dumps({**asdict(ex), **(extra[i] if extra else {})}) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _jsonl_rows(path: Path):
    try:
        f = open(path, "rb")
    except OSError as e:
        raise DataError(path, None, f"cannot be read ({e.strerror})") from None
    with f:
        # readline with a limit: a huge line is refused without ever being held in memory whole.
        for line_no, raw in enumerate(iter(lambda: f.readline(MAX_LINE_BYTES + 1), b""), 1):
            if len(raw.rstrip(b"\r\n")) > MAX_LINE_BYTES:
                raise DataError(path, line_no, f"line longer than {MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8-sig" if line_no == 1 else "utf-8")  # a leading BOM is fine
            except UnicodeDecodeError as e:
                raise DataError(path, line_no, f"invalid UTF-8 at byte {e.start}") from None
            if text.strip():
                yield line_no, _parse_json(path, line_no, text)


def _parse_json(path: Path, line_no: int, text: str):
    try:
        row = json.loads(text)
        if "\\ud" in text.lower():
            # "\ud800" decodes to an unpaired surrogate: a str that cannot be written back as UTF-8.
            json.dumps(row, ensure_ascii=False).encode("utf-8")
        return row
    except UnicodeEncodeError:
        raise DataError(
            path, line_no, "a \\u escape encodes an unpaired surrogate, which is not text"
        ) from None
    except json.JSONDecodeError as e:
        hint = " (pretty-printed JSON? one object a line is expected)" if text.strip() in ("[", "{") else ""
        raise DataError(path, line_no, f"invalid JSON: {e.msg} at column {e.colno}{hint}") from None
    except RecursionError:
        raise DataError(path, line_no, "invalid JSON: nested too deeply") from None


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types (ArrowInvalid, OSError, ...) for a broken file
        reason = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise DataError(path, None, f"not a readable Parquet file ({reason})") from None
    yield from enumerate(table.to_pylist(), 1)


def _example(path: Path, line: int, row) -> Example:
    if not isinstance(row, dict):
        raise DataError(path, line, f"expected one JSON object a line, got {_kind(row)}")
    # A null is an absent field: Parquet rows have every column of the file.
    row = {key: value for key, value in row.items() if value is not None}
    _check_types(path, line, row)
    ident = _text(row.get("id")) or f"{path.name}:{line}"
    if "prompt" in row:
        prompt, answer = _required(path, line, row, "prompt"), _required(path, line, row, "answer")
        return Example(ident, prompt, answer, _text(row.get("response")) or None)
    if "question" in row:
        return _from_gsm8k(path, line, row, ident)
    if "problem" in row:
        answer, solution = _required(path, line, row, "answer"), _text(row.get("solution"))
        response = f"<think>{solution}</think><answer>{answer}</answer>" if solution else None
        return Example(ident, _required(path, line, row, "problem"), answer, response)
    if "messages" in row:
        return _from_chat(path, line, row, ident)
    raise DataError(
        path,
        line,
        f"row matches no accepted shape (its keys: {', '.join(sorted(row)) or 'none'}); accepted: {SHAPES}",
    )


def _check_types(path: Path, line: int, row: dict) -> None:
    for key in TEXT_FIELDS:
        if key in row and not isinstance(row[key], str):
            raise DataError(path, line, f"field {key!r} must be a string, got {_kind(row[key])}")
    for key in TEXT_OR_NUMBER_FIELDS:
        value = row.get(key, "")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(path, line, f"field {key!r} must be a string or a number, got {_kind(value)}")
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(path, line, f"field {key!r} is {value}, not a usable value")


def _required(path: Path, line: int, row: dict, key: str) -> str:
    value = _text(row.get(key))
    if not value or not value.strip():
        raise DataError(path, line, f"field {key!r} is missing or empty")
    return value


def _text(value) -> str | None:
    return None if value is None else str(value)


def _kind(value) -> str:
    return {
        dict: "an object",
        list: "a list",
        str: "a string",
        bool: "a boolean",
        int: "a number",
        float: "a number",
        type(None): "null",
    }.get(type(value), f"a {type(value).__name__}")


def _from_gsm8k(path: Path, line: int, row: dict, ident: str) -> Example:
    reasoning, sep, final = _required(path, line, row, "answer").rpartition("####")
    final = final.strip().replace(",", "")
    if not sep or not final:
        raise DataError(path, line, "GSM8K answer has no final '#### <number>' part")
    reasoning = GSM8K_CALCULATOR.sub("", reasoning).strip()
    return Example(
        ident,
        _required(path, line, row, "question"),
        final,
        f"<think>{reasoning}</think><answer>{final}</answer>",
    )


def _from_chat(path: Path, line: int, row: dict, ident: str) -> Example:
    messages = row["messages"]
    if not isinstance(messages, list) or not all(
        isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
        for m in messages
    ):
        raise DataError(path, line, "'messages' must be a list of {role, content} objects with text content")
    if not messages or messages[-1]["role"] != "assistant":
        raise DataError(path, line, "'messages' must end with an assistant message")
    users = [m["content"] for m in messages[:-1] if m["role"] == "user"]
    if not users:
        raise DataError(path, line, "'messages' has no user message before the final assistant message")
    response = messages[-1]["content"]
    answer = _text(row.get("answer")) or extract_answer(response)
    if not answer:
        raise DataError(
            path,
            line,
            "no answer: neither an 'answer' field nor <answer>...</answer> in the final assistant message",
        )
    return Example(ident, users[-1], answer, response)
