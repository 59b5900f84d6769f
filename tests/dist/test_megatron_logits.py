"""megatron-core at TP=2 and PP=2 on 2 real ranks computes Hugging Face's logits, and gathering its
shards gives back the HF weights bit for bit."""
from __future__ import annotations

import re

import pytest

from tests.conftest import REPO

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "megatron_logits.py"


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_megatron_logits_match_hf_and_gather_is_exact(torchrun, tp, pp, tmp_path):
    out = torchrun(WORKER, 2, str(tp), str(pp), str(tmp_path)).stdout
    diffs = [float(x) for x in re.findall(r"LOGITS_MAX_DIFF (\S+)", out)]
    assert diffs and max(diffs) < 1e-4, out
    assert "GATHER_EXACT True" in out, out
