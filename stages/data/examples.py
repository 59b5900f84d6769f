"""Task examples and reading them from files in the common shapes.

A row may be ours ({prompt, answer, response?, id?}), GSM8K's ({question, answer: "... #### 72"}),
MATH-like ({problem, solution?, answer}) or chat ({messages: [...]}); each becomes an `Example`.
A malformed row is a `DataError` naming the file and line.
"""
from __future__ import annotations

import json
import os
import re
from dataclasses import asdict, dataclass
from pathlib import Path

MAX_LINE_BYTES = 1 << 20
SHAPES = "{prompt, answer}, {question, answer with '#### N'}, {problem, answer[, solution]}, {messages}"


@dataclass(frozen=True)
class Example:
    id: str
    prompt: str
    answer: str
    response: str | None = None


class DataError(ValueError):
    def __init__(self, path, line: int | None, message: str):
        super().__init__(f"{path}:{line}: {message}" if line is not None else f"{path}: {message}")


def read_examples(path) -> list[Example]:
    path = Path(path)
    if not path.is_file():
        raise DataError(path, None, "file not found")
    rows = _parquet_rows(path) if path.suffix == ".parquet" else _jsonl_rows(path)
    examples = [_example(path, line, row) for line, row in rows]
    if not examples:
        raise DataError(path, None, "no examples (the file is empty)")
    return examples


def write_examples(path, examples, extra: list[dict] | None = None) -> None:
    """JSONL, one example a line (plus per-line extra fields, e.g. provenance), written atomically."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "w") as f:
        for i, ex in enumerate(examples):
            f.write(json.dumps({**asdict(ex), **(extra[i] if extra else {})}) + "\n")
    os.replace(tmp, path)


def _jsonl_rows(path: Path):
    with open(path, "rb") as f:
        for line_no, raw in enumerate(f, 1):
            if len(raw) > MAX_LINE_BYTES:
                raise DataError(path, line_no, f"line longer than {MAX_LINE_BYTES} bytes")
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(path, line_no, f"invalid UTF-8 at byte {e.start}") from None
            if not text.strip():
                continue
            try:
                yield line_no, json.loads(text)
            except json.JSONDecodeError as e:
                raise DataError(path, line_no, f"invalid JSON ({e.msg})") from None


def _parquet_rows(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # pyarrow raises several types for a broken file
        raise DataError(path, None, f"not a readable Parquet file ({e})") from None
    yield from enumerate(table.to_pylist(), 1)


def _example(path: Path, line: int, row) -> Example:
    if not isinstance(row, dict):
        raise DataError(path, line, f"expected a JSON object, got {type(row).__name__}")
    for key in ("prompt", "question", "problem", "answer", "response", "solution", "id"):
        if key in row and row[key] is not None and not isinstance(row[key], (str, int, float)):
            raise DataError(path, line, f"field {key!r} must be a string (got {type(row[key]).__name__})")
    ident = str(row.get("id", f"{path.name}:{line}"))
    if "messages" in row:
        return _from_messages(path, line, row, ident)
    if "prompt" in row:
        _require(path, line, row, "answer")
        return Example(ident, str(row["prompt"]), str(row["answer"]), row.get("response"))
    if "question" in row:
        _require(path, line, row, "answer")
        return _from_gsm8k(path, line, str(row["question"]), str(row["answer"]), ident)
    if "problem" in row:
        _require(path, line, row, "answer")
        answer = str(row["answer"])
        solution = row.get("solution")
        response = f"<think>{solution}</think><answer>{answer}</answer>" if solution else None
        return Example(ident, str(row["problem"]), answer, response)
    raise DataError(path, line, f"row matches no known shape (keys {sorted(row)}); accepted: {SHAPES}")


def _require(path: Path, line: int, row: dict, key: str) -> None:
    if row.get(key) is None or str(row[key]).strip() == "":
        raise DataError(path, line, f"field {key!r} is missing")


def _from_gsm8k(path: Path, line: int, question: str, answer: str, ident: str) -> Example:
    reasoning, sep, final = answer.rpartition("####")
    if not sep:
        raise DataError(path, line, "GSM8K answer has no '#### <number>' final line")
    final = final.strip().replace(",", "")
    reasoning = re.sub(r"<<[^>]*>>", "", reasoning).strip()
    return Example(ident, question, final, f"<think>{reasoning}</think><answer>{final}</answer>")


def _from_messages(path: Path, line: int, row: dict, ident: str) -> Example:
    messages = row["messages"]
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m and "content" in m
                                                  for m in messages):
        raise DataError(path, line, "'messages' must be a list of {role, content} objects")
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise DataError(path, line, "'messages' must end with an assistant message")
    users = [m["content"] for m in messages[:-1] if m["role"] == "user"]
    if not users:
        raise DataError(path, line, "'messages' has no user message before the answer")
    response = str(messages[-1]["content"])
    found = re.findall(r"<answer>(.*?)</answer>", response, flags=re.S)
    answer = row.get("answer") or (found[-1].strip() if found else None)
    if not answer:
        raise DataError(path, line, "no answer: neither an 'answer' field nor <answer>...</answer> in the reply")
    return Example(ident, str(users[-1]), str(answer), response)
