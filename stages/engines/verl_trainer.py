"""A GRPO stage handed to verl (`engine: verl`): our config as the Hydra overrides of
`verl.trainer.main_ppo`, checked by composing verl's own config and running verl's validation.

Every key below is one the installed verl's `ppo_trainer` config has (Hydra rejects any other);
tests/unit/test_verl_engine.py composes the 70B config to prove it. What runs the trainer on a
cluster (Ray, vLLM) lives in launch/verl_job.py and slurm/templates/verl_stage.sbatch.
"""

from __future__ import annotations

import contextlib
import io
import os
import re
from pathlib import Path

from core.cluster import COLLECTIVE_TIMEOUT_ENV, rollout_pool_problem, rollout_span_problem
from core.config import ConfigError, GRPOStage, RunConfig, SynthStage, engine_of
from core.rundir import RunDir
from stages.engines.verl_platform_names import CPU_PLATFORM, CPU_ROLLOUT

DATA_SOURCE = "hpcr1"  # the parquet rows' data_source: names our reward in verl's metrics
REWARD_MODULE = Path(__file__).with_name("verl_reward.py")


def verl_paths(run: RunDir, sid: str) -> dict[str, Path]:
    """Where a verl stage keeps verl's own files inside the stage directory."""
    stage = run.stage(sid).resolve()
    return {
        "train": stage / "verl_data" / "train.parquet",
        "val": stage / "verl_data" / "val.parquet",
        "ckpt": run.ckpt(sid).resolve(),
        "traces": stage / "verl_traces",
        "metrics": stage / "verl_metrics",  # one file an attempt (verl_io.next_metrics_file)
    }


def verl_overrides(cfg: RunConfig, run: RunDir, sid: str, nnodes: int, gpus_per_node: int) -> list[str]:
    """The `main_ppo` command line for stage `sid` on `nnodes` x `gpus_per_node` GPUs."""
    s: GRPOStage = getattr(cfg, sid)
    v = s.verl
    (nnodes, gpus_per_node), rollout_pool = pools(s, nnodes, gpus_per_node)
    paths = verl_paths(run, sid)
    model = run.model_dir(s.init_from).resolve()
    overrides = {
        "algorithm.adv_estimator": "grpo",
        "algorithm.use_kl_in_reward": False,  # KL is a loss term, as in the native engine
        "critic.enable": False,
        "data.train_files": paths["train"],
        "data.val_files": paths["val"],
        "data.prompt_key": "prompt",
        "data.reward_fn_key": "data_source",
        "data.train_batch_size": s.prompts_per_step,
        "data.max_prompt_length": v.max_prompt_length,
        "data.max_response_length": s.max_new_tokens,
        "data.truncation": "error",
        "data.seed": cfg.seed,
        "actor_rollout_ref.model.path": model,
        "actor_rollout_ref.actor.ppo_mini_batch_size": s.prompts_per_step // s.mini_batches,
        "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu": v.micro_batch_size_per_gpu,
        **token_budget_overrides(v),
        "actor_rollout_ref.actor.ppo_epochs": s.ppo_epochs,
        # old_log_probs 'rollout': verl's bypass mode reads the rollout's log-probs, which it must then return
        "algorithm.rollout_correction.bypass_mode": s.old_log_probs == "rollout",
        **({"actor_rollout_ref.rollout.calculate_log_probs": True} if s.old_log_probs == "rollout" else {}),
        "actor_rollout_ref.actor.clip_ratio": s.clip_ratio,
        "actor_rollout_ref.actor.clip_ratio_low": s.clip_ratio,
        "actor_rollout_ref.actor.clip_ratio_high": s.clip_ratio,
        "actor_rollout_ref.actor.loss_agg_mode": "token-mean",
        "actor_rollout_ref.actor.use_kl_loss": s.kl_coef > 0,
        "actor_rollout_ref.actor.kl_loss_coef": s.kl_coef,
        "actor_rollout_ref.actor.kl_loss_type": s.kl_type,
        "actor_rollout_ref.actor.entropy_coeff": 0,
        "actor_rollout_ref.actor.data_loader_seed": cfg.seed,
        "actor_rollout_ref.actor.optim.lr": s.lr,
        "actor_rollout_ref.actor.optim.lr_warmup_steps": s.warmup_steps,
        "actor_rollout_ref.actor.optim.weight_decay": 0.0,
        "actor_rollout_ref.actor.optim.clip_grad": s.grad_clip,
        "actor_rollout_ref.rollout.name": v.rollout,
        "actor_rollout_ref.rollout.n": s.group_size,
        "actor_rollout_ref.rollout.temperature": s.temperature,
        "actor_rollout_ref.rollout.top_p": s.top_p,
        "actor_rollout_ref.rollout.seed": cfg.seed,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": v.rollout_tp,
        "actor_rollout_ref.rollout.gpu_memory_utilization": v.gpu_memory_utilization,
        "actor_rollout_ref.rollout.max_model_len": v.max_model_len(s.max_new_tokens),
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu": v.micro_batch_size_per_gpu,
        "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu": v.micro_batch_size_per_gpu,
        "reward.custom_reward_function.path": REWARD_MODULE,
        "reward.custom_reward_function.name": "compute_score",
        "+reward.custom_reward_function.reward_kwargs.format_weight": s.format_reward,
        "trainer.balance_batch": s.balance_batch,
        "trainer.nnodes": nnodes,
        "trainer.n_gpus_per_node": gpus_per_node,
        "trainer.total_training_steps": s.steps,
        "trainer.total_epochs": s.steps,  # an epoch has at least one step: never the limit
        "trainer.save_freq": s.checkpoint_every,
        "trainer.max_actor_ckpt_to_keep": s.keep_checkpoints,
        "trainer.resume_mode": "auto",
        "trainer.default_local_dir": paths["ckpt"],
        # No validation in training: final/ is scored after the hand-over as every stage's is (eval.*)
        "trainer.val_before_train": False,
        "trainer.test_freq": -1,
        "trainer.project_name": cfg.wandb.project,
        "trainer.experiment_name": run.wandb_run(sid)[0],
        "trainer.logger": logger_list(cfg),
        **backend_overrides(s),
        **(separate_rollout_overrides(s, *rollout_pool) if rollout_pool else {}),
        **profiler_overrides(cfg, s, paths["traces"], nnodes, gpus_per_node),
    }
    return [f"{key}={hydra_value(value)}" for key, value in overrides.items()]


def pools(s: GRPOStage, nnodes: int, gpus_per_node: int) -> tuple[tuple[int, int], tuple[int, int] | None]:
    """(nodes, GPUs a node) of the trainers, and of the rollout pool of their own (None: colocated):
    the job's last `rollout_ranks` GPUs, part of its one node or whole nodes."""
    r = s.rollout_ranks
    if not r:
        return (nnodes, gpus_per_node), None
    if nnodes == 1:
        return (1, gpus_per_node - r), (1, r)
    return (nnodes - r // gpus_per_node, gpus_per_node), (r // gpus_per_node, gpus_per_node)


def check_pools(s: GRPOStage, sid: str, nnodes: int, gpus_per_node: int) -> None:
    """A rollout pool that verl's separate trainer can place (core.cluster.rollout_pool_problem)."""
    problem = s.rollout_ranks and rollout_pool_problem(s.rollout_ranks, nnodes * gpus_per_node, gpus_per_node)
    if problem:
        raise ConfigError(f"{sid}.rollout_ranks", problem)


def separate_rollout_overrides(s: GRPOStage, nnodes: int, gpus_per_node: int) -> dict:
    """verl's own split (trainer.v1 separate_async): the rollout on a pool of `nnodes` x
    `gpus_per_node` GPUs, the weights handed over after every step by the gloo checkpoint engine
    (verl_gloo_weights.py). A step's batch is verl's parameter_sync_step mini-batches, trained with
    one set of old log-probabilities; a trajectory spans at most max_staleness weight versions
    (verl drops older ones): a bound, where the native engine's staleness is exact."""
    from stages.engines import verl_gloo_weights

    rollout = "actor_rollout_ref.rollout"
    separate = "trainer.v1.separate_async"
    overrides = {
        "trainer.v1.trainer_mode": "separate_async",
        "actor_rollout_ref.hybrid_engine": False,
        f"{rollout}.nnodes": nnodes,
        f"{rollout}.n_gpus_per_node": gpus_per_node,
        f"{rollout}.checkpoint_engine.backend": verl_gloo_weights.BACKEND,
        f"{rollout}.checkpoint_engine.custom_backend_module": verl_gloo_weights.__name__,
        f"{separate}.parameter_sync_step": s.mini_batches,
        f"{separate}.num_warmup_batches": s.max_staleness,
        "trainer.v1.sampler.max_off_policy_threshold": s.max_staleness,
    }
    if s.importance_cap is not None and s.old_log_probs == "actor":
        overrides |= {
            "algorithm.rollout_correction.rollout_is": "token",
            "algorithm.rollout_correction.rollout_is_threshold": s.importance_cap,
            f"{rollout}.calculate_log_probs": True,
        }
    return overrides


def backend_overrides(s: GRPOStage) -> dict:
    v = s.verl
    if v.backend == "fsdp":
        return {
            # verl loads HF models with flash_attention_2 unless told otherwise and packs sequences
            # for it (use_remove_padding); flash-attn is a source build (no wheel on PyPI) that
            # only `make setup-gpu` with a CUDA toolkit makes, so sdpa unless packing is asked for.
            "+actor_rollout_ref.model.override_config.attn_implementation": (
                "flash_attention_2" if v.remove_padding else "sdpa"
            ),
            "actor_rollout_ref.model.use_remove_padding": v.remove_padding,
            # verl's default is FSDP1; FSDP2 is what the CPU platform can run (FSDP1 needs a GPU to
            # start), so the GPUs run what the tests execute. The reference takes the actor's.
            "actor_rollout_ref.actor.strategy": "fsdp2",
            "actor_rollout_ref.actor.optim.lr_scheduler_type": "constant",
            "actor_rollout_ref.actor.grad_clip": s.grad_clip,  # the FSDP actor's own copy of optim.clip_grad
            "actor_rollout_ref.actor.fsdp_config.param_offload": v.param_offload,
            "actor_rollout_ref.actor.fsdp_config.optimizer_offload": v.optimizer_offload,
            "actor_rollout_ref.ref.fsdp_config.param_offload": v.param_offload,
            "actor_rollout_ref.actor.fsdp_config.reshard_after_forward": s.reshard_after_forward,
            "actor_rollout_ref.ref.fsdp_config.reshard_after_forward": s.reshard_after_forward,
        }
    # model_engine picks verl's megatron actor/ref config groups; the reference follows the actor's layout.
    return {
        "model_engine": "megatron",
        "actor_rollout_ref.actor.optim.lr_decay_style": "constant",
        "actor_rollout_ref.actor.megatron.tensor_model_parallel_size": v.megatron_tp,
        "actor_rollout_ref.actor.megatron.pipeline_model_parallel_size": v.megatron_pp,
        "actor_rollout_ref.actor.megatron.param_offload": v.param_offload,
        "actor_rollout_ref.actor.megatron.optimizer_offload": v.optimizer_offload,
    }


def token_budget_overrides(v) -> dict:
    """verl's dynamic micro-batches; the reference's and rollout's log-prob passes take the actor's
    use_dynamic_bsz and budget (oc.select in verl's ref and rollout configs)."""
    if v.max_tokens_per_gpu is None:
        return {}
    return {
        "actor_rollout_ref.actor.use_dynamic_bsz": True,
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu": v.max_tokens_per_gpu,
    }


def profiler_overrides(cfg: RunConfig, s: GRPOStage, traces: Path, nnodes: int, gpus_per_node: int) -> dict:
    """torch-profiler traces of the chosen steps, from the profiled ranks of the actor/reference/rollout
    worker, into the stage directory (verl_job turns them into profile/ events)."""
    if not cfg.profile.comm or not s.verl.profile_steps:
        return {}
    ranks = profiled_ranks(s.verl.profile_ranks, nnodes, gpus_per_node)
    return {
        "global_profiler.tool": "torch",
        "global_profiler.steps": list(s.verl.profile_steps),
        "global_profiler.save_path": traces,
        "actor_rollout_ref.actor.profiler.enable": True,
        "actor_rollout_ref.actor.profiler.ranks": ranks,
        "actor_rollout_ref.ref.profiler.enable": True,
        "actor_rollout_ref.ref.profiler.ranks": ranks,
        # record_param_comms carries the collectives' sizes only with shapes recorded
        "actor_rollout_ref.actor.profiler.tool_config.torch.contents": ["cuda", "shapes"],
    }


def profiled_ranks(chosen: list[int] | None, nnodes: int, gpus_per_node: int) -> list[int]:
    """`chosen`, or every rank of the first node and the first of each other node (VerlConfig)."""
    if chosen is not None:
        return sorted(set(chosen))
    return list(range(gpus_per_node)) + [node * gpus_per_node for node in range(1, nnodes)]


def logger_list(cfg: RunConfig) -> list[str]:
    """console always; file (verl_metrics/, where the held-out accuracy is read back); wandb
    unless disabled (offline or online is WANDB_MODE's business, set by the job)."""
    return ["console", "file"] + ([] if cfg.wandb.mode == "disabled" else ["wandb"])


# --- the CPU test platform and the environment of verl's actors -----------------------------------


def platform_overrides(platform: str, backend: str = "fsdp") -> list[str]:
    """What verl needs beside our overrides on the CPU test platform (stages/engines/verl_cpu.py);
    nothing on GPUs. The rollout engine becomes the platform's HF one, whatever the config names.
    `backend`: the GRPO stage's verl.backend (generation has no actor: the default)."""
    if platform != CPU_PLATFORM:
        return []
    overrides = {
        "trainer.device": "cpu",
        "actor_rollout_ref.rollout.name": CPU_ROLLOUT,
        **(_MEGATRON_ON_CPU if backend == "megatron" else {}),
        "actor_rollout_ref.model.enable_gradient_checkpointing": False,
        "actor_rollout_ref.actor.use_torch_compile": False,
        "actor_rollout_ref.ref.use_torch_compile": False,
        # fewer processes on a few cores: one agent-loop, reward and TransferQueue storage worker
        "actor_rollout_ref.rollout.agent.num_workers": 1,
        "reward.num_workers": 1,
        "data.dataloader_num_workers": 0,
        "transfer_queue.backend.SimpleStorage.num_data_storage_units": 1,
    }
    return [f"{key}={hydra_value(value)}" for key, value in overrides.items()]


# megatron-core without Transformer Engine or flash-attn (stages/engines/verl_cpu_megatron.py): its
# local layers (the reference's megatron config takes the actor's transformer overrides and packing).
_MEGATRON_TF = "+actor_rollout_ref.actor.megatron.override_transformer_config"
_MEGATRON_ON_CPU = {
    # the local attention rejects packed (THD) sequences (transformer/dot_product_attention.py:153)
    "actor_rollout_ref.model.use_remove_padding": False,
    "actor_rollout_ref.actor.megatron.use_remove_padding": False,
    # verl asks for flash attention (workers/engine/megatron/transformer_impl.py:367): megatron's own
    "actor_rollout_ref.actor.megatron.override_transformer_config.attention_backend": "local",
    # the local spec's norms without Apex are torch's, which refuse sequence parallelism
    # (megatron/core/transformer/torch_norm.py:50); the reference has its own flag
    "actor_rollout_ref.actor.megatron.sequence_parallel": False,
    "actor_rollout_ref.ref.megatron.sequence_parallel": False,
    # fused RoPE and the persistent layer norm are CUDA kernels (Apex/TE)
    f"{_MEGATRON_TF}.apply_rope_fusion": False,
    f"{_MEGATRON_TF}.persist_layer_norm": False,
    # Bridge's provider turns the fused masked softmax on (gpt_provider.py:199), an Apex/CUDA kernel
    # (megatron/core/fusions/fused_softmax.py imports scaled_masked_softmax_cuda)
    f"{_MEGATRON_TF}.masked_softmax_fusion": False,
}


# What every verl process imports on start (verl/__init__.py), on every platform
ALWAYS_LOADED = "stages.engines.verl_timeouts,stages.engines.verl_fixes"


def verl_process_env(platform: str) -> dict[str, str]:
    """The environment every verl process, Ray's workers too, needs: our modules loaded (the CPU
    platform on the CPU), and the profile's collective timeout, which the stage job exports."""
    env = {"VERL_USE_EXTERNAL_MODULES": ALWAYS_LOADED}
    if COLLECTIVE_TIMEOUT_ENV in os.environ:
        env[COLLECTIVE_TIMEOUT_ENV] = os.environ[COLLECTIVE_TIMEOUT_ENV]
    if platform == CPU_PLATFORM:
        env["VERL_USE_EXTERNAL_MODULES"] += ",stages.engines.verl_cpu"
        env["VERL_PLATFORM"] = CPU_PLATFORM
    return env


def runtime_env_overrides(env: dict[str, str]) -> list[str]:
    """`env` for every process of main_ppo's Ray job (its runtime environment): a Ray started apart,
    as on a cluster, hands its actors the environment of `ray start`, not the driver's."""
    return [
        f"+ray_kwargs.ray_init.runtime_env.env_vars.{name}={hydra_string(value)}"
        for name, value in env.items()
    ]


_PLAIN = re.compile(r"^[A-Za-z0-9_./:+-]+$")


def hydra_string(text: str) -> str:
    """`text` as a string Hydra reads back unchanged, even one that looks like a number or a bool."""
    return hydra_value(str(text)) if not _PLAIN.match(str(text)) else f"'{text}'"


def hydra_value(value) -> str:
    """A Python value as Hydra's override grammar reads it back unchanged."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(hydra_value(v) for v in value) + "]"
    text = str(value)
    if _PLAIN.match(text) and text not in ("true", "false", "null"):
        return text
    if "${" in text:
        # OmegaConf would read it as an interpolation, even quoted.
        raise ConfigError("--run-dir", f"{text!r}: a path with '${{' cannot be passed to verl's Hydra config")
    # Hydra's quoted strings: a backslash escapes only before a quote (or the closing quote).
    body = re.sub(r"(\\+)(?='|$)", lambda m: m.group(1) * 2, text).replace("'", "\\'")
    return f"'{body}'"


# --- checking against the installed verl ---------------------------------------------------------


def compose_verl_config(overrides: list[str]):
    """verl's `ppo_trainer` config with our overrides, as `main_ppo` composes it (Hydra errors on
    a key verl does not have)."""
    import verl
    from hydra import compose, initialize_config_dir

    config_dir = os.path.join(os.path.dirname(verl.__file__), "trainer", "config")
    with initialize_config_dir(config_dir=config_dir, version_base=None):
        return compose("ppo_trainer", overrides=overrides)


def validate_verl_config(config) -> None:
    """What `main_ppo` checks before it starts Ray, and the typed configs its workers build."""
    from verl.trainer.ppo.utils import need_critic, need_reference_policy
    from verl.utils.config import omega_conf_to_dataclass, validate_config

    with contextlib.redirect_stdout(io.StringIO()):  # it prints a success line
        validate_config(
            config, use_reference_policy=need_reference_policy(config), use_critic=need_critic(config)
        )
    omega_conf_to_dataclass(config.actor_rollout_ref.rollout)


# (verl's words for what went wrong, the field of ours that sets it), the more specific words first
_FIELD_OF = (
    ("real_train_batch_size", "prompts_per_step"),
    ("ppo_mini_batch_size", "mini_batches"),
    ("tensor_model_parallel_size", "verl.rollout_tp"),
    ("model_parallel_size", "verl.megatron_tp"),
    ("micro_batch", "verl.micro_batch_size_per_gpu"),
    ("gpu_memory_utilization", "verl.gpu_memory_utilization"),
)


def check_rollout_gpus(section: str, rollout_tp: int, nnodes: int, gpus_per_node: int) -> None:
    """verl's rollout engines need GPUs. One instance spans `rollout_tp` GPUs: part of a node, or
    whole nodes (verl's RolloutReplica: its world size a multiple of the GPUs of a node), and the
    instances fill the job's GPUs. `section` is the config section whose `verl` settings these are."""
    if gpus_per_node < 1:
        raise ConfigError(
            "--cluster",
            f"{section} runs on verl, which needs GPUs: the cluster profile has gpus_per_node 0",
        )
    problem = rollout_span_problem(rollout_tp, nnodes * gpus_per_node, gpus_per_node)
    if problem:
        raise ConfigError(f"{section}.verl.rollout_tp", f"{problem} of the job ({nnodes} nodes)")


def check_verl_stage(
    cfg: RunConfig, run: RunDir, sid: str, nnodes: int, gpus_per_node: int, platform: str = "gpu"
) -> list[str]:
    """The stage's overrides after verl has accepted them; otherwise a ConfigError naming our field."""
    s: GRPOStage = getattr(cfg, sid)
    check_pools(s, sid, nnodes, gpus_per_node)
    trainers, rollout_pool = pools(s, nnodes, gpus_per_node)
    check_rollout_gpus(sid, s.verl.rollout_tp, *(rollout_pool or trainers))
    outside = [rank for rank in s.verl.profile_ranks or [] if rank >= nnodes * gpus_per_node]
    if outside:
        raise ConfigError(
            f"{sid}.verl.profile_ranks", f"{outside}: not ranks of the job's {nnodes * gpus_per_node} GPUs"
        )
    overrides = verl_overrides(cfg, run, sid, nnodes, gpus_per_node)
    overrides += platform_overrides(platform, s.verl.backend)
    try:
        validate_verl_config(compose_verl_config(overrides))
    except Exception as e:  # Hydra, OmegaConf, verl's asserts and ValueErrors: all say "bad config"
        message = " ".join(str(e).split()) or type(e).__name__
        field = next((ours for theirs, ours in _FIELD_OF if theirs in message), "engine")
        raise ConfigError(f"{sid}.{field}", f"verl rejects the stage's config: {message}") from None
    _check_batch_split(s, sid, trainers[0] * trainers[1])
    return overrides


def _check_batch_split(s: GRPOStage, sid: str, n_gpus: int) -> None:
    """What verl asserts only in its workers, at the first update on the GPUs: every mini-batch's
    responses split evenly over the data-parallel ranks."""
    if s.prompts_per_step % s.mini_batches:
        raise ConfigError(
            f"{sid}.mini_batches", f"{s.mini_batches} does not divide prompts_per_step ({s.prompts_per_step})"
        )
    dp = n_gpus // (s.verl.megatron_tp * s.verl.megatron_pp) if s.verl.backend == "megatron" else n_gpus
    responses = s.prompts_per_step // s.mini_batches * s.group_size
    if responses % dp:
        raise ConfigError(
            f"{sid}.mini_batches",
            f"a mini-batch of {responses} responses (prompts_per_step / "
            f"mini_batches * group_size) does not split over {dp} data-parallel GPUs",
        )
    micro = s.verl.micro_batch_size_per_gpu
    if s.verl.max_tokens_per_gpu is None and responses // dp % micro:
        # verl/workers/engine/utils.py:124 asserts it in each rank's first update
        raise ConfigError(
            f"{sid}.verl.micro_batch_size_per_gpu",
            f"{micro} does not divide a GPU's share of a mini-batch ({responses // dp} responses: "
            f"prompts_per_step / mini_batches * group_size / {dp} GPUs)",
        )


def verl_stages(cfg: RunConfig, only: list[str] | None = None) -> list[str]:
    """Stages whose Slurm job brings up Ray for verl: GRPO or synthesis with engine 'verl', and,
    when eval.engine is 'verl', every stage that exports a model (verl's generation server writes
    the held-out answers once the ranks are done)."""
    return [sid for sid, stage in cfg.stages().items() if uses_verl(cfg, stage) and (not only or sid in only)]


def uses_verl(cfg: RunConfig, stage) -> bool:
    if engine_of(stage) == "verl":
        return True
    return cfg.eval.engine == "verl" and not isinstance(stage, SynthStage)


def refuse_local_verl(cfg: RunConfig, only: list[str] | None = None) -> None:
    """`hpcr1 run` starts stages with torchrun on this machine; verl needs a Ray cluster of GPUs
    and a vLLM/SGLang engine. Said before anything is written or launched."""
    stages = verl_stages(cfg, only)
    if not stages:
        return
    sid = stages[0]
    if engine_of(getattr(cfg, sid)) != "verl":
        raise ConfigError(
            "eval.engine",
            f"'verl' cannot run here: {sid}'s held-out answers would come from verl's generation "
            "server, which needs GPUs and a vLLM or SGLang engine. Submit the run with "
            "`hpcr1 submit CONFIG --cluster NAME`, or set eval.engine=native",
        )
    raise ConfigError(
        f"{sid}.engine",
        "'verl' cannot run here: verl needs GPUs and "
        "a vLLM or SGLang engine. Submit it with `hpcr1 submit CONFIG --cluster NAME`, or "
        f"set {sid}.engine=native to run it with the in-tree engine",
    )
