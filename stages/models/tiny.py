"""The embedded default's base model: a small Llama (RMSNorm, SwiGLU, RoPE, grouped-query
attention, untied embeddings) initialised from a seed and saved as a Hugging Face directory."""

from __future__ import annotations

import torch
from transformers import LlamaConfig, LlamaForCausalLM


def build_tiny_llama(
    out_dir,
    vocab_size: int,
    hidden_size: int = 128,
    num_layers: int = 4,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    ffn_hidden_size: int = 352,
    max_position_embeddings: int = 1024,
    rope_theta: float = 10000.0,
    seed: int = 0,
    pad_token_id: int | None = None,
    eos_token_id: int | None = None,
) -> None:
    """Write config.json, generation_config.json and fp32 model.safetensors to out_dir; the
    weights (normal, std = initializer_range 0.02) depend only on the arguments."""
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        intermediate_size=ffn_hidden_size,
        max_position_embeddings=max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        pad_token_id=pad_token_id,
        eos_token_id=eos_token_id,
        bos_token_id=None,
        dtype="float32",
    )
    with torch.random.fork_rng(devices=[]):  # seed the init without moving the caller's RNG
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = pad_token_id
    model.generation_config.eos_token_id = eos_token_id
    model.save_pretrained(out_dir)
