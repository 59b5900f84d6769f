"""`hpcr1 plan`'s search and `--write-overrides`: the written settings load through the config's own
override parser into a valid RunConfig that plans back to the same layout and verdict; the search's
pruning changes nothing against trying every candidate; the JSON keeps its shape."""

import json
from functools import partial

import pytest

from analysis import plan_search
from analysis.memory import Footprint, Layout, Site, Term
from analysis.model_shape import shape_from_hf_config
from analysis.plan import (
    CAVEAT,
    FITS,
    GIB,
    NO_FIT,
    RUNTIME_PER_RANK,
    Machine,
    Option,
    choose,
    evaluate,
    searched,
)
from core.cluster import load_profile
from core.config import RunConfig, load_config
from pipeline.cli import main
from tests.conftest import REPO

MODELS = REPO / "configs" / "models"
CONFIG_70B, CONFIG_8B = REPO / "configs/llama-3.3-70b-perlmutter.yaml", REPO / "configs/llama-3.1-8b.yaml"
SHIPPED = {
    "8b": (CONFIG_8B, "perlmutter", "llama-3.1-8b"),
    "70b": (CONFIG_70B, "perlmutter-80g", "llama-3.3-70b"),
}


def plan_argv(tmp_path, key: str, *extra) -> list[str]:
    config, cluster, model = SHIPPED[key]
    return [
        "plan",
        str(config),
        "--cluster",
        cluster,
        "--json",
        "--out",
        str(tmp_path / "plan.md"),
        f"model.path={MODELS / model}",
        *extra,
    ]


def planned(capsys, argv: list[str]) -> dict:
    assert main(argv) == 0
    return json.loads(capsys.readouterr().out)


def same_plan(option: dict) -> tuple:
    return option["layout"], option["verdict"], option["caveats"], option["settings"]


@pytest.mark.parametrize("key, nproc", [("8b", 16), ("8b", 8), ("70b", 128), ("70b", 64)])
def test_written_overrides_make_a_valid_config_that_plans_back_to_the_planned_layout(
    capsys, tmp_path, key, nproc
):
    written = tmp_path / "overrides.txt"
    argv = plan_argv(tmp_path, key, "--gpus", str(nproc), f"nproc={nproc}", "--write-overrides", str(written))
    before = planned(capsys, argv)
    lines = written.read_text().splitlines()
    assert lines == before["overrides"]["lines"] and lines[0] == f"nproc={nproc}"
    assert all("=" in line and " " not in line for line in lines)
    config, _, model = SHIPPED[key]
    cfg = load_config(config, [f"model.path={MODELS / model}", *lines], data_files=False)
    assert isinstance(cfg, RunConfig) and cfg.nproc == nproc
    after = planned(capsys, [*plan_argv(tmp_path, key, "--gpus", str(nproc)), *lines])
    for sid, stage in before["stages"].items():
        assert any(line.startswith(f"{sid}.") for line in lines), sid  # every stage fits here
        # as configured now, the stage is exactly what was planned, and the search agrees
        assert same_plan(after["stages"][sid]["at_nproc"]) == same_plan(stage["planned_at_nproc"]), sid
        assert same_plan(after["stages"][sid]["planned_at_nproc"]) == same_plan(stage["planned_at_nproc"])


P_8B = 8_030_261_248
USABLE_40G = 0.9 * 40 * GIB  # perlmutter's A100s, GPU_USABLE of them


def test_a_stage_whose_plan_no_config_field_can_set_is_left_as_configured_and_named(capsys, tmp_path):
    """On 4 GPUs the 8B SFT fits only with optimizer offload and recomputation, which the SFT engine
    does not do; the 8B GRPO does not fit at all (the optimizer step's 20·P/4, whatever is
    offloaded); synthesis fits, and only its settings are written."""
    written = tmp_path / "overrides.txt"
    argv = plan_argv(tmp_path, "8b", "--gpus", "4", "nproc=4", "--write-overrides", str(written))
    assert main(argv) == 0
    captured = capsys.readouterr()
    lines = written.read_text().splitlines()
    assert not any(line.startswith(("stage1_sft.", "stage2_grpo.")) for line in lines)
    assert "stage1_sft: its plan at nproc=4 needs optimizer offload and recompute, which" in captured.err
    assert "stage2_grpo: does not fit at nproc=4; left as configured" in captured.err
    grpo = json.loads(captured.out)["stages"]["stage2_grpo"]["planned_at_nproc"]
    assert grpo["verdict"] == NO_FIT
    assert 20 * P_8B / 4 > USABLE_40G
    assert grpo["phases"]["optimizer_step"] == pytest.approx(20 * P_8B / 4, rel=1e-12)
    assert "stage3_synth.verl.rollout_tp=1" in lines


def exhaustive(stage, shape, machine: Machine, site: Site, gpus: int):
    """The search's choice with every candidate judged: what pruning must not change."""
    judged = partial(evaluate, stage, shape, site, machine, gpus)
    groups = plan_search.groups(stage, shape, gpus, machine.gpus_per_node)
    return choose(judged(c) for g in groups for c in g.candidates)


@pytest.mark.parametrize(
    "key, sid, counts",
    [
        ("8b", "stage1_sft", [1, 4, 8]),
        ("8b", "stage2_grpo", [1, 4, 16, 256]),
        ("70b", "stage1_sft", [32, 128]),
        ("70b", "stage2_grpo", [8, 32, 128]),
    ],
)
def test_skipping_groups_whose_smallest_micro_batch_does_not_fit_changes_no_choice(key, sid, counts):
    config, cluster, model = SHIPPED[key]
    cfg = load_config(config, [f"model.path={MODELS / model}"], data_files=False)
    shape = shape_from_hf_config(MODELS / model / "config.json")
    machine = Machine.from_profile(load_profile(cluster))
    site = Site(machine.gpu_bytes, machine.gpus_per_node, RUNTIME_PER_RANK, 512, cfg.eval)
    stage = getattr(cfg, sid)
    for n in counts:
        judged = partial(evaluate, stage, shape, site, machine, n)
        fast = choose(searched(plan_search.groups(stage, shape, n, machine.gpus_per_node), judged))
        slow = exhaustive(stage, shape, machine, site, n)
        assert (fast.verdict, fast.settings, fast.layout) == (slow.verdict, slow.settings, slow.layout), n


def test_where_nothing_fits_equal_peaks_go_to_the_layout_leaner_in_its_other_phases():
    """An optimizer step can be the peak whatever the micro-batch (verl's 8B GRPO on 1 GPU): then the
    smallest micro-batch is the leanest, the one `searched` keeps of a group where nothing fits,
    though the larger comes first. A refused option is never chosen over one that is not."""

    def option(micro: int, refused: bool = False) -> Option:
        terms = [Term("states", "", 10.0), Term("step", "", 10.0), Term("activations", "", 4.0 * micro)]
        phases = {"training": ("states", "activations"), "optimizer_step": ("states", "step")}
        fp = Footprint(terms, [], phases, ("refused",) * refused)
        return Option(Layout(1, 1, 3), fp, NO_FIT, settings={"micro": micro})

    assert option(2).footprint.gpu_bytes() == option(1).footprint.gpu_bytes() == 20.0
    assert choose([option(2), option(1)]).settings == {"micro": 1}
    assert choose([option(1, refused=True), option(2)]).settings == {"micro": 2}


def test_json_gives_per_count_verdict_caveats_and_layout_and_both_minimums(capsys, tmp_path):
    plan = planned(capsys, plan_argv(tmp_path, "8b", "--gpus", "1,2,4,8,16"))
    for sid, stage in plan["stages"].items():
        counts = ["1", "2", "4", "8", "16"]
        assert list(stage["verdicts"]) == list(stage["caveats"]) == list(stage["layouts"]) == counts, sid
        for n in counts:
            verdict, caveats = stage["verdicts"][n], stage["caveats"][n]
            assert verdict in (FITS, CAVEAT, NO_FIT) and bool(caveats) == (verdict == CAVEAT), (sid, n)
        fit = [int(n) for n in counts if stage["verdicts"][n] == FITS]
        any_fit = [int(n) for n in counts if stage["verdicts"][n] != NO_FIT]
        assert stage["min_gpus"] == min(fit, default=None), sid
        assert stage["min_gpus_with_caveat"] == min(any_fit, default=None), sid
    # the 8B GRPO: no fit on 1-4 GPUs, where the optimizer step's 20·P/N alone is above usable
    # memory (offload moves the states back for it), without caveat from 8
    grpo = plan["stages"]["stage2_grpo"]
    assert grpo["verdicts"] == {"1": NO_FIT, "2": NO_FIT, "4": NO_FIT, "8": FITS, "16": FITS}
    for option in grpo["options"]:
        step = 20 * P_8B / option["gpus"]
        assert option["phases"]["optimizer_step"] == pytest.approx(step, rel=1e-12)
        assert (step > USABLE_40G) == (option["verdict"] == NO_FIT), option["gpus"]


def test_what_our_commands_refuse_is_refused_once_and_never_planned(capsys, tmp_path):
    """A rollout_tp that neither fits in a node nor spans whole nodes (hpcr1 submit's check), a
    batch that does not split (submit's and the config's), each named once; the 8B GRPO's 128
    responses a mini-batch cannot feed 256 GPUs."""
    sft = load_config(CONFIG_8B, [f"model.path={MODELS / 'llama-3.1-8b'}"], data_files=False).stage1_sft
    layout = plan_search.engine_layout(sft, 256)
    assert plan_search.refusals(sft, layout, 4) == (
        "global_batch_size 64 is not a multiple of micro_batch_size·dp (1·128)",
    )
    plan = planned(capsys, plan_argv(tmp_path, "8b", "--gpus", "16,256", "stage2_grpo.verl.rollout_tp=6"))
    grpo = plan["stages"]["stage2_grpo"]
    assert grpo["at_nproc"]["refusals"] == [
        "rollout_tp 6 neither divides the 4 GPUs of a node nor spans whole nodes (hpcr1 submit refuses it)"
    ]
    assert grpo["verdicts"] == {"16": FITS, "256": NO_FIT}
    assert grpo["options"][0]["settings"]["verl.rollout_tp"] <= 4
    assert (
        "a mini-batch of 128 responses does not split over 256 data-parallel GPUs"
        in (grpo["options"][1]["refusals"])
    )
