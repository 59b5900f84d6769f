"""The verl engine for GRPO (`engine: verl`): the overrides of the 70B config compose into the
installed verl's own Hydra config and pass verl's validation; what verl rejects comes back as
exit 2 naming our field; `hpcr1 run` refuses the engine before writing anything; the rendered
Ray-on-Slurm script passes shellcheck; verl's reward function scores as ours does; verl's traces
become profile/ events."""

from __future__ import annotations

import gzip
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from core.cluster import COLLECTIVE_TIMEOUT_ENV
from core.config import ConfigError, load_config
from core.rundir import RunDir
from launch import verl_job
from launch.verl_job import _evaluate_on_verl as EVALUATE_ON_VERL
from launch.verl_job import _run_verl as run_verl_for_real
from launch.verl_job import check_verl_job
from pipeline.cli import main
from runtime.preemption import PREEMPTED_EXIT
from runtime.trace_parser import parse_trace
from stages.data.examples import read_examples
from stages.engines.verl_io import (
    VERL_PHASES,
    next_metrics_file,
    traces_to_events,
    verl_metric_rows,
)
from stages.engines.verl_trainer import (
    check_verl_stage,
    compose_verl_config,
    hydra_value,
    verl_paths,
    verl_process_env,
)
from stages.rewards.math_reward import score
from tests.conftest import REPO, free_port
from tests.support.system_packages import system_command

CONFIG_70B = REPO / "configs" / "llama-3.3-70b-perlmutter.yaml"
SHAPE_70B = "model.path=models/llama-3.3-70b"  # config.json only: enough for every check here
CONFIG_8B = REPO / "configs" / "llama-3.1-8b.yaml"  # its GRPO runs on verl; synthesis fits a 40 GB GPU
SHAPE_8B = "model.path=models/llama-3.1-8b"
TRACE = Path(__file__).parent / "fixtures" / "nccl_trace_h100_torch211.json"
# A small task in place of the 70B config's data files (which are placeholders).
SMALL_DATA = [
    "data.task=arithmetic",
    "data.arithmetic.sft_size=8",
    "data.arithmetic.prompts_size=8",
    "data.arithmetic.eval_size=4",
]


def config_70b(*overrides: str):
    return load_config(
        CONFIG_70B,
        [SHAPE_70B, "stage2_grpo.engine=verl", "stage4_grpo.engine=verl", *overrides],
        data_files=False,
    )


@pytest.fixture(scope="module")
def composed_70b(tmp_path_factory):
    """{stage: (our stage config, verl's composed config)} for the 70B config on 32 Perlmutter nodes."""
    cfg = config_70b()
    run = RunDir(tmp_path_factory.mktemp("run"))
    return (
        run,
        cfg,
        {
            sid: compose_verl_config(check_verl_stage(cfg, run, sid, 32, 4))
            for sid in ("stage2_grpo", "stage4_grpo")
        },
    )


@pytest.mark.parametrize("sid", ["stage2_grpo", "stage4_grpo"])
def test_70b_overrides_compose_and_pass_verls_validation_with_our_values(composed_70b, sid):
    run, cfg, configs = composed_70b
    ours, theirs = getattr(cfg, sid), configs[sid]
    arr = theirs.actor_rollout_ref
    assert theirs.algorithm.adv_estimator == "grpo"
    assert arr.rollout.n == ours.group_size == 8
    assert theirs.data.train_batch_size == ours.prompts_per_step == 128
    assert arr.actor.ppo_mini_batch_size == ours.prompts_per_step // ours.mini_batches
    assert arr.actor.use_kl_loss is True and arr.actor.kl_loss_coef == ours.kl_coef == 0.001
    assert arr.actor.kl_loss_type == ours.kl_type and arr.actor.optim.lr == ours.lr
    assert arr.actor.clip_ratio_low == arr.actor.clip_ratio_high == ours.clip_ratio
    assert (
        theirs.data.max_response_length == ours.max_new_tokens and arr.rollout.temperature == ours.temperature
    )
    assert theirs.trainer.resume_mode == "auto" and theirs.trainer.default_local_dir == str(
        run.ckpt(sid).resolve()
    )
    assert theirs.trainer.nnodes * theirs.trainer.n_gpus_per_node == cfg.nproc == 128
    assert theirs.trainer.balance_batch is ours.balance_batch
    assert (
        theirs.trainer.total_training_steps == ours.steps
        and theirs.trainer.save_freq == ours.checkpoint_every
    )
    assert arr.model.path == str(run.final(ours.init_from).resolve())
    assert arr.rollout.name == "vllm" and arr.actor.strategy == ours.verl.backend == "megatron"
    mcore = arr.actor.megatron
    assert (mcore.tensor_model_parallel_size, mcore.pipeline_model_parallel_size) == (
        ours.verl.megatron_tp,
        ours.verl.megatron_pp,
    )
    assert (mcore.param_offload, mcore.optimizer_offload) == (
        ours.verl.param_offload,
        ours.verl.optimizer_offload,
    )
    assert arr.ref.megatron.param_offload == ours.verl.param_offload  # the reference follows the actor
    assert theirs.global_profiler.tool == "torch"
    assert Path(theirs.global_profiler.save_path).parent == run.stage(sid).resolve()
    assert Path(theirs.reward.custom_reward_function.path).is_file()
    assert theirs.reward.custom_reward_function.reward_kwargs.format_weight == ours.format_reward


@pytest.mark.parametrize("source, bypass", [("actor", False), ("rollout", True)])
def test_old_log_probs_from_the_rollout_is_verls_bypass_mode_with_rollout_log_probs(tmp_path, source, bypass):
    cfg = config_70b(f"stage2_grpo.old_log_probs={source}")
    composed = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4))
    assert composed.algorithm.rollout_correction.bypass_mode is bypass
    assert (
        composed.algorithm.rollout_correction.loss_type == "ppo_clip"
    )  # our clipped loss, ratio to the rollout's
    assert composed.actor_rollout_ref.rollout.calculate_log_probs is True


# the 70B's megatron layout (tp x pp = 32) on the trainers left; verl's FSDP on one node
@pytest.mark.parametrize(
    "nodes, rollout_ranks, backend, trainers, rollout",
    [((32, 4), 96, "megatron", (8, 4), (24, 4)), ((1, 4), 2, "fsdp", (1, 2), (1, 2))],
)
def test_rollout_ranks_on_verl_is_its_separate_async_trainer_on_a_pool_of_its_own(
    tmp_path, nodes, rollout_ranks, backend, trainers, rollout
):
    split = (f"stage2_grpo.rollout_ranks={rollout_ranks}", "stage2_grpo.max_staleness=2")
    cfg = config_70b(*split, f"stage2_grpo.verl.backend={backend}", "stage2_grpo.verl.rollout_tp=1")
    composed = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", *nodes))
    arr, v1, ours = composed.actor_rollout_ref, composed.trainer.v1, cfg.stage2_grpo
    assert v1.trainer_mode == "separate_async" and arr.hybrid_engine is False
    assert (composed.trainer.nnodes, composed.trainer.n_gpus_per_node) == trainers
    assert (arr.rollout.nnodes, arr.rollout.n_gpus_per_node) == rollout
    assert arr.rollout.checkpoint_engine.backend == "gloo"  # verl's own asserts refuse 'naive'
    # verl's assertion: a step's batch is parameter_sync_step mini-batches
    assert (
        composed.data.train_batch_size
        == v1.separate_async.parameter_sync_step * arr.actor.ppo_mini_batch_size
    )
    assert v1.separate_async.num_warmup_batches == v1.sampler.max_off_policy_threshold == 2
    correction = composed.algorithm.rollout_correction
    assert (correction.rollout_is, correction.rollout_is_threshold) == ("token", ours.importance_cap)
    assert arr.rollout.calculate_log_probs is True
    colocated = compose_verl_config(check_verl_stage(config_70b(), RunDir(tmp_path), "stage2_grpo", 32, 4))
    assert colocated.trainer.v1.trainer_mode == "sync" and colocated.actor_rollout_ref.hybrid_engine is True
    assert colocated.actor_rollout_ref.rollout.checkpoint_engine.backend == "naive"


@pytest.mark.parametrize(
    "overrides, nodes, field, words",
    [
        (["stage2_grpo.rollout_ranks=2"], (32, 4), "stage2_grpo.rollout_ranks", "not whole nodes of 4 GPUs"),
        (["stage2_grpo.rollout_ranks=4"], (1, 4), "stage2_grpo.rollout_ranks", "leaves none to train on"),
    ],
)
def test_a_rollout_pool_verl_cannot_place_names_rollout_ranks(tmp_path, overrides, nodes, field, words):
    with pytest.raises(ConfigError) as e:
        check_verl_stage(
            config_70b(*overrides, "stage2_grpo.verl.rollout_tp=1"), RunDir(tmp_path), "stage2_grpo", *nodes
        )
    assert e.value.field == field and words in str(e.value), str(e.value)


def test_a_synchronous_split_on_verl_is_refused_naming_max_staleness():
    with pytest.raises(ConfigError) as e:
        config_70b("stage2_grpo.rollout_ranks=4", "stage2_grpo.max_staleness=0")
    assert e.value.field == "stage2_grpo.max_staleness"


def test_megatron_backend_selects_verls_megatron_actor_with_our_layout(tmp_path):
    cfg = config_70b("stage2_grpo.verl.backend=megatron", "stage2_grpo.verl.megatron_tp=4")
    composed = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4))
    actor, ref = composed.actor_rollout_ref.actor, composed.actor_rollout_ref.ref
    assert actor.strategy == "megatron" and actor.megatron.tensor_model_parallel_size == 4
    assert ref.megatron.tensor_model_parallel_size == 4  # the reference follows the actor


def test_a_token_budget_is_verls_dynamic_batch_size_for_the_update_and_both_log_prob_passes(tmp_path):
    cfg = config_70b("stage2_grpo.verl.backend=fsdp", "stage2_grpo.verl.max_tokens_per_gpu=24000")
    composed = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4))
    arr = composed.actor_rollout_ref
    assert arr.actor.use_dynamic_bsz and arr.actor.ppo_max_token_len_per_gpu == 24000
    assert arr.ref.log_prob_use_dynamic_bsz and arr.ref.log_prob_max_token_len_per_gpu == 24000
    assert arr.rollout.log_prob_use_dynamic_bsz and arr.rollout.log_prob_max_token_len_per_gpu == 24000
    assert not arr.model.use_remove_padding and arr.model.override_config.attn_implementation == "sdpa"


def test_a_token_budget_shorter_than_one_sequence_names_the_field():
    """verl asserts max_token_len >= the longest sequence (rearrange_micro_batches) mid-step."""
    with pytest.raises(ConfigError) as e:  # the 70B config: 512 prompt + 384 response tokens
        config_70b("stage2_grpo.verl.max_tokens_per_gpu=895")
    assert e.value.field == "stage2_grpo.verl.max_tokens_per_gpu" and "896" in str(e.value)
    assert config_70b("stage2_grpo.verl.max_tokens_per_gpu=896").stage2_grpo.verl.max_tokens_per_gpu == 896


def test_packing_without_flash_attn_warns_here_and_is_refused_in_a_gpu_venv(tmp_path, monkeypatch, capsys):
    """verl would die at model load without flash-attn. This CPU .venv (no CUDA torch) has none and
    only checks or dry-runs a GPU config: a warning naming the field. A venv with a CUDA torch runs
    the jobs: there it is refused."""
    if verl_job._installed("flash_attn"):
        pytest.skip("this Python has flash-attn")
    cfg = config_70b("stage2_grpo.verl.backend=fsdp", "stage2_grpo.verl.remove_padding=true")
    overrides = check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    arr = compose_verl_config(overrides).actor_rollout_ref
    assert (
        arr.model.use_remove_padding and arr.model.override_config.attn_implementation == "flash_attention_2"
    )
    check_verl_job(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    (line,) = capsys.readouterr().err.splitlines()
    assert line.startswith("hpcr1: warning: stage2_grpo.verl.remove_padding: packing needs flash-attn")
    assert "make setup-gpu" in line

    monkeypatch.setattr(verl_job, "_cuda_torch", lambda: True)
    with pytest.raises(ConfigError) as e:
        check_verl_job(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    assert e.value.field == "stage2_grpo.verl.remove_padding" and "flash-attn" in str(e.value)
    assert "make setup-gpu" in str(e.value)


def test_a_batch_verl_rejects_is_exit_2_naming_our_field_and_writes_nothing(tmp_path, capsys):
    # On FSDP, 100 prompts x 8 responses do not split over 128 GPUs: verl's validate_config says so.
    # (The shipped config's megatron layout has 8 data-parallel groups, over which any batch of
    # 8 responses a prompt splits.)
    rc = main(
        [
            "submit",
            str(CONFIG_70B),
            "--cluster",
            "perlmutter",
            "--nodes",
            "32",
            "--dry-run",
            "--run-dir",
            str(tmp_path / "run"),
            SHAPE_70B,
            *SMALL_DATA,
            "stage2_grpo.engine=verl",
            "stage2_grpo.verl.backend=fsdp",
            "stage2_grpo.prompts_per_step=100",
        ]
    )
    err = capsys.readouterr().err
    assert (
        rc == 2
        and "stage2_grpo.prompts_per_step" in err
        and "verl rejects" in err
        and "real_train_batch_size" in err
    )
    assert not (tmp_path / "run").exists()


def test_a_mini_batch_that_does_not_split_over_the_gpus_names_mini_batches(tmp_path):
    # 128 / 2 prompts x 8 = 512 responses split over 128 GPUs, but 128 / 3 does not divide at all.
    cfg = config_70b("stage2_grpo.mini_batches=3")
    with pytest.raises(ConfigError) as e:
        check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    assert e.value.field == "stage2_grpo.mini_batches"


def test_micro_batches_that_do_not_divide_a_gpus_share_of_a_mini_batch_name_the_field(tmp_path):
    # 128 / 2 prompts x 8 = 512 responses a mini-batch, 4 a GPU of 128 under FSDP: micro-batches of 8 do not
    # divide them, which verl asserts only in its workers' first update (seen on its CPU platform).
    cfg = config_70b(
        "stage2_grpo.verl.backend=fsdp",
        "stage2_grpo.mini_batches=2",
        "stage2_grpo.verl.micro_batch_size_per_gpu=8",
    )
    with pytest.raises(ConfigError) as e:
        check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    assert e.value.field == "stage2_grpo.verl.micro_batch_size_per_gpu"


def test_a_key_verl_does_not_have_is_rejected_by_composition():
    with pytest.raises(Exception, match="no_such_key"):
        compose_verl_config(["actor_rollout_ref.actor.no_such_key=1"])


def test_hpcr1_run_refuses_the_verl_engine_before_writing_anything(tmp_path, capsys):
    rc = main(
        [
            "run",
            str(REPO / "configs" / "tiny-cpu.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "stage2_grpo.engine=verl",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "stage2_grpo.engine" in err and "hpcr1 submit" in err and "vLLM" in err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "path", ["/tmp/run dir/it's", "/tmp/back\\slash", "/tmp/end\\", "/tmp/q\\'x", "/tmp/a=b,c[d]"]
)
def test_paths_reach_verl_unchanged_through_hydras_grammar(path):
    composed = compose_verl_config([f"trainer.default_local_dir={hydra_value(path)}"])
    assert composed.trainer.default_local_dir == path


def test_dry_run_submit_renders_the_verl_script_and_it_passes_shellcheck(tmp_path, capsys):
    run = tmp_path / "run"
    rc = main(
        [
            "submit",
            str(CONFIG_8B),
            "--cluster",
            "perlmutter",
            "--nodes",
            "4",
            "--dry-run",
            "--run-dir",
            str(run),
            SHAPE_8B,
            *SMALL_DATA,
        ]
    )
    assert rc == 0, capsys.readouterr().err
    verl_script = (run / "stage2_grpo" / "logs" / "stage2_grpo.sbatch").read_text()
    native_script = (run / "stage3_sft" / "logs" / "stage3_sft.sbatch").read_text()
    assert (
        "start --head" in verl_script
        and "--port=6379" in verl_script
        and "--min-worker-port=10002" in verl_script
    )
    assert "-m launch.ray_cluster" in verl_script and "-m pipeline.cli stage" in verl_script
    assert "ray.scripts.scripts" not in native_script
    shellcheck = system_command("shellcheck")
    out = subprocess.run([shellcheck, "-s", "bash", "-"], input=verl_script, capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def test_verls_reward_function_scores_as_our_reward():
    from verl.utils.import_utils import load_extern_object

    compute_score = load_extern_object(str(REPO / "stages" / "engines" / "verl_reward.py"), "compute_score")
    cases = [
        ("<think>2+2=4</think><answer>4</answer>", "4"),
        ("<think>x</think><answer>5</answer>", "4"),
        ("the answer is 4", "4"),
        ("<answer>1,234</answer>", "1234"),
        ("<think>a</think> <answer>1/2</answer>", "0.5"),
    ]
    for response, truth in cases:
        ours = score(response, truth, format_weight=0.3)
        theirs = compute_score(
            data_source="hpcr1", solution_str=response, ground_truth=truth, format_weight=0.3
        )
        assert theirs == {
            "score": ours.reward,
            "acc": float(ours.correct),
            "format_ok": float(ours.format_ok),
        }


def test_verl_traces_become_profile_events_with_step_rank_and_phase(tmp_path):
    trace = json.loads(TRACE.read_text())
    spans = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    start, end = min(e["ts"] for e in spans), max(e["ts"] + e["dur"] for e in spans)
    # verl's DistProfiler wraps the actor's update in a range named after its role
    trace["traceEvents"].append(
        {
            "ph": "X",
            "cat": "user_annotation",
            "name": "actor_update",
            "ts": start,
            "dur": end - start,
            "pid": 0,
            "tid": 0,
            "args": {},
        }
    )
    traces = tmp_path / "verl_traces"
    traces.mkdir()
    with gzip.open(traces / "actor_actor_update_step3_rank0-of-1_pid42_20261123.json.gz", "wt") as f:
        json.dump(trace, f)
    n = traces_to_events(traces, tmp_path / "profile", "stage2_grpo")
    events = [
        json.loads(line) for line in (tmp_path / "profile" / "rank-00000.jsonl").read_text().splitlines()
    ]
    expected = parse_trace(TRACE, stage="stage2_grpo")
    assert n == len(events) == len(expected) == 5
    assert [(e["op"], e["bytes"], e["seq"]) for e in events] == [
        (e["op"], e["bytes"], e["seq"]) for e in expected
    ]
    assert all(
        e["step"] == 3 and e["phase"] == VERL_PHASES["actor_update"] == "policy_update" for e in events
    )


def log_attempt(folder: Path, rows: list[tuple[int, dict]]) -> Path:
    """One attempt's file as verl's file logger writes it, in the file verl_job gives that attempt."""
    path = next_metrics_file(folder)
    path.write_text("".join(json.dumps({"step": s, "data": d}) + "\n" for s, d in rows))
    return path


def test_a_resumed_attempt_adds_to_the_metrics_of_the_one_before_and_redone_steps_keep_the_last(tmp_path):
    first = log_attempt(tmp_path, [(1, {"actor/pg_loss": 1.0}), (2, {"actor/pg_loss": 2.0})])
    second = log_attempt(tmp_path, [(2, {"actor/pg_loss": 2.5}), (3, {"val-core/hpcr1/acc/mean@1": 0.5})])
    assert first != second and first.is_file()  # verl opens its file "wb": one file an attempt
    rows = verl_metric_rows(tmp_path)
    assert [(r["step"], r["data"]) for r in rows] == [
        (1, {"actor/pg_loss": 1.0}),
        (2, {"actor/pg_loss": 2.5}),
        (3, {"val-core/hpcr1/acc/mean@1": 0.5}),
    ]


def test_hpcr1_config_shows_the_engine_and_its_verl_section(capsys):
    assert main(["config", str(REPO / "configs" / "tiny-cpu.yaml"), "stage2_grpo.engine=verl"]) == 0
    out = capsys.readouterr().out
    assert "engine: verl" in out and "rollout_tp: auto" in out and "gpu_memory_utilization: 0.6" in out


def test_verls_own_dataset_reads_our_parquet_as_chat_prompts_with_their_answers(tmp_path):
    from verl.utils.dataset.rl_dataset import RLHFDataset

    from stages.data.arithmetic import generate_arithmetic
    from stages.data.tokenizer import build_char_tokenizer
    from stages.engines.verl_io import verl_rows, write_parquet

    examples = generate_arithmetic(0, 4, "prompts", 3, 4, 1.0)
    write_parquet(tmp_path / "train.parquet", verl_rows(examples, "train", "hpcr1"))
    data_config = compose_verl_config(["data.prompt_key=prompt", "data.dataloader_num_workers=0"]).data
    dataset = RLHFDataset(
        str(tmp_path / "train.parquet"), build_char_tokenizer(tmp_path / "tok"), data_config
    )
    assert len(dataset) == len(examples)
    for i, ex in enumerate(examples):
        row = dataset[i]
        assert row["raw_prompt"] == [{"role": "user", "content": ex.prompt}]
        assert row["reward_model"]["ground_truth"] == ex.answer and row["data_source"] == "hpcr1"


def test_verls_step_timers_become_our_phase_times(tmp_path):
    from analysis.events import load_phase_times
    from stages.engines.verl_io import write_metrics

    timers = {"timing_s/update_actor": 1.0, "timing_s/step": 4.0, "actor/pg_loss": 0.1}
    log_attempt(tmp_path / "verl_metrics", [(s, {"timing_s/gen": 2.0 * s, **timers}) for s in (1, 2)])
    write_metrics(verl_metric_rows(tmp_path / "verl_metrics"), tmp_path / "metrics.jsonl")
    assert load_phase_times(tmp_path) == {"rollout": 6.0, "policy_update": 2.0}
    # separate_async: the trainers wait for batches a pool of its own samples
    write_metrics(
        verl_metric_rows(tmp_path / "verl_metrics"), tmp_path / "metrics.jsonl", separate_rollout=True
    )
    assert load_phase_times(tmp_path) == {"rollout_wait": 6.0, "policy_update": 2.0}


def test_a_cluster_without_gpus_is_refused_for_verl(tmp_path):
    with pytest.raises(ConfigError, match="needs GPUs"):
        check_verl_stage(config_70b(), RunDir(tmp_path), "stage2_grpo", 64, 0)


def test_a_megatron_layout_that_does_not_divide_the_gpus_names_megatron_tp(tmp_path):
    cfg = config_70b("stage2_grpo.verl.backend=megatron", "stage2_grpo.verl.megatron_tp=3")
    with pytest.raises(ConfigError, match="verl rejects") as e:
        check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4)
    assert e.value.field == "stage2_grpo.verl.megatron_tp"


@pytest.fixture
def verl_stage_run(tmp_path, monkeypatch):
    """A prepared run with a verl GRPO stage from the base model; `_run_verl` and the hand-over
    stubbed: what the job would start is recorded (args, env). Running it takes a Ray cluster and
    verl's trainer: tests/slurm/test_slurm_verl.py (whole stages; logger and wandb reach the
    actors) does."""
    from launch import verl_job
    from pipeline.driver import check_run, write_run

    stage = ["init_from=base", "engine=verl", "verl.rollout_tp=1", "prompts_per_step=8", "max_new_tokens=48"]
    overrides = [*SMALL_DATA, *(f"stage2_grpo.{o}" for o in stage), "wandb.mode=offline"]
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", overrides)
    run = RunDir(tmp_path / "run")
    write_run(cfg, run, check_run(cfg, REPO / "configs"), REPO / "configs")
    started = []
    monkeypatch.setattr(
        verl_job, "_run_verl", lambda run, sid, args, env, fds: started.append((args, env)) or 0
    )
    monkeypatch.setattr(verl_job, "finish_verl_stage", lambda cfg, run, sid: None)
    monkeypatch.setattr(verl_job, "_evaluate_on_verl", lambda cfg, run, sid, nodes, fds: 0)
    monkeypatch.setenv("HPCR1_VERL_PLATFORM", "cpu")
    return cfg, run, started


def test_what_verls_actors_read_reaches_them_through_the_ray_jobs_runtime_env(verl_stage_run):
    from launch import verl_job

    cfg, run, started = verl_stage_run
    assert verl_job._train_on_verl(cfg, run, "stage2_grpo", (1, 2), ()) == 0
    args, env = started[0]
    # A Ray started apart gives its actors `ray start`'s environment: each variable must be in the
    # job's runtime environment, where verl's TaskRunner and workers get it.
    passed = {
        a.split("=", 1)[0].rsplit(".", 1)[1]: a.split("=", 1)[1]
        for a in args
        if ".runtime_env.env_vars." in a
    }
    assert set(passed) == set(env) >= {"VERL_FILE_LOGGER_PATH", "WANDB_MODE", "WANDB_DIR", "VERL_PLATFORM"}
    assert passed["WANDB_MODE"] == "'offline'" and env["WANDB_MODE"] == "offline"
    assert Path(env["VERL_FILE_LOGGER_PATH"]).name == "attempt-001.jsonl"
    config = compose_verl_config([a for a in args[2:]])
    assert (
        config.ray_kwargs.ray_init.runtime_env.env_vars.VERL_USE_EXTERNAL_MODULES
        == "stages.engines.verl_timeouts,stages.engines.verl_fixes,stages.engines.verl_cpu"
    )
    assert config.actor_rollout_ref.rollout.name == "hf" and not config.trainer.val_before_train


def test_an_attempt_resuming_at_the_last_step_hands_over_without_starting_verls_trainer(verl_stage_run):
    """An attempt that died between its last checkpoint and its eval: nothing is left to train."""
    from launch import verl_job

    cfg, run, started = verl_stage_run
    ckpt = run.ckpt("stage2_grpo")
    ckpt.mkdir(parents=True)
    (ckpt / "latest_checkpointed_iteration.txt").write_text(str(cfg.stage2_grpo.steps))
    assert verl_job._train_on_verl(cfg, run, "stage2_grpo", (1, 2), ()) == 0
    assert started == []


def test_a_grpo_stage_on_verl_is_scored_with_every_stages_eval_settings(verl_stage_run, monkeypatch):
    """verl validated with the GRPO stage's max_new_tokens and greedy only: accuracies not comparable
    with the other stages' (eval.max_new_tokens, mean@k), and no validation split. Now no validation
    runs in training, and final/ is scored after the hand-over by verl's replicas with the eval
    section's settings, held-out and validation examples in one pass."""
    from launch import verl_job
    from stages.data.examples import read_examples
    from stages.inputs import validation_examples

    cfg, run, started = verl_stage_run
    monkeypatch.setattr(verl_job, "_evaluate_on_verl", EVALUATE_ON_VERL)
    validation = {ex.prompt for ex in validation_examples(run, cfg.eval.validation_count)}
    held_out = len(read_examples(run.task_file("eval"))[: cfg.eval.num_examples])
    asked = []

    def replicas(cfg, run, sid, model_dir, examples, nodes, fds, sampled=None):
        """Every held-out answer right, half the sampled ones; every validation answer wrong."""
        asked.append((verl_job.generation_of(cfg, sid)[2], sampled, len(examples)))
        right = ["no" if ex.prompt in validation else f"<think>x</think> <answer>{ex.answer}</answer>"
                 for ex in examples]  # fmt: skip
        return {"responses": [[a] for a in right], "sampled_responses": [[a, "no"] * 2 for a in right]}

    monkeypatch.setattr(verl_job, "_generate_on_verl", replicas)
    assert verl_job._train_on_verl(cfg, run, "stage2_grpo", (1, 2), ()) == 0
    assert compose_verl_config(started[0][0][2:]).trainer.test_freq <= 0  # no validation in training
    greedy, sampled, prompts = asked[0]
    assert (
        greedy.temperature == 0 and greedy.max_new_tokens == sampled.max_new_tokens == cfg.eval.max_new_tokens
    )
    assert cfg.eval.max_new_tokens != cfg.stage2_grpo.max_new_tokens
    assert (sampled.n, sampled.temperature) == (cfg.eval.samples, cfg.eval.temperature) == (4, 0.7)
    result = json.loads(run.eval_result("stage2_grpo").read_text())
    assert (result["accuracy"], result["mean_at_k"], result["k"], result["n"]) == (1.0, 0.5, 4, held_out)
    assert validation and prompts == held_out + len(validation)
    scored = result["validation"]
    assert (scored["accuracy"], scored["mean_at_k"], scored["n"]) == (0.0, 0.0, len(validation)), scored
    assert scored["engine"] == "verl" and scored["max_new_tokens"] == cfg.eval.max_new_tokens


def test_max_pass_rate_on_verl_trains_on_the_prompts_the_starting_model_does_not_already_solve(
    verl_stage_run, monkeypatch
):
    """As the native engine selects them: the starting model answers each prompt group_size times
    (here by verl's replicas, at the stage's temperature); verl trains on the prompts solved at most
    max_pass_rate of the time. The counts are kept: the next attempt trains on the same prompts."""
    import pyarrow.parquet as pq

    from launch import verl_job

    cfg, run, started = verl_stage_run
    stage = cfg.stage2_grpo.model_copy(update={"max_pass_rate": 0.5, "prompts_per_step": 2, "group_size": 2})
    cfg = cfg.model_copy(update={"stage2_grpo": stage})
    asked = []

    def replicas(cfg, run, sid, model_dir, examples, nodes, fds, sampled=None, generation=None):
        asked.append(generation)  # the even prompts solved every time, the odd ones never
        return {
            "responses": [
                [f"<answer>{ex.answer if i % 2 == 0 else 'x'}</answer>"] * 2 for i, ex in enumerate(examples)
            ]
        }

    monkeypatch.setattr(verl_job, "_generate_on_verl", replicas)
    for _ in range(2):
        assert verl_job._train_on_verl(cfg, run, "stage2_grpo", (1, 2), ()) == 0
        trained = pq.read_table(verl_paths(run, "stage2_grpo")["train"]).to_pylist()
        prompts = read_examples(run.task_file("prompts"))
        assert [row["extra_info"]["id"] for row in trained] == [ex.id for ex in prompts[1::2]]
    assert len(asked) == 1 and len(started) == 2  # sampled once, trained twice
    field, rollout, sampling = asked[0]
    assert (field, sampling.n, sampling.temperature) == ("stage2_grpo", 2, stage.temperature)


def test_a_usr1_during_the_hand_over_stops_the_job_for_its_requeue(verl_stage_run, monkeypatch):
    """main_ppo has exited and the hand-over (merging 1 TB at 70B) is under way when Slurm's USR1
    comes: the job leaves for its requeue, instead of swallowing the signal and being killed at its
    time limit (TIMEOUT: not requeued, the stage left "running")."""
    from launch import verl_job

    cfg, run, _ = verl_stage_run
    quick_verl = lambda run, sid, args, env, fds: run_verl_for_real(run, sid, ["-c", ""], env, fds)  # noqa: E731
    monkeypatch.setattr(verl_job, "_run_verl", quick_verl)
    handed_over = []

    def hand_over(cfg, run, sid):
        os.kill(os.getpid(), signal.SIGUSR1)
        time.sleep(3)  # the merge, under way when the signal lands
        handed_over.append(sid)

    monkeypatch.setattr(verl_job, "finish_verl_stage", hand_over)
    for name, value in {"RAY_ADDRESS": "unused", "SLURM_NNODES": "1", "HPCR1_GPUS_PER_NODE": "2"}.items():
        monkeypatch.setenv(name, value)
    before = signal.getsignal(signal.SIGUSR1)
    assert verl_job.run_verl_stage(run.root, "stage2_grpo") == PREEMPTED_EXIT
    assert not handed_over
    assert signal.getsignal(signal.SIGUSR1) is before  # the job's handler does not outlive it


# verl's own start of a worker's process group (the v1 trainer's, verl/workers/engine_workers.py:89)
WORKER_GROUP_TIMEOUT = """
import torch, verl
from verl.utils.distributed import initialize_global_process_group_ray
initialize_global_process_group_ray(timeout_second=None, backend="gloo")
print(torch.distributed.group.WORLD._get_backend(torch.device("cpu")).options._timeout.total_seconds())
"""


@pytest.mark.parametrize("platform", ["gpu", "cpu"])
def test_verls_process_groups_wait_the_profiles_collective_timeout(platform, monkeypatch):
    """verl 0.9.1 gives its workers' group no timeout and reads its nccl_timeout nowhere: torch's
    10 minutes on NCCL, around 70B checkpoint saves. On GPUs as on the CPU platform, what verl's
    processes load makes the timeout the stage job exports (the profile's collective_timeout_s)."""
    monkeypatch.setenv(COLLECTIVE_TIMEOUT_ENV, "1234")
    env = {**os.environ, **verl_process_env(platform), "PYTHONPATH": str(REPO)}
    env.update(RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    out = subprocess.run(
        [sys.executable, "-c", WORKER_GROUP_TIMEOUT], env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert float(out.stdout.split()[-1]) == 1234


def test_gpus_run_verls_fsdp2_as_the_cpu_tests_do(tmp_path):
    """verl's default strategy is FSDP1, which cannot start on the CPU platform: the GPU jobs must run
    the FSDP2 the CPU tests execute, actor and reference alike."""
    cfg = load_config(CONFIG_8B, [SHAPE_8B], data_files=False)
    for sid in ("stage2_grpo", "stage4_grpo"):
        config = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), sid, 2, 4))
        assert config.actor_rollout_ref.actor.strategy == config.actor_rollout_ref.ref.strategy == "fsdp2"


# verl's wandb.init (verl/utils/tracking.py:85): a project and a name, no id
VERLS_WANDB_INIT = """
import sys, wandb
run = wandb.init(project="hpcr1", name=sys.argv[1])
print(run.id)
run.finish()
"""


def test_every_attempt_of_a_verl_stage_logs_to_one_wandb_run(verl_stage_run):
    """verl's wandb.init names no run id: without one from the job each requeued attempt would open a
    new wandb run. Two attempts' environments, given to wandb.init as verl calls it, open one run."""
    from launch import verl_job

    cfg, run, started = verl_stage_run
    for _ in range(2):
        assert verl_job._train_on_verl(cfg, run, "stage2_grpo", (1, 2), ()) == 0
    ids = []
    for _, env in started:
        out = subprocess.run(
            [sys.executable, "-c", VERLS_WANDB_INIT, "attempt"],
            env={**os.environ, **env},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0, out.stderr[-3000:]
        ids.append(out.stdout.split()[-1])
    assert ids[0] == ids[1] == env["WANDB_RUN_ID"], ids


def test_the_torch_profiler_records_one_node_whole_and_the_first_rank_of_each_other(composed_70b):
    """A trace with shapes is large and each is parsed in the hand-over: at 32 nodes of 4, the ranks
    of the first node and the first of every other (35 traces), not all 128."""
    _, _, composed = composed_70b
    expected = [0, 1, 2, 3, *range(4, 128, 4)]
    for config in composed.values():
        for role in (config.actor_rollout_ref.actor, config.actor_rollout_ref.ref):
            assert not role.profiler.all_ranks and list(role.profiler.ranks) == expected


def test_profiled_ranks_may_be_chosen_and_must_be_the_jobs(tmp_path):
    cfg = config_70b("stage2_grpo.verl.profile_ranks=[5,0]")
    config = compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 32, 4))
    assert list(config.actor_rollout_ref.actor.profiler.ranks) == [0, 5]
    with pytest.raises(ConfigError) as e:
        check_verl_stage(
            config_70b("stage2_grpo.verl.profile_ranks=[128]"), RunDir(tmp_path), "stage2_grpo", 32, 4
        )
    assert e.value.field == "stage2_grpo.verl.profile_ranks"


ENGINE_SWITCHES = [
    "stage2_grpo.engine=verl",
    "stage4_grpo.engine=verl",
    "stage3_synth.engine=verl",
    "eval.engine=verl",
]


def test_the_embedded_default_takes_every_verl_engine_with_its_switches_alone(tmp_path, capsys):
    """rollout_tp was 4 unless told: on the local profile's 2 ranks the first of a wall of refusals.
    'auto' layouts are chosen for the job's GPUs at submission, said, and written into the run."""
    run = tmp_path / "run"
    argv = ["submit", str(REPO / "configs" / "tiny-cpu.yaml"), "--cluster", "local", "--dry-run"]
    assert main([*argv, "--run-dir", str(run), *ENGINE_SWITCHES]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out
    for section in ("stage2_grpo", "stage4_grpo", "stage3_synth", "eval"):
        assert f"layout: {section}.verl.rollout_tp=auto -> 1:" in out, out
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    assert resolved["stage2_grpo"]["verl"]["rollout_tp"] == resolved["eval"]["verl"]["rollout_tp"] == 1


def test_an_auto_layout_on_gpus_is_what_hpcr1_plan_writes_for_the_jobs_gpus(tmp_path):
    from analysis.auto_layout import resolve_auto_layouts
    from analysis.model_shape import model_shape
    from core.cluster import load_profile

    auto = [
        "stage2_grpo.verl.rollout_tp=auto",
        "stage2_grpo.verl.megatron_tp=auto",
        "eval.verl.rollout_tp=auto",
    ]
    cfg = config_70b(*auto)
    resolved, lines = resolve_auto_layouts(
        cfg, model_shape(cfg, CONFIG_70B.parent), load_profile("perlmutter"), 128
    )
    written = tmp_path / "plan.txt"
    argv = [
        "plan",
        str(CONFIG_70B),
        "--cluster",
        "perlmutter",
        "--gpus",
        "128",
        "--out",
        str(tmp_path / "p.md"),
    ]
    assert main([*argv, "--write-overrides", str(written), SHAPE_70B, *auto]) == 0
    plan_lines = written.read_text().split()
    for key in ("stage2_grpo.verl.rollout_tp", "stage2_grpo.verl.megatron_tp", "eval.verl.rollout_tp"):
        sid, _, name = key.split(".")
        section = getattr(resolved, sid).verl
        assert f"{key}={getattr(section, name)}" in plan_lines, (key, plan_lines)
        assert any(line.startswith(f"{key}=auto -> ") for line in lines)


def test_verls_engines_import_on_the_cpu_platform_without_megatron_bridge():
    """The CPU .venv has megatron-core but no Megatron-Bridge: verl's engine registry (which every
    trainer imports, the FSDP one too) must still import with the platform's megatron patches armed."""
    env = {**os.environ, **verl_process_env("cpu"), "PYTHONPATH": str(REPO)}
    code = (
        "import verl, verl.workers.engine as e; print(e.MegatronEngine is not None, e.FSDPEngine is not None)"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split()[-2:] == ["True", "True"]
