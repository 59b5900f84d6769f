"""Hugging Face Llama <-> megatron-core weights, exact, for any tensor/pipeline layout.

megatron's layout: attention's Q, K, V fused into `linear_qkv`, interleaved per query group
([q heads of group g, k_g, v_g] for g in groups) and split across TP ranks by groups; the MLP's
gate and up fused into `linear_fc1` as [gate shard; up shard] per TP rank; row-parallel layers
(`linear_proj`, `linear_fc2`) split on their input dimension; embedding and output layer split
along the vocabulary; norms replicated. Pipeline stages hold consecutive layers renumbered from 0,
the embedding on the first stage and the final norm and output layer on the last. A tied model
(`tie_word_embeddings`, PP=1 only) has no output-layer weight on either side: megatron's output
layer multiplies by the embedding's, and HF's directory holds no `lm_head.weight` (as
save_pretrained writes it), so none is read or written.

`shard_layout` is the one description of that layout: which rows or columns of which HF tensors
make each tensor of a (tp, pp) shard. Two readers use it: `hf_to_megatron` (pure, from whole
tensors; the reference) and `load_hf_into_megatron` (streaming: memory-mapped slices, only this
rank's). `megatron_to_hf` is the inverse, written independently, unit by unit (embedding, layer,
head), so that `export_megatron_to_hf` can gather, convert and write one unit at a time.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from tqdm import tqdm
from transformers import AutoConfig

from stages.models.hf_files import MAX_SHARD_BYTES, HFCheckpoint, HFDirWriter, TensorSpec
from stages.models.megatron_llama import head_dim, tied_embeddings, validate_parallel_layout

HF_LAYER = "model.layers.{}."
MG_LAYER = "decoder.layers.{}."


def _qkv_groups(hf_config) -> tuple[int, int, int]:
    groups = hf_config.num_key_value_heads
    return groups, hf_config.num_attention_heads // groups, head_dim(hf_config)


def split_qkv(qkv: torch.Tensor, hf_config) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, q_per_group, d = _qkv_groups(hf_config)
    hidden = qkv.shape[1]
    q, k, v = qkv.view(groups, (q_per_group + 2) * d, hidden).split([q_per_group * d, d, d], dim=1)
    return q.reshape(-1, hidden), k.reshape(-1, hidden), v.reshape(-1, hidden)


def _layer_range(hf_config, pp_rank: int, pp_size: int) -> range:
    per_stage = hf_config.num_hidden_layers // pp_size
    return range(pp_rank * per_stage, (pp_rank + 1) * per_stage)


@dataclass(frozen=True)
class Piece:
    """Rows (dim 0) or columns (dim 1) [start, stop) of one HF tensor."""

    hf_name: str
    dim: int
    start: int
    stop: int


def shard_layout(hf_config, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int) -> dict[str, list[Piece]]:
    """The shard of (tp_rank, pp_rank): each megatron tensor (keyed as GPTModel.state_dict() names
    it, without the local spec's `_extra_state` entries) as the HF pieces whose concatenation along
    dim 0 it is. The one description of megatron's layout that every reader of HF weights uses."""
    problems = validate_parallel_layout(hf_config, tp_size, pp_size)
    if problems:  # an uneven split would silently drop rows
        raise ValueError("; ".join(problems))

    def share(name, dim, size):  # this TP rank's equal part of `size` rows or columns
        n = size // tp_size
        return [Piece(name, dim, tp_rank * n, (tp_rank + 1) * n)]

    def whole(name, size):
        return [Piece(name, 0, 0, size)]

    groups, q_per_group, d = _qkv_groups(hf_config)
    hidden, ffn, vocab = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    my_groups = range(tp_rank * groups // tp_size, (tp_rank + 1) * groups // tp_size)
    out = {}
    if pp_rank == 0:
        out["embedding.word_embeddings.weight"] = share("model.embed_tokens.weight", 0, vocab)
    for local, layer in enumerate(_layer_range(hf_config, pp_rank, pp_size)):
        h, m = HF_LAYER.format(layer), MG_LAYER.format(local)
        # [q heads of group g, k_g, v_g] for this rank's query groups
        out[m + "self_attention.linear_qkv.weight"] = [
            Piece(h + f"self_attn.{name}_proj.weight", 0, g * rows, (g + 1) * rows)
            for g in my_groups
            for name, rows in (("q", q_per_group * d), ("k", d), ("v", d))
        ]
        out[m + "self_attention.linear_proj.weight"] = share(
            h + "self_attn.o_proj.weight", 1, groups * q_per_group * d
        )
        out[m + "mlp.linear_fc1.weight"] = share(h + "mlp.gate_proj.weight", 0, ffn) + share(
            h + "mlp.up_proj.weight", 0, ffn
        )
        out[m + "mlp.linear_fc2.weight"] = share(h + "mlp.down_proj.weight", 1, ffn)
        out[m + "input_layernorm.weight"] = whole(h + "input_layernorm.weight", hidden)
        out[m + "pre_mlp_layernorm.weight"] = whole(h + "post_attention_layernorm.weight", hidden)
    if pp_rank == pp_size - 1:
        out["decoder.final_layernorm.weight"] = whole("model.norm.weight", hidden)
        if not tied_embeddings(hf_config):
            out["output_layer.weight"] = share("lm_head.weight", 0, vocab)
    return out


def assemble(pieces: list[Piece], read: Callable[[Piece], torch.Tensor]) -> torch.Tensor:
    """One megatron tensor from its pieces; `read` returns a piece as a tensor of its own."""
    parts = [read(p) for p in pieces]
    return parts[0] if len(parts) == 1 else torch.cat(parts)


def hf_to_megatron(
    hf: Mapping[str, torch.Tensor], hf_config, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> dict[str, torch.Tensor]:
    """The shard of (tp_rank, pp_rank) cut from whole HF tensors (the reference the streaming
    loader is tested against). Reads only this stage's keys of `hf`."""

    def read(p: Piece) -> torch.Tensor:  # a compact copy, so the shard keeps no full HF tensor alive
        return (
            hf[p.hf_name]
            .narrow(p.dim, p.start, p.stop - p.start)
            .clone(memory_format=torch.contiguous_format)
        )

    return {
        key: assemble(pieces, read)
        for key, pieces in shard_layout(hf_config, tp_rank, tp_size, pp_rank, pp_size).items()
    }


def stream_shard(
    ckpt: HFCheckpoint, hf_config, tp_rank: int, tp_size: int, pp_rank: int, pp_size: int
) -> Iterator[tuple[str, torch.Tensor]]:
    """The same shard as hf_to_megatron, one tensor at a time, each read from the memory-mapped
    files as only the rows/columns it is made of."""

    def read(p: Piece) -> torch.Tensor:
        return (ckpt.read_rows if p.dim == 0 else ckpt.read_columns)(p.hf_name, p.start, p.stop)

    for key, pieces in shard_layout(hf_config, tp_rank, tp_size, pp_rank, pp_size).items():
        yield key, assemble(pieces, read)


@dataclass(frozen=True)
class Unit:
    """A piece of the model that one pipeline stage holds whole: the embedding, one decoder layer
    (`layer`, `local` its index on the stage), or the head (final norm and output layer, which a
    `tied` head lacks: it is the embedding)."""

    pp: int
    kind: str
    layer: int = 0
    local: int = 0
    tied: bool = False

    def megatron_keys(self) -> list[str]:
        if self.kind == "embedding":
            return ["embedding.word_embeddings.weight"]
        if self.kind == "head":
            return ["decoder.final_layernorm.weight"] + ([] if self.tied else ["output_layer.weight"])
        m = MG_LAYER.format(self.local)
        return [
            m + name
            for name in (
                "self_attention.linear_qkv.weight",
                "self_attention.linear_proj.weight",
                "mlp.linear_fc1.weight",
                "mlp.linear_fc2.weight",
                "input_layernorm.weight",
                "pre_mlp_layernorm.weight",
            )
        ]


def model_units(hf_config, pp_size: int) -> list[Unit]:
    """The whole model in HF order."""
    layers = [
        Unit(pp, "layer", layer, local)
        for pp in range(pp_size)
        for local, layer in enumerate(_layer_range(hf_config, pp, pp_size))
    ]
    return [Unit(0, "embedding"), *layers, Unit(pp_size - 1, "head", tied=tied_embeddings(hf_config))]


def unit_to_hf(unit: Unit, tp_shards: list[dict], hf_config) -> Iterator[tuple[str, torch.Tensor]]:
    """The HF tensors of one unit, one at a time, from its megatron tensors on each TP rank
    (tp_shards[tp_rank])."""

    def rows(key):
        return torch.cat([s[key] for s in tp_shards], dim=0)

    def cols(key):
        return torch.cat([s[key] for s in tp_shards], dim=1)

    if unit.kind == "embedding":
        yield "model.embed_tokens.weight", rows("embedding.word_embeddings.weight")
        return
    if unit.kind == "head":
        yield "model.norm.weight", tp_shards[0]["decoder.final_layernorm.weight"]
        if not unit.tied:
            yield "lm_head.weight", rows("output_layer.weight")
        return
    h, m = HF_LAYER.format(unit.layer), MG_LAYER.format(unit.local)
    yield from zip(
        (h + "self_attn.q_proj.weight", h + "self_attn.k_proj.weight", h + "self_attn.v_proj.weight"),
        split_qkv(rows(m + "self_attention.linear_qkv.weight"), hf_config),
    )
    yield h + "self_attn.o_proj.weight", cols(m + "self_attention.linear_proj.weight")
    gate_up = [s[m + "mlp.linear_fc1.weight"].chunk(2, dim=0) for s in tp_shards]
    yield h + "mlp.gate_proj.weight", torch.cat([g for g, _ in gate_up])
    yield h + "mlp.up_proj.weight", torch.cat([u for _, u in gate_up])
    yield h + "mlp.down_proj.weight", cols(m + "mlp.linear_fc2.weight")
    yield h + "input_layernorm.weight", tp_shards[0][m + "input_layernorm.weight"]
    yield h + "post_attention_layernorm.weight", tp_shards[0][m + "pre_mlp_layernorm.weight"]


def megatron_to_hf(shards: list[list[dict]], hf_config) -> dict[str, torch.Tensor]:
    """The inverse of hf_to_megatron, written independently of shard_layout: shards[pp_rank][tp_rank]
    -> one HF state dict. Works for any dict keyed like the shards (weights, or their gradients)."""
    hf = {}
    for unit in model_units(hf_config, len(shards)):
        hf.update(unit_to_hf(unit, shards[unit.pp], hf_config))
    return {k: v.contiguous() for k, v in hf.items()}


def hf_specs(hf_config, dtype: torch.dtype) -> list[TensorSpec]:
    """Every tensor of the HF Llama, with its shape, in HF order."""
    groups, q_per_group, d = _qkv_groups(hf_config)
    hidden, ffn, vocab = hf_config.hidden_size, hf_config.intermediate_size, hf_config.vocab_size
    layer = {
        "self_attn.q_proj.weight": (groups * q_per_group * d, hidden),
        "self_attn.k_proj.weight": (groups * d, hidden),
        "self_attn.v_proj.weight": (groups * d, hidden),
        "self_attn.o_proj.weight": (hidden, groups * q_per_group * d),
        "mlp.gate_proj.weight": (ffn, hidden),
        "mlp.up_proj.weight": (ffn, hidden),
        "mlp.down_proj.weight": (hidden, ffn),
        "input_layernorm.weight": (hidden,),
        "post_attention_layernorm.weight": (hidden,),
    }
    shapes = {
        "model.embed_tokens.weight": (vocab, hidden),
        **{
            HF_LAYER.format(i) + name: shape
            for i in range(hf_config.num_hidden_layers)
            for name, shape in layer.items()
        },
        "model.norm.weight": (hidden,),
        **({} if tied_embeddings(hf_config) else {"lm_head.weight": (vocab, hidden)}),
    }
    return [TensorSpec(name, shape, dtype) for name, shape in shapes.items()]


def _parallel_ranks() -> tuple[int, int, int, int]:
    return (
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
        parallel_state.get_pipeline_model_parallel_rank(),
        parallel_state.get_pipeline_model_parallel_world_size(),
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    # The local spec's linear layers report an `_extra_state` (None, TransformerEngine's FP8
    # metadata slot): no weight.
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def load_hf_into_megatron(model: torch.nn.Module, hf_dir: Path, hf_config=None) -> None:
    """Stream this rank's shard of the HF directory's weights into `model` (strict: every weight
    must be covered), for the layout of megatron's parallel_state: each tensor's rows/columns this
    rank owns are read from the memory-mapped files and copied into the parameter, one at a time,
    so the rank's memory grows by about one tensor of its shard, never by the model."""
    hf_config = hf_config or AutoConfig.from_pretrained(hf_dir)
    ranks = _parallel_ranks()
    weights = _weights(model)
    expected = shard_layout(hf_config, *ranks).keys()
    if weights.keys() != expected:
        raise ValueError(
            f"the model's weights do not match the layout: missing {sorted(expected - weights.keys())},"
            f" unexpected {sorted(weights.keys() - expected)}"
        )
    show = dist.is_initialized() and dist.get_rank() == 0
    with torch.no_grad():
        for key, tensor in tqdm(
            stream_shard(HFCheckpoint(hf_dir), hf_config, *ranks),
            total=len(weights),
            desc="loading weights",
            unit="tensor",
            disable=not show,
        ):
            if tensor.shape != weights[key].shape:
                raise ValueError(
                    f"{key}: {hf_dir} gives {tuple(tensor.shape)}, the model has {tuple(weights[key].shape)}"
                )
            weights[key].copy_(tensor)


def megatron_shape(pieces: list[Piece], hf_shapes: dict[str, tuple[int, ...]]) -> tuple[int, ...]:
    """The shape of the megatron tensor the pieces make (hf_shapes: every HF tensor's shape)."""
    if pieces[0].dim == 1:
        return hf_shapes[pieces[0].hf_name][0], pieces[0].stop - pieces[0].start
    return sum(p.stop - p.start for p in pieces), *hf_shapes[pieces[0].hf_name][1:]


def _replica0_ranks() -> dict[tuple[int, int], int]:
    """The global rank of every (pp_rank, tp_rank) of data-parallel replica 0. Every rank must call it."""
    tp_rank, _, pp_rank, _ = _parallel_ranks()
    everyone = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, (pp_rank, tp_rank, parallel_state.get_data_parallel_rank()))
    return {(pp, tp): rank for rank, (pp, tp, dp) in enumerate(everyone) if dp == 0}


def _gather_unit(
    unit: Unit,
    weights: dict[str, torch.Tensor],
    owners: dict[tuple[int, int], int],
    hf_config,
    hf_shapes: dict,
) -> list[dict] | None:
    """The unit's megatron tensors from every TP rank of its stage (data-parallel replica 0), sent
    to global rank 0 as [tp_rank] -> {key: tensor} (None elsewhere). Every rank must call it, units
    in the same order."""
    tp_rank, tp_size, _, pp_size = _parallel_ranks()
    keys, rank = unit.megatron_keys(), dist.get_rank()
    if rank != 0:
        if owners[unit.pp, tp_rank] == rank:
            for key in keys:
                dist.send(weights[key].detach().contiguous(), dst=0)
        return None
    some = next(iter(weights.values()))
    tp_shards = []
    for tp in range(tp_size):
        owner = owners[unit.pp, tp]
        if owner == 0:
            tp_shards.append({key: weights[key].detach().cpu() for key in keys})
            continue
        layout = shard_layout(hf_config, tp, tp_size, unit.pp, pp_size)
        part = {}
        for key in keys:
            part[key] = torch.empty(
                megatron_shape(layout[key], hf_shapes), dtype=some.dtype, device=some.device
            )
            dist.recv(part[key], src=owner)
        tp_shards.append({key: t.cpu() for key, t in part.items()})
    return tp_shards


def export_megatron_to_hf(
    model: torch.nn.Module,
    hf_config,
    out_dir: Path,
    tokenizer_dir: Path | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
) -> None:
    """Write the model as an HF directory from global rank 0, one unit (embedding, layer, head) at
    a time: received from its TP ranks (point to point from data-parallel replica 0), converted,
    written to its place in the safetensors files, dropped; rank 0 never holds more than about one
    layer beyond its own shard. Every rank must call it."""
    weights = _weights(model)
    specs = hf_specs(hf_config, next(iter(weights.values())).dtype)
    hf_shapes = {spec.name: spec.shape for spec in specs}
    owners = _replica0_ranks()
    writer = HFDirWriter(out_dir, specs, max_shard_bytes) if dist.get_rank() == 0 else None
    units = model_units(hf_config, parallel_state.get_pipeline_model_parallel_world_size())
    for unit in tqdm(units, desc="exporting", unit="unit", disable=writer is None):
        tp_shards = _gather_unit(unit, weights, owners, hf_config, hf_shapes)
        if writer is not None:
            for name, tensor in unit_to_hf(unit, tp_shards, hf_config):
                writer.write(name, tensor)
    if writer is not None:
        writer.finish(hf_config, tokenizer_dir)
    dist.barrier()
