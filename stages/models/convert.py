"""Hugging Face Llama <-> megatron-core weights, exact, for any tensor/pipeline layout.

megatron's layout: attention's Q, K, V fused into `linear_qkv`, interleaved per query group
([q heads of group g, k_g, v_g] for g in groups) and split across TP ranks by groups; the MLP's
gate and up fused into `linear_fc1` as [gate shard; up shard] per TP rank; row-parallel layers
(`linear_proj`, `linear_fc2`) split on their input dimension; embedding and output layer split
along the vocabulary; norms replicated. Pipeline stages hold consecutive layers renumbered from 0,
the embedding on the first stage and the final norm and output layer on the last.

`hf_to_megatron` and `megatron_to_hf` are pure; the helpers below them move shards between files,
ranks and models.
"""
from __future__ import annotations

import copy
import shutil
from collections.abc import Mapping
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from safetensors import safe_open
from safetensors.torch import save_file
from transformers import AutoConfig

from stages.models.megatron_llama import head_dim, validate_parallel_layout

HF_LAYER = "model.layers.{}."
MG_LAYER = "decoder.layers.{}."
# Files of an HF model directory that are not weights or config.json: the tokenizer's, and the
# generation defaults (eos/pad ids) that `generate` reads.
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
              "tokenizer.model", "generation_config.json")


def _qkv_groups(hf_config) -> tuple[int, int, int]:
    groups = hf_config.num_key_value_heads
    return groups, hf_config.num_attention_heads // groups, head_dim(hf_config)


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, hf_config) -> torch.Tensor:
    groups, q_per_group, d = _qkv_groups(hf_config)
    hidden = q.shape[1]
    return torch.cat([q.view(groups, q_per_group * d, hidden), k.view(groups, d, hidden),
                      v.view(groups, d, hidden)], dim=1).reshape(-1, hidden)


def split_qkv(qkv: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, q_per_group, d = _qkv_groups(hf_config)
    hidden = qkv.shape[1]
    q, k, v = qkv.view(groups, (q_per_group + 2) * d, hidden).split([q_per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _layer_range(hf_config, pp_rank: int, pp_size: int) -> range:
    per_stage = hf_config.num_hidden_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


def hf_to_megatron(hf: Mapping[str, torch.Tensor], hf_config, tp_rank: int, tp_size: int, pp_rank: int,
                   pp_size: int) -> dict[str, torch.Tensor]:
    """The shard of (tp_rank, pp_rank), keyed as GPTModel.state_dict() names it (without the
    local spec's `_extra_state` entries). Reads only this stage's keys of `hf`."""
    problems = validate_parallel_layout(hf_config, tp_size, pp_size)
    if problems:  # torch.chunk would split unevenly without a word
        raise ValueError("; ".join(problems))

    def own(t):  # a compact copy, so the shard keeps no full HF tensor alive
        return t.clone(memory_format=torch.contiguous_format)

    def rows(t):  # column-parallel (and vocab-parallel): split the output dimension
        return own(t.chunk(tp_size, dim=0)[tp_rank])

    def cols(t):  # row-parallel: split the input dimension
        return own(t.chunk(tp_size, dim=1)[tp_rank])

    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = rows(hf["model.embed_tokens.weight"])
    for local, layer in enumerate(_layer_range(hf_config, pp_rank, pp_size)):
        h, m = HF_LAYER.format(layer), MG_LAYER.format(local)
        qkv = fuse_qkv(hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"],
                       hf[h + "self_attn.v_proj.weight"], hf_config)
        out[m + "self_attention.linear_qkv.weight"] = rows(qkv)
        out[m + "self_attention.linear_proj.weight"] = cols(hf[h + "self_attn.o_proj.weight"])
        out[m + "mlp.linear_fc1.weight"] = torch.cat([rows(hf[h + "mlp.gate_proj.weight"]),
                                                      rows(hf[h + "mlp.up_proj.weight"])])
        out[m + "mlp.linear_fc2.weight"] = cols(hf[h + "mlp.down_proj.weight"])
        out[m + "input_layernorm.weight"] = own(hf[h + "input_layernorm.weight"])
        out[m + "pre_mlp_layernorm.weight"] = own(hf[h + "post_attention_layernorm.weight"])
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = own(hf["model.norm.weight"])
        out["output_layer.weight"] = rows(hf["lm_head.weight"])
    return out


def megatron_to_hf(shards: list[list[dict]], hf_config) -> dict[str, torch.Tensor]:
    """The inverse: shards[pp_rank][tp_rank] -> one HF state dict. Works for any dict keyed like
    the shards (weights, or their gradients)."""
    pp_size = len(shards)

    def rows(pp, key):
        return torch.cat([s[key] for s in shards[pp]], dim=0)

    def cols(pp, key):
        return torch.cat([s[key] for s in shards[pp]], dim=1)

    hf = {"model.embed_tokens.weight": rows(0, "embedding.word_embeddings.weight")}
    for pp in range(pp_size):
        for local, layer in enumerate(_layer_range(hf_config, pp, pp_size)):
            h, m = HF_LAYER.format(layer), MG_LAYER.format(local)
            q, k, v = split_qkv(rows(pp, m + "self_attention.linear_qkv.weight"), hf_config)
            hf[h + "self_attn.q_proj.weight"], hf[h + "self_attn.k_proj.weight"] = q, k
            hf[h + "self_attn.v_proj.weight"] = v
            hf[h + "self_attn.o_proj.weight"] = cols(pp, m + "self_attention.linear_proj.weight")
            gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in shards[pp]]
            hf[h + "mlp.gate_proj.weight"] = torch.cat([g for g, _ in gate_up])
            hf[h + "mlp.up_proj.weight"] = torch.cat([u for _, u in gate_up])
            hf[h + "mlp.down_proj.weight"] = cols(pp, m + "mlp.linear_fc2.weight")
            hf[h + "input_layernorm.weight"] = shards[pp][0][m + "input_layernorm.weight"]
            hf[h + "post_attention_layernorm.weight"] = shards[pp][0][m + "pre_mlp_layernorm.weight"]
    hf["model.norm.weight"] = shards[-1][0]["decoder.final_layernorm.weight"]
    hf["lm_head.weight"] = rows(pp_size - 1, "output_layer.weight")
    return {k: v.contiguous() for k, v in hf.items()}


class HFWeights(Mapping):
    """The tensors of an HF safetensors directory, each read from disk when asked for, so a
    pipeline stage never holds the layers of the others."""

    def __init__(self, hf_dir: Path):
        self.file_of = {}
        for path in sorted(Path(hf_dir).glob("*.safetensors")):
            with safe_open(path, "pt") as f:
                self.file_of.update(dict.fromkeys(f.keys(), path))
        if not self.file_of:
            raise FileNotFoundError(f"no *.safetensors in {hf_dir}")

    def __getitem__(self, key: str) -> torch.Tensor:
        with safe_open(self.file_of[key], "pt") as f:
            return f.get_tensor(key)

    def rows(self, key: str, start: int, stop: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Rows [start, stop) of a tensor, read from the memory-mapped file without the others."""
        with safe_open(self.file_of[key], "pt") as f:
            return f.get_slice(key)[start:stop].to(dtype)

    def __iter__(self):
        return iter(self.file_of)

    def __len__(self) -> int:
        return len(self.file_of)


def read_hf_weights(hf_dir: Path) -> dict[str, torch.Tensor]:
    return dict(HFWeights(hf_dir))


def load_hf_into_megatron(model: torch.nn.Module, hf_dir: Path, hf_config=None) -> None:
    """Load this rank's shard of the HF directory's weights into `model` (strict: every parameter
    must be covered), for the layout of megatron's parallel_state."""
    hf_config = hf_config or AutoConfig.from_pretrained(hf_dir)
    shard = hf_to_megatron(HFWeights(hf_dir), hf_config,
                           parallel_state.get_tensor_model_parallel_rank(),
                           parallel_state.get_tensor_model_parallel_world_size(),
                           parallel_state.get_pipeline_model_parallel_rank(),
                           parallel_state.get_pipeline_model_parallel_world_size())
    # The local spec's linear layers report an `_extra_state` (None, TransformerEngine's FP8
    # metadata slot); a strict load wants it back unchanged.
    extra = {k: v for k, v in model.state_dict().items() if k.endswith("_extra_state")}
    model.load_state_dict({**shard, **extra}, strict=True)


def gather_shards(local: dict[str, torch.Tensor]) -> list[list[dict]] | None:
    """Every (pp, tp) rank's `local` dict of one data-parallel replica, on global rank 0 as
    shards[pp_rank][tp_rank] (None elsewhere). Every rank must call it."""
    mine = None
    if parallel_state.get_data_parallel_rank() == 0:  # one replica is enough: the others are equal
        mine = (parallel_state.get_pipeline_model_parallel_rank(), parallel_state.get_tensor_model_parallel_rank(),
                {k: v.detach().cpu() for k, v in local.items()})
    gathered = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
    dist.gather_object(mine, gathered, dst=0)
    if gathered is None:
        return None
    shards = [[None] * parallel_state.get_tensor_model_parallel_world_size()
              for _ in range(parallel_state.get_pipeline_model_parallel_world_size())]
    for pp, tp, state in filter(None, gathered):
        shards[pp][tp] = state
    return shards


def gather_megatron_shards(model: torch.nn.Module) -> list[list[dict]] | None:
    """The whole model's weights as shards[pp_rank][tp_rank] on global rank 0 (None elsewhere),
    ready for megatron_to_hf."""
    return gather_shards({k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")})


def save_hf_dir(hf_state: dict[str, torch.Tensor], hf_config, out_dir: Path, tokenizer_dir: Path | None = None) -> None:
    """safetensors + config.json (+ the tokenizer's and generation files of tokenizer_dir),
    loadable by AutoModelForCausalLM; config.json's dtype is the weights' dtype."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in hf_state.items()}, out_dir / "model.safetensors",
              metadata={"format": "pt"})
    config = copy.deepcopy(hf_config)
    config.dtype = next(iter(hf_state.values())).dtype
    config.save_pretrained(out_dir)
    for name in SIDE_FILES if tokenizer_dir else ():
        if (Path(tokenizer_dir) / name).exists():
            shutil.copy2(Path(tokenizer_dir) / name, out_dir / name)
