"""Bad configs and bad data files: exit code 2, one message naming the field or line, and nothing
written (the run directory is not even created)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from pipeline.cli import main

REPO = Path(__file__).resolve().parents[2]
BASE = yaml.safe_load((REPO / "configs" / "tiny-cpu.yaml").read_text())


def _cli_on(tmp_path: Path, config_text: str, *overrides: str, capsys) -> tuple[int, str]:
    config = tmp_path / "bad.yaml"
    config.write_text(config_text)
    rc = main(["run", str(config), "--run-dir", str(tmp_path / "run"), *overrides])
    err = capsys.readouterr().err
    assert not (tmp_path / "run").exists(), "a rejected config must not create the run directory"
    return rc, err


def _with(**changes) -> str:
    cfg = yaml.safe_load(yaml.safe_dump(BASE))
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = cfg
        for p in parents:
            node = node[p]
        if value is _DELETE:
            del node[leaf]
        else:
            node[leaf] = value
    return yaml.safe_dump(cfg)


_DELETE = object()

BAD_CONFIGS = {
    "unknown top-level key": (_with(optimiser={"lr": 1}), "optimiser"),
    "unknown nested key": (_with(stage1_sft__learning_rate=0.1), "stage1_sft.learning_rate"),
    "wrong type: steps is text": (_with(stage1_sft__steps="ten"), "stage1_sft.steps"),
    "wrong type: lr is a list": (_with(stage1_sft__lr=[0.1]), "stage1_sft.lr"),
    "wrong type: nproc is a float": (_with(nproc=2.5), "nproc"),
    "negative steps": (_with(stage1_sft__steps=-5), "stage1_sft.steps"),
    "zero stage out of range": (
        _with(stage1_sft__parallel={"zero_stage": 5}),
        "stage1_sft.parallel.zero_stage",
    ),
    "tp does not divide heads": (_with(nproc=3, stage1_sft__parallel={"tp": 3}), "stage1_sft.parallel.tp"),
    "tp*pp does not divide nproc": (_with(stage1_sft__parallel={"tp": 4}), "stage1_sft.parallel"),
    "pp does not divide layers": (
        _with(model__tiny__num_layers=3, stage1_sft__parallel={"pp": 2}),
        "stage1_sft.parallel.pp",
    ),
    "ZeRO-2 under pipeline stages": (
        _with(stage1_sft__parallel={"pp": 2, "zero_stage": 2}),
        "stage1_sft.parallel.zero_stage",
    ),
    "overlap_comm under pipeline stages": (
        _with(stage1_sft__parallel={"pp": 2, "overlap_comm": True}),
        "stage1_sft.parallel.overlap_comm",
    ),
    "batch not a multiple of micro*dp": (
        _with(stage1_sft__global_batch_size=48),
        "stage1_sft.global_batch_size",
    ),
    "kv heads do not divide heads": (_with(model__tiny__num_kv_heads=3), "model.tiny.num_kv_heads"),
    "init_from an unknown stage": (_with(stage1_sft__init_from="stage9"), "stage1_sft.init_from"),
    "data from an unknown stage": (_with(stage1_sft__data="stage3_synth"), "stage1_sft.data"),
    "min_lr above lr": (_with(stage1_sft__min_lr=1.0), "stage1_sft.min_lr"),
    "missing data file": (
        _with(
            data={
                "task": "files",
                "sft_file": "nope.jsonl",
                "prompts_file": "nope.jsonl",
                "eval_file": "nope.jsonl",
            }
        ),
        "data.sft_file",
    ),
    "more validation problems than the task has": (
        _with(
            data={
                "arithmetic": {
                    "num_operands": 2,
                    "digits": 1,
                    "sft_size": 8,
                    "prompts_size": 8,
                    "eval_size": 8,
                }
                | {"validation_size": 2}  # of the 100 problems of two digits, one is in validation
            }
        ),
        "data.arithmetic.validation_size",
    ),
    "as many generators as trainers and more": (
        _with(stage2_grpo__rollout_ranks=2),
        "stage2_grpo.rollout_ranks",
    ),
    "generators beside FSDP2 trainers": (
        _with(stage2_grpo__rollout_ranks=1, stage2_grpo__data_parallel="fsdp2"),
        "stage2_grpo.data_parallel",
    ),
    "generators with a prompt selection": (
        _with(stage2_grpo__rollout_ranks=1, stage2_grpo__max_pass_rate=0.5),
        "stage2_grpo.max_pass_rate",
    ),
    "generators of their own on verl, synchronous": (
        _with(stage2_grpo__rollout_ranks=1, stage2_grpo__engine="verl", stage2_grpo__max_staleness=0),
        "stage2_grpo.max_staleness",
    ),
    "prompts not shared by the trainers": (
        _with(nproc=4, stage1_sft__global_batch_size=128, stage2_grpo__rollout_ranks=1),
        "stage2_grpo.prompts_per_step",
    ),
    "negative sample count": (_with(eval={"samples": -1}), "eval.samples"),
    "zero eval temperature": (_with(eval={"temperature": 0.0}), "eval.temperature"),
    "hf model without a path": (_with(model={"source": "hf"}), "model.path"),
    "hf model path without config.json": (
        _with(model={"source": "hf", "path": "/nonexistent"}),
        "model.path",
    ),
    "unknown model source": (_with(model={"source": "gpt2"}), "model.source"),
    "missing run name": (_with(name=_DELETE), "name"),
    "empty stage graph": (_with(stage1_sft=None), "stage1_sft"),
    "not a mapping": ("- just\n- a list\n", "bad.yaml"),
    "invalid YAML names the line": ("name: x\nseed: [1, 2\nnproc: 2\n", "bad.yaml:3"),
}


@pytest.mark.parametrize("case", sorted(BAD_CONFIGS))
def test_bad_config_exits_2_naming_the_field(case, tmp_path, capsys):
    text, field = BAD_CONFIGS[case]
    rc, err = _cli_on(tmp_path, text, capsys=capsys)
    assert rc == 2, err
    assert field in err, f"{case}: message does not name {field!r}: {err}"
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


BAD_OVERRIDES = {
    "no equals sign": ("stage1_sft.steps", "stage1_sft.steps"),
    "override into a value": ("seed.x=1", "seed"),
    "override with a wrong type": ("stage1_sft.parallel.tp=two", "stage1_sft.parallel.tp"),
    "override of an unknown key": ("stage1_sft.nope=1", "stage1_sft.nope"),
}


@pytest.mark.parametrize("case", sorted(BAD_OVERRIDES))
def test_bad_override_exits_2_naming_the_field(case, tmp_path, capsys):
    override, field = BAD_OVERRIDES[case]
    rc, err = _cli_on(tmp_path, yaml.safe_dump(BASE), override, capsys=capsys)
    assert rc == 2 and field in err, err


def test_short_exponent_floats_read_as_numbers(tmp_path):
    """YAML 1.1 reads `1e-4` as a string; a learning rate written that way must work, in the file too."""
    from core.config import load_config

    path = tmp_path / "c.yaml"
    config = {**BASE, "stage1_sft": {**BASE.get("stage1_sft", {}), "lr": "LR"}}
    path.write_text(yaml.safe_dump(config).replace("LR", "1e-4"))
    cfg = load_config(path, ["stage1_sft.min_lr=5E-6"])
    assert cfg.stage1_sft.lr == 1e-4 and cfg.stage1_sft.min_lr == 5e-6


BAD_DATA = {
    "invalid JSON": ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": oops}\n', ":2"),
    "row is not an object": ('{"prompt": "1+1=", "answer": "2"}\n[1, 2]\n', ":2"),
    "missing answer": ('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n', ":2"),
    "answer of the wrong type": ('{"prompt": "1+1=", "answer": ["2"]}\n', ":1"),
    "empty file": ("", "bad.jsonl"),
    "invalid UTF-8": (b'{"prompt": "1+1=", "answer": "2"}\n{"prompt": "\xff\xfe", "answer": "2"}\n', ":2"),
}


@pytest.mark.parametrize("case", sorted(BAD_DATA))
def test_bad_data_file_exits_2_naming_the_line(case, tmp_path, capsys):
    content, where = BAD_DATA[case]
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(content if isinstance(content, bytes) else content.encode())
    good = tmp_path / "good.jsonl"
    good.write_text(
        '{"prompt": "1+1=", "answer": "2", "response": "<think>1+1=2</think><answer>2</answer>"}\n'
    )
    cfg = _with(
        data={"task": "files", "sft_file": str(bad), "prompts_file": str(good), "eval_file": str(good)}
    )
    rc, err = _cli_on(tmp_path, cfg, capsys=capsys)
    assert rc == 2, err
    assert f"bad.jsonl{where}" in err or (where == "bad.jsonl" and "bad.jsonl" in err), err


def test_a_tied_model_cannot_be_split_into_pipeline_stages(tmp_path, capsys):
    """megatron keeps a second copy of a tied embedding on the last stage, which only megatron's own
    training loop keeps equal to the first stage's: refused before any rank starts."""
    model = tmp_path / "tied"
    model.mkdir()
    dims = {"num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 4, "vocab_size": 128}
    (model / "config.json").write_text(json.dumps({**dims, "tie_word_embeddings": True}))
    text = _with(model={"source": "hf", "path": str(model)}, stage1_sft__parallel={"pp": 2})
    rc, err = _cli_on(tmp_path, text, capsys=capsys)
    assert rc == 2 and "stage1_sft.parallel.pp" in err and "tie_word_embeddings" in err, err
