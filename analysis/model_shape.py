"""The dimensions of a Llama-architecture model that decide its memory, read from a Hugging Face
`config.json` alone (no weights, no transformers): what `hpcr1 plan` works from.

configs/models/ holds the config.json of the Llama 3.x family as published on the model cards
(3.2-1B, 3.2-3B, 3.1-8B, 3.3-70B; 3.1-70B has 3.3-70B's shape).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from core.config import ConfigError, RunConfig, TinyModel, hf_config_json

# Bytes per element of the dtypes a checkpoint is stored in (config.json's torch_dtype / dtype).
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# The character tokenizer's vocabulary is padded to 128 (stages/data/tokenizer.py).
TINY_VOCAB = 128


@dataclass(frozen=True)
class LlamaShape:
    layers: int
    """Decoder layers (L)."""
    hidden: int
    """Width of the residual stream (h)."""
    heads: int
    """Query heads (a)."""
    kv_heads: int
    """Key/value heads (grouped-query attention)."""
    head_dim: int
    """Width of one head."""
    ffn: int
    """Inner width of the SwiGLU MLP (f)."""
    vocab: int
    """Vocabulary (V)."""
    tied_embeddings: bool
    """The output layer reuses the input embedding."""
    rope_theta: float
    """RoPE base."""
    rope_scaling: dict | None
    """Llama 3's RoPE scaling (factor, low/high frequency factors, original context), or None."""
    file_bytes: int
    """Bytes per parameter in the checkpoint files."""
    max_positions: int | None = None
    """config.json's max_position_embeddings: the max_model_len vLLM takes when none is given."""

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values) of one token: KV heads x head_dim."""
        return self.kv_heads * self.head_dim

    def layer_params(self) -> int:
        """One decoder layer: Q and O (h x a*d each), K and V (h x kv*d each), SwiGLU's three
        matrices (h x f), two RMSNorm weights."""
        attention = 2 * self.hidden * self.heads * self.head_dim + 2 * self.hidden * self.kv_width
        return attention + 3 * self.hidden * self.ffn + 2 * self.hidden

    def embedding_params(self) -> int:
        """Input embedding, plus the output layer unless it is tied to it."""
        return self.vocab * self.hidden * (1 if self.tied_embeddings else 2)

    def params(self) -> int:
        """All parameters (P): the layers, the embeddings and the final norm."""
        return self.layers * self.layer_params() + self.embedding_params() + self.hidden


def shape_from_hf_config(path: Path) -> LlamaShape:
    """The shape in a Hugging Face config.json; a missing or malformed field is a ConfigError naming it."""
    try:
        hf = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(str(path), f"not a readable config.json ({e})") from None

    def field(name: str, default=None):
        value = hf.get(name, default)
        if value is None or isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ConfigError(f"{path}:{name}", f"a positive number is needed (got {value!r})")
        return value

    # transformers 5 writes `rope_parameters` (theta included) where 4.x wrote rope_theta + rope_scaling.
    rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
    heads = field("num_attention_heads")
    return LlamaShape(
        layers=field("num_hidden_layers"),
        hidden=field("hidden_size"),
        heads=heads,
        kv_heads=field("num_key_value_heads", heads),
        head_dim=field("head_dim", hf["hidden_size"] // heads),
        ffn=field("intermediate_size"),
        vocab=field("vocab_size"),
        tied_embeddings=bool(hf.get("tie_word_embeddings", False)),
        rope_theta=float(rope.get("rope_theta", hf.get("rope_theta", 10000.0))),
        rope_scaling={k: v for k, v in rope.items() if k != "rope_theta"}
        if rope.get("rope_type") == "llama3"
        else None,
        file_bytes=DTYPE_BYTES.get(hf.get("torch_dtype") or hf.get("dtype"), 4),
        max_positions=hf.get("max_position_embeddings"),
    )


def tiny_shape(t: TinyModel) -> LlamaShape:
    """The embedded default's model (stages/models/tiny.py: untied, fp32 files, default RoPE)."""
    return LlamaShape(
        layers=t.num_layers,
        hidden=t.hidden_size,
        heads=t.num_heads,
        kv_heads=t.num_kv_heads,
        head_dim=t.hidden_size // t.num_heads,
        ffn=t.ffn_hidden_size,
        vocab=TINY_VOCAB,
        tied_embeddings=False,
        rope_theta=10000.0,
        rope_scaling=None,
        file_bytes=4,
    )


def model_shape(cfg: RunConfig, config_dir: Path) -> LlamaShape:
    """The base model's shape: built from `model.tiny`, or read from the config.json of `model.path`
    (or of `model.shape` while `path` has no model yet)."""
    if cfg.model.source == "tiny":
        return tiny_shape(cfg.model.tiny)
    return shape_from_hf_config(hf_config_json(cfg, config_dir, shape_will_do=True))
