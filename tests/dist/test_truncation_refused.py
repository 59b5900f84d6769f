"""GSM8K-shaped data with the embedded default's stage1_sft.max_seq_len (96) and its character
tokenizer: every prompt is longer than 96 tokens, so no response token would be trained on. The
stage refuses before training, exit code 2 with one line naming the field to raise, the count in
the manifest, nothing trained (it used to die in its first step dividing by zero loss tokens)."""

from __future__ import annotations

import json

import pytest

from tests.conftest import SMALL_RUN, hpcr1_run
from tests.support.gsm8k_like import gsm8k_like, write_gsm8k_like

pytestmark = pytest.mark.dist


def test_gsm8k_files_with_the_default_max_seq_len_are_refused_naming_it(tmp_path):
    data = write_gsm8k_like(tmp_path / "gsm8k.jsonl", gsm8k_like(40))
    files = {"task": "files", "sft_file": str(data), "prompts_file": str(data), "eval_file": str(data)}
    out = hpcr1_run(tmp_path / "run", config={**SMALL_RUN, "data": files}, check=False)

    assert out.returncode == 2, out.stdout[-2000:] + out.stderr[-3000:]
    assert "Traceback" not in out.stdout + out.stderr
    # One message, the last line (before it only the progress bar of the tiny model's making).
    *_, line = out.stderr.strip().splitlines()
    assert out.stderr.count("hpcr1:") == 1, out.stderr
    prefix = "hpcr1: error: stage1_sft.max_seq_len: 96 leaves no response token in any of the 40 examples"
    assert line.startswith(prefix) and line.endswith("; raise stage1_sft.max_seq_len"), line
    entry = json.loads((tmp_path / "run" / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert entry["state"] == "failed" and entry["error"]["summary"].endswith("raise stage1_sft.max_seq_len")
    counts = entry["training_data"]
    assert (counts["examples"], counts["truncated"], counts["left_out"]) == (40, 40, 40)
    assert counts["longest_prompt"] > 96 and counts["refused"]["field"] == "stage1_sft.max_seq_len"
    assert not (tmp_path / "run" / "stage1_sft" / "ckpt").exists()
