"""Synthesis and held-out eval on verl's generation server (engine 'verl', eval.engine 'verl'):
our settings compose into the installed verl's config with the values main_generation_server reads;
what verl or the cluster refuses is exit 2 naming our field before anything is queued; its answer
file, in the format main_generation_server writes, becomes the same dataset, final/ and eval.json
as the native engines'; the 70B config submits, and the native engines are refused where a GPU
cannot hold the model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from core.config import ConfigError, load_config
from core.rundir import RunDir
from launch import verl_job
from launch.slurm_launch import run_stage_in_allocation
from launch.verl_job import (
    MEGATRON_BACKEND_PACKAGES,
    _installed,
    check_verl_job,
    generation_of,
    generation_paths,
    run_then_eval_on_verl,
    run_verl_stage,
    run_verl_synth,
    verl_launcher,
)
from pipeline.cli import main
from stages.data.examples import Example, read_examples
from stages.engines.verl_generation import generation_overrides, read_responses
from stages.engines.verl_io import verl_rows
from stages.engines.verl_trainer import DATA_SOURCE, compose_verl_config
from stages.eval import accuracy_of, tally
from stages.synth import accepted_answers, write_outputs
from tests.conftest import REPO

CONFIG_70B = REPO / "configs" / "llama-3.3-70b-perlmutter.yaml"
SHAPE_70B = f"model.path={REPO / 'configs' / 'models' / 'llama-3.3-70b'}"


def config_70b(*overrides: str):
    return load_config(CONFIG_70B, [SHAPE_70B, *overrides], data_files=False)


def composed(cfg, sid: str, run: RunDir, prompts: int = 500):
    """verl's generation config for `prompts` prompts on a job of 32 nodes of 4 GPUs."""
    field, rollout, sampling = generation_of(cfg, sid)
    paths = generation_paths(run, sid)
    overrides = generation_overrides(
        Path("/models/final"), rollout, sampling, paths["prompts"], paths["output"], cfg.seed, 32, 4,
        prompts * sampling.n,
    )  # fmt: skip
    return compose_verl_config(overrides)


def test_held_out_eval_starts_the_replicas_its_prompts_need_not_one_on_every_gpu(tmp_path):
    """500 held-out prompts after a stage of 32 nodes: 2 replicas of 4 GPUs hold them all (256 in
    flight each), not 32 replicas of the 70B each loading 141 GB. Synthesis's 2000 prompts x 4
    answers keep 32 replicas busy: it takes every GPU."""
    cfg = config_70b("stage3_synth.samples_per_prompt=4")
    trainer = composed(cfg, "stage1_sft", RunDir(tmp_path), prompts=500).trainer
    assert (trainer.nnodes, trainer.n_gpus_per_node) == (2, 4)
    trainer = composed(cfg, "stage3_synth", RunDir(tmp_path), prompts=2000).trainer
    assert (trainer.nnodes, trainer.n_gpus_per_node) == (32, 4)
    # fewer GPUs than a node: part of one
    one = config_70b("eval.verl.rollout_tp=1", "eval.verl.requests_in_flight=200")
    trainer = composed(one, "stage1_sft", RunDir(tmp_path), prompts=500).trainer
    assert (trainer.nnodes, trainer.n_gpus_per_node) == (1, 3)


def test_synthesis_settings_reach_verls_rollout_config(tmp_path):
    cfg = config_70b("stage3_synth.samples_per_prompt=6", "stage3_synth.top_p=0.9")
    rollout = composed(cfg, "stage3_synth", RunDir(tmp_path)).actor_rollout_ref.rollout
    s = cfg.stage3_synth
    assert (rollout.n, rollout.temperature, rollout.top_p) == (6, s.temperature, 0.9)
    assert rollout.response_length == s.max_new_tokens and rollout.prompt_length == s.verl.max_prompt_length
    # what vLLM must hold, not the model's 131072 positions (whose KV cache it would reserve room for)
    assert rollout.max_model_len == s.verl.max_prompt_length + s.max_new_tokens
    assert rollout.tensor_model_parallel_size == s.verl.rollout_tp
    assert rollout.gpu_memory_utilization == s.verl.gpu_memory_utilization
    # a standalone replica has no actor to sync from: verl's default 'dummy' would answer at random
    assert rollout.load_format == "auto" and rollout.seed == cfg.seed


def test_held_out_eval_on_verl_is_greedy_with_the_eval_settings(tmp_path):
    cfg = config_70b("eval.max_new_tokens=333")
    config = composed(cfg, "stage1_sft", RunDir(tmp_path))
    rollout = config.actor_rollout_ref.rollout
    assert (rollout.n, rollout.temperature, rollout.response_length) == (1, 0.0, 333)
    assert rollout.tensor_model_parallel_size == cfg.eval.verl.rollout_tp
    assert config.data.output_path.endswith("generation_answers.parquet")


def test_each_stage_of_the_70b_config_runs_where_its_engine_is():
    cfg = config_70b()
    launchers = {sid: verl_launcher(cfg, sid) for sid in cfg.stages()}
    assert launchers == {
        "stage1_sft": run_then_eval_on_verl,
        "stage2_grpo": run_verl_stage,
        "stage3_synth": run_verl_synth,
        "stage3_sft": run_then_eval_on_verl,
        "stage4_grpo": run_verl_stage,
    }
    native = config_70b("eval.engine=native", "stage3_synth.engine=native")
    assert verl_launcher(native, "stage1_sft") is run_stage_in_allocation
    assert verl_launcher(native, "stage3_synth") is run_stage_in_allocation


@pytest.mark.parametrize(
    "override, nodes, field",
    [
        ("stage3_synth.verl.rollout_tp=3", 32, "stage3_synth.verl.rollout_tp"),
        ("eval.verl.rollout_tp=6", 32, "eval.verl.rollout_tp"),
        ("eval.verl.rollout_tp=8", 3, "eval.verl.rollout_tp"),  # whole nodes, but 2 of 3
    ],
)
def test_a_rollout_that_does_not_tile_the_nodes_is_refused_naming_the_field(tmp_path, override, nodes, field):
    cfg = config_70b(override)
    sid = "stage3_synth" if override.startswith("stage3_synth") else "stage1_sft"
    with pytest.raises(ConfigError) as e:
        check_verl_job(cfg, RunDir(tmp_path), sid, nodes, 4)
    assert e.value.field == field


def test_a_rollout_spanning_whole_nodes_is_accepted(tmp_path):
    """verl's RolloutReplica takes a tensor-parallel size that is a multiple of a node's GPUs: two
    4-GPU nodes hold a 70B vLLM instance that one 40 GB node cannot."""
    # Ours; its layout is verl's abstract RolloutReplica's, as vLLM's replica class inherits it.
    from stages.engines.verl_hf_rollout import HFReplica

    for sid in ("stage3_synth", "stage1_sft"):
        section = "eval" if sid == "stage1_sft" else sid
        cfg, run = config_70b(f"{section}.verl.rollout_tp=8"), RunDir(tmp_path)
        check_verl_job(cfg, run, sid, 32, 4)  # raises no ConfigError
        # verl lays the accepted rollout out as one instance over two whole nodes
        replica = HFReplica(0, composed(cfg, sid, run).actor_rollout_ref.rollout, None, gpus_per_node=4)
        assert (replica.world_size, replica.gpus_per_replica_node, replica.nnodes) == (8, 4, 2)


def test_a_cluster_without_gpus_is_refused_for_verl_generation(tmp_path):
    with pytest.raises(ConfigError, match="needs GPUs"):
        check_verl_job(config_70b(), RunDir(tmp_path), "stage3_synth", 2, 0)


def submit_70b(tmp_path, *overrides):
    data = tmp_path / "data.jsonl"
    data.write_text(json.dumps({"question": "What is 1 plus 1?", "answer": "1 plus 1 is 2.\n#### 2"}) + "\n")
    files = [f"data.{name}_file={data}" for name in ("sft", "prompts", "eval")]
    argv = ["submit", str(CONFIG_70B), "--cluster", "perlmutter-80g", "--nodes", "32", "--dry-run"]
    return main([*argv, "--run-dir", str(tmp_path / "run"), SHAPE_70B, *files, *overrides])


ON_FSDP = [f"{sid}.verl.backend=fsdp" for sid in ("stage2_grpo", "stage4_grpo")]


def test_the_70b_config_submits_with_ray_in_every_job_that_runs_verl(tmp_path, capsys):
    assert submit_70b(tmp_path, *ON_FSDP) == 0, capsys.readouterr().err
    for sid in ("stage1_sft", "stage3_synth", "stage3_sft"):
        script = (tmp_path / "run" / sid / "logs" / f"{sid}.sbatch").read_text()
        assert "start --head" in script and "export HPCR1_LAUNCHER=srun" in script


@pytest.mark.parametrize(
    "override, field, holds",
    [
        ("eval.engine=native", "eval.engine", "131.4 GiB"),  # the bf16 SFT model, whole
        ("stage3_synth.engine=native", "stage3_synth", "131.4 GiB"),  # one bf16 copy a rank (dtype auto)
    ],
)
def test_native_generation_of_70b_is_refused_before_anything_is_written(
    tmp_path, capsys, override, field, holds
):
    rc = submit_70b(tmp_path, override, *ON_FSDP)
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err
    assert f"{field}: the native engine holds {holds} a GPU" in err and "=verl" in err
    assert not (tmp_path / "run").exists()


def test_grpo_on_verls_megatron_backend_warns_from_the_cpu_venv_naming_what_the_jobs_need(tmp_path, capsys):
    """verl 0.9.1's megatron engine imports Megatron-Bridge, Transformer Engine's torch extension and
    flash-attn in the jobs, which run with the Python that submits them. This CPU .venv lacks them,
    and checks (dry-runs) the GPU config: it submits, with one warning line a GRPO stage."""
    if all(_installed(module) for module in MEGATRON_BACKEND_PACKAGES):
        pytest.skip("this Python has verl's megatron backend")
    rc = submit_70b(tmp_path)
    err = capsys.readouterr().err
    assert rc == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("hpcr1: warning:")]
    assert [w.split(":")[2].strip() for w in warnings] == [
        "stage2_grpo.verl.backend",
        "stage4_grpo.verl.backend",
    ]
    for line in warnings:
        assert "Megatron-Bridge" in line and "Transformer Engine" in line and "flash-attn" in line
        assert "make setup-gpu" in line
    assert (tmp_path / "run" / "stage2_grpo" / "logs" / "stage2_grpo.sbatch").exists()


def test_grpo_on_verls_megatron_backend_is_refused_by_a_gpu_venv_without_it(tmp_path, capsys, monkeypatch):
    """A venv with a CUDA torch is one the jobs run with: lacking the backend, it submits nothing."""
    if all(_installed(module) for module in MEGATRON_BACKEND_PACKAGES):
        pytest.skip("this Python has verl's megatron backend")
    monkeypatch.setattr(verl_job, "_cuda_torch", lambda: True)
    rc = submit_70b(tmp_path)
    err = capsys.readouterr().err
    assert rc == 2 and "stage2_grpo.verl.backend: 'megatron' needs" in err and "Traceback" not in err
    assert "make setup-gpu" in err
    assert not (tmp_path / "run").exists()


def test_hpcr1_run_refuses_eval_on_verl_naming_the_field(tmp_path, capsys):
    rc = main(
        [
            "run",
            str(REPO / "configs" / "tiny-cpu.yaml"),
            "--run-dir",
            str(tmp_path / "run"),
            "eval.engine=verl",
        ]
    )
    err = capsys.readouterr().err
    assert rc == 2 and "eval.engine" in err and "hpcr1 submit" in err
    assert not (tmp_path / "run").exists()


def write_like_main_generation_server(rows: list[dict], responses: list[list[str]], path: Path) -> None:
    """What verl.trainer.main_generation_server does with its answers: a `responses` column of
    lists added to the prompt rows, written by pandas."""
    import pandas as pd

    dataset = pd.DataFrame(rows)
    dataset["responses"] = responses
    dataset.to_parquet(path)


EXAMPLES = [Example(f"p{i}", f"What is {i} plus {i}?", str(2 * i), "") for i in range(3)]
# well-formed and correct; well-formed and wrong; correct but not in the R1 format
RIGHT, WRONG, BARE = (
    "<think>sum</think><answer>{}</answer>",
    "<think>x</think><answer>999</answer>",
    "<answer>{}</answer>",
)


def test_verls_answer_file_reads_back_in_prompt_order_and_its_shape_is_checked(tmp_path):
    answers = [[RIGHT.format(2 * i), WRONG] for i in range(3)]
    out = tmp_path / "answers.parquet"
    write_like_main_generation_server(verl_rows(EXAMPLES, "generation", DATA_SOURCE), answers, out)
    assert read_responses(out, 3, 2) == answers
    with pytest.raises(RuntimeError, match="expected 3 rows of 3 answers"):
        read_responses(out, 3, 3)


def test_verls_answers_make_the_same_dataset_as_the_native_filter(tmp_path):
    """The 3 prompts answered twice each: correct and well-formed answers are kept (distinct, at most
    max_per_prompt); the dataset, final/ and eval.json are those of the native engine's writer."""
    cfg = load_config(REPO / "configs" / "tiny-cpu.yaml", ["stage3_synth.max_per_prompt=1"], data_files=False)
    run = RunDir(tmp_path / "run")
    model_dir = run.model_dir("stage2_grpo")
    model_dir.mkdir(parents=True)
    (model_dir / "model.safetensors").write_bytes(b"weights")
    answers = [[RIGHT.format(0), RIGHT.format(0)], [WRONG, BARE.format(2)], [RIGHT.format(4), WRONG]]
    out = tmp_path / "answers.parquet"
    write_like_main_generation_server(verl_rows(EXAMPLES, "generation", DATA_SOURCE), answers, out)
    accepted = accepted_answers(EXAMPLES, read_responses(out, 3, 2))
    assert [(c.prompt_index, c.sample_index) for c in accepted] == [(0, 0), (0, 1), (2, 0)]
    summary = write_outputs(cfg, run, "stage3_synth", EXAMPLES, accepted, 6, model_dir, {"replicas": 2})
    kept = read_examples(run.synthetic_data("stage3_synth"))
    assert [ex.id for ex in kept] == ["p0-s0", "p2-s0"]  # the duplicate of p0 is dropped by the cap
    assert (summary["accepted"], summary["kept"], summary["replicas"]) == (3, 2, 2)
    assert json.loads(run.eval_result("stage3_synth").read_text()) == {"accuracy": 0.5, "n": 6, "kept": 2}
    assert (run.final("stage3_synth") / "provenance.json").is_file()


def test_held_out_answers_from_verl_are_scored_as_the_native_eval_scores_them():
    responses = [RIGHT.format(0), WRONG, BARE.format(4)]
    assert tally(EXAMPLES, responses) == [2, 2, 3]  # correct, well-formed, scored
    assert accuracy_of(tally(EXAMPLES, responses)) == {"accuracy": 2 / 3, "format_rate": 2 / 3, "n": 3}


@pytest.fixture
def grpo_8b(tmp_path):
    """(our stage2_grpo, verl's composed config) of the 8B config on 4 nodes of 4 GPUs."""
    from stages.engines.verl_trainer import check_verl_stage

    cfg = load_config(
        REPO / "configs" / "llama-3.1-8b.yaml",
        [f"model.path={REPO / 'configs' / 'models' / 'llama-3.1-8b'}"],
        data_files=False,
    )
    return cfg.stage2_grpo, compose_verl_config(check_verl_stage(cfg, RunDir(tmp_path), "stage2_grpo", 4, 4))


def test_grpo_rollout_holds_prompt_and_response_not_the_models_positions(grpo_8b):
    """Unset, verl hands vLLM the model's max_position_embeddings (131072 for Llama 3.1 8B), and
    vLLM refuses to start unless a sequence that long fits its KV cache beside the weights."""
    ours, theirs = grpo_8b
    rollout = theirs.actor_rollout_ref.rollout
    assert rollout.max_model_len == ours.verl.max_prompt_length + ours.max_new_tokens < 131072


def test_verls_fsdp_actor_asks_only_for_attention_the_gpu_lock_installs(grpo_8b):
    """verl's default is flash_attention_2 with packed sequences (use_remove_padding); without
    flash-attn, transformers refuses to build the model on the first GPU. Should the lock gain
    flash-attn, this test says to revisit the choice."""
    lock = (REPO / "requirements-gpu.lock").read_text().lower()
    assert "\nflash-attn==" not in lock and "\nflash_attn==" not in lock
    model = grpo_8b[1].actor_rollout_ref.model
    assert model.override_config.attn_implementation == "sdpa" and model.use_remove_padding is False


class FakeReplica:
    """A verl replica whose server answers each request after `delay_s` (never, if None), counting
    how many it holds at once. Real replicas (Ray actors: tests/slurm/test_slurm_verl.py's held-out
    evals) cannot be made to hold requests a set time, or never answer."""

    def __init__(self, delay_s: float | None, address: str = "10.0.0.1:8000"):
        import concurrent.futures
        import threading
        import types

        self.server_address, self.held, self.most, self.seeds = address, 0, 0, []
        lock = threading.Lock()

        def remote(prompt_ids, sampling_params, request_id):
            future = concurrent.futures.Future()
            with lock:
                self.held += 1
                self.most = max(self.most, self.held)
            self.seeds.append(sampling_params["seed"])

            def answer():
                with lock:
                    self.held -= 1
                future.set_result(types.SimpleNamespace(token_ids=[len(prompt_ids)]))

            if delay_s is not None:
                threading.Timer(delay_s, answer).start()
            return types.SimpleNamespace(future=lambda: future)

        self.server_handle = types.SimpleNamespace(generate=types.SimpleNamespace(remote=remote))


def test_generation_holds_at_most_requests_in_flight_a_replica_and_seeds_each_sample(monkeypatch):
    import asyncio

    from stages.engines.verl_generate import generate_all

    replicas = [FakeReplica(0.01), FakeReplica(0.01, "10.0.0.2:8000")]
    prompts = [[1] * k for k in range(1, 11)]
    servers, addresses = [r.server_handle for r in replicas], [r.server_address for r in replicas]
    answers = asyncio.run(generate_all(servers, addresses, prompts, 3, {"temperature": 1.0}, 100, 2, 30))
    assert answers == [[[len(p)]] * 3 for p in prompts]  # in the prompts' order, n a prompt
    assert all(r.most == 2 for r in replicas)  # bounded, and used to the bound
    assert sorted(replicas[0].seeds + replicas[1].seeds) == list(range(100, 130))


def test_a_replica_that_does_not_answer_fails_generation_naming_it(monkeypatch):
    import asyncio

    import ray

    from stages.engines.verl_generate import generate_all

    cancelled = []
    monkeypatch.setattr(ray, "cancel", lambda ref: cancelled.append(ref))
    with pytest.raises(TimeoutError, match=r"10.0.0.9:8000 did not answer a request within 0.5 s"):
        silent = FakeReplica(None)
        asyncio.run(generate_all([silent.server_handle], ["10.0.0.9:8000"], [[1, 2]], 1, {}, 0, 4, 0.5))
    assert cancelled
