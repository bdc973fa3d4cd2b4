"""Hugging Face <-> megatron-core weight conversion for Qwen3 and Llama-3 dense models.

Two layouts meet here.  *HF layout*: ``model.layers.{i}.self_attn.q_proj.weight`` etc.  *Full
megatron layout*: the TP=1 megatron state dict, where ``linear_qkv`` fuses q/k/v interleaved per
GQA group (``[q_g0 (heads/groups rows of head_dim) | k_g0 | v_g0 | q_g1 | ...]``) and
``linear_fc1`` stacks ``[gate; up]``.  A rank's *shard* is cut from the full layout by
``shard()`` and re-assembled by ``unshard()`` according to the tensor's ``ShardKind``.

Invariant: ``megatron_to_hf(hf_to_megatron(w)) == w`` exactly (pure reindexing, no arithmetic),
and ``unshard([shard(t, r, n) for r in range(n)]) == t`` for every kind.  The same split/fuse
helpers serve LoRA tensors (``lora_B`` of ``linear_qkv`` de-interleaves like the qkv weight).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

import torch


@dataclass(frozen=True)
class ModelShape:
    """The sizes conversion needs, read from a HF config."""

    num_layers: int
    hidden_size: int
    num_heads: int
    num_groups: int
    head_dim: int
    ffn_hidden_size: int
    vocab_size: int
    tied_embeddings: bool
    qk_norm: bool

    @property
    def heads_per_group(self) -> int:
        return self.num_heads // self.num_groups

    @classmethod
    def from_hf_config(cls, cfg: Any) -> ModelShape:
        heads = int(cfg.num_attention_heads)
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
        return cls(
            num_layers=int(cfg.num_hidden_layers),
            hidden_size=int(cfg.hidden_size),
            num_heads=heads,
            num_groups=int(getattr(cfg, "num_key_value_heads", None) or heads),
            head_dim=int(head_dim),
            ffn_hidden_size=int(cfg.intermediate_size),
            vocab_size=int(cfg.vocab_size),
            tied_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            qk_norm=cfg.model_type == "qwen3",
        )


class ShardKind(Enum):
    """How a full-layout tensor is split over TP ranks."""

    REPLICATED = "replicated"
    COLUMN = "column"  # split dim 0 (output features; qkv is already group-contiguous)
    COLUMN_GLU = "column_glu"  # [gate; up]: each rank takes its chunk of gate and of up
    ROW = "row"  # split dim 1 (input features)


def shard(tensor: torch.Tensor, kind: ShardKind, rank: int, size: int) -> torch.Tensor:
    """The ``rank``-th of ``size`` TP shards of a full-layout tensor (a contiguous copy)."""
    if size == 1 or kind is ShardKind.REPLICATED:
        return tensor.clone()
    if kind is ShardKind.COLUMN:
        return tensor.chunk(size, dim=0)[rank].clone()
    if kind is ShardKind.ROW:
        return tensor.chunk(size, dim=1)[rank].clone()
    gate, up = tensor.chunk(2, dim=0)  # [ffn, ...] each
    return torch.cat([gate.chunk(size, dim=0)[rank], up.chunk(size, dim=0)[rank]], dim=0)


def unshard(parts: list[torch.Tensor], kind: ShardKind) -> torch.Tensor:
    """Inverse of ``shard``: the full-layout tensor from every rank's shard, in rank order."""
    if len(parts) == 1 or kind is ShardKind.REPLICATED:
        return parts[0].clone()
    if kind is ShardKind.COLUMN:
        return torch.cat(parts, dim=0)
    if kind is ShardKind.ROW:
        return torch.cat(parts, dim=1)
    halves = [p.chunk(2, dim=0) for p in parts]  # per rank: (gate_r, up_r)
    return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)


def weight_shard_kind(name: str) -> ShardKind:
    """Shard kind of a base megatron parameter, by name."""
    if name.endswith(("linear_qkv.weight", "output_layer.weight", "word_embeddings.weight")):
        return ShardKind.COLUMN
    if name.endswith("linear_fc1.weight"):
        return ShardKind.COLUMN_GLU
    if name.endswith(("linear_proj.weight", "linear_fc2.weight")):
        return ShardKind.ROW
    return ShardKind.REPLICATED


# ---- qkv and gate/up fusion (work on any trailing dims: weights [out, in], lora_B [out, r]) ----


def fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, shape: ModelShape) -> torch.Tensor:
    g, d = shape.num_groups, shape.head_dim
    tail = q.shape[1:]
    qg = q.reshape(g, shape.heads_per_group * d, *tail)  # [g, hpg*d, ...]
    kg = k.reshape(g, d, *tail)  # [g, d, ...]
    vg = v.reshape(g, d, *tail)  # [g, d, ...]
    return torch.cat([qg, kg, vg], dim=1).reshape(g * (shape.heads_per_group + 2) * d, *tail)


def split_qkv(qkv: torch.Tensor, shape: ModelShape) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g, d, hpg = shape.num_groups, shape.head_dim, shape.heads_per_group
    tail = qkv.shape[1:]
    grouped = qkv.reshape(g, (hpg + 2) * d, *tail)  # [g, (hpg+2)*d, ...]
    q, k, v = grouped.split([hpg * d, d, d], dim=1)
    return (
        q.reshape(g * hpg * d, *tail).clone(),  # [heads*d, ...]
        k.reshape(g * d, *tail).clone(),  # [groups*d, ...]
        v.reshape(g * d, *tail).clone(),  # [groups*d, ...]
    )


def fuse_glu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    return torch.cat([gate, up], dim=0)  # [2*ffn, ...]


def split_glu(fc1: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    gate, up = fc1.chunk(2, dim=0)
    return gate.clone(), up.clone()


# ---- whole state dicts ----

_LAYER_RENAMES: dict[str, str] = {
    # HF suffix under model.layers.{i}.  ->  megatron suffix under decoder.layers.{i}.
    "input_layernorm.weight": "input_layernorm.weight",
    "post_attention_layernorm.weight": "pre_mlp_layernorm.weight",
    "self_attn.o_proj.weight": "self_attention.linear_proj.weight",
    "self_attn.q_norm.weight": "self_attention.q_layernorm.weight",
    "self_attn.k_norm.weight": "self_attention.k_layernorm.weight",
    "mlp.down_proj.weight": "mlp.linear_fc2.weight",
}


def hf_to_megatron(hf: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """Full megatron layout from a HF state dict (``lm_head`` ignored when tied)."""
    out: dict[str, torch.Tensor] = {
        "embedding.word_embeddings.weight": hf["model.embed_tokens.weight"],
        "decoder.final_layernorm.weight": hf["model.norm.weight"],
    }
    if not shape.tied_embeddings:
        out["output_layer.weight"] = hf["lm_head.weight"]
    for i in range(shape.num_layers):
        src, dst = f"model.layers.{i}.", f"decoder.layers.{i}."
        for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
            if "_norm." in hf_suffix and not shape.qk_norm:
                continue
            out[dst + mg_suffix] = hf[src + hf_suffix]
        attn = src + "self_attn."
        out[dst + "self_attention.linear_qkv.weight"] = fuse_qkv(
            hf[attn + "q_proj.weight"], hf[attn + "k_proj.weight"], hf[attn + "v_proj.weight"], shape
        )
        out[dst + "mlp.linear_fc1.weight"] = fuse_glu(
            hf[src + "mlp.gate_proj.weight"], hf[src + "mlp.up_proj.weight"]
        )
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], shape: ModelShape) -> dict[str, torch.Tensor]:
    """HF state dict from the full megatron layout (``lm_head`` included, shared when tied)."""
    out: dict[str, torch.Tensor] = {
        "model.embed_tokens.weight": mg["embedding.word_embeddings.weight"],
        "model.norm.weight": mg["decoder.final_layernorm.weight"],
        "lm_head.weight": mg[
            "embedding.word_embeddings.weight" if shape.tied_embeddings else "output_layer.weight"
        ],
    }
    for i in range(shape.num_layers):
        src, dst = f"decoder.layers.{i}.", f"model.layers.{i}."
        for hf_suffix, mg_suffix in _LAYER_RENAMES.items():
            if "_norm." in hf_suffix and not shape.qk_norm:
                continue
            out[dst + hf_suffix] = mg[src + mg_suffix]
        q, k, v = split_qkv(mg[src + "self_attention.linear_qkv.weight"], shape)
        out[dst + "self_attn.q_proj.weight"] = q
        out[dst + "self_attn.k_proj.weight"] = k
        out[dst + "self_attn.v_proj.weight"] = v
        gate, up = split_glu(mg[src + "mlp.linear_fc1.weight"])
        out[dst + "mlp.gate_proj.weight"] = gate
        out[dst + "mlp.up_proj.weight"] = up
    return out
