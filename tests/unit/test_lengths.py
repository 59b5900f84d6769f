"""Every sequence length a config sets is checked against the model's positions before anything
runs: `hpcr1 config`, `run` and `submit` refuse it with exit 2 and one line naming the field and
both figures, and write nothing."""

from __future__ import annotations

import pytest

from pipeline.cli import main
from tests.conftest import REPO

TINY = REPO / "configs" / "tiny-cpu.yaml"
CONFIG_70B = REPO / "configs" / "llama-3.3-70b-perlmutter.yaml"
POSITIONS = "model.tiny.max_position_embeddings=128"
SHORT_VERL_PROMPTS = ("eval.verl.max_prompt_length=32",)

# (overrides on the tiny config with 128 positions, the field named, the longest sequence it counts)
TOO_LONG = {
    "SFT": (["stage1_sft.max_seq_len=129"], "stage1_sft.max_seq_len", 129),
    "second SFT": (["stage3_sft.max_seq_len=200"], "stage3_sft.max_seq_len", 200),
    "native GRPO": (["stage4_grpo.max_new_tokens=128"], "stage4_grpo.max_new_tokens", 129),
    "native synthesis": (["stage3_synth.max_new_tokens=150"], "stage3_synth.max_new_tokens", 151),
    "native eval": (["eval.max_new_tokens=128"], "eval.max_new_tokens", 129),
    "GRPO on verl": (
        ["stage2_grpo.engine=verl", "stage2_grpo.verl.max_prompt_length=100", *SHORT_VERL_PROMPTS],
        "stage2_grpo.verl.max_prompt_length",
        164,
    ),
    "synthesis on verl": (
        ["stage3_synth.engine=verl", "stage3_synth.verl.max_prompt_length=65"],
        "stage3_synth.verl.max_prompt_length",
        129,
    ),
    "eval on verl": (
        ["eval.engine=verl", "eval.verl.max_prompt_length=70"],
        "eval.verl.max_prompt_length",
        134,
    ),
    # A GRPO stage on verl is scored by verl's generation server with eval's settings.
    "eval of a GRPO stage on verl": (
        ["stage2_grpo.engine=verl", "stage2_grpo.verl.max_prompt_length=32"],
        "eval.verl.max_prompt_length",
        512 + 64,
    ),
}


@pytest.mark.parametrize("case", sorted(TOO_LONG))
@pytest.mark.parametrize("command", ["config", "run", "submit"])
def test_a_sequence_longer_than_the_models_positions_is_refused_naming_the_field(
    case, command, tmp_path, capsys
):
    overrides, field, longest = TOO_LONG[case]
    run = tmp_path / "run"
    argv = {
        "config": ["config", str(TINY)],
        "run": ["run", str(TINY), "--run-dir", str(run)],
        "submit": ["submit", str(TINY), "--cluster", "local", "--dry-run", "--run-dir", str(run)],
    }[command]
    assert main([*argv, POSITIONS, *overrides]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"hpcr1: error: {field}: ") and "\n" not in err, err
    assert err.endswith(f"{longest} tokens, more than the model's 128 positions (max_position_embeddings)"), (
        err
    )
    assert not run.exists()


def test_the_same_lengths_within_the_positions_pass(capsys):
    within = ["stage1_sft.max_seq_len=128", "stage4_grpo.max_new_tokens=127", "eval.max_new_tokens=127"]
    assert main(["config", str(TINY), POSITIONS, *within]) == 0, capsys.readouterr().err


def test_a_hugging_face_models_positions_come_from_its_config_json(tmp_path, capsys):
    """Llama 3.3 70B's config.json says 131072 positions: a GRPO stage on verl asking for more is
    refused at submission, before its layouts are planned."""
    (tmp_path / "data.jsonl").write_text('{"question": "2 plus 2?", "answer": "4\\n#### 4"}\n')
    files = [f"data.{name}_file={tmp_path / 'data.jsonl'}" for name in ("sft", "prompts", "eval")]
    shape = f"model.path={REPO / 'configs' / 'models' / 'llama-3.3-70b'}"
    too_long = "stage2_grpo.verl.max_prompt_length=131000"
    argv = [
        "submit",
        str(CONFIG_70B),
        "--cluster",
        "perlmutter",
        "--dry-run",
        "--run-dir",
        str(tmp_path / "r"),
    ]
    assert main([*argv, shape, *files, too_long]) == 2
    err = capsys.readouterr().err
    assert "stage2_grpo.verl.max_prompt_length: max_prompt_length + max_new_tokens (131000 + " in err, err
    assert "more than the model's 131072 positions" in err
