"""The data: the arithmetic task is deterministic, its splits disjoint and its chain of thought right;
every accepted file shape loads; every malformed file is one clear DataError naming file and line."""

from __future__ import annotations

import itertools
import json
import re
from collections import Counter
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from core.config import load_config
from stages.data.arithmetic import chain_of_thought, generate_arithmetic, max_problems
from stages.data.examples import DataError, Example, read_examples, write_examples
from stages.inputs import load_task
from tests.conftest import REPO

SPLITS = ("train", "prompts", "validation", "eval")
STEP = re.compile(r"(\d(?:\+\d)*)\+(\d+)=(\d+)")  # "0+4+3+0=7": column digits, carry in, column sum


def operands(example: Example) -> tuple[int, ...]:
    return tuple(int(x) for x in example.prompt.rstrip("=").split("+"))


# --- the arithmetic task -------------------------------------------------------------------------


def test_same_seed_split_and_n_give_the_same_examples():
    assert generate_arithmetic(7, 300, "train") == generate_arithmetic(7, 300, "train")


def test_other_seeds_give_other_examples():
    prompts = {seed: [e.prompt for e in generate_arithmetic(seed, 50, "eval")] for seed in (7, 8)}
    assert prompts[7] != prompts[8]


def test_fewer_examples_are_a_prefix_of_more():
    assert generate_arithmetic(3, 10, "prompts") == generate_arithmetic(3, 100, "prompts")[:10]


@pytest.mark.parametrize("seed", [0, 1])
def test_splits_share_no_problem(seed):
    sizes = {"train": 3000, "prompts": 1000, "validation": 1000, "eval": 1000}
    sets = {s: {operands(e) for e in generate_arithmetic(seed, n, s)} for s, n in sizes.items()}
    assert [len(sets[s]) for s in SPLITS] == list(sizes.values()), "problems repeat within a split"
    for a, b in itertools.combinations(SPLITS, 2):
        assert not sets[a] & sets[b], (a, b)


def test_the_embedded_defaults_validation_and_held_out_sets_are_disjoint_from_all_else():
    """What a run writes to inputs/data/: validation (tuning reads it) and held-out (only reported)
    share no problem with each other nor with what is trained on, checked on the prompts themselves."""
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml")
    task = load_task(cfg, REPO / "configs")
    prompts = {split: [e.prompt for e in examples] for split, examples in task.items()}
    assert len(prompts["validation"]) == cfg.data.arithmetic.validation_size >= 200
    assert len(prompts["eval"]) == cfg.data.arithmetic.eval_size >= 200
    assert cfg.eval.num_examples >= 200, "one held-out problem must be at most 0.5 points"
    for split, listed in prompts.items():
        assert len(set(listed)) == len(listed), f"{split} repeats a problem"
    for a, b in itertools.combinations(prompts, 2):
        assert not set(prompts[a]) & set(prompts[b]), (a, b)
    # the answers are those of the prompts, whatever split they are in
    assert all(int(e.answer) == sum(operands(e)) for e in task["validation"] + task["eval"])


def test_splits_of_a_small_space_partition_it_and_refuse_more_than_they_hold():
    # 100 problems of two 1-digit numbers: together the splits hold each exactly once.
    problems = {}
    for split in SPLITS:
        n = max_problems(split, num_operands=2, digits=1)
        problems[split] = {operands(e) for e in generate_arithmetic(0, n, split, num_operands=2, digits=1)}
        with pytest.raises(ValueError, match="distinct problems"):
            generate_arithmetic(0, n + 1, split, num_operands=2, digits=1)
    assert sum(len(p) for p in problems.values()) == len(set().union(*problems.values())) == 100


def test_ids_are_numbered_per_split():
    examples = generate_arithmetic(0, 3, "eval")
    assert [e.id for e in examples] == ["arith-eval-000000", "arith-eval-000001", "arith-eval-000002"]


@pytest.mark.parametrize("num_operands, digits", [(3, 4), (2, 2), (5, 7)])
def test_prompt_is_zero_padded_operands_joined_by_plus(num_operands, digits):
    for e in generate_arithmetic(0, 200, "train", num_operands, digits):
        assert re.fullmatch(rf"\d{{{digits}}}(\+\d{{{digits}}}){{{num_operands - 1}}}=", e.prompt), e.prompt


def test_worked_example_of_the_spec():
    assert chain_of_thought((30, 8494, 5673), digits=4) == (
        "0+4+3+0=7 3+9+7+0=19 0+4+6+1=11 0+8+5+1=14",
        "14197",
    )


@pytest.mark.parametrize("num_operands, digits", [(3, 4), (2, 2), (5, 7), (1, 3)])
def test_chain_of_thought_is_arithmetically_right(num_operands, digits):
    for e in generate_arithmetic(1, 500, "train", num_operands, digits):
        nums = operands(e)
        padded = e.prompt.rstrip("=").split("+")
        think, answer = re.fullmatch(r"<think>(.*)</think><answer>(\d+)</answer>", e.response).groups()
        steps = think.split(" ")
        assert len(steps) == digits
        carry = 0
        for position, step in enumerate(steps):  # least significant column first
            column, carry_in, total = STEP.fullmatch(step).groups()
            assert column.split("+") == [p[digits - 1 - position] for p in padded]
            assert int(carry_in) == carry
            assert int(total) == sum(int(d) for d in column.split("+")) + carry
            carry = int(total) // 10
        assert answer == e.answer == str(sum(nums))
        # The answer's digits are the column sums' units, topped by the last column's whole sum.
        units = "".join(STEP.fullmatch(s).group(3)[-1] for s in reversed(steps[:-1]))
        assert int(STEP.fullmatch(steps[-1]).group(3) + units) == sum(nums)


def test_worked_fraction_leaves_out_the_working_of_that_share_and_keeps_the_problems():
    full = generate_arithmetic(4, 2000, "train")
    partial = generate_arithmetic(4, 2000, "train", worked_fraction=0.3)
    assert [(e.id, e.prompt, e.answer) for e in partial] == [(e.id, e.prompt, e.answer) for e in full]
    bare = [e for e in partial if e.response == f"<think></think><answer>{e.answer}</answer>"]
    worked = [e for e, f in zip(partial, full) if e.response == f.response]
    assert len(bare) + len(worked) == len(partial)
    assert 520 < len(worked) < 680, len(worked)  # 600 expected, sd 20
    assert generate_arithmetic(4, 100, "train", worked_fraction=0.0)[0].response.startswith("<think></think>")


@pytest.mark.parametrize("fraction", [-0.1, 1.5])
def test_worked_fraction_outside_zero_one_is_refused(fraction):
    with pytest.raises(ValueError, match="worked_fraction"):
        generate_arithmetic(0, 1, "train", worked_fraction=fraction)


# Pearson's chi-square of ten uniform digits' counts exceeds this (9 degrees of freedom) once in 1,000.
CHI2_9_DOF_TAIL_0_001 = 27.88


def test_operands_are_uniform():
    """Every digit position of the operands is uniform over 0-9: each position's chi-square over
    18,000 operands stays below the 0.1 % tail (the seed fixes the draws: it cannot flake). Drawing
    0000-0199 twice as often as the rest (one leading digit 18 % too often) exceeds it."""
    numbers = [x for e in generate_arithmetic(2, 6000, "train") for x in operands(e)]
    expected = len(numbers) / 10
    for position in range(4):
        counts = Counter(str(x).zfill(4)[position] for x in numbers)
        chi2 = sum((counts[str(digit)] - expected) ** 2 / expected for digit in range(10))
        assert chi2 < CHI2_9_DOF_TAIL_0_001, (position, chi2, sorted(counts.items()))


@pytest.mark.parametrize("n", [-1, 10**9])
def test_impossible_sizes_are_refused(n):
    with pytest.raises(ValueError):
        generate_arithmetic(0, n, "eval", num_operands=2, digits=2)


def test_unknown_split_is_refused():
    with pytest.raises(ValueError, match="test"):
        generate_arithmetic(0, 1, "test")


# --- reading the accepted shapes -----------------------------------------------------------------

GSM8K_ANSWER = (
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
    "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 1,072"
)
ROWS_AND_EXAMPLES = [
    (
        {"prompt": "1+1=", "answer": "2", "response": "<think>1+1=2</think><answer>2</answer>", "id": "a"},
        Example("a", "1+1=", "2", "<think>1+1=2</think><answer>2</answer>"),
    ),
    ({"prompt": "2+2=", "answer": "4"}, Example("data:2", "2+2=", "4", None)),
    (
        {"question": "How many clips?", "answer": GSM8K_ANSWER},
        Example(
            "data:3",
            "How many clips?",
            "1072",
            "<think>Natalia sold 48/2 = 24 clips in May.\n"
            "Natalia sold 48+24 = 72 clips altogether in April and May."
            "</think><answer>1072</answer>",
        ),
    ),
    (
        {
            "problem": "What is 1/2 of 1?",
            "solution": "Half of 1 is $\\frac{1}{2}$.",
            "answer": "\\frac{1}{2}",
        },
        Example(
            "data:4",
            "What is 1/2 of 1?",
            "\\frac{1}{2}",
            "<think>Half of 1 is $\\frac{1}{2}$.</think><answer>\\frac{1}{2}</answer>",
        ),
    ),
    ({"problem": "What is 3*3?", "answer": "9"}, Example("data:5", "What is 3*3?", "9", None)),
    (
        {
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": "first"},
                {"role": "assistant", "content": "<answer>0</answer>"},
                {"role": "user", "content": "5+5="},
                {"role": "assistant", "content": "<think>5+5=10</think><answer>10</answer>"},
            ]
        },
        Example("data:6", "5+5=", "10", "<think>5+5=10</think><answer>10</answer>"),
    ),
    (
        {
            "messages": [{"role": "user", "content": "6*7="}, {"role": "assistant", "content": "It is 42."}],
            "answer": "42",
        },
        Example("data:7", "6*7=", "42", "It is 42."),
    ),
    ({"prompt": "3+3=", "answer": 6, "id": 17}, Example("17", "3+3=", "6", None)),
]


def expected_for(name: str) -> list[Example]:
    """The examples of ROWS_AND_EXAMPLES as read from a file called `name` (rows without an id are
    named "<file name>:<line>")."""
    return [replace(e, id=e.id.replace("data:", f"{name}:")) for _, e in ROWS_AND_EXAMPLES]


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_every_shape_loads_from_jsonl(tmp_path):
    path = write_jsonl(tmp_path / "data.jsonl", [r for r, _ in ROWS_AND_EXAMPLES])
    assert read_examples(path) == expected_for("data.jsonl")


def test_every_shape_loads_from_parquet(tmp_path):
    # One table: every row has every column, null where the row's shape has no such field. The last
    # row's numeric answer and id would not share a column with the others' text.
    path = tmp_path / "data.parquet"
    rows = [r for r, _ in ROWS_AND_EXAMPLES[:-1]]
    columns = sorted({key for r in rows for key in r})
    pq.write_table(pa.Table.from_pylist([{c: r.get(c) for c in columns} for r in rows]), path)
    assert read_examples(path) == expected_for("data.parquet")[:-1]


def test_numeric_parquet_columns_load_as_text(tmp_path):
    path = tmp_path / "nums.parquet"
    pq.write_table(pa.Table.from_pylist([{"id": 5, "problem": "2*3?", "answer": 6}]), path)
    assert read_examples(path) == [Example("5", "2*3?", "6", None)]


def test_blank_lines_are_skipped_but_count_for_line_numbers(tmp_path):
    path = tmp_path / "data.json"
    path.write_text('\n{"prompt": "1+1=", "answer": "2"}\n\n  \n{"prompt": "2+2=", "answer": "4"}\n')
    assert [e.id for e in read_examples(path)] == ["data.json:2", "data.json:5"]


def test_a_leading_byte_order_mark_is_accepted(tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b'\xef\xbb\xbf{"prompt": "1+1=", "answer": "2"}\n')
    assert read_examples(path) == [Example("bom.jsonl:1", "1+1=", "2", None)]


def test_written_examples_read_back_the_same(tmp_path):
    examples = generate_arithmetic(0, 20, "train") + [Example("p", 'q "é" \n', "1", None)]
    path = tmp_path / "out" / "set.jsonl"
    write_examples(path, examples)
    assert read_examples(path) == examples
    first = json.loads(path.read_text().splitlines()[0])
    assert sorted(first) == ["answer", "id", "prompt", "response"]
    assert list(path.parent.iterdir()) == [path], "the temporary file was left behind"


def test_written_extra_fields_go_on_their_line(tmp_path):
    path = tmp_path / "set.jsonl"
    write_examples(path, generate_arithmetic(0, 2, "eval"), extra=[{"reward": 1.0}, {"reward": 0.5}])
    assert [json.loads(line)["reward"] for line in path.read_text().splitlines()] == [1.0, 0.5]


def test_a_failed_write_leaves_the_old_file(tmp_path):
    path = tmp_path / "set.jsonl"
    write_examples(path, generate_arithmetic(0, 2, "eval"))
    before = path.read_text()
    with pytest.raises(TypeError):
        write_examples(path, [Example("x", "p", "a", None), object()])
    assert path.read_text() == before


# --- malformed files -----------------------------------------------------------------------------

OK = '{"prompt": "1+1=", "answer": "2"}\n'
BAD_JSONL = {  # name: (content, line named in the message or None, a phrase the message must hold)
    "invalid JSON": (OK + OK + '{"prompt": oops}\n', 3, "invalid JSON"),
    "row is a list": (OK + "[1, 2]\n", 2, "got a list"),
    "row is null": (OK + "null\n", 2, "got null"),
    "invalid UTF-8": (OK.encode() + b'{"prompt": "\xff\xfe", "answer": "2"}\n', 2, "UTF-8"),
    "answer is a list": ('{"prompt": "1+1=", "answer": ["2"]}\n', 1, "'answer'"),
    "answer is a boolean": (OK + '{"prompt": "1+1=", "answer": true}\n', 2, "'answer'"),
    "prompt is a number": (OK + '{"prompt": 11, "answer": "2"}\n', 2, "'prompt'"),
    "missing answer": (OK + '{"prompt": "2+2="}\n', 2, "'answer' is missing"),
    "empty answer": (OK + OK + OK + '{"prompt": "2+2=", "answer": "  "}\n', 4, "'answer' is missing"),
    "no accepted shape": (OK + '{"text": "hello"}\n', 2, "{question, answer"),
    "GSM8K without a final number": ('{"question": "q", "answer": "because"}\n', 1, "####"),
    "chat not ending with the assistant": (
        '{"messages": [{"role": "user", "content": "hi"}]}\n',
        1,
        "end with an assistant",
    ),
    "chat without an answer": (
        '{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}\n',
        1,
        "no answer",
    ),
    "chat content not text": (
        '{"messages": [{"role": "user", "content": ["hi"]}, '
        '{"role": "assistant", "content": "<answer>1</answer>"}]}\n',
        1,
        "messages",
    ),
    "JSON nested too deeply": ("[" * 200_000 + "]" * 200_000 + "\n", 1, "invalid JSON"),
    "pretty-printed JSON": ('[\n  {"prompt": "1+1=", "answer": "2"}\n]\n', 1, "one object a line"),
    "line over 1 MB": (OK + '{"prompt": "' + "1" * (1 << 20) + '", "answer": "2"}\n', 2, "longer than"),
    "empty file": ("", None, "no examples"),
    "only blank lines": ("\n \n\n", None, "no examples"),
}


@pytest.mark.parametrize("case", sorted(BAD_JSONL))
def test_malformed_jsonl_names_the_file_and_line(case, tmp_path):
    content, line, phrase = BAD_JSONL[case]
    path = tmp_path / "bad.jsonl"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(DataError) as caught:
        read_examples(path)
    message = str(caught.value)
    where = f"{path}:{line}: " if line is not None else f"{path}: "
    assert message.startswith(where), message
    assert phrase in message and "\n" not in message and "Traceback" not in message, message


def test_no_shape_message_lists_every_accepted_shape(tmp_path):
    path = write_jsonl(tmp_path / "bad.jsonl", [{"text": "hello"}])
    with pytest.raises(DataError, match="prompt.*question.*problem.*messages"):
        read_examples(path)


def test_malformed_parquet_names_the_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(
        pa.Table.from_pylist([{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": None}]), path
    )
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:2: field 'answer' is missing"):
        read_examples(path)


def test_parquet_of_the_wrong_type_names_the_file_and_row(tmp_path):
    path = tmp_path / "bad.parquet"
    pq.write_table(pa.Table.from_pylist([{"prompt": "1+1=", "answer": ["2"]}]), path)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}:1: field 'answer' must be"):
        read_examples(path)


def test_a_file_that_is_not_parquet_is_one_clear_error(tmp_path):
    path = tmp_path / "bad.parquet"
    path.write_text(OK)
    with pytest.raises(DataError, match=rf"^{re.escape(str(path))}: not a readable Parquet file") as caught:
        read_examples(path)
    assert "\n" not in str(caught.value)


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(DataError, match=rf"^{re.escape(str(tmp_path / 'nope.jsonl'))}: file not found$"):
        read_examples(tmp_path / "nope.jsonl")
