"""The run configuration: typed sections with a docstring per field, YAML on top, dotted overrides.

`load_config(path, overrides)` returns a validated `RunConfig` or raises `ConfigError` naming the
field; nothing is written before a config has passed. YAML files only override the defaults here.
"""

from __future__ import annotations

import json
import re
import reprlib
from pathlib import Path
from typing import Annotated, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

STAGE_IDS = ("stage1_sft", "stage2_grpo", "stage3_synth", "stage3_sft", "stage4_grpo")


class ConfigError(ValueError):
    """A bad configuration; `field` is the dotted path (or file:line) the message is about."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field


class Section(BaseModel):
    # No inf/nan: `lr: .inf` would start a run that can only produce nan losses.
    model_config = ConfigDict(extra="forbid", strict=True, use_attribute_docstrings=True, allow_inf_nan=False)


PositiveInt = Annotated[int, Field(gt=0)]
NonNegativeInt = Annotated[int, Field(ge=0)]
PositiveFloat = Annotated[float, Field(gt=0)]
NonNegativeFloat = Annotated[float, Field(ge=0)]
Probability = Annotated[float, Field(gt=0, le=1)]


class TinyModel(Section):
    hidden_size: PositiveInt = 128
    """Width of the residual stream."""
    num_layers: PositiveInt = 4
    """Transformer blocks."""
    num_heads: PositiveInt = 4
    """Query heads."""
    num_kv_heads: PositiveInt = 2
    """Key/value heads (grouped-query attention); divides num_heads."""
    ffn_hidden_size: PositiveInt = 352
    """Inner width of the SwiGLU MLP."""
    max_position_embeddings: PositiveInt = 1024
    """Longest sequence the model takes (RoPE has no weights: the number changes no result). Every
    length the stages set is checked against it, as against a real model's; 1024 admits verl's
    default max_prompt_length."""


class ModelConfig(Section):
    source: Literal["tiny", "hf"] = "tiny"
    """'tiny': build a small Llama and a character tokenizer locally; 'hf': load a Hugging Face model
    directory."""
    path: str | None = None
    """Hugging Face model directory (config.json, safetensors, tokenizer) when source is 'hf'."""
    shape: str | None = None
    """A directory holding the model's config.json alone (configs/models/ has the Llama 3.x family),
    relative to the config file: what `hpcr1 plan` reads while `path` holds no model yet. A run
    reads `path`."""
    tiny: TinyModel = TinyModel()
    """Architecture of the locally built model when source is 'tiny'."""


class ArithmeticTask(Section):
    num_operands: PositiveInt = 3
    """Numbers added per problem."""
    digits: PositiveInt = 4
    """Digits per operand (zero-padded)."""
    sft_size: PositiveInt = 20000
    """Curated chain-of-thought examples for SFT."""
    prompts_size: PositiveInt = 2000
    """Prompts for GRPO and synthetic-data generation."""
    validation_size: NonNegativeInt = 200
    """Validation problems, disjoint from every other split: what tuning decisions read (0: none)."""
    eval_size: PositiveInt = 200
    """Held-out (test) problems, disjoint from every other split: only reported, never tuned on."""
    worked_fraction: Annotated[float, Field(ge=0, le=1)] = 1.0
    """Share of the curated SFT solutions that show their working; the others give the answer alone
    (`<think></think>`), as scraped datasets often do. Below 1, SFT learns to skip the working on
    some prompts, and GRPO's reward can teach the model that working pays."""


class DataConfig(Section):
    task: Literal["arithmetic", "files"] = "arithmetic"
    """'arithmetic': generate the task from the seed; 'files': read the three files below."""
    arithmetic: ArithmeticTask = ArithmeticTask()
    """Sizes and shape of the generated task."""
    sft_file: str | None = None
    """JSONL or Parquet with worked solutions (GSM8K, problem/solution/answer or chat messages)."""
    prompts_file: str | None = None
    """JSONL or Parquet with prompts and answers for GRPO and synthesis."""
    validation_file: str | None = None
    """JSONL or Parquet validation set, disjoint from the held-out set: what tuning decisions read.
    Optional: without it no validation accuracy is measured."""
    eval_file: str | None = None
    """JSONL or Parquet held-out (test) set: only reported, never tuned on."""


class VerlRolloutConfig(Section):
    """How verl's rollout engine generates (read only where the engine is 'verl')."""

    rollout: Literal["vllm", "sglang"] = "vllm"
    """Inference engine that generates."""
    rollout_tp: PositiveInt | Literal["auto"] = "auto"
    """GPUs one rollout engine instance spans (tensor parallel): a divisor of a node's GPUs, or a
    multiple of them for a model one node cannot hold (the instance spans whole nodes). 'auto':
    chosen at submission for the job's GPUs and the model, as `hpcr1 plan` would (printed)."""
    gpu_memory_utilization: Probability = 0.6
    """Share of each GPU's memory the rollout engine takes for weights and KV cache."""
    max_prompt_length: PositiveInt = 512
    """Longest prompt in tokens, chat template included; a longer prompt is an error, not truncated."""
    requests_in_flight: PositiveInt = 256
    """Generation requests (synthesis, held-out eval) a rollout engine instance is sent at once; the
    rest wait in the job's driver, not as open connections. The engine batches what it holds."""
    request_timeout_s: PositiveFloat = 900
    """Seconds one generation request may take before the stage fails naming the engine instance:
    a dead or hung instance ends the job then, not at its time limit."""

    def max_model_len(self, max_new_tokens: int) -> int:
        """The longest sequence the engine must hold, as verl is told it: unset, verl passes the
        model's max_position_embeddings (131072 for Llama 3.1), and vLLM will not start unless one
        sequence that long fits its KV cache beside the weights."""
        return self.max_prompt_length + max_new_tokens


class EvalConfig(Section):
    num_examples: PositiveInt = 200
    """Held-out (test) examples scored after each stage, the first N of the held-out split: only
    reported, never tuned on. At 200 one problem is 0.5 points."""
    validation_examples: NonNegativeInt | None = None
    """Validation examples scored after each stage, the first N of the validation split, as the
    held-out ones are: what tuning decisions read. None: as many as num_examples, or the whole split
    where it holds fewer; 0: none."""
    samples: NonNegativeInt = 4
    """k: answers sampled per problem at `temperature`, besides the greedy one; the stage reports
    their mean accuracy (mean@k, R1's pass@1 estimate) beside the greedy accuracy. 0: greedy only."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of the k sampled answers: the rollout's (the GRPO stages' temperature)."""
    max_new_tokens: PositiveInt = 64
    """Generation budget per answer."""
    batch_size: PositiveInt = 50
    """Answers generated together per rank (greedy and sampled alike)."""

    @property
    def validation_count(self) -> int:
        """Validation examples scored at most (validation_examples, or num_examples where it is None)."""
        return self.num_examples if self.validation_examples is None else self.validation_examples

    engine: Literal["native", "verl"] = "native"
    """What generates the held-out answers of stages that do not run on verl: 'native' (each
    rank loads the whole model in its dtype and decodes its share) or 'verl' (verl's generation
    server after training, for models one GPU cannot hold; GPU clusters only). A GRPO stage on verl
    is always scored by verl's generation server, with the same settings."""
    verl: VerlRolloutConfig = VerlRolloutConfig()
    """The rollout engine's settings (engine 'verl')."""


class ParallelConfig(Section):
    tp: PositiveInt = 1
    """Tensor-parallel size (megatron-core)."""
    pp: PositiveInt = 1
    """Pipeline-parallel size (megatron-core)."""
    zero_stage: Literal[0, 1, 2, 3] = 1
    """DeepSpeed ZeRO stage over the data-parallel group."""
    overlap_comm: bool = False
    """DeepSpeed reduces gradient buckets during backward on a CUDA stream of its own
    (zero_optimization.overlap_comm, ZeRO 1 and 2), so the reduction overlaps the backward, at the
    cost of a second gradient bucket. On CPU there are no streams: the reduction only moves into
    backward and still blocks."""

    @field_validator("zero_stage", mode="before")
    @classmethod
    def _not_a_boolean(cls, value):
        # YAML reads `yes`/`on`/`true` as True, which a Literal of ints takes for 1.
        if isinstance(value, bool):
            raise ValueError(f"must be 0, 1, 2 or 3, not the boolean {value}")
        return value


class SFTStage(Section):
    init_from: str = "base"
    """'base' or the id of an earlier stage whose final/ model this stage starts from."""
    data: str = "curated"
    """'curated' (the SFT set of `data`) or the id of a synthesis stage whose dataset to train on."""
    steps: PositiveInt = 600
    """Optimizer steps."""
    global_batch_size: PositiveInt = 64
    """Sequences per optimizer step, over all data-parallel ranks."""
    micro_batch_size: PositiveInt = 16
    """Sequences per forward/backward on one rank (gradient accumulation makes up the rest)."""
    max_seq_len: PositiveInt = 96
    """Longer examples are truncated (the loss mask follows); those left without a response token
    are left out. The stage logs the counts and records them in the manifest (training_data), and
    refuses to train when no example keeps a response token."""
    lr: PositiveFloat = 2e-3
    """Peak learning rate (AdamW)."""
    min_lr: NonNegativeFloat = 2e-5
    """Learning rate at the last step: cosine decay from lr after warmup."""
    warmup_steps: NonNegativeInt = 20
    """Linear warmup steps."""
    weight_decay: NonNegativeFloat = 0.0
    """AdamW weight decay."""
    grad_clip: NonNegativeFloat = 1.0
    """Global gradient-norm clip (0 disables)."""
    dtype: Literal["fp32", "bf16"] = "fp32"
    """Parameter and compute precision."""
    parallel: ParallelConfig = ParallelConfig()
    """Model and data parallel layout; data-parallel size = nproc / (tp * pp)."""
    checkpoint_every: PositiveInt = 100
    """Steps between step checkpoints (one is always written at the end)."""
    keep_checkpoints: PositiveInt = 2
    """Newest step checkpoints kept; older ones are deleted."""

    def upstream(self) -> list[str]:
        """Earlier stages whose outputs this one reads."""
        return [src for src in (self.init_from, self.data) if src not in ("base", "curated")]


class VerlConfig(VerlRolloutConfig):
    """What verl's trainer needs that the GRPO fields do not say (read only when engine is 'verl')."""

    backend: Literal["fsdp", "megatron"] = "fsdp"
    """How verl shards the actor and reference: FSDP, or megatron-core with the tp/pp below."""
    megatron_tp: PositiveInt | Literal["auto"] = 1
    """Tensor-parallel size of the megatron actor and reference (backend 'megatron'); 'auto' as for
    rollout_tp."""
    megatron_pp: PositiveInt | Literal["auto"] = 1
    """Pipeline-parallel size of the megatron actor and reference (backend 'megatron'); 'auto' as for
    rollout_tp."""
    param_offload: bool = False
    """FSDP: keep the actor's and reference's parameters in host memory between uses."""
    optimizer_offload: bool = False
    """FSDP: keep the actor's optimizer states in host memory between updates."""
    micro_batch_size_per_gpu: PositiveInt = 1
    """Sequences per forward/backward on one GPU, for the update and for log-probs (unless
    max_tokens_per_gpu is set)."""
    max_tokens_per_gpu: PositiveInt | None = None
    """Micro-batches by token budget instead (verl's use_dynamic_bsz, ppo_max_token_len_per_gpu and
    the log-prob passes' budgets): each GPU's share of a mini-batch is split into the fewest
    micro-batches of at most this many prompt and response tokens, balanced. At least
    max_prompt_length + the stage's max_new_tokens. Without remove_padding each micro-batch is
    still padded to its longest sequence."""
    remove_padding: bool = False
    """Pack a micro-batch's sequences into one row (verl's use_remove_padding) with flash-attn's
    variable-length attention and its in-place cross-entropy: no padding, and the logits' gradient
    takes no room of its own. Needs flash-attn in the jobs' Python (PyPI has no wheel: `make
    setup-gpu` builds it from source); `hpcr1 submit` from a CUDA venv without it refuses."""
    profile_steps: list[PositiveInt] = [2]
    """Steps recorded by the torch profiler (when profile.comm is on); their traces become
    <stage>/profile/ events."""
    profile_ranks: list[NonNegativeInt] | None = None
    """Ranks the torch profiler records. None: every rank of the first node and the first rank of
    each other node, which shows stragglers within a node and between nodes; a trace with shapes is
    large, and every trace is parsed in the hand-over (at 32 nodes of 4: 35 traces, not 128)."""


class GRPOStage(Section):
    engine: Literal["native", "verl"] = "native"
    """'native': the in-tree SPMD trainer (torchrun, runs anywhere); 'verl': hand the stage to
    verl.trainer.main_ppo (Ray, vLLM/SGLang rollout; GPU clusters only, through `hpcr1 submit`)."""
    verl: VerlConfig = VerlConfig()
    """verl-only settings (backend, rollout engine, offload, profiled steps)."""
    init_from: str = "stage1_sft"
    """The earlier stage whose final/ model is both the starting policy and the frozen reference."""
    steps: PositiveInt = 40
    """Rollout-and-update iterations."""
    prompts_per_step: PositiveInt = 16
    """Prompts per rollout batch, over all ranks."""
    group_size: PositiveInt = 8
    """Responses sampled per prompt (GRPO's G); advantages are normalised within each group."""
    max_new_tokens: PositiveInt = 64
    """Generation budget per response."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature of the rollout."""
    top_p: Probability = 1.0
    """Nucleus sampling threshold of the rollout."""
    max_pass_rate: Probability = 1.0
    """Train on the prompts the starting model does not already solve reliably: before the first
    step it answers every prompt group_size times at `temperature`, and prompts with a larger share
    of correct answers are left out (1.0: every prompt). A group whose answers are all right has no
    advantage and teaches nothing; a stage that starts from a model solving most prompts (stage 3's)
    otherwise spends most of its rollouts on them. Costs one rollout of the prompt set."""
    lr: PositiveFloat = 1e-4
    """Actor learning rate (AdamW), constant after the warmup."""
    warmup_steps: NonNegativeInt = 0
    """Iterations of linear learning-rate warmup. Adam's first updates move every weight by about lr
    whatever the noise in the policy gradient, which can undo much of a small model's SFT."""
    ppo_epochs: PositiveInt = 1
    """Passes over each rollout batch."""
    mini_batches: PositiveInt = 2
    """Optimizer steps per pass: the rollout batch is split into this many mini-batches."""
    micro_batch_size: PositiveInt = 16
    """Most rows per forward on each rank in the log-prob and update passes. Rows are sorted by
    response length first (with reshard_after_forward false, a row less than half as long as the
    longest of its micro-batch starts another), and each micro-batch is forwarded only up to its own
    longest response, so smaller micro-batches forward less padding but make more forwards. The
    update differentiates each micro-batch before it forwards the next (gradients accumulate), so it
    holds one micro-batch's activations; with shared prompts each micro-batch forwards its own."""
    reshard_after_forward: bool = True
    """FSDP2's (data_parallel fsdp2): free each gathered layer after its forward (and gather it again
    for the backward). False keeps the actor's layers gathered from a forward until its backward
    ends and the frozen reference's gathered for good: no repeated all-gathers, at the price of
    whole-model weights on every rank (`hpcr1 plan` counts them). For models that fit whole on a
    rank. False also has the log-prob passes forward each distinct prompt once for its whole group
    (one more forward call, which would cost one more all-gather of every layer were the layers
    freed after each forward)."""
    data_parallel: Literal["fsdp2", "ddp"] = "fsdp2"
    """How the actor and the reference are spread over the ranks (the native engine's). 'fsdp2':
    sharded, each rank holding 1/N of the weights, gradients and optimizer state; reshard_after_forward
    and fsdp_units set when the weights are gathered. 'ddp': whole on every rank, the actor's gradients
    and optimizer state too; torch's DistributedDataParallel averages the gradients in the backward
    and nothing else communicates: no gathers (the rollout's weight sync included), and the clip and
    the optimizer step run on plain tensors, not DTensors. For models that fit whole on a rank with
    room to spare (`hpcr1 plan` counts it); the log-prob passes then share prompts (see
    reshard_after_forward). The native engine's only: verl's trainer always shards with FSDP."""
    fsdp_units: Literal["layer", "model"] = "layer"
    """How the actor and the reference are cut into FSDP2 units (data_parallel fsdp2). 'layer': each
    decoder layer is its own unit, gathered and reduced on its own (on GPUs, a layer's collectives
    overlap its neighbours' compute). 'model': the whole model is one unit, one all-gather and one
    reduce-scatter a pass. On CPU ranks, where gloo's collectives overlap nothing, the fewer calls
    are faster; with reshard_after_forward false the whole model is gathered at once either way. The
    native engine's only: verl's FSDP2 always makes each decoder layer a unit."""
    old_log_probs: Literal["actor", "rollout"] = "actor"
    """Where the PPO ratio's old log-probabilities come from. 'actor': a forward of the actor over
    the rollout batch before the update (verl's default). 'rollout': those the rollout computed while
    sampling, which saves that forward (verl's algorithm.rollout_correction.bypass_mode). The native
    rollout samples from the actor's weights, synced before every rollout, in the same dtype, so the
    two differ by rounding only; with a vLLM/SGLang rollout (engine 'verl') they may differ more."""
    rollout_ranks: NonNegativeInt = 0
    """Ranks that only generate, the job's last ones: the others train, and each side works at its
    own pace, the weights going from the trainers to the generators by a broadcast after every step
    (phase weight_sync). 0: every rank generates, then trains (colocated). Native engine: the actor
    and the reference are replicated over the trainers (data_parallel 'ddp'). Engine 'verl': verl's
    separate_async trainer with a rollout pool of these GPUs (part of a one-node job, whole nodes of
    a bigger one), the weights handed over by the gloo checkpoint engine."""
    max_staleness: NonNegativeInt = 1
    """With rollout_ranks: the batch trained at step s was generated with the weights of step s - k
    (the initial ones for the first k steps), exactly, so that a resumed stage repeats the schedule.
    1: generating step s + 1 overlaps training step s. 0: generation waits for every update. On
    verl a bound, not exact: its trajectories span at most k weight versions (older ones dropped),
    and it generates k batches ahead; 0 is refused there."""
    importance_cap: PositiveFloat | None = 2.0
    """With rollout_ranks: each token's policy-gradient term of a stale batch is weighted by the
    ratio of the old policy's probability to the behaviour policy's (the rollout's), truncated at
    this cap (verl's rollout correction, token level; its mean, max and capped fraction are in the
    step's metrics). None: no correction. With old_log_probs 'rollout' the two are one and every
    weight is 1: the PPO ratio itself is then taken against the behaviour policy."""
    balance_batch: bool = True
    """Move whole groups of rollout rows between ranks after the rollout so that each rank's share of
    every mini-batch has about the same tokens (verl's trainer.balance_batch): the reference pass and
    the update then take about as long on every rank, instead of all waiting for the one whose
    responses came out longest."""
    clip_ratio: PositiveFloat = 0.2
    """PPO clip range of the importance ratio."""
    kl_coef: NonNegativeFloat = 0.02
    """Weight of the KL penalty against the reference model (0 disables the reference)."""
    kl_type: Literal["low_var_kl", "k1", "k2", "k3"] = "low_var_kl"
    """KL estimator (verl's kl_penalty)."""
    format_reward: NonNegativeFloat = 0.1
    """Reward for a well-formed <think>/<answer> response, added to 1.0 for a correct answer."""
    grad_clip: NonNegativeFloat = 1.0
    """Global gradient-norm clip."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """Compute precision of the native engine (SFT's field, with a per-device default). 'bf16': the
    actor computes in bf16 over fp32 master weights and optimizer states (gradients reduced in fp32);
    the reference and the rollout hold bf16 copies; final/ is written in bf16. Log-probabilities,
    the loss and sampling are fp32 either way, and fp32 matmuls on CUDA use TF32. 'auto': bf16 on CUDA
    ranks, fp32 on CPU ones (measured faster there: bench/RESULTS.md). Under DDP the actor's autocast
    keeps its residual stream in fp32, so its log-probs differ from the bf16 reference's and
    rollout's by rounding even before a step (FSDP2's bf16 forward is theirs). verl's engine ignores it."""
    checkpoint_every: PositiveInt = 10
    """Iterations between step checkpoints."""
    keep_checkpoints: PositiveInt = 2
    """Newest step checkpoints kept."""

    def upstream(self) -> list[str]:
        return [self.init_from] if self.init_from != "base" else []

    @property
    def shares_prompts(self) -> bool:
        """Whether the log-prob passes forward each distinct prompt once for its group: only where
        the layers stay whole (see reshard_after_forward and stages/grpo/logprobs.py)."""
        return self.data_parallel == "ddp" or not self.reshard_after_forward


class SynthStage(Section):
    engine: Literal["native", "verl"] = "native"
    """'native': the in-tree sampler (torchrun, one whole model a rank in `dtype`, runs anywhere);
    'verl': verl's generation server (vLLM/SGLang replicas on Ray; GPU clusters only, through
    `hpcr1 submit`). Either way the same reward filter keeps the answers."""
    verl: VerlRolloutConfig = VerlRolloutConfig()
    """The rollout engine's settings (engine 'verl')."""
    init_from: str = "stage2_grpo"
    """The stage whose final/ model generates the data."""
    num_prompts: PositiveInt = 2000
    """Prompts from the prompt set answered (the first N)."""
    samples_per_prompt: PositiveInt = 4
    """Responses sampled per prompt."""
    max_per_prompt: PositiveInt = 2
    """Correct, distinct responses kept per prompt at most."""
    temperature: PositiveFloat = 1.0
    """Sampling temperature."""
    top_p: Probability = 1.0
    """Nucleus sampling threshold."""
    max_new_tokens: PositiveInt = 64
    """Generation budget per response."""
    batch_size: PositiveInt = 64
    """Prompts a rank generates together; ranks take batches from a shared queue."""
    dtype: Literal["auto", "fp32", "bf16"] = "auto"
    """The native sampler's model precision (sampling itself is fp32): as GRPO's, 'auto' is bf16 on
    CUDA ranks and fp32 on CPU ones."""

    def upstream(self) -> list[str]:
        return [self.init_from] if self.init_from != "base" else []


class ProfileConfig(Section):
    comm: bool = True
    """Record every collective and point-to-point call per rank into <stage>/profile/."""
    flush_every_s: float = Field(2.0, gt=0)
    """Seconds between appends of the recorded calls to the rank's file: what a rank killed without
    warning (SIGKILL, OOM, time limit) loses at most."""


class WandbConfig(Section):
    mode: Literal["offline", "online", "disabled"] = "offline"
    """wandb mode; offline writes into <stage>/wandb and needs no network."""
    project: str = "hpcr1"
    """wandb project name."""


class RunConfig(Section):
    name: Annotated[str, Field(min_length=1)]
    """Run name; the run directory defaults to runs/<name>."""
    seed: NonNegativeInt = 0
    """Seeds data generation, model initialisation, data order and sampling."""
    nproc: PositiveInt = 2
    """Ranks per stage when run locally (torchrun --nproc-per-node)."""
    model: ModelConfig = ModelConfig()
    """The base model."""
    data: DataConfig = DataConfig()
    """The task: curated SFT set, prompt set, validation set and held-out set."""
    eval: EvalConfig = EvalConfig()
    """Validation and held-out evaluation after each stage."""
    profile: ProfileConfig = ProfileConfig()
    """Communication profiling."""
    wandb: WandbConfig = WandbConfig()
    """Experiment tracking."""
    stage1_sft: SFTStage | None = None
    """SFT of the base model on curated chain-of-thought data (absent: not in the graph)."""
    stage2_grpo: GRPOStage | None = None
    """GRPO on the prompt set, from stage 1 (absent: not in the graph)."""
    stage3_synth: SynthStage | None = None
    """Rejection-sampled synthetic data from the stage 2 model (absent: not in the graph)."""
    stage3_sft: SFTStage | None = None
    """SFT of the stage 1 model on the synthesised data (absent: not in the graph)."""
    stage4_grpo: GRPOStage | None = None
    """GRPO again, from stage 3 (absent: not in the graph)."""

    def stages(self) -> dict[str, SFTStage | GRPOStage | SynthStage]:
        """The stage graph: present stages in their canonical order."""
        return {sid: getattr(self, sid) for sid in STAGE_IDS if getattr(self, sid, None) is not None}


def engine_of(stage: SFTStage | GRPOStage | SynthStage) -> str:
    """The engine a stage runs on; SFT has only ours."""
    return getattr(stage, "engine", "native")


def load_config(path: str | Path, overrides: list[str] = (), data_files: bool = True) -> RunConfig:
    """`data_files=False` is for planning: the data files need not exist, and the model's shape may
    come from `model.shape` while `model.path` holds no model yet (the planner reads neither)."""
    raw = _read_yaml(Path(path))
    for item in overrides:
        _apply_override(raw, item)
    try:
        cfg = RunConfig.model_validate(raw)
    except ValidationError as e:
        err = e.errors()[0]
        field = ".".join(str(p) for p in err["loc"]) or "<top level>"
        raise ConfigError(field, f"{err['msg']} (got {_short_repr(err.get('input'))})") from None
    _check_consistency(cfg, Path(path).parent, data_files)
    return _with_absolute_paths(cfg, Path(path).parent)


def _short_repr(value) -> str:
    """repr of a bad value, bounded: YAML aliases can make a small file expand to billions of items."""
    short = reprlib.Repr()
    short.maxlevel, short.maxlist, short.maxdict, short.maxstring, short.maxother = 3, 4, 4, 60, 60
    return short.repr(value)


def _with_absolute_paths(cfg: RunConfig, base: Path) -> RunConfig:
    """File paths relative to the config file become absolute, so the resolved config in the run
    directory means the same from anywhere (a batch job, `hpcr1 resume`)."""

    def absolute(p):
        return None if p is None else str(resolve_path(base, p).resolve())

    files = ("sft_file", "prompts_file", "validation_file", "eval_file")
    data = cfg.data.model_copy(update={k: absolute(getattr(cfg.data, k)) for k in files})
    model = cfg.model.model_copy(update={k: absolute(getattr(cfg.model, k)) for k in ("path", "shape")})
    return cfg.model_copy(update={"data": data, "model": model})


def load_resolved(run) -> RunConfig:
    """The config a run directory was made with (already validated when it was written)."""
    if not run.config.is_file():
        raise ConfigError(str(run.root), "not a run directory (no config.yaml)")
    return RunConfig.model_validate(yaml.safe_load(run.config.read_text()))


def dump_config(cfg: RunConfig) -> str:
    return yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False)


class _YamlLoader(yaml.SafeLoader):
    """YAML 1.1 reads `1e-4` as a string (it wants `1.0e-4`); users write learning rates the short way."""


_YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:\d[\d_]*\.?\d*|\.\d+)[eE][-+]?\d+$"),
    list("-+0123456789."),
)


def _unique_keys_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    """PyYAML keeps the last of two equal keys; a config that sets `lr` twice is a mistake to report."""
    seen: set = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if not isinstance(key, (str, int, float)):
            continue  # an unhashable key: construct_mapping reports it
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice", key_node.start_mark
            )
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_YamlLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _unique_keys_mapping)


def _load_yaml(text: str):
    return yaml.load(text, Loader=_YamlLoader)


def _read_yaml(path: Path) -> dict:
    if not path.is_file():
        raise ConfigError(str(path), "config file not found")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}", f"not UTF-8 text (byte {e.start})") from None
    try:
        raw = _load_yaml(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        problem = " ".join(str(getattr(e, "problem", None) or e).split())  # one line, whatever PyYAML says
        raise ConfigError(where, f"not valid YAML ({problem})") from None
    except RecursionError:
        raise ConfigError(str(path), "not a usable config: nested too deeply") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(path), "the config must be a mapping of sections")
    return raw


def _apply_override(raw: dict, item: str) -> None:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ConfigError(item, "an override must look like section.field=value")
    *parents, leaf = key.split(".")
    node = raw
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        if not isinstance(child, dict):
            raise ConfigError(".".join(parents[: i + 1]), f"is a value, not a section (in override {item!r})")
        node = child
    try:
        node[leaf] = _load_yaml(value)
    except yaml.YAMLError:
        raise ConfigError(key, f"override value {value!r} is not valid YAML") from None


def hf_config_json(cfg: RunConfig, base: Path, shape_will_do: bool = False) -> Path:
    """The config.json of the Hugging Face model directory `model.path` (relative to `base`), or,
    where a shape will do (planning) and `path` has none yet, of `model.shape`."""
    found = cfg.model.path is not None and (resolve_path(base, cfg.model.path) / "config.json").is_file()
    if shape_will_do and not found and cfg.model.shape is not None:
        config_json = resolve_path(base, cfg.model.shape) / "config.json"
        if not config_json.is_file():
            raise ConfigError("model.shape", f"{config_json} not found (a directory with config.json)")
        return config_json
    if cfg.model.path is None:
        raise ConfigError("model.path", "required when model.source is 'hf'")
    config_json = resolve_path(base, cfg.model.path) / "config.json"
    if not config_json.is_file():
        hint = "; to plan before the weights are there, set model.shape" if shape_will_do else ""
        raise ConfigError(
            "model.path", f"{config_json} not found (a Hugging Face model directory is expected){hint}"
        )
    return config_json


def model_dims(cfg: RunConfig, base: Path, shape_will_do: bool = False) -> dict:
    """Heads, KV heads, layers, vocabulary, tying and positions (None: not said) of the base model,
    for layout and length checks."""
    if cfg.model.source == "tiny":
        t = cfg.model.tiny
        # The character tokenizer's vocabulary is padded to 128 (stages/data/tokenizer.py).
        return {
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "num_hidden_layers": t.num_layers,
            "vocab_size": 128,
            "tie_word_embeddings": False,
            "max_position_embeddings": t.max_position_embeddings,
        }
    hf = json.loads(hf_config_json(cfg, base, shape_will_do).read_text())
    return {
        **{
            k: hf.get(k, hf.get("num_attention_heads"))
            for k in ("num_attention_heads", "num_key_value_heads", "num_hidden_layers", "vocab_size")
        },
        "tie_word_embeddings": bool(hf.get("tie_word_embeddings", False)),
        "max_position_embeddings": hf.get("max_position_embeddings"),
    }


def resolve_path(base: Path, path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() or p.exists() else base / p


def _check_consistency(cfg: RunConfig, base: Path, data_files: bool) -> None:
    """Checks across fields: layouts that cannot be built, files that are not there, a broken graph."""
    t = cfg.model.tiny
    if cfg.model.source == "tiny" and t.num_heads % t.num_kv_heads:
        raise ConfigError(
            "model.tiny.num_kv_heads", f"{t.num_kv_heads} does not divide num_heads ({t.num_heads})"
        )
    if cfg.data.task == "files" and data_files:
        for name in ("sft_file", "prompts_file", "validation_file", "eval_file"):
            value = getattr(cfg.data, name)
            if name == "validation_file" and value is None:  # optional
                continue
            if value is None or not resolve_path(base, value).is_file():
                raise ConfigError(f"data.{name}", f"file {value!r} not found")
    dims = model_dims(cfg, base, shape_will_do=not data_files)
    if not cfg.stages():
        raise ConfigError("stage1_sft", "no stage is configured: the graph is empty")
    _check_lengths(cfg, dims["max_position_embeddings"])
    earlier: list[str] = []
    for sid, stage in cfg.stages().items():
        for src in stage.upstream():
            if src not in earlier:
                raise ConfigError(
                    f"{sid}.{'init_from' if src == stage.init_from else 'data'}",
                    f"{src!r} is not an earlier stage of this graph ({earlier})",
                )
        if isinstance(stage, SFTStage):
            _check_sft_stage(cfg, sid, stage, dims)
        elif isinstance(stage, GRPOStage):
            _check_grpo_stage(cfg, sid, stage)
        earlier.append(sid)


def _check_lengths(cfg: RunConfig, positions: int | None) -> None:
    """Every sequence a stage or the evaluation builds must fit the model's positions: past them a
    model's RoPE extrapolates beyond what it was trained on (and vLLM refuses to start)."""
    if positions is None:
        return
    for field, longest, what in _sequence_lengths(cfg):
        if longest > positions:
            where = f"{what} = " if what else ""
            message = f"{where}{longest} tokens, more than the model's {positions} positions"
            raise ConfigError(field, f"{message} (max_position_embeddings)")


def _sequence_lengths(cfg: RunConfig):
    """(field to lower, longest sequence, how it is counted) for every length the config sets."""
    stages = cfg.stages()
    # A GRPO stage on verl is scored by verl's generation server with eval's settings.
    on_verl = cfg.eval.engine == "verl" or any(
        isinstance(s, GRPOStage) and s.engine == "verl" for s in stages.values()
    )
    for engine in dict.fromkeys([cfg.eval.engine, "verl" if on_verl else cfg.eval.engine]):
        yield _generation_length("eval", cfg.eval.max_new_tokens, engine, cfg.eval.verl)
    for sid, s in stages.items():
        if isinstance(s, SFTStage):
            yield f"{sid}.max_seq_len", s.max_seq_len, ""
        else:
            yield _generation_length(sid, s.max_new_tokens, s.engine, s.verl)


def _generation_length(section: str, max_new_tokens: int, engine: str, verl: VerlRolloutConfig):
    """verl's engines hold max_prompt_length + max_new_tokens; ours a prompt as long as the data's,
    of one token at least, and the response."""
    if engine == "verl":
        longest = verl.max_model_len(max_new_tokens)
        counted = f"max_prompt_length + max_new_tokens ({verl.max_prompt_length} + {max_new_tokens})"
        return f"{section}.verl.max_prompt_length", longest, counted
    return f"{section}.max_new_tokens", max_new_tokens + 1, f"1 prompt token + {max_new_tokens}"


def _check_sft_stage(cfg: RunConfig, sid: str, s: SFTStage, dims: dict) -> None:
    if s.min_lr > s.lr:
        raise ConfigError(f"{sid}.min_lr", f"{s.min_lr} is above lr ({s.lr})")
    p = s.parallel
    if cfg.nproc % (p.tp * p.pp):
        raise ConfigError(f"{sid}.parallel", f"tp*pp = {p.tp * p.pp} does not divide nproc ({cfg.nproc})")
    for what in ("num_attention_heads", "num_key_value_heads", "vocab_size"):
        if dims[what] % p.tp:
            raise ConfigError(
                f"{sid}.parallel.tp", f"{p.tp} does not divide the model's {what} ({dims[what]})"
            )
    if dims["num_hidden_layers"] % p.pp:
        raise ConfigError(
            f"{sid}.parallel.pp", f"{p.pp} does not divide the model's layers ({dims['num_hidden_layers']})"
        )
    if p.pp > 1:
        _check_pipeline(sid, p, dims)
    if p.zero_stage == 3:
        raise ConfigError(
            f"{sid}.parallel.zero_stage",
            "ZeRO-3 is not supported with megatron-core's tensor parallel layers here; use 0, 1 or 2",
        )
    dp = cfg.nproc // (p.tp * p.pp)
    if s.global_batch_size % (s.micro_batch_size * dp):
        raise ConfigError(
            f"{sid}.global_batch_size",
            f"{s.global_batch_size} is not a multiple of "
            f"micro_batch_size * data-parallel size ({s.micro_batch_size} * {dp})",
        )


def _check_pipeline(sid: str, p: ParallelConfig, dims: dict) -> None:
    """Pipeline stages run their backward under megatron's schedule, outside DeepSpeed's engine:
    what DeepSpeed does inside its own backward cannot run (as its PipelineEngine, ZeRO 0 or 1)."""
    if p.zero_stage > 1:
        raise ConfigError(
            f"{sid}.parallel.zero_stage",
            f"ZeRO-{p.zero_stage} partitions gradients inside DeepSpeed's backward, which pp > 1 does "
            "not run; use 0 or 1 (ZeRO-1 shards the optimizer states, as Megatron-DeepSpeed does)",
        )
    if p.overlap_comm:
        raise ConfigError(
            f"{sid}.parallel.overlap_comm", "reduces in DeepSpeed's backward hooks, which pp > 1 does not run"
        )
    if dims.get("tie_word_embeddings"):
        raise ConfigError(
            f"{sid}.parallel.pp",
            "a model whose output layer is its embedding (tie_word_embeddings) cannot be split: use pp=1",
        )


def _check_token_budget(sid: str, s: GRPOStage) -> None:
    """verl's rearrange_micro_batches asserts that the longest sequence fits one micro-batch."""
    budget, longest = s.verl.max_tokens_per_gpu, s.verl.max_model_len(s.max_new_tokens)
    if budget is not None and budget < longest:
        raise ConfigError(
            f"{sid}.verl.max_tokens_per_gpu",
            f"{budget} tokens cannot hold one sequence of max_prompt_length + max_new_tokens ({longest})",
        )


def _check_grpo_stage(cfg: RunConfig, sid: str, s: GRPOStage) -> None:
    if s.group_size < 2:
        raise ConfigError(f"{sid}.group_size", "GRPO needs at least 2 responses per prompt to compare")
    if s.engine == "verl":
        if s.rollout_ranks and not s.max_staleness:
            message = (
                "verl's separate trainer always trains one step behind at least: 1 or more with rollout_ranks"
            )
            raise ConfigError(f"{sid}.max_staleness", message)
        _check_token_budget(sid, s)
        return  # verl splits batches over GPUs its own way: checked against verl's rules at submission
    trainers = cfg.nproc - s.rollout_ranks
    if s.rollout_ranks:
        _check_rollout_ranks(cfg, sid, s)
    if s.prompts_per_step % trainers:
        raise ConfigError(
            f"{sid}.prompts_per_step",
            f"{s.prompts_per_step} is not a multiple of the training ranks ({trainers})",
        )
    if (s.prompts_per_step // trainers) % s.mini_batches:
        raise ConfigError(
            f"{sid}.mini_batches",
            f"{s.mini_batches} does not divide a training rank's prompts ({s.prompts_per_step // trainers})",
        )


def _check_rollout_ranks(cfg: RunConfig, sid: str, s: GRPOStage) -> None:
    """What a split of the ranks into generators and trainers needs (stages/grpo/split.py)."""
    if not s.rollout_ranks <= cfg.nproc // 2:
        message = f"{s.rollout_ranks} of {cfg.nproc} ranks leaves fewer trainers than generators"
        raise ConfigError(f"{sid}.rollout_ranks", message)
    if s.data_parallel != "ddp":
        message = "rollout_ranks needs 'ddp' (fsdp2 over the trainers alone is not built)"
        raise ConfigError(f"{sid}.data_parallel", message)
    if s.max_pass_rate < 1:
        message = "prompt selection runs on colocated ranks only: 1.0 with rollout_ranks"
        raise ConfigError(f"{sid}.max_pass_rate", message)
