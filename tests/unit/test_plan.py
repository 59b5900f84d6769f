"""`hpcr1 plan`: the Llama 3.x shapes, the memory arithmetic against hand-computed numbers, the
70B verdicts against an independent search, the example configs' layouts, JSON shape, bad input."""

import json
from dataclasses import replace

import pytest

from analysis.memory import BF16_MIXED, Footprint, Layout, Site, grpo_footprint, training_states
from analysis.model_shape import shape_from_hf_config
from analysis.plan import CAVEAT, FITS, GIB, GPU_USABLE, HEADROOM, HOST_USABLE, NO_FIT, Machine, fits
from core.config import GRPOStage, VerlConfig
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


P_70B, L_70B, H_70B, KV_70B, F_70B, A_70B, V_70B = 70_553_706_496, 80, 8192, 1024, 28672, 64, 128256


def sft_70b_tp4_zero2(n: int, micro: int, recompute: bool, pp: int = 1) -> tuple[float, float]:
    """Training and optimizer step of the 70B SFT (1024-token sequences) at TP 4 (a node) and PP pp,
    ZeRO-2 over n/4/pp, written out from the 70B config's numbers: bf16 weights of the rank's
    stage, ZeRO-2-sharded bf16 gradients and fp32 master + Adam states, DeepSpeed's 5e8-element bf16
    gradient bucket and its flattened copy, the activations (every layer's, or with full
    recomputation each layer's input and one layer's: under 1F1B the first stage keeps pp
    micro-batches of L/pp layers, as many), the logits; then the optimizer step: weights, master +
    Adam, the partition's bf16 gradients, their fp32 copy and AdamW's sqrt(v)."""
    P, L, h, kv, f, a, V, s, tp = P_70B, L_70B, H_70B, KV_70B, F_70B, A_70B, V_70B, 1024, 4
    one_layer = micro * s * 2 * (4 * h + (2 * h + 2 * kv + 4 * f + 2 * a * s) / tp)
    layers = L * micro * s * 2 * h + one_layer if recompute else L * one_layer
    activations = layers + micro * s * V * (2 + 4) / tp  # megatron's loss: bf16 logits, fp32 copy
    training = 2 * P / (tp * pp) + 14 * P / n + 2 * 5e8 * 2 + activations
    step = 2 * P / (tp * pp) + (12 + 2 + 4 + 4) * P / n
    return training, step


def sft_70b_tp4_pp_zero1(n: int, pp: int, micro: int = 1) -> tuple[float, float]:
    """Training and optimizer step of the 70B SFT's first pipeline stage (L/pp layers and the
    embedding, over TP 4) with ZeRO-1 over n/4/pp, written out from the 70B config's numbers: bf16
    weights and gradients, fp32 master + Adam states sharded, one flattened bf16 copy of the
    gradients for the reduction (no bucket under pp > 1), and min(pp, M) micro-batches' activations
    of its layers (1F1B, M micro-batches of the 128 sequences a step); then the optimizer step:
    weights, master + Adam, the partition's flat fp32 gradient (its bf16 gradients freed before
    AdamW) and AdamW's sqrt(v)."""
    P, L, h, kv, f, a, V, s, tp = P_70B, L_70B, H_70B, KV_70B, F_70B, A_70B, V_70B, 1024, 4
    layer = (P - 2 * V * h - h) / L  # one decoder layer's parameters
    first, dp = (L / pp * layer + V * h) / tp, n // (tp * pp)
    in_flight = min(pp, 128 // (micro * dp))
    one_layer = micro * s * 2 * (4 * h + (2 * h + 2 * kv + 4 * f + 2 * a * s) / tp)
    training = 4 * first + 12 * first / dp + min(5e8, first) * 2 + in_flight * L / pp * one_layer
    step = 2 * first + (12 + 4 + 4) * first / dp
    return training, step


def independent_70b_sft_min_gpus(gpu_gib: float, counts: list[int]) -> int | None:
    """The least-memory layout SFT can build without offload and pipeline stages: TP 4 = a node,
    ZeRO-2, full recomputation, one sequence (sft_70b_tp4_zero2)."""
    for n in counts:
        if n % 4 == 0 and max(sft_70b_tp4_zero2(n, 1, True)) <= GPU_USABLE * gpu_gib * GIB:
            return n
    return None


def test_70b_sft_does_not_fit_one_gpu_and_fits_first_where_an_independent_count_says(capsys, tmp_path):
    """Where the leanest layout without pipeline stages first fits, its optimizer step bounds it, not
    its activations: it fits without recomputation too (one sequence; two do not), so the plan needs
    none, and takes it over any pp > 1. The final eval is configured at gmu 0.85 of the 80 GiB GPU,
    above 90% of usable: the plan runs it at 0.8 instead, which it writes as eval.* overrides. Half
    the GPUs fit with pipeline stages (PP 4, ZeRO-1), without caveat: pp is a config setting."""
    counts = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    plan = plan_json(
        capsys,
        tmp_path,
        str(REPO / "configs/llama-3.3-70b-perlmutter.yaml"),
        "--gpus",
        ",".join(map(str, counts)),
        "--cluster",
        "perlmutter-80g",
        "model.path=models/llama-3.3-70b",
        "eval.verl.gpu_memory_utilization=0.85",
    )
    sft = plan["stages"]["stage1_sft"]
    assert sft["verdicts"]["1"] == NO_FIT
    expected = independent_70b_sft_min_gpus(80, counts)
    usable = GPU_USABLE * 80 * GIB
    assert expected == 64 and max(sft_70b_tp4_zero2(expected, 1, False)) < HEADROOM * usable
    assert sft_70b_tp4_zero2(expected, 2, False)[0] > usable
    chosen = sft["options"][counts.index(expected)]
    layout = chosen["tp"], chosen["pp"], chosen["zero_stage"], chosen["settings"]["micro_batch_size"]
    assert layout == (4, 1, 2, 1) and not chosen["recompute"] and not chosen["offload"]
    assert not chosen["caveats"] and chosen["eval_settings"]["verl.gpu_memory_utilization"] == 0.8
    half = expected // 2
    assert max(sft_70b_tp4_zero2(half, 1, False)) > usable
    assert sft["min_gpus"] == half and not sft["caveats"][str(half)]
    piped = sft["options"][counts.index(half)]
    assert (piped["tp"], piped["pp"], piped["zero_stage"], piped["unsettable"]) == (4, 4, 1, [])
    assert piped["settings"]["parallel.pp"] == 4
    training, step = sft_70b_tp4_pp_zero1(half, 4)
    assert piped["phases"]["training"] == pytest.approx(training, rel=1e-9)
    assert piped["phases"]["optimizer_step"] == pytest.approx(step, rel=1e-9)


def test_70b_sft_on_40gb_nodes_fits_at_its_nproc_with_pipeline_stages_and_no_caveat(capsys, tmp_path):
    """TP 4 within a node leaves 35.3 GB of bf16 weights a GPU, most of the 38.65 GB usable: no
    pp = 1 layout fits 40 GB. PP 8 (10 layers a stage) with ZeRO-1 does, and the plan writes it."""
    plan = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter", "llama-3.3-70b")
    planned = plan["stages"]["stage1_sft"]["planned_at_nproc"]
    assert planned["verdict"] == FITS and not planned["caveats"] and not planned["unsettable"]
    assert (planned["tp"], planned["pp"], planned["zero_stage"]) == (4, 8, 1)
    assert planned["layout"] == "tp4 pp8 dp4 zero1 micro1"
    training, step = sft_70b_tp4_pp_zero1(128, 8)
    assert planned["phases"]["training"] == pytest.approx(training, rel=1e-9)
    assert max(training, step) < HEADROOM * GPU_USABLE * plan["cluster"]["gpu_bytes"]
    assert "stage1_sft.parallel.pp=8" in plan["overrides"]["lines"]
    assert not any(line.startswith("stage1_sft") for line in plan["overrides"]["left_as_configured"])


CONFIG_70B, CONFIG_8B = REPO / "configs/llama-3.3-70b-perlmutter.yaml", REPO / "configs/llama-3.1-8b.yaml"


def shipped_plan(capsys, tmp_path, config, cluster, model, *overrides) -> dict:
    """The plan of a shipped config as shipped (its model.shape is `model`'s directory)."""
    plan = plan_json(capsys, tmp_path, str(config), "--cluster", cluster, *overrides)
    assert plan["params"] == PUBLISHED[model]
    return plan


@pytest.mark.parametrize("config", [CONFIG_8B, CONFIG_70B])
@pytest.mark.parametrize("cluster", ["perlmutter", "perlmutter-80g"])
def test_shipped_configs_plan_as_shipped_on_both_perlmutter_node_kinds(capsys, tmp_path, config, cluster):
    """model.path points at weights that are not here; model.shape's config.json stands in."""
    assert main(["plan", str(config), "--cluster", cluster, "--out", str(tmp_path / "p.md")]) == 0
    assert "GPU total" in (tmp_path / "p.md").read_text()


@pytest.mark.parametrize(
    "config, cluster, model, key",
    [(CONFIG_8B, "perlmutter", "llama-3.1-8b", "8b"), (CONFIG_70B, "perlmutter-80g", "llama-3.3-70b", "70b")],
)
def test_shipped_synthesis_on_verl_fits_where_the_native_sampler_does_not(
    capsys, tmp_path, config, cluster, model, key
):
    native = shipped_plan(capsys, tmp_path, config, cluster, model, "stage3_synth.engine=native")
    assert native["stages"]["stage3_synth"]["at_nproc"]["verdict"] == NO_FIT
    on_verl = shipped_plan(capsys, tmp_path, config, cluster, model)["stages"]["stage3_synth"]
    assert on_verl["engine"].startswith("verl vllm") and on_verl["at_nproc"]["verdict"] == FITS
    # vLLM's 0.85 of the GPU is 94.4% of the 90% usable (rounded up): fits, above the headroom
    edge = shipped_plan(
        capsys, tmp_path, config, cluster, model, "stage3_synth.verl.gpu_memory_utilization=0.85"
    )
    at_edge = edge["stages"]["stage3_synth"]
    assert at_edge["at_nproc"]["verdict"] == CAVEAT and at_edge["planned_at_nproc"]["verdict"] == FITS
    assert at_edge["at_nproc"]["caveats"] == ["95% of usable GPU memory"]


def test_70b_synthesis_on_40gb_nodes_fits_without_caveat_once_a_vllm_instance_spans_two_nodes(
    capsys, tmp_path
):
    """bf16 70B weights over one 4-GPU node are 35.3 GB a GPU: 91% of the 38.65 GB usable, all of
    gmu 0.9's share. Over two nodes (tensor parallel 8, a whole-node span verl's RolloutReplica
    takes) they are half that, and vLLM fits with room for its KV cache."""
    plan = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter", "llama-3.3-70b", "--gpus", "4,8")
    four, eight = options = plan["stages"]["stage3_synth"]["options"]
    assert four["settings"]["verl.rollout_tp"] == 4 and four["verdict"] == CAVEAT
    assert eight["settings"]["verl.rollout_tp"] == 8 and eight["verdict"] == FITS
    weights = [next(t["bytes"] for t in o["gpu_terms"] if t["name"] == "rollout_weights") for o in options]
    assert weights[0] == pytest.approx(2 * weights[1]) and weights[0] / 1e9 == pytest.approx(35.28, abs=0.01)
    rejected = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter", "llama-3.3-70b", "--gpus", "12")
    twelve = rejected["stages"]["stage3_synth"]["options"][0]
    assert twelve["settings"]["verl.rollout_tp"] != 8  # 8 GPUs do not tile 12


def test_70b_sfts_final_eval_on_40gb_nodes_is_planned_over_two_nodes_and_written_as_eval_overrides(
    capsys, tmp_path
):
    """The config's eval (vLLM tp4 at gmu 0.8) cannot start on 40 GB GPUs: 35.3 GB of weights a GPU
    exceed 0.8 x 42.9 GB. The plan runs it at tp8 over two nodes, and where the stage's own plan
    can be written, writes the eval's settings beside it."""
    plan = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter", "llama-3.3-70b", "--gpus", "8,64")
    sft = plan["stages"]["stage1_sft"]
    assert any("exceed gmu·M" in r for r in sft["at_nproc"]["refusals"])  # as configured
    for option in sft["options"]:
        assert option["eval_settings"] == {"verl.rollout_tp": 8, "verl.gpu_memory_utilization": 0.8}
        assert not any("gmu" in r for r in option["refusals"])
    out = tmp_path / "overrides.txt"
    argv = ["plan", str(CONFIG_70B), "--cluster", "perlmutter-80g", "--out", str(tmp_path / "p.md")]
    assert main([*argv, "--write-overrides", str(out)]) == 0
    lines = out.read_text().split()
    assert lines.count("eval.verl.rollout_tp=4") == 1  # both SFT stages plan it; written once


def test_8b_config_with_synthesis_on_verl_fits_its_40gb_nodes_at_its_nproc(capsys, tmp_path):
    plan = shipped_plan(capsys, tmp_path, CONFIG_8B, "perlmutter", "llama-3.1-8b")
    stages = plan["stages"]
    configured = {sid: s["at_nproc"]["verdict"] for sid, s in stages.items()}
    assert configured == dict.fromkeys(stages, FITS)  # the config ships what the planner chose
    assert {sid: s["planned_at_nproc"]["verdict"] for sid, s in stages.items()} == dict.fromkeys(stages, FITS)
    assert stages["stage2_grpo"]["engine"].startswith("verl fsdp, vllm tp1 gmu0.6")
    assert stages["stage3_synth"]["engine"] == "verl vllm tp1 gmu0.8"
    assert {s["at_nproc"]["gpus"] for s in stages.values()} == {16}


def test_70b_config_fits_every_stage_at_nproc_128_on_80gb_nodes(capsys, tmp_path):
    """GPU and host memory of every stage at nproc 128, GRPO on verl's megatron backend; the config
    ships the planner's choice, so nothing needs a caveat."""
    plan = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter-80g", "llama-3.3-70b")
    host_usable = HOST_USABLE * plan["cluster"]["host_bytes"]
    for sid, stage in plan["stages"].items():
        at = stage["at_nproc"]
        assert at["gpus"] == 128 and at["verdict"] == FITS and not at["refusals"], sid
        assert at["gpu_bytes"] <= GPU_USABLE * plan["cluster"]["gpu_bytes"], sid
        assert at["host_bytes_per_node"] <= host_usable, sid
    for sid in ("stage2_grpo", "stage4_grpo"):
        grpo = plan["stages"][sid]
        assert grpo["engine"] == "verl megatron tp4 pp8, vllm tp4 gmu0.5, micro-batch 4, offload: none"
        assert grpo["at_nproc"]["layout"] == "megatron tp4 pp8 dp4, rollout tp4 gmu0.5 micro4"
        assert grpo["at_nproc"] == grpo["planned_at_nproc"]


def test_70b_grpo_with_param_offload_fits_with_that_caveat_and_its_host_memory_near_the_limit(
    capsys, tmp_path
):
    """The earlier layout (PP 4, parameters offloaded): a configured offload is a caveat, and so are
    227.7 GB of the 247.4 GB usable a node."""
    settings = [
        "megatron_pp=4",
        "param_offload=true",
        "micro_batch_size_per_gpu=1",
        "gpu_memory_utilization=0.6",
    ]
    plan = shipped_plan(
        capsys,
        tmp_path,
        CONFIG_70B,
        "perlmutter-80g",
        "llama-3.3-70b",
        *(f"stage2_grpo.verl.{kv}" for kv in settings),
    )
    at = plan["stages"]["stage2_grpo"]["at_nproc"]
    assert (
        at["verdict"] == CAVEAT
        and at["layout"] == "megatron tp4 pp4 dp8 +param_offload, rollout tp4 gmu0.6 micro1"
    )
    assert at["caveats"] == ["param offload", "93% of usable host memory"]


def test_70b_grpo_on_verls_fsdp_backend_does_not_fit_for_its_rank0_fp32_load(capsys, tmp_path):
    """On FSDP the GRPO stages fit their GPUs but not the node's host memory: rank 0 builds the
    whole actor in fp32 (4·P = 282 GB) before sharding it."""
    fsdp = [f"{sid}.verl.backend=fsdp" for sid in ("stage2_grpo", "stage4_grpo")]
    plan = shipped_plan(capsys, tmp_path, CONFIG_70B, "perlmutter-80g", "llama-3.3-70b", *fsdp)
    host_usable = HOST_USABLE * plan["cluster"]["host_bytes"]
    at = plan["stages"]["stage2_grpo"]["at_nproc"]
    assert at["verdict"] == NO_FIT and not at["refusals"]
    assert at["gpu_bytes"] <= GPU_USABLE * plan["cluster"]["gpu_bytes"] < at["host_bytes_per_node"]
    loading = {t["name"]: t["bytes"] for t in at["host_terms"]}["loading"]
    assert loading == 4 * PUBLISHED["llama-3.3-70b"] > host_usable


def test_summary_line_names_the_engine_its_settings_and_the_verdict(capsys, tmp_path):
    argv = [
        "plan",
        str(CONFIG_8B),
        "--cluster",
        "perlmutter",
        "--gpus",
        "16",
        "--out",
        str(tmp_path / "p.md"),
    ]
    assert main([*argv, f"model.path={MODELS / 'llama-3.1-8b'}"]) == 0
    out = capsys.readouterr().out.splitlines()
    start = out.index(next(line for line in out if line.startswith("stage2_grpo [")))
    assert out[start : start + 4] == [
        "stage2_grpo [verl fsdp, vllm tp1 gmu0.6, micro-batch 8, offload: none]: min_gpus 16",
        "  as configured at nproc=16: fsdp16 +recompute, rollout tp1 gmu0.6 micro8: fits — 31.79 GB per GPU "
        "(peak: generation), 56.15 GB host per node",
        "  planned at nproc=16: fsdp16 +recompute, rollout tp1 gmu0.6 micro8: fits — 31.79 GB per GPU "
        "(peak: generation), 56.15 GB host per node",
        "  planned settings (--write-overrides): stage2_grpo.verl.param_offload=false "
        "stage2_grpo.verl.optimizer_offload=false stage2_grpo.verl.rollout_tp=1 "
        "stage2_grpo.verl.micro_batch_size_per_gpu=8 stage2_grpo.verl.gpu_memory_utilization=0.6",
    ]


def test_json_gives_per_stage_verdicts_min_gpus_and_formulas(capsys, tmp_path):
    plan = plan_json(capsys, tmp_path, str(REPO / "configs/tiny-cpu.yaml"), "--gpus", "4,1,2")
    assert list(plan["stages"]) == ["stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo"]
    for stage in plan["stages"].values():
        assert set(stage["verdicts"]) == {"1", "2", "4"}
        assert stage["min_gpus"] == 1  # a 1.2M-parameter model fits anywhere
        option = stage["options"][0]
        # the peak phase's terms (SFT: training or its final eval), else all terms at once
        whole = sum(t["bytes"] for t in option["gpu_terms"])
        assert option["gpu_bytes"] == pytest.approx(max(option["phases"].values(), default=whole))
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


@pytest.mark.parametrize("shape, field", [("null", "model.path"), (str(REPO / "configs"), "model.shape")])
def test_plan_of_an_hf_config_without_config_json_names_the_field(capsys, tmp_path, shape, field):
    """No shape and no model at model.path, or a shape directory without config.json."""
    argv = ["plan", str(CONFIG_8B), f"model.shape={shape}", "--out", str(tmp_path / "p.md")]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"hpcr1: error: {field}:" in err and "Traceback" not in err


SHAPE_8B = shape_from_hf_config(MODELS / "llama-3.1-8b" / "config.json")
SITE = Site(gpu_bytes=40 * GIB, gpus_per_node=4, runtime_per_rank=0.0)


def grpo_terms(layout: Layout, **stage) -> tuple[dict[str, float], Footprint]:
    fp = grpo_footprint(SHAPE_8B, GRPOStage(**stage), layout, SITE)
    return {t.name: t.bytes for t in fp.gpu}, fp


def verl(**settings) -> dict:
    """A verl stage; rollout_tp 4 unless given (footprints are of a layout, never of 'auto')."""
    return {"engine": "verl", "verl": VerlConfig(**{"rollout_tp": 4, **settings})}


@pytest.mark.parametrize("dtype, w", [("auto", 2), ("bf16", 2), ("fp32", 4)])
def test_native_grpo_holds_native_fits_residency_and_gathers_by_reshard_setting(dtype, w):
    """fp32 master weights and states; the reference, rollout and sync copies in the stage's dtype,
    'auto' being bf16 on the GPUs a plan is for; the gathered unit counted in bf16."""
    n = 8
    layout = Layout(gpus=n, tp=1, zero=3)
    resharding, _ = grpo_terms(layout, dtype=dtype)
    keeping, _ = grpo_terms(layout, reshard_after_forward=False, dtype=dtype)
    whole, _ = grpo_terms(layout, fsdp_units="model", dtype=dtype)
    ddp, _ = grpo_terms(Layout(gpus=n, tp=1, zero=0), data_parallel="ddp", dtype=dtype)
    assert resharding["resident"] == (16 + w) * P_8B / n + 2 * w * P_8B  # native_fit's fsdp2 formula
    assert ddp["resident"] == (16 + 2 * w) * P_8B and ddp["actor_gathered"] == 0
    assert keeping["actor_gathered"] == whole["actor_gathered"] == 2 * P_8B > resharding["actor_gathered"]


def test_verl_activations_scale_with_micro_batch_per_gpu_not_with_samples_over_n():
    layout = Layout(gpus=8, tp=2, zero=3, recompute=True)
    one, _ = grpo_terms(layout, **verl(micro_batch_size_per_gpu=1))
    four, _ = grpo_terms(layout, **verl(micro_batch_size_per_gpu=4))
    more_samples, _ = grpo_terms(layout, prompts_per_step=512, **verl(micro_batch_size_per_gpu=1))
    assert four["activations"] == pytest.approx(4 * one["activations"])
    assert more_samples["activations"] == one["activations"]


def test_verl_offload_moves_exactly_the_offloaded_states_from_gpu_to_host():
    settings = dict(gpus=8, tp=2, zero=3, recompute=True)
    (kept, fp_kept), (_, fp_moved) = (
        grpo_terms(Layout(**settings), **verl()),
        grpo_terms(
            Layout(**settings, offload=True, param_offload=True),
            **verl(param_offload=True, optimizer_offload=True),
        ),
    )
    generation = lambda fp: fp.phase_bytes()["generation"]  # noqa: E731
    assert generation(fp_kept) - generation(fp_moved) == kept["actor_weights"] + kept["actor_optimizer"]
    ranks = 4
    moved_host = fp_moved.host_bytes() - fp_kept.host_bytes()
    assert moved_host == pytest.approx(ranks * (kept["actor_weights"] + kept["actor_optimizer"]))
    assert fp_kept.phase_bytes()["training"] == fp_moved.phase_bytes()["training"]  # loaded to train


def test_a_rollout_whose_weights_exceed_its_gmu_share_does_not_fit():
    machine = Machine("test", "GPU", 40 * GIB, 4, 1024 * GIB)
    _, fp = grpo_terms(
        Layout(gpus=8, tp=1, zero=3, recompute=True), **verl(rollout_tp=1, gpu_memory_utilization=0.3)
    )
    assert P_8B * 2 > 0.3 * 40 * GIB and fp.refusals and "exceed" in fp.refusals[0]
    assert not fits(fp, machine)
    _, roomy = grpo_terms(
        Layout(gpus=8, tp=2, zero=3, recompute=True), **verl(rollout_tp=2, gpu_memory_utilization=0.6)
    )
    assert not roomy.refusals and fits(roomy, machine)


def test_vllm_needs_one_max_model_len_sequence_of_kv_beside_its_weights():
    """max_model_len is what verl is told: the longest prompt and a whole response."""
    shape, prompt, response = SHAPE_8B, 4096, 28000
    tokens = prompt + response
    kv = 2 * shape.layers * shape.kv_width * 2 * tokens  # bf16 keys and values of one sequence
    gmu = (2 * P_8B + kv / 2) / (40 * GIB)  # exactly enough on one GPU for half the sequence's KV
    layout = Layout(gpus=8, tp=1, zero=3, recompute=True)
    settings = dict(rollout_tp=1, gpu_memory_utilization=gmu, max_prompt_length=prompt)
    _, fp = grpo_terms(layout, max_new_tokens=response, **verl(**settings))
    assert fp.refusals and f"one {tokens}-token max_model_len" in fp.refusals[0]
    _, half = grpo_terms(layout, max_new_tokens=response // 2 - prompt, **verl(**settings))
    assert not any("max_model_len" in r for r in half.refusals)


def test_a_max_model_len_beyond_the_models_positions_is_refused():
    _, fp = grpo_terms(
        Layout(gpus=8, tp=1, zero=3, recompute=True),
        max_new_tokens=131072,
        **verl(rollout_tp=1, gpu_memory_utilization=0.9),
    )
    assert any("exceeds the model's 131072 positions" in r for r in fp.refusals)


def test_native_eval_of_sft_is_a_phase_of_its_own_holding_the_whole_model():
    from analysis.memory import sft_footprint
    from core.config import EvalConfig, SFTStage

    stage = SFTStage(dtype="bf16", micro_batch_size=1, max_seq_len=512)
    layout = Layout(gpus=8, tp=2, zero=2)
    native = sft_footprint(SHAPE_8B, stage, layout, SITE)
    eval_on_verl = EvalConfig(engine="verl", verl={"rollout_tp": 4})
    on_verl = sft_footprint(SHAPE_8B, stage, layout, replace(SITE, eval=eval_on_verl))
    terms = {t.name: t.bytes for t in native.gpu}
    assert terms["eval_weights"] == 2 * P_8B
    assert native.phase_bytes()["training"] == on_verl.phase_bytes()["training"]
    assert native.phase_bytes()["final_eval"] == terms["eval_weights"] + terms["eval_kv_cache"]
    assert on_verl.phase_bytes()["final_eval"] == pytest.approx(0.6 * 40 * GIB)


def megatron(tp: int, pp: int, n: int = 64, **flags) -> tuple[dict[str, float], Footprint]:
    """verl's megatron actor at tp x pp on n GPUs, flags the verl offload settings."""
    layout = Layout(n, tp, 1, flags.get("optimizer_offload", False), False, flags.get("param_offload", False))
    settings = dict(backend="megatron", megatron_tp=tp, megatron_pp=pp, **flags)
    return grpo_terms(replace(layout, pp=pp, megatron=True), **verl(**settings))


@pytest.mark.parametrize("before, after", [((2, 1), (4, 1)), ((2, 2), (2, 4)), ((4, 1), (4, 2))])
def test_megatron_parameters_gradients_and_reference_fall_by_exactly_the_growth_of_tp_pp(before, after):
    small, _ = megatron(*before)
    large, _ = megatron(*after)
    assert large["actor_weights"] == small["actor_weights"] / 2 == P_8B * 2 / (2 * before[0] * before[1])
    assert large["actor_gradients"] == small["actor_gradients"] / 2 == 2 * large["actor_weights"]  # fp32
    assert large["reference_weights"] == large["actor_weights"]  # bf16, the actor's layout
    # master + m + v over tp·pp·dp = N: every layout of the same N holds the same optimizer share
    assert large["actor_optimizer"] == small["actor_optimizer"] == pytest.approx(12 * P_8B / 64)


def test_megatron_optimizer_states_shard_over_data_parallel_groups_only():
    at_64, _ = megatron(4, 2, n=64)
    at_128, _ = megatron(4, 2, n=128)
    assert at_128["actor_optimizer"] == pytest.approx(at_64["actor_optimizer"] / 2)
    assert at_128["actor_weights"] == at_64["actor_weights"]
    assert at_128["actor_gradients"] == at_64["actor_gradients"]  # not sharded by the optimizer


@pytest.mark.parametrize("flag", ["param_offload", "optimizer_offload"])
def test_megatron_offload_moves_exactly_what_verls_offload_functions_move(flag):
    kept, fp_kept = megatron(4, 2)
    _, fp_moved = megatron(4, 2, **{flag: True})
    # param_offload: parameters copied to host, the gradient buffer freed; the reference's too
    on_gpu = {
        "param_offload": ["actor_weights", "actor_gradients", "reference_weights"],
        "optimizer_offload": ["actor_optimizer"],
    }[flag]
    to_host = {
        "param_offload": ["actor_weights", "reference_weights"],
        "optimizer_offload": ["actor_optimizer"],
    }
    generation = lambda fp: fp.phase_bytes()["generation"]  # noqa: E731
    assert generation(fp_kept) - generation(fp_moved) == pytest.approx(sum(kept[n] for n in on_gpu))
    ranks = 4
    moved_host = fp_moved.host_bytes() - fp_kept.host_bytes()
    assert moved_host == pytest.approx(ranks * sum(kept[n] for n in to_host[flag]))
    # the actor's states are loaded to train; a reference not offloaded stays on the GPU meanwhile
    training = fp_kept.phase_bytes()["training"] - fp_moved.phase_bytes()["training"]
    assert training == (kept["reference_weights"] if flag == "param_offload" else 0)


def test_megatron_ranks_read_their_pipeline_stage_not_a_whole_fp32_model():
    _, meg = megatron(4, 4)
    fsdp = grpo_terms(Layout(gpus=64, tp=2, zero=3, recompute=True), **verl())[1]
    loading = lambda fp: {t.name: t.bytes for t in fp.host}["loading"]  # noqa: E731
    assert loading(meg) == 4 * (P_8B / 4) * SHAPE_8B.file_bytes  # 4 ranks a node, P/pp each
    assert loading(fsdp) == 4 * P_8B > loading(meg)


def test_a_megatron_layout_that_does_not_divide_the_gpus_or_layers_is_refused():
    assert not megatron(4, 2, n=64)[1].refusals
    assert any("tp·pp (8) does not divide 4 GPUs" in r for r in megatron(4, 2, n=4)[1].refusals)
    assert any("pp 3 does not divide the 32 layers" in r for r in megatron(4, 3, n=96)[1].refusals)
