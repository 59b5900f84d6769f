"""A megatron-core GPTModel that is a Llama: RMSNorm, SwiGLU, RoPE (with Llama 3's scaling),
grouped-query attention, no biases, the output layer tied to the input embedding or not — built
from a Hugging Face LlamaConfig for the tensor/pipeline layout megatron's parallel_state holds."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

from runtime.dist import rank_device

# megatron-core's RotaryEmbedding hard-codes Llama 3.x's RoPE scaling except for its factor.
LLAMA3_ROPE_FIXED = {
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def tied_embeddings(hf_config) -> bool:
    """The output layer is the input embedding (Llama 3.2 1B/3B; 3.1 and 3.3 are untied)."""
    return bool(getattr(hf_config, "tie_word_embeddings", False))


def unsupported_features(hf_config) -> list[str]:
    """What in the HF config this megatron Llama does not reproduce (empty when it is exact)."""
    problems = []
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        problems.append("attention_bias/mlp_bias are not supported (Llama has no biases)")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        problems.append(f"hidden_act={hf_config.hidden_act!r} is not supported (Llama's MLP is SwiGLU)")
    rope = hf_config.rope_parameters
    kind = rope.get("rope_type", "default")
    mismatched = {k: rope.get(k) for k, v in LLAMA3_ROPE_FIXED.items() if float(rope.get(k, v)) != v}
    if kind not in ("default", "llama3") or mismatched:
        problems.append(
            f"RoPE scaling {rope} is not supported by megatron-core's GPTModel "
            f"(only 'default' and 'llama3' with {LLAMA3_ROPE_FIXED})"
        )
    return problems


def validate_parallel_layout(hf_config, tp: int, pp: int) -> list[str]:
    """Human-readable reasons why (tp, pp) cannot shard this model (empty when it can)."""
    if tp < 1 or pp < 1:
        return [f"tp ({tp}) and pp ({pp}) must be at least 1"]
    split_by_tp = {
        "num_attention_heads": hf_config.num_attention_heads,
        "num_key_value_heads": hf_config.num_key_value_heads,
        "vocab_size": hf_config.vocab_size,  # vocab-parallel embedding and output layer
        "intermediate_size": hf_config.intermediate_size,
    }
    problems = [
        f"tp={tp} does not divide {name}={value}" for name, value in split_by_tp.items() if value % tp
    ]
    if hf_config.num_hidden_layers % pp:
        problems.append(f"pp={pp} does not divide num_hidden_layers={hf_config.num_hidden_layers}")
    if pp > 1 and tied_embeddings(hf_config):
        # megatron would keep a second copy of the embedding on the last stage, kept equal to the
        # first stage's only by megatron's own training loop (finalize_model_grads), not DeepSpeed's.
        problems.append(f"pp={pp} with tie_word_embeddings=True is not supported: use pp=1")
    return problems


def rope_settings(hf_config) -> dict:
    """GPTModel's rotary arguments for the HF config's `rope_parameters` (transformers 5)."""
    rope = hf_config.rope_parameters
    settings = {"rotary_base": rope["rope_theta"]}
    if rope.get("rope_type", "default") == "llama3":
        settings.update(rope_scaling=True, rope_scaling_factor=float(rope["factor"]))
    return settings


def _model_parallel_sizes() -> dict:
    if not parallel_state.model_parallel_is_initialized():
        return {}
    return {
        "tensor_model_parallel_size": parallel_state.get_tensor_model_parallel_world_size(),
        "pipeline_model_parallel_size": parallel_state.get_pipeline_model_parallel_world_size(),
    }


def transformer_config_from_hf(
    hf_config, params_dtype: torch.dtype = torch.float32, **overrides
) -> TransformerConfig:
    """The TransformerConfig of the HF Llama for parallel_state's layout; `overrides` are
    TransformerConfig fields (e.g. recompute_granularity, calculate_per_token_loss)."""
    sizes = _model_parallel_sizes()
    problems = unsupported_features(hf_config) + validate_parallel_layout(
        hf_config, sizes.get("tensor_model_parallel_size", 1), sizes.get("pipeline_model_parallel_size", 1)
    )
    if problems:  # refused before GPTModel is built, each problem named by its field
        raise ValueError("; ".join(problems))
    fields = dict(
        num_layers=hf_config.num_hidden_layers,
        hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads,
        num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config),
        ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=hf_config.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # The fused kernels need apex/TransformerEngine/CUDA; the unfused paths are exact everywhere.
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        # megatron initialises directly on the GPU only through torch.cuda; elsewhere on the CPU.
        use_cpu_initialization=rank_device().type != "cuda",
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        **sizes,
    )
    return TransformerConfig(**{**fields, **overrides})


def build_megatron_llama(
    hf_config,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    params_dtype: torch.dtype = torch.float32,
    **overrides,
) -> GPTModel:
    """This rank's part of the model; by default the pipeline stage parallel_state says it is.
    `overrides` go to transformer_config_from_hf."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    model = GPTModel(
        transformer_config_from_hf(hf_config, params_dtype, **overrides),
        get_gpt_layer_local_spec(normalization="RMSNorm"),
        vocab_size=hf_config.vocab_size,
        max_sequence_length=hf_config.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        # Tied, the output layer allocates no weight and multiplies by the embedding's (at PP=1).
        share_embeddings_and_output_weights=tied_embeddings(hf_config),
        position_embedding_type="rope",
        **rope_settings(hf_config),
    )
    # The local spec's torch RMSNorm is made in the default dtype on the default device, the
    # linear layers in params_dtype (on the GPU where there is one): bring them together on the
    # rank's device, as Megatron-LM's get_model and Float16Module do. (RoPE's inv_freq is no
    # buffer: it stays fp32.)
    return model.to(device=rank_device(), dtype=params_dtype)
