"""Small Llama configurations that several tests and their rank workers build models from."""

from __future__ import annotations

from transformers import LlamaConfig

# GQA with every tensor- and pipeline-parallel layout the tests use valid: 8 heads, 4 KV heads,
# vocabulary and FFN divisible by 4.
GQA_LLAMA = LlamaConfig(
    vocab_size=128,
    hidden_size=64,
    num_hidden_layers=4,
    num_attention_heads=8,
    num_key_value_heads=4,
    intermediate_size=96,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    rms_norm_eps=1e-5,
)
GQA_LLAMA_TIED = LlamaConfig(**{**GQA_LLAMA.to_dict(), "tie_word_embeddings": True})  # Llama 3.2 1B/3B's head


def llama3_rope(original_max_position_embeddings: int) -> dict:
    """Llama 3.1's RoPE scaling; a short original context makes the scaling reach a tiny model's
    positions, a base this large makes it change the low frequencies."""
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": original_max_position_embeddings,
    }
