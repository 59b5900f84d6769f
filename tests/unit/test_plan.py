"""`hpcr1 plan`: the Llama 3.x shapes, the memory arithmetic against hand-computed numbers, the
70B verdicts against an independent search, the example configs' layouts, JSON shape, bad input."""

import json

import pytest

from analysis.memory import BF16_MIXED, Layout, training_states
from analysis.model_shape import shape_from_hf_config
from analysis.plan import GIB, GPU_USABLE, NO_FIT
from pipeline.cli import main
from tests.conftest import REPO

MODELS = REPO / "configs" / "models"
# Parameter counts published with the models (Hugging Face model cards / safetensors index).
PUBLISHED = {
    "llama-3.2-1b": 1_235_814_400,
    "llama-3.2-3b": 3_212_749_824,
    "llama-3.1-8b": 8_030_261_248,
    "llama-3.3-70b": 70_553_706_496,
}
P_8B = PUBLISHED["llama-3.1-8b"]


def plan_json(capsys, tmp_path, *args) -> dict:
    assert main(["plan", *args, "--json", "--out", str(tmp_path / "plan.md")]) == 0
    return json.loads(capsys.readouterr().out)


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_llama3_config_json_gives_the_published_parameter_count(name):
    assert shape_from_hf_config(MODELS / name / "config.json").params() == PUBLISHED[name]


def test_llama3_rope_scaling_and_tied_embeddings_are_read():
    small, big = (
        shape_from_hf_config(MODELS / "llama-3.2-1b/config.json"),
        shape_from_hf_config(MODELS / "llama-3.1-8b/config.json"),
    )
    assert small.tied_embeddings and not big.tied_embeddings
    assert big.rope_theta == 500000.0
    assert big.rope_scaling == {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    }
    assert (small.head_dim, big.head_dim) == (64, 128)


def test_8b_bf16_weights_are_16_06_gb():
    weights = training_states(P_8B, BF16_MIXED, Layout(gpus=1, tp=1, zero=0))[0]
    assert round(weights.bytes / 1e9, 2) == 16.06


@pytest.mark.parametrize(
    "zero, sharded",
    [
        (0, set()),
        (1, {"optimizer"}),
        (2, {"optimizer", "gradients"}),
        (3, {"optimizer", "gradients", "weights"}),
    ],
)
def test_zero_stage_divides_exactly_its_states_by_dp(zero, sharded):
    dp = 8
    full = {"weights": 2 * P_8B, "gradients": 2 * P_8B, "optimizer": 12 * P_8B}  # bf16, bf16, fp32 master+m+v
    terms = {t.name: t.bytes for t in training_states(P_8B, BF16_MIXED, Layout(gpus=dp, tp=1, zero=zero))}
    assert terms == {k: v / dp if k in sharded else v for k, v in full.items()}


def independent_70b_sft_min_gpus(gpu_gib: float, counts: list[int]) -> int | None:
    """The least-memory layout SFT can build (TP 4 = a node, ZeRO-2, full recomputation), written
    out from the 70B config's numbers: bf16 weights, ZeRO-2-sharded bf16 gradients and fp32
    master + Adam states, each layer's input kept, one layer's activations, the logits."""
    P, L, h, kv, f, a, V, s, tp = 70_553_706_496, 80, 8192, 1024, 28672, 64, 128256, 1024, 4
    one_layer = s * 2 * (4 * h + (2 * h + 2 * kv + 4 * f + 2 * a * s) / tp)
    activations = L * s * 2 * h + one_layer + s * V * 10 / tp
    for n in counts:
        if n % tp == 0 and 2 * P / tp + 14 * P / n + activations <= GPU_USABLE * gpu_gib * GIB:
            return n
    return None


def test_70b_sft_does_not_fit_one_gpu_and_fits_first_where_an_independent_count_says(capsys, tmp_path):
    counts = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    plan = plan_json(
        capsys,
        tmp_path,
        str(REPO / "configs/llama-3.3-70b-perlmutter.yaml"),
        "--gpus",
        ",".join(map(str, counts)),
        "--gpu-memory-gib",
        "80",
        "model.path=models/llama-3.3-70b",
    )
    sft = plan["stages"]["stage1_sft"]
    assert sft["verdicts"]["1"] == NO_FIT
    expected = independent_70b_sft_min_gpus(80, counts)
    assert expected is not None and sft["min_gpus"] == expected


@pytest.mark.parametrize(
    "config, args",
    [
        (
            str(REPO / "configs/llama-3.3-70b-perlmutter.yaml"),
            ["--gpu-memory-gib", "80", "model.path=models/llama-3.3-70b"],
        ),
        (str(REPO / "configs/llama-3.1-8b.yaml"), ["model.path=models/llama-3.1-8b"]),
    ],
)
def test_example_configs_layouts_fit_at_their_nproc(capsys, tmp_path, config, args):
    plan = plan_json(capsys, tmp_path, config, "--gpus", "16", *args)
    assert {sid: s["at_nproc"]["verdict"] for sid, s in plan["stages"].items()} == dict.fromkeys(
        plan["stages"], "fits"
    )


def test_json_gives_per_stage_verdicts_min_gpus_and_formulas(capsys, tmp_path):
    plan = plan_json(capsys, tmp_path, str(REPO / "configs/tiny-cpu.yaml"), "--gpus", "4,1,2")
    assert list(plan["stages"]) == ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]
    for stage in plan["stages"].values():
        assert set(stage["verdicts"]) == {"1", "2", "4"}
        assert stage["min_gpus"] == 1  # a 1.2M-parameter model fits anywhere
        option = stage["options"][0]
        assert option["gpu_bytes"] == pytest.approx(sum(t["bytes"] for t in option["gpu_terms"]))
        assert all(t["formula"] for t in option["gpu_terms"] + option["host_terms"])
    assert (tmp_path / "plan.md").read_text().startswith("# Memory plan: tiny-cpu")


@pytest.mark.parametrize(
    "args, field",
    [
        (["--gpus", "1,x"], "--gpus"),
        (["--gpus", "0,4"], "--gpus"),
        (["--gpus", ""], "--gpus"),
        (["--cluster", "nowhere"], "--cluster"),
        (["--cluster", "local"], "--cluster"),
        (["--prompt-tokens", "0"], "--prompt-tokens"),
    ],
)
def test_bad_plan_input_exits_2_naming_the_field(capsys, tmp_path, args, field):
    assert main(["plan", str(REPO / "configs/tiny-cpu.yaml"), *args, "--out", str(tmp_path / "p.md")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hpcr1: error: ") and field in err and "Traceback" not in err
    assert not (tmp_path / "p.md").exists()


def test_plan_of_an_hf_config_without_config_json_names_model_path(capsys, tmp_path):
    assert main(["plan", str(REPO / "configs/llama-3.1-8b.yaml"), "--out", str(tmp_path / "p.md")]) == 2
    assert "model.path" in capsys.readouterr().err


def test_keeping_layers_gathered_counts_the_whole_model_for_actor_and_reference():
    from analysis.memory import grpo_footprint
    from core.config import GRPOStage

    shape = shape_from_hf_config(MODELS / "llama-3.1-8b" / "config.json")
    n = 8

    def gpu_terms(reshard: bool) -> dict[str, float]:
        footprint = grpo_footprint(
            shape,
            GRPOStage(reshard_after_forward=reshard),
            Layout(gpus=n, tp=1, zero=3),
            prompt_tokens=512,
            gpus_per_node=4,
            runtime_per_rank=0.0,
        )
        return {t.name: t.bytes for t in footprint.gpu}

    resharding, keeping = gpu_terms(True), gpu_terms(False)
    one_unit = grpo_footprint(
        shape,
        GRPOStage(fsdp_units="model"),
        Layout(gpus=n, tp=1, zero=3),
        prompt_tokens=512,
        gpus_per_node=4,
        runtime_per_rank=0.0,
    )
    assert {t.name: t.bytes for t in one_unit.gpu}["actor_gathered"] == 2 * P_8B  # the whole model per pass
    assert keeping["reference_weights"] == 2 * P_8B == n * resharding["reference_weights"]
    assert keeping["actor_gathered"] == 2 * P_8B > resharding["actor_gathered"]
    assert {k: v for k, v in keeping.items() if k not in ("reference_weights", "actor_gathered")} == {
        k: v for k, v in resharding.items() if k not in ("reference_weights", "actor_gathered")
    }


def test_ddp_counts_the_whole_actor_and_reference_on_every_rank():
    from analysis.memory import grpo_footprint
    from core.config import GRPOStage

    shape = shape_from_hf_config(MODELS / "llama-3.1-8b" / "config.json")

    def gpu_terms(**stage) -> dict[str, float]:
        footprint = grpo_footprint(
            shape,
            GRPOStage(**stage),
            Layout(gpus=8, tp=1, zero=3),
            prompt_tokens=512,
            gpus_per_node=4,
            runtime_per_rank=0.0,
        )
        return {t.name: t.bytes for t in footprint.gpu}

    ddp, fsdp2 = gpu_terms(data_parallel="ddp"), gpu_terms()
    # fp32 weights and gradients and Adam's two fp32 moments, none of them divided over the 8 ranks
    assert (ddp["actor_weights"], ddp["actor_gradients"], ddp["actor_optimizer"]) == (
        4 * P_8B,
        4 * P_8B,
        8 * P_8B,
    )
    assert ddp["actor_optimizer"] == 8 * fsdp2["actor_optimizer"]
    assert ddp["reference_weights"] == 2 * P_8B and ddp["actor_gathered"] == 0
    # verl's trainer shards whatever the native engine's setting
    assert gpu_terms(data_parallel="ddp", engine="verl") == fsdp2
