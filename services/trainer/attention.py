"""Core attention for packed (THD) batches with per-document causal masking.

The engine packs several datums into one token stream: ``T = sum(len_d)`` tokens, positions
restarting at 0 for each document, boundaries given by ``PackedSeqParams.cu_seqlens_q``.
These modules plug into megatron's ``SelfAttention`` as its ``core_attention`` submodule (the
slot megatron fills with ``DotProductAttention``); megatron has already projected q/k/v,
applied qk-norm and per-document RoPE before calling them.

Invariant: a token attends to itself and the earlier tokens of its own document only, never
across a document boundary; query heads map to key/value groups as megatron and Hugging Face
do (head ``h`` uses group ``h // (heads / groups)``).  Backends differ only in speed, so
``ATTENTION_BACKENDS`` lets a GPU variant (flex_attention, varlen flash attention) replace
the CPU ones by configuration alone.
"""

from __future__ import annotations

import itertools
import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


def _split_heads(config: Any, tp_world: int) -> tuple[int, int, int]:
    heads = config.num_attention_heads // tp_world
    groups = config.num_query_groups // tp_world
    head_dim = config.kv_channels
    return heads, groups, head_dim


class _PackedAttentionBase(nn.Module):
    """Shared constructor: megatron builds core attention with these keyword arguments."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        tp_world = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.heads, self.groups, self.head_dim = _split_heads(config, tp_world)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            # Unpacked [s, b, heads, d]: every batch row is one document.
            s, b = query.shape[0], query.shape[1]
            bounds = [0, s]
            outs = [
                self._attend(query[:, i], key[:, i], value[:, i], bounds)  # [s, heads, d]
                for i in range(b)
            ]
            return torch.stack(outs, dim=1).reshape(s, b, -1)  # [s, b, heads*d]
        bounds = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
        out = self._attend(query, key, value, bounds)  # [T, heads, d]
        return out.reshape(out.shape[0], -1)  # [T, heads*d]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        raise NotImplementedError


class PerDocumentSdpa(_PackedAttentionBase):
    """Causal SDPA run once per document of the packed stream (O(sum len^2) memory)."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        rep = self.heads // self.groups
        outs = []
        for start, end in itertools.pairwise(bounds):
            qd = q[start:end].transpose(0, 1)  # [heads, t, d]
            kd = k[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, t, d]
            vd = v[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, t, d]
            od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=self.scale)  # [heads, t, d]
            outs.append(od.transpose(0, 1))  # [t, heads, d]
        return torch.cat(outs, dim=0)  # [T, heads, d]


class BlockDiagonalSdpa(_PackedAttentionBase):
    """One SDPA call over the whole stream with a block-diagonal causal mask (O(T^2) memory)."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        rep = self.heads // self.groups
        total = q.shape[0]
        lengths = torch.tensor([e - s for s, e in itertools.pairwise(bounds)], device=q.device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)  # [T]
        pos = torch.arange(total, device=q.device)  # [T]
        allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        qt = q.transpose(0, 1)  # [heads, T, d]
        kt = k.transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, T, d]
        vt = v.transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, T, d]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=self.scale)  # [heads, T, d]
        return out.transpose(0, 1)  # [T, heads, d]


ATTENTION_BACKENDS: dict[str, type[nn.Module]] = {
    "sdpa_per_document": PerDocumentSdpa,
    "sdpa_block_diagonal": BlockDiagonalSdpa,
}
