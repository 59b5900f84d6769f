"""Pipeline-parallel SFT on 4 gloo ranks through the real CLI: PP=2 (x DP=2) and TP=2 x PP=2 give
one rank's losses and final weights; a run failed mid-stage resumes from the pipeline's checkpoint
(each stage's shard) to the same losses and byte-identical weights; the pipeline's send/recv move
exactly the activations and their gradients."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from core.config import load_resolved
from core.rundir import RunDir
from runtime.rank_failure import FAIL_AT_ENV
from stages.data.examples import read_examples
from stages.data.sft_batches import GlobalBatchOrder, tokenize_examples
from stages.data.tokenizer import load_tokenizer
from stages.models.hf_files import read_hf_weights
from tests.conftest import hpcr1_run, resumed_steps, run_once
from tests.conftest import sft_losses as losses

pytestmark = pytest.mark.dist

# Short, and final/ scored greedily on a few problems only: what is tested is the training.
SHORT = ("stage1_sft.steps=4", "stage1_sft.checkpoint_every=2", "eval.num_examples=4", "eval.samples=0")
PP2 = ("nproc=4", "stage1_sft.parallel.pp=2")


def final_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    return read_hf_weights(run_dir / "stage1_sft" / "final")


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return run_once(tmp_path_factory.mktemp("pipeline"), *SHORT)


@pytest.mark.parametrize(
    "name, layout",
    [("pp2", PP2), ("tp2-pp2", ("nproc=4", "stage1_sft.parallel.pp=2", "stage1_sft.parallel.tp=2"))],
)
def test_pipeline_stages_train_as_one_rank_does(runs, name, layout):
    one, split = runs("one-rank", "nproc=1"), runs(name, *layout)
    assert losses(split) == pytest.approx(losses(one), abs=1e-5)
    reference, weights = final_weights(one), final_weights(split)
    assert weights.keys() == reference.keys()
    worst = max((weights[k] - reference[k]).abs().max().item() for k in reference)
    assert worst < 1e-4, worst
    manifest = json.loads((split / "manifest.json").read_text())["stages"]["stage1_sft"]
    assert manifest["state"] == "done"
    AutoModelForCausalLM.from_pretrained(split / "stage1_sft" / "final")


def expected_activation_bytes(run_dir: Path, dp_size: int) -> dict[tuple[int, int], list[int]]:
    """What 1F1B must move between the two stages of each replica in each step, each way, as
    {(dp_rank, step 1-based): bytes per micro-batch}: an fp32 tensor [S, micro_batch, hidden], S the
    replica's longest sample less one (its micro-batches share one shape), rebuilt here from the
    run's data and config."""
    run = RunDir(run_dir)
    cfg = load_resolved(run)
    sft = cfg.stage1_sft
    samples, _ = tokenize_examples(
        load_tokenizer(run.base_model), read_examples(run.task_file("sft")), sft.max_seq_len
    )
    order = GlobalBatchOrder(len(samples), sft.global_batch_size, cfg.seed)
    hidden = json.loads((run.base_model / "config.json").read_text())["hidden_size"]
    out = {}
    for step in range(1, sft.steps + 1):
        batch = [samples[i] for i in order.indices(step - 1)]
        for dp_rank in range(dp_size):
            local = batch[dp_rank::dp_size]
            longest = max(len(s.input_ids) for s in local) - 1
            out[dp_rank, step] = [sft.micro_batch_size * longest * hidden * 4] * (
                len(local) // sft.micro_batch_size
            )
    return out


def test_the_pipeline_moves_the_activations_and_their_gradients(runs):
    run_dir = runs("pp2", *PP2)
    expected = expected_activation_bytes(run_dir, dp_size=2)
    for path in sorted((run_dir / "stage1_sft" / "profile").glob("rank-*.jsonl")):
        events = [json.loads(line) for line in path.read_text().splitlines()]
        rank = events[0]["rank"]
        stage, dp_rank = divmod(rank, 2)  # megatron's order: data parallel within a stage
        peer = rank + 2 if stage == 0 else rank - 2
        for step in range(1, 5):
            p2p = [
                e
                for e in events
                if e["step"] == step and e["op"] in ("send", "recv") and e["phase"] != "export"
            ]
            assert {e["phase"] for e in p2p} == {"pipeline_p2p"} and {e["peer"] for e in p2p} == {peer}
            want = expected[dp_rank, step]
            for op in ("send", "recv"):  # forward activations one way, their gradients back
                assert [e["bytes"] for e in p2p if e["op"] == op] == want, (rank, step, op)


def test_a_failed_pipeline_run_resumes_to_the_same_bytes(runs, tmp_path):
    """Rank 1 (first pipeline stage, second replica) raises as step 4 begins: a fault at a known
    step (no kill racing the run to the checkpoint of step 2 before the last one is written), one
    step past that checkpoint, so that the resumed run repeats step 3."""
    reference = runs("pp2", *PP2)
    run_dir = tmp_path / "failed"
    failed = hpcr1_run(run_dir, *SHORT, *PP2, env={FAIL_AT_ENV: "rank=1,step=4"}, check=False)
    assert failed.returncode == 1 and len(losses(run_dir)) == 3, failed.stdout[-3000:]

    hpcr1_run(run_dir, *SHORT, *PP2)
    assert resumed_steps(run_dir) == [2]
    assert losses(run_dir) == losses(reference)
    final, ref_final = (d / "stage1_sft" / "final" for d in (run_dir, reference))
    for f in sorted(p.name for p in ref_final.glob("*.safetensors")):
        assert (final / f).read_bytes() == (ref_final / f).read_bytes(), f
