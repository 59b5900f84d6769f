"""The GRPO roles' sharded load (each rank reads only its rows of each tensor, on 2 real ranks) gives
exactly the weights and logits of transformers' own load of the whole model: uneven shards, bf16
files split over several safetensors with an index, a tied head, Llama-3 RoPE scaling."""

from __future__ import annotations

import pytest

from tests.conftest import REPO, run_torchrun
from tests.dist.workers.fsdp2_load import BASE, VARIANTS
from tests.dist.workers.results import read_results

pytestmark = pytest.mark.dist
WORKER = REPO / "tests" / "dist" / "workers" / "fsdp2_load.py"


@pytest.fixture(scope="module")
def findings(tmp_path_factory) -> dict:
    """{(variant, check): [value on rank 0, value on rank 1]}."""
    out = run_torchrun(WORKER, 2, str(tmp_path_factory.mktemp("fsdp2"))).stdout
    found: dict = {}
    for item in read_results(out):
        found.setdefault((item["variant"], item["check"]), []).append(item["value"])
    return found


@pytest.mark.parametrize("variant", VARIANTS)
def test_sharded_load_equals_the_whole_model_load(findings, variant):
    assert findings[variant, "weights_equal"] == [True, True]
    assert findings[variant, "unit_gathered_equal"] == [True, True]  # the rollout's weight sync
    assert findings[variant, "resharded"] == [True, True]
    assert max(findings[variant, "logits"]) < 1e-5


def test_each_rank_holds_only_its_rows_and_the_files_were_really_split(findings):
    assert findings["bf16-tied-sharded", "files"][0] > 1
    for variant in VARIANTS:
        rows = findings[variant, "local_rows"]
        # 37 vocabulary rows and 97 FFN rows: 19 + 18 and 49 + 48, as torch.chunk splits them
        assert [r["model.embed_tokens.weight"] for r in rows] == [19, 18]
        assert [r["model.layers.0.mlp.up_proj.weight"] for r in rows] == [49, 48]
    assert BASE["vocab_size"] == 37 and BASE["intermediate_size"] == 97
