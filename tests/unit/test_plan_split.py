"""`hpcr1 plan`'s split of a GRPO stage's GPUs between generation and training (analysis/plan_split.py):
each side's memory is the colocated footprint's terms, divided as the engines divide them; the
step estimate is the roofline's, computed here by hand; the choice follows the estimate and the
memory verdicts, and needs the profile's rates."""

from __future__ import annotations

import pytest

from analysis.memory import BF16, Site
from analysis.model_shape import shape_from_hf_config
from analysis.plan import GIB, NO_FIT, RUNTIME_PER_RANK, Machine, Speed, evaluate
from analysis.plan_search import configured
from analysis.plan_split import TRAINING_MFU, plan_split, rollout_counts
from core.cluster import load_profile
from core.config import GRPOStage, VerlConfig
from tests.conftest import REPO
from tests.unit.test_plan import plan_json

SHAPE_8B = shape_from_hf_config(REPO / "configs" / "models" / "llama-3.1-8b" / "config.json")
A100 = Machine.from_profile(load_profile("perlmutter-80g"))
SITE = Site(A100.gpu_bytes, A100.gpus_per_node, RUNTIME_PER_RANK, 512)


def verl_stage(prompts_per_step=64, **fields) -> GRPOStage:
    verl = VerlConfig(rollout_tp=1, max_prompt_length=512, micro_batch_size_per_gpu=4)
    return GRPOStage(
        engine="verl", prompts_per_step=prompts_per_step, group_size=8, mini_batches=2, verl=verl, **fields
    )


def test_the_profiles_datasheet_rates_reach_the_planner():
    assert A100.speed == Speed(312e12, 2039e9, 25e9)
    assert Machine.from_profile(load_profile("perlmutter")).speed.memory_bandwidth == 1555e9
    assert Machine.from_profile(load_profile("generic")).speed is None


def test_the_estimate_is_the_roofline_computed_by_hand():
    g = verl_stage(max_new_tokens=1024, kl_coef=0.001)
    sp = plan_split(g, SHAPE_8B, SITE, A100, 16)
    P, m, speed = SHAPE_8B.params(), SHAPE_8B, A100.speed
    option = next(o for o in sp.options if o.rollout_gpus == 8)
    # 8 replicas of one GPU, 64 sequences each, decoding at a mean context of 512 + 1024/2 tokens
    sequences, context = 64 * 8 / 8, 512 + 512
    kv_read = 2 * m.layers * m.kv_heads * m.head_dim * 2 * context * sequences
    decode = max((2 * P + kv_read) / speed.memory_bandwidth, 2 * P * sequences / speed.flops)
    generation = 2 * P * sequences * 512 / speed.flops + 1024 * decode
    # update (6), reference (2), old log-probs (2) FLOPs a parameter and token, on the 8 left
    training = (6 + 2 + 2) * P * 64 * 8 * (512 + 1024) / (8 * speed.flops * TRAINING_MFU)
    assert option.timing.generation == pytest.approx(generation, rel=1e-9)
    assert option.timing.training == pytest.approx(training, rel=1e-9)
    assert option.timing.handover == pytest.approx(2 * P / 25e9, rel=1e-9)
    assert option.timing.split_step == pytest.approx(max(generation, training) + 2 * P / 25e9)


def test_the_training_side_is_the_colocated_footprint_less_the_rollout():
    g = verl_stage(max_new_tokens=1024)
    sp = plan_split(g, SHAPE_8B, SITE, A100, 16)
    option = next(o for o in sp.options if o.rollout_gpus == 4)
    colocated = evaluate(g, SHAPE_8B, SITE, A100, 12, configured(g)).footprint
    trained = option.training.footprint
    assert {t.name for t in colocated.gpu} - {t.name for t in trained.gpu} == {
        "rollout_budget", "rollout_weights", "rollout_min_kv"
    }  # fmt: skip
    assert "generation" in colocated.phases and "generation" not in trained.phases
    by_name = {t.name: t.bytes for t in colocated.gpu}
    assert trained.phase_bytes()["weight_sync"] == pytest.approx(
        colocated.phase_bytes()["weight_sync"] - by_name["rollout_weights"]
    )
    # the generating GPU holds vLLM's share, gmu of its memory
    assert option.generation.footprint.gpu_bytes() == g.verl.gpu_memory_utilization * 80 * GIB


def test_a_native_trainer_holds_no_rollout_copy_and_a_generator_the_whole_model():
    g = GRPOStage(prompts_per_step=64, group_size=8, max_new_tokens=256, data_parallel="ddp", dtype="bf16")
    sp = plan_split(g, SHAPE_8B, SITE, A100, 8)
    assert [o.rollout_gpus for o in sp.options] == [1, 2, 3, 4]  # at most half the ranks
    option = sp.options[1]
    colocated = evaluate(g, SHAPE_8B, SITE, A100, 6, configured(g)).footprint
    resident = lambda fp: next(t.bytes for t in fp.gpu if t.name == "resident")  # noqa: E731
    assert resident(colocated) - resident(option.training.footprint) == BF16 * SHAPE_8B.params()
    weights, kv = option.generation.footprint.gpu
    assert weights.bytes == BF16 * SHAPE_8B.params()
    assert kv.bytes == pytest.approx(
        2 * SHAPE_8B.layers * SHAPE_8B.kv_heads * SHAPE_8B.head_dim * BF16 * (512 + 256) * 64 * 8 / 2
    )


def test_long_answers_choose_a_split_and_short_ones_stay_colocated():
    # 48 prompts: a mini-batch's 192 responses split over 12, 8 and 4 trainers alike
    long = plan_split(verl_stage(48, max_new_tokens=2048, kl_coef=0.0), SHAPE_8B, SITE, A100, 16)
    assert long.chosen is not None and long.chosen.feasible
    steps = {o.rollout_gpus: o.timing.split_step for o in long.options if o.feasible}
    assert long.chosen.timing.split_step == min(steps.values())
    assert long.chosen.timing.split_step < long.colocated.generation + long.colocated.training
    assert f"{long.chosen.rollout_gpus} of 16 GPUs generating" in long.why
    short = plan_split(verl_stage(48, max_new_tokens=64, ppo_epochs=4), SHAPE_8B, SITE, A100, 16)
    assert short.chosen is None and short.why.startswith("colocated:")


def test_a_split_whose_side_does_not_fit_is_never_chosen():
    # 12 trainers: a mini-batch of 256 responses does not split over them
    sp = plan_split(verl_stage(max_new_tokens=2048, kl_coef=0.0), SHAPE_8B, SITE, A100, 16)
    refused = next(o for o in sp.options if o.rollout_gpus == 4)
    assert refused.training.verdict == NO_FIT and not refused.feasible
    # the fastest estimate of all, but refused: a step no engine would run
    assert refused.timing.split_step == min(o.timing.split_step for o in sp.options)
    assert sp.chosen is None or sp.chosen.rollout_gpus != 4


def test_without_the_profiles_rates_the_verdicts_stand_and_nothing_is_chosen():
    local = Machine("nodes", "GPU", 80 * GIB, 4, 256 * GIB)
    sp = plan_split(verl_stage(48, max_new_tokens=2048), SHAPE_8B, SITE, local, 16)
    assert sp.chosen is None and "gives no rates" in sp.why
    assert all(o.timing is None for o in sp.options) and sp.options


@pytest.mark.parametrize(
    "gpus, backend, expected",
    [(8, "fsdp", [4]), (16, "fsdp", [4, 8, 12]), (4, "fsdp", [1, 2, 3]), (16, "megatron", [8])],
)
def test_verls_rollout_pool_is_whole_nodes_and_leaves_whole_megatron_layouts(gpus, backend, expected):
    verl = VerlConfig(
        rollout_tp=1, backend=backend, megatron_tp=4 if backend == "megatron" else 1, megatron_pp=2
    )
    assert rollout_counts(GRPOStage(engine="verl", verl=verl), gpus, 4) == expected


def test_hpcr1_plan_prints_each_grpo_stages_split_and_its_choice(capsys, tmp_path):
    config = str(REPO / "configs" / "llama-3.1-8b.yaml")
    plan = plan_json(capsys, tmp_path, config, "--cluster", "perlmutter-80g", "--gpus", "16")
    split = plan["splits"]["stage2_grpo"]
    assert split["gpus"] == plan["overrides"]["nproc"] and split["why"]
    assert [o["rollout_ranks"] for o in split["options"]] and all(o["timing_s"] for o in split["options"])
    text = (tmp_path / "plan.md").read_text()
    assert "split between generation and training" in text and "stage2_grpo split:" in text
