"""Generation on verl's rollout engine, for models one GPU cannot hold: `stages/engines/verl_generate.py`
starts vLLM (or SGLang) replicas of `rollout_tp` GPUs each on the job's Ray cluster, as verl's
`main_generation_server` does, and asks them for each prompt of a parquet file `n` times; it
writes the answers back as a `responses` column (a list of n strings a row), as
main_generation_server does. Synthesis (stage engine 'verl') samples with it, held-out eval
(eval.engine 'verl') decodes greedily with it, and our reward scores both.

Its config is verl's `ppo_trainer` config, composed and checked here as for GRPO. Two settings
differ from verl's defaults on purpose: `load_format=auto`, since a standalone replica has no
actor to sync weights from (verl's default 'dummy' would answer with random weights), and the
engine's seed (each request also carries its own).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from core.config import ConfigError, VerlRolloutConfig
from stages.engines.verl_trainer import check_rollout_gpus, compose_verl_config, hydra_value

MODULE = "stages.engines.verl_generate"  # verl's replicas, asked with bounded requests
RESPONSES = "responses"  # the column of answers added to the prompt rows
SAMPLED_RESPONSES = "sampled_responses"  # held-out eval's k sampled answers, beside the greedy ones


@dataclass(frozen=True)
class Sampling:
    n: int
    """Answers per prompt."""
    temperature: float
    """0: greedy (then n must be 1)."""
    top_p: float
    max_new_tokens: int


GREEDY = 0.0


def generation_overrides(
    model_dir: Path,
    rollout: VerlRolloutConfig,
    sampling: Sampling,
    prompts: Path,
    output: Path,
    seed: int,
    nnodes: int,
    gpus_per_node: int,
    answers: int,
) -> list[str]:
    """The generation job's verl config: `prompts` (verl's RL rows) in, `output` out; `answers` of
    them in all, on the job's `nnodes` x `gpus_per_node` GPUs (replica_layout)."""
    nnodes, gpus_per_node = replica_layout(rollout, answers, nnodes, gpus_per_node)
    overrides = {
        "data.train_files": prompts,
        "data.prompt_key": "prompt",
        "+data.output_path": output,
        "data.max_prompt_length": rollout.max_prompt_length,
        "data.max_response_length": sampling.max_new_tokens,
        "actor_rollout_ref.model.path": model_dir,
        "actor_rollout_ref.rollout.name": rollout.rollout,
        "actor_rollout_ref.rollout.load_format": "auto",
        "actor_rollout_ref.rollout.seed": seed,
        "actor_rollout_ref.rollout.n": sampling.n,
        "actor_rollout_ref.rollout.temperature": sampling.temperature,
        "actor_rollout_ref.rollout.top_p": sampling.top_p,
        "actor_rollout_ref.rollout.tensor_model_parallel_size": rollout.rollout_tp,
        "actor_rollout_ref.rollout.gpu_memory_utilization": rollout.gpu_memory_utilization,
        "actor_rollout_ref.rollout.max_model_len": rollout.max_model_len(sampling.max_new_tokens),
        "trainer.nnodes": nnodes,
        "trainer.n_gpus_per_node": gpus_per_node,
    }
    return [f"{key}={hydra_value(value)}" for key, value in overrides.items()]


def replica_layout(
    rollout: VerlRolloutConfig, answers: int, nnodes: int, gpus_per_node: int
) -> tuple[int, int]:
    """(nodes, GPUs a node) of the job that the rollout replicas take (verl starts one on every
    `rollout_tp` of them): as many as keep each sent `requests_in_flight` at once, at most all. A 70B
    replica loads for minutes: one on each of 32 x 4 GPUs for 500 held-out prompts would load 8 times
    the weights the answers need. Past one node, whole nodes (verl's layout is nodes x GPUs a node)."""
    replicas = max(1, math.ceil(answers / rollout.requests_in_flight))
    gpus = min(replicas * rollout.rollout_tp, nnodes * gpus_per_node)
    if gpus <= gpus_per_node:
        return 1, gpus
    return math.ceil(gpus / gpus_per_node), gpus_per_node


def replica_count(rollout: VerlRolloutConfig, answers: int, nnodes: int, gpus_per_node: int) -> int:
    nodes, gpus = replica_layout(rollout, answers, nnodes, gpus_per_node)
    return nodes * gpus // rollout.rollout_tp


def check_generation(
    field: str,
    rollout: VerlRolloutConfig,
    sampling: Sampling,
    overrides: list[str],
    nodes: tuple[int, int],
) -> None:
    """What verl would refuse once the job's Ray cluster is up, said before submission;
    `field` is the config section whose `verl` settings these are (e.g. stage3_synth); `nodes` the
    job's (nodes, GPUs a node)."""
    check_rollout_gpus(field, rollout.rollout_tp, *nodes)
    from verl.utils.config import omega_conf_to_dataclass

    try:
        omega_conf_to_dataclass(compose_verl_config(overrides).actor_rollout_ref.rollout)
    except Exception as e:  # Hydra, OmegaConf and verl's own checks all mean "bad config"
        message = " ".join(str(e).split()) or type(e).__name__
        raise ConfigError(f"{field}.verl", f"verl rejects the generation config: {message}") from None


def read_responses(output: Path, rows: int, n: int, column: str = RESPONSES) -> list[list[str]]:
    """The answers, one list of `n` a prompt row, in the rows' order."""
    import pyarrow.parquet as pq

    table = pq.read_table(output, columns=[column])
    responses = [list(r) for r in table.column(column).to_pylist()]
    if len(responses) != rows or any(len(r) != n for r in responses):
        raise RuntimeError(
            f"{output}: expected {rows} rows of {n} answers, found {len(responses)} rows "
            f"of {sorted({len(r) for r in responses})} answers"
        )
    return responses
