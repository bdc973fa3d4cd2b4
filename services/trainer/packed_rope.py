"""RoPE for packed (THD) batches without host synchronisation (a patch of megatron-core 0.16.1).

megatron's `rope_utils._apply_rotary_pos_emb_thd` reads the document lengths back to the host
(`.tolist()` and a size comparison) twice per layer, then slices and concatenates the frequencies
document by document: on a GPU that is a stall per layer. Positions restart at 0 in every
document, so the same frequencies are `freqs[pos]` with `pos = t - cu_seqlens[doc(t)]`, computed
on the device once per forward. At context-parallel size 1 the result is bit-identical; other
CP sizes keep megatron's function. Measured on the H200: see docs/benchmarks.md.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.attention import document_ids

_cache: dict[str, Any] = {"key": None, "positions": None}
_original: Any = None


def _rope_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is not None and cp_group.size() > 1:
        return _original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    total = t.shape[0]
    if _cache["key"] is not cu_seqlens:  # every layer of one forward shares the same tensor
        doc = document_ids(cu_seqlens, total)  # [T]
        _cache.update(key=cu_seqlens, positions=torch.arange(total, device=t.device) - cu_seqlens.long()[doc])
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),  # [T, 1, heads, d]
        freqs[_cache["positions"]],  # [T, 1, 1, d]
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


def install() -> None:
    """Idempotent."""
    global _original
    from megatron.core.models.common.embeddings import rope_utils

    if _original is None:
        _original = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = _rope_thd
