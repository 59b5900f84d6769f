"""A megatron-core GPTModel that is a Llama: RMSNorm, SwiGLU, RoPE (with Llama 3's scaling),
grouped-query attention, no biases, untied embeddings — built from a Hugging Face LlamaConfig for
the tensor/pipeline layout megatron's parallel_state holds."""
from __future__ import annotations

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer import TransformerConfig

# megatron-core hard-codes Llama 3.1's RoPE scaling except for its factor.
LLAMA3_ROPE_FIXED = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def rope_settings(hf_config) -> dict:
    """GPTModel's rotary arguments for the HF config (transformers 5 `rope_parameters`, or 4's fields)."""
    params = dict(getattr(hf_config, "rope_parameters", None) or {})
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    scaling = params if params.get("rope_type", "default") != "default" else getattr(hf_config, "rope_scaling", None)
    if not scaling or scaling.get("rope_type", scaling.get("type")) in (None, "default"):
        return {"rotary_base": theta}
    mismatched = {k: scaling.get(k) for k, v in LLAMA3_ROPE_FIXED.items() if float(scaling.get(k, v)) != v}
    if scaling.get("rope_type", scaling.get("type")) != "llama3" or mismatched:
        raise ValueError(f"RoPE scaling {scaling} is not supported by megatron-core's GPTModel "
                         f"(only llama3 with {LLAMA3_ROPE_FIXED})")
    return {"rotary_base": theta, "rope_scaling": True, "rope_scaling_factor": float(scaling["factor"])}


def head_dim(hf_config) -> int:
    return getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads


def transformer_config_from_hf(hf_config, params_dtype: torch.dtype = torch.float32) -> TransformerConfig:
    if getattr(hf_config, "tie_word_embeddings", False):
        raise ValueError("tied input/output embeddings are not supported yet (Llama 3.1/3.3 are untied)")
    return TransformerConfig(
        num_layers=hf_config.num_hidden_layers, hidden_size=hf_config.hidden_size,
        num_attention_heads=hf_config.num_attention_heads, num_query_groups=hf_config.num_key_value_heads,
        kv_channels=head_dim(hf_config), ffn_hidden_size=hf_config.intermediate_size,
        normalization="RMSNorm", layernorm_epsilon=hf_config.rms_norm_eps, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, add_qkv_bias=False, hidden_dropout=0.0, attention_dropout=0.0,
        bias_activation_fusion=False, masked_softmax_fusion=False, apply_rope_fusion=False,
        gradient_accumulation_fusion=False, use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=params_dtype, pipeline_dtype=params_dtype, bf16=params_dtype == torch.bfloat16,
        tensor_model_parallel_size=parallel_state.get_tensor_model_parallel_world_size(),
        pipeline_model_parallel_size=parallel_state.get_pipeline_model_parallel_world_size(),
    )


def build_megatron_llama(hf_config, pre_process: bool | None = None, post_process: bool | None = None,
                         params_dtype: torch.dtype = torch.float32) -> GPTModel:
    """This rank's part of the model; by default the pipeline stage parallel_state says it is."""
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage()
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage()
    return GPTModel(transformer_config_from_hf(hf_config, params_dtype),
                    get_gpt_layer_local_spec(normalization="RMSNorm"), vocab_size=hf_config.vocab_size,
                    max_sequence_length=hf_config.max_position_embeddings, pre_process=pre_process,
                    post_process=post_process, share_embeddings_and_output_weights=False,
                    position_embedding_type="rope", **rope_settings(hf_config))
