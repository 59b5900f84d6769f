"""Hostile input: malformed configs generated from the schema itself (every field, every section)
and by hypothesis, hand-written YAML attacks, and malformed data files. Each must give exit code 2
with one line naming the field or the file and line, and leave an existing run directory exactly
as it was. The bulk runs the CLI in-process; a representative few run the real `hpcr1` process."""

from __future__ import annotations

import contextlib
import copy
import io
import json
import subprocess
import sys
import types
import typing

import annotated_types
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from core.config import RunConfig, Section, load_config
from core.manifest import Manifest
from core.rundir import RunDir
from pipeline.cli import main
from pipeline.driver import prepare_run
from tests.conftest import REPO, hpcr1_env, snapshot

BASE = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())
BASE["data"]["arithmetic"] = {
    "num_operands": 2,
    "digits": 2,
    "sft_size": 32,
    "prompts_size": 16,
    "eval_size": 8,
}
BASE["model"]["tiny"] = {
    "hidden_size": 32,
    "num_layers": 2,
    "num_heads": 4,
    "num_kv_heads": 2,
    "ffn_hidden_size": 64,
}
GOOD_ROW = '{"prompt": "1+1=", "answer": "2", "response": "<think>1+1=2</think><answer>2</answer>"}\n'


@pytest.fixture(scope="module")
def existing(tmp_path_factory):
    """A run directory a previous run left (resolved config, inputs with the model, manifest)."""
    root = tmp_path_factory.mktemp("hostile")
    (root / "good.yaml").write_text(yaml.safe_dump(BASE))
    (root / "good.jsonl").write_text(GOOD_ROW)
    run = RunDir(root / "run")
    prepare_run(load_config(root / "good.yaml"), run, root)
    Manifest(run.root).start_attempt("stage1_sft")
    return root, run


def rejected(existing, config_text: str | bytes, *overrides: str, name: str = "bad.yaml") -> str:
    """`hpcr1 run` in-process on the existing run dir: exit 2, one line, nothing changed; the message."""
    root, run = existing
    config = root / name
    config.write_bytes(config_text if isinstance(config_text, bytes) else config_text.encode())
    before = snapshot(run.root)
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        rc = main(["run", str(config), "--run-dir", str(run.root), *overrides])
    message = err.getvalue()
    assert rc == 2, message
    assert "Traceback" not in message and len(message.strip().splitlines()) == 1, message
    assert snapshot(run.root) == before, "a rejected input changed the run directory"
    return message


def with_value(dotted: str, value) -> str:
    cfg = copy.deepcopy(BASE)
    *parents, leaf = dotted.split(".")
    node = cfg
    for part in parents:
        node = node.setdefault(part, {})
    node[leaf] = value
    return yaml.safe_dump(cfg)


# --- configs generated from the schema: every field gets a value of the wrong kind, every section
# an unknown key and a scalar, every bounded number a value out of bounds ---


def schema_fields(model: type[Section] = RunConfig, prefix: str = ""):
    """(dotted path, field info, section class or None) for every field, depth first."""
    for name, info in model.model_fields.items():
        section = _section_of(info.annotation)
        yield f"{prefix}{name}", info, section
        if section is not None:
            yield from schema_fields(section, f"{prefix}{name}.")


def _alternatives(annotation) -> list:
    """The types an annotation admits: a union's members (`X | None`, and `Optional[...]`, which an
    Annotated member such as PositiveInt makes of it), each stripped of its Annotated metadata."""
    union = typing.get_origin(annotation) in (typing.Union, types.UnionType)
    args = typing.get_args(annotation) if union else (annotation,)
    return [typing.get_args(a)[0] if typing.get_origin(a) is typing.Annotated else a for a in args]


def _section_of(annotation):
    sections = (a for a in _alternatives(annotation) if isinstance(a, type) and issubclass(a, Section))
    return next(sections, None)


def _kind(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return "literal"
    return next(a.__name__ for a in _alternatives(annotation) if a is not type(None))


WRONG_KIND = {
    "int": "three",
    "float": "fast",
    "str": 12345,
    "bool": "maybe",
    "literal": "no-such-choice",
    "list": "every step",
}


def _out_of_bounds(info):
    for bound in info.metadata:
        if isinstance(bound, annotated_types.Gt):
            return bound.gt
        if isinstance(bound, annotated_types.Ge):
            return bound.ge - 1
        if isinstance(bound, annotated_types.Le):
            return bound.le + 1
    return None


def generated_configs() -> dict[str, tuple[str, str]]:
    """{case: (config text, the field the message must name)}"""
    cases = {}
    for path, info, section in schema_fields():
        if section is not None:
            cases[f"{path}: a scalar for a section"] = (with_value(path, 7), path)
            cases[f"{path}: unknown key"] = (with_value(f"{path}.no_such_field", 1), f"{path}.no_such_field")
            continue
        cases[f"{path}: wrong kind"] = (with_value(path, WRONG_KIND[_kind(info.annotation)]), path)
        bad = _out_of_bounds(info)
        if bad is not None:
            cases[f"{path}: out of bounds ({bad})"] = (with_value(path, bad), path)
    cases["unknown top-level key"] = (with_value("no_such_section", {"x": 1}), "no_such_section")
    return cases


GENERATED = generated_configs()


def test_schema_generates_enough_malformed_configs():
    assert len(GENERATED) >= 40, len(GENERATED)


@pytest.mark.parametrize("case", sorted(GENERATED))
def test_generated_bad_config_exits_2_naming_the_field(case, existing):
    text, field = GENERATED[case]
    assert field in rejected(existing, text)


LEAVES = [(path, info) for path, info, section in schema_fields() if section is None]


@st.composite
def bad_field_value(draw):
    path, info = draw(st.sampled_from(LEAVES))
    words = st.text(min_size=1, max_size=20).map(lambda t: "x" + t)  # never read back as a number
    garbage = {
        "int": st.one_of(
            words,
            st.booleans(),
            st.lists(st.integers(), max_size=3),
            st.floats(-1e6, 1e6).filter(lambda x: not x.is_integer()),
        ),
        "float": st.one_of(
            words,
            st.booleans(),
            st.lists(st.floats(), max_size=2),
            st.sampled_from([float("inf"), float("-inf"), float("nan")]),
        ),
        "str": st.one_of(st.integers(), st.booleans(), st.lists(words, max_size=2)),
        "bool": st.one_of(words, st.integers()),
        "literal": st.one_of(words, st.lists(words, min_size=1, max_size=2)),
        "list": st.one_of(words, st.integers(), st.lists(words, min_size=1, max_size=2)),
    }  # list[int] fields
    return path, draw(garbage[_kind(info.annotation)])


@settings(max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(bad_field_value())
def test_random_bad_values_exit_2_naming_the_field(existing, case):
    path, value = case
    assert path in rejected(existing, with_value(path, value))


@settings(max_examples=40, deadline=None, derandomize=True)
@given(st.text(max_size=200))
def test_random_text_as_a_config_exits_2(existing, text):
    rejected(existing, text)


# --- YAML attacks and accidents, written by hand ---

BOMB = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi")
)

HOSTILE_YAML = {
    "invalid UTF-8": (b"name: x\nseed: \xff\xfe\n", "bad.yaml:2"),
    "nested 10000 deep": ("name: " + "[" * 10000 + "]" * 10000 + "\n", "bad.yaml"),
    "billion laughs in a field": (BOMB + "name: *i\nstage1_sft: {}\n", "name"),
    "billion laughs under an unknown key": (
        "name: x\nstage1_sft: {}\nbomb:\n  " + BOMB.replace("\n", "\n  "),
        "bomb",
    ),
    "python object tag": ("!!python/object/apply:os.system ['touch /tmp/pwned']\n", "bad.yaml:1"),
    "duplicate key": ("name: x\nstage1_sft: {lr: 0.1, lr: 0.2}\n", "bad.yaml:2"),
    "NUL bytes": ("name: x\0\0\n", "bad.yaml"),
    "unhashable key": ("name: x\n? [a, b]\n: 1\n", "bad.yaml:2"),
    "a number as a key": ("name: x\n1: 2\nstage1_sft: {}\n", "1"),
    "learning rate .inf": ("name: x\nstage1_sft: {lr: .inf}\n", "stage1_sft.lr"),
    "learning rate .nan": ("name: x\nstage1_sft: {lr: .nan}\n", "stage1_sft.lr"),
    "zero_stage: yes": (
        "name: x\nstage1_sft: {parallel: {zero_stage: yes}}\n",
        "stage1_sft.parallel.zero_stage",
    ),
    "empty file": ("", "bad.yaml"),
    "empty run name": ("name: ''\nstage1_sft: {}\n", "name"),
    "tab indentation": ("name: x\nstage1_sft:\n\tsteps: 5\n", "bad.yaml:3"),
}


@pytest.mark.parametrize("case", sorted(HOSTILE_YAML))
def test_hostile_yaml_exits_2_naming_the_place(case, existing):
    text, where = HOSTILE_YAML[case]
    assert where in rejected(existing, text)


# --- malformed data files: each in the slot of one of the three files ---


def _parquet(rows: list[dict]) -> bytes:
    sink = io.BytesIO()
    pq.write_table(pa.Table.from_pylist(rows), sink)
    return sink.getvalue()


HUGE = '{"prompt": "' + "1+" * 600_000 + '1=", "answer": "2"}\n'
BAD_DATA = {  # case: (slot, file name, content, what the message names)
    "huge line": ("sft", "bad.jsonl", GOOD_ROW + HUGE, "bad.jsonl:2"),
    "truncated last line": ("sft", "bad.jsonl", GOOD_ROW + '{"prompt": "1+1=", "ans', "bad.jsonl:2"),
    "pretty-printed JSON": (
        "sft",
        "bad.jsonl",
        '{\n  "prompt": "1+1=",\n  "answer": "2"\n}\n',
        "bad.jsonl:1",
    ),
    "one JSON array": ("sft", "bad.jsonl", '[{"prompt": "1+1=", "answer": "2"}]\n', "bad.jsonl:1"),
    "blank lines only": ("sft", "bad.jsonl", "\n \n\t\n", "bad.jsonl"),
    "NaN answer": ("sft", "bad.jsonl", '{"prompt": "1+1=", "answer": NaN}\n', "bad.jsonl:1"),
    "prompt is a number": ("sft", "bad.jsonl", '{"prompt": 12, "answer": "2"}\n', "bad.jsonl:1"),
    "empty prompt": ("sft", "bad.jsonl", GOOD_ROW + '{"prompt": "", "answer": "2"}\n', "bad.jsonl:2"),
    "blank answer": ("sft", "bad.jsonl", '{"prompt": "1+1=", "answer": "  "}\n', "bad.jsonl:1"),
    "null answer": ("sft", "bad.jsonl", '{"prompt": "1+1=", "answer": null}\n', "bad.jsonl:1"),
    "boolean answer": ("sft", "bad.jsonl", '{"prompt": "1+1=", "answer": true}\n', "bad.jsonl:1"),
    "id is an object": (
        "sft",
        "bad.jsonl",
        '{"id": {"a": 1}, "prompt": "1+1=", "answer": "2"}\n',
        "bad.jsonl:1",
    ),
    "GSM8K answer without ####": (
        "sft",
        "bad.jsonl",
        '{"question": "q?", "answer": "it is 4"}\n',
        "bad.jsonl:1",
    ),
    "chat messages not a list": ("sft", "bad.jsonl", '{"messages": "hi"}\n', "bad.jsonl:1"),
    "chat not ending with the assistant": (
        "sft",
        "bad.jsonl",
        '{"messages": [{"role": "user", "content": "1+1="}]}\n',
        "bad.jsonl:1",
    ),
    "chat without a user": (
        "sft",
        "bad.jsonl",
        '{"messages": [{"role": "assistant", "content": "<answer>2</answer>"}]}\n',
        "bad.jsonl:1",
    ),
    "chat content not text": (
        "sft",
        "bad.jsonl",
        '{"messages": [{"role": "user", "content": [1]}, {"role": "assistant", "content": "2"}]}\n',
        "bad.jsonl:1",
    ),
    "no known shape": ("sft", "bad.jsonl", '{"text": "1+1=2"}\n', "bad.jsonl:1"),
    "JSON nested 100000 deep": ("sft", "bad.jsonl", "[" * 100_000 + "]" * 100_000 + "\n", "bad.jsonl:1"),
    "unpaired surrogate escape": (
        "sft",
        "bad.jsonl",
        '{"prompt": "\\ud800", "answer": "2"}\n',
        "bad.jsonl:1",
    ),
    "UTF-16 file": ("sft", "bad.jsonl", GOOD_ROW.encode("utf-16"), "bad.jsonl:1"),
    "binary garbage": ("sft", "bad.jsonl", bytes(range(256)) * 4, "bad.jsonl:1"),
    "JSONL named .parquet": ("sft", "bad.parquet", GOOD_ROW, "bad.parquet"),
    "truncated Parquet": (
        "sft",
        "bad.parquet",
        _parquet([{"prompt": "1+1=", "answer": "2"}] * 50)[:300],
        "bad.parquet",
    ),
    "Parquet answer column of lists": (
        "sft",
        "bad.parquet",
        _parquet([{"prompt": "1+1=", "answer": ["2"]}]),
        "bad.parquet:1",
    ),
    "bad row in the prompts file": ("prompts", "bad.jsonl", GOOD_ROW + '{"prompt": "1+1="}\n', "bad.jsonl:2"),
    "bad row in the held-out file": ("eval", "bad.jsonl", GOOD_ROW * 3 + "{oops}\n", "bad.jsonl:4"),
}


def data_config(existing, slot: str, name: str, content) -> str:
    root, _ = existing
    bad = root / name
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    files = {f"{s}_file": str(bad if s == slot else root / "good.jsonl") for s in ("sft", "prompts", "eval")}
    return with_value("data", {"task": "files", **files})


def test_enough_malformed_data_files():
    assert len(BAD_DATA) >= 20, len(BAD_DATA)


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_file_exits_2_naming_file_and_line(case, existing):
    slot, name, content, where = BAD_DATA[case]
    message = rejected(existing, data_config(existing, slot, name, content))
    assert where in message and (where.endswith(name) or f"{where}:" in message), message


# --- the real command, a representative few ---

CLI_CASES = {
    "wrong kind": (
        lambda existing: with_value("stage2_grpo.group_size", "eight"),
        [],
        "stage2_grpo.group_size",
    ),
    "bad override": (
        lambda existing: yaml.safe_dump(BASE),
        ["stage1_sft.parallel.tp=two"],
        "stage1_sft.parallel.tp",
    ),
    "billion laughs": (lambda existing: BOMB + "name: *i\nstage1_sft: {}\n", [], "name"),
    "bad data line": (
        lambda existing: data_config(existing, "sft", "bad.jsonl", BAD_DATA["NaN answer"][2]),
        [],
        "bad.jsonl:1",
    ),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_real_cli_exits_2_naming_the_field_and_changes_nothing(case, existing):
    root, run = existing
    make_text, overrides, where = CLI_CASES[case]
    (root / "cli.yaml").write_text(make_text(existing))
    before = snapshot(run.root)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pipeline.cli",
            "run",
            str(root / "cli.yaml"),
            "--run-dir",
            str(run.root),
            *overrides,
        ],
        capture_output=True,
        text=True,
        env=hpcr1_env(),
        cwd=REPO,
        timeout=120,
    )
    assert proc.returncode == 2 and where in proc.stderr, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and json.loads((run.root / "manifest.json").read_text())
    assert snapshot(run.root) == before
