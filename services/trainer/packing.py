"""Pack datums of many slots into one THD token stream.

Datums are stably sorted by slot and concatenated: ``T = sum(N_d)`` tokens, positions restart
at 0 per datum, ``cu_seqlens = [0, N_0, N_0 + N_1, ...]`` marks document boundaries, and each
maximal run of one slot becomes a ``Segment`` for the LoRA routing.

Invariant: ``order[j]`` is the caller's index of the j-th packed datum, so results unpack back
into request order; datums of one slot form exactly one contiguous segment.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from services.trainer.host_copy import to_device
from services.trainer.lora import Segment


@dataclass(frozen=True)
class DatumInput:
    """One datum of a ``forward_backward`` call.

    ``loss_inputs`` always holds ``target_tokens`` (int64[N]) plus the loss's own inputs, each
    of length N; position i of ``tokens`` predicts ``target_tokens[i]``.
    """

    slot: int
    tokens: np.ndarray  # int64[N]
    loss_inputs: Mapping[str, np.ndarray] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.tokens.shape[0])


@dataclass(frozen=True)
class PackedBatch:
    """The packed stream plus the bookkeeping to unpack it."""

    order: list[int]  # caller index of each packed datum
    bounds: list[int]  # document boundaries, len(order) + 1 entries
    segments: list[Segment]
    input_ids: torch.Tensor  # [1, T] int64
    position_ids: torch.Tensor  # [1, T] int64
    labels: torch.Tensor  # [1, T] int64
    cu_seqlens: torch.Tensor  # [D + 1] int32
    max_len: int


def pack(datums: list[DatumInput], device: torch.device) -> PackedBatch:
    order = sorted(range(len(datums)), key=lambda i: datums[i].slot)
    lengths = [datums[i].num_tokens for i in order]
    bounds = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64).tolist()
    tokens = np.concatenate([np.asarray(datums[i].tokens, dtype=np.int64) for i in order])  # [T]
    # Datums without targets (logits-only calls) get their own tokens as placeholder labels.
    targets = np.concatenate(
        [
            np.asarray(datums[i].loss_inputs.get("target_tokens", datums[i].tokens), dtype=np.int64)
            for i in order
        ]
    )
    positions = np.concatenate([np.arange(n, dtype=np.int64) for n in lengths])  # [T]
    segments: list[Segment] = []
    for j, i in enumerate(order):
        slot = datums[i].slot
        if segments and segments[-1].slot == slot:
            segments[-1] = Segment(slot, segments[-1].start, bounds[j + 1])
        else:
            segments.append(Segment(slot, bounds[j], bounds[j + 1]))
    return PackedBatch(
        order=order,
        bounds=bounds,
        segments=segments,
        input_ids=to_device(tokens, device)[None],  # [1, T]
        position_ids=to_device(positions, device)[None],  # [1, T]
        labels=to_device(targets, device)[None],  # [1, T]
        cu_seqlens=to_device(bounds, device, torch.int32),  # [D + 1]
        max_len=max(lengths),
    )
