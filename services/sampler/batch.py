"""The running batch's tensors: a left-padded KV cache that rows can join and leave.

Invariant: row ``i`` of every cache layer holds the keys/values of all of that row's
tokens except ``pending[i]`` (the last sampled token, fed on the next step), packed
against the right edge; ``mask[i]`` is 1 exactly over those columns and 0 over the
left padding.  Position ids are tracked per row (``positions[i]`` is the position of
``pending[i]``), so padding never shifts RoPE.

Joining (``merge``) left-pads the shorter cache to the longer one's width; leaving
(``select``) drops rows and then any leading columns that only padding still uses.
Both rebuild the ``DynamicCache`` from its per-layer key/value tensors; they run only
when the batch changes membership, never per decode step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


def left_pad(prompts: Sequence[Sequence[int]]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Left-pad ``prompts`` into ``(input_ids, mask, position_ids)``, each (B, L) long."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)
    mask = torch.zeros(len(prompts), width, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
        mask[row, width - len(prompt) :] = 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)  # padding gets position 0; it is masked anyway
    return ids, mask, positions


def _layers(cache: DynamicCache) -> list[tuple[torch.Tensor, torch.Tensor]]:
    kv: list[tuple[torch.Tensor, torch.Tensor]] = []
    for layer in cache.layers:
        if type(layer) is not DynamicLayer:
            raise TypeError(f"only full-attention caches can be re-batched, got {type(layer).__name__}")
        assert layer.keys is not None and layer.values is not None, "cache layer was never filled"
        kv.append((layer.keys, layer.values))  # each (B, kv_heads, L, head_dim)
    return kv


def _cache(kv: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> DynamicCache:
    return DynamicCache(ddp_cache_data=list(kv))


@dataclass(slots=True)
class KVBatch:
    """Left-padded cache, mask and per-row feed state of the rows being decoded."""

    cache: DynamicCache
    mask: torch.Tensor
    """(B, L) long; 1 where the cache column holds one of the row's tokens."""
    positions: torch.Tensor
    """(B,) long; position id of ``pending``."""
    pending: torch.Tensor
    """(B,) long; the last sampled token of each row, not yet in the cache."""

    @property
    def size(self) -> int:
        return int(self.mask.shape[0])

    def select(self, rows: Sequence[int]) -> KVBatch:
        """Keep only ``rows`` (in that order) and drop columns that are padding for all of them."""
        index = torch.tensor(rows, dtype=torch.long)
        mask = self.mask[index]
        used = mask.any(dim=0).nonzero()
        start = int(used[0]) if used.numel() else mask.shape[1]
        kv = [(k[index, :, start:], v[index, :, start:]) for k, v in _layers(self.cache)]
        return KVBatch(_cache(kv), mask[:, start:], self.positions[index], self.pending[index])

    @staticmethod
    def merge(a: KVBatch | None, b: KVBatch) -> KVBatch:
        """Rows of ``a`` followed by rows of ``b``, both left-padded to a common width."""
        if a is None:
            return b
        width = max(a.mask.shape[1], b.mask.shape[1])

        def pad_kv(t: torch.Tensor) -> torch.Tensor:  # (B, H, L, D) -> (B, H, width, D)
            return F.pad(t, (0, 0, width - t.shape[2], 0))

        def pad_mask(m: torch.Tensor) -> torch.Tensor:  # (B, L) -> (B, width)
            return F.pad(m, (width - m.shape[1], 0))

        kv = [
            (torch.cat([pad_kv(ka), pad_kv(kb)]), torch.cat([pad_kv(va), pad_kv(vb)]))
            for (ka, va), (kb, vb) in zip(_layers(a.cache), _layers(b.cache), strict=True)
        ]
        return KVBatch(
            _cache(kv),
            torch.cat([pad_mask(a.mask), pad_mask(b.mask)]),
            torch.cat([a.positions, b.positions]),
            torch.cat([a.pending, b.pending]),
        )
