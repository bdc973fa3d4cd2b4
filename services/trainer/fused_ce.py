"""Chunked fused linear cross-entropy: target log-probabilities without materialising logits.

For the packed hidden states ``h [T, H]`` (after the final norm), this rank's vocabulary shard
``W [V/tp, H]`` of the frozen output layer and, per segment of slot ``s`` that trains the
unembedding, its lm_head LoRA (``u = h A_s^T`` and ``B_s`` already scaled by ``alpha / rank``)::

    logit[t, v] = h_t . W_v + u_t . B_s,v          (the LoRA term only on its slot's tokens)
    lp[t]       = logit[t, y_t] - logsumexp_v logit[t, v]

The tokens are cut into pieces, each inside one segment and at most ``chunk`` tokens long; a
piece's logits ``[t, V/tp]`` live only while that piece is processed.  Forward keeps the
log-sum-exp per token (fp32) and recomputes each piece's logits in backward, where

    d logit[t, v] = g_t * (1[v = y_t] - exp(logit[t, v] - lse_t))

gives ``dh = dlogit W``, ``du = dlogit B_s`` and ``dB_s = dlogit^T u`` (summed over the slot's
pieces); the frozen ``W`` gets no gradient.  Logits are computed in the activation dtype (bf16 on
GPU, as the output layer computes them), the exponentials and log-sum-exp in fp32.

Tensor parallelism: each rank holds ``V/tp`` vocabulary rows.  A piece's local log-sum-exp and
local target logit (0 where the target lies in another shard) are combined once per call: one
all-gather of the local log-sum-exps (a log-sum-exp over ranks) and one all-reduce SUM of the
target logits.  ``dh`` and ``du`` from one shard are partial sums: the caller passes ``h`` and
``u`` through ``copy_to_tensor_model_parallel_region`` (identity forward, all-reduce backward),
exactly as the output layer and its LoRA do; ``lm_head_logprobs`` does so per segment, so the
backward makes one all-reduce for ``h`` and one per segment with an lm_head LoRA.

Isolation: a piece holds one slot's tokens only, ``dB_s`` sums over slot ``s``'s pieces only,
and every other product is row-wise in tokens, so a tenant's non-finite values reach no other
slot's gradients (docs/semantics.md §6).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from services.trainer.parallel import tp_rank, tp_size

# Budget per piece, in logits elements: the fp32 exponentials of one piece take 4x this in bytes.
# 2**28 gives 1536 tokens at Qwen3's 151,936-entry vocabulary (about 0.9 GiB of fp32 per piece).
CHUNK_ELEMENTS = 1 << 28


def chunk_tokens(local_vocab: int, elements: int = CHUNK_ELEMENTS) -> int:
    """Tokens per piece: ``elements / local_vocab`` rounded down to a multiple of 256, in [256, 8192]."""
    return max(256, min(8192, (elements // max(1, local_vocab)) // 256 * 256))


@dataclass(frozen=True)
class Piece:
    """Tokens ``[start, end)`` of the segment starting at ``base``; ``lora`` indexes the LoRA
    inputs (or is -1: none), whose rows are the segment's tokens (row ``t - base``)."""

    start: int
    end: int
    lora: int
    base: int


def pieces(segments: list[tuple[int, int, int]], chunk: int) -> list[Piece]:
    """Cut ``(start, end, lora)`` segments into pieces of at most ``chunk`` tokens."""
    out: list[Piece] = []
    for start, end, lora in segments:
        for s in range(start, end, chunk):
            out.append(Piece(s, min(end, s + chunk), lora, start))
    return out


def _piece_logits(
    h: torch.Tensor,
    weight: torch.Tensor,
    us: tuple[torch.Tensor, ...],
    bs: tuple[torch.Tensor, ...],
    piece: Piece,
) -> torch.Tensor:
    rows = h[piece.start : piece.end]  # [t, H]
    logits = rows @ weight.t()  # [t, Vl]
    if piece.lora >= 0:
        u = us[piece.lora][piece.start - piece.base : piece.end - piece.base]  # [t, r]
        logits = logits + u @ bs[piece.lora].t()  # [t, Vl]
    return logits


def _tp_group() -> Any:
    from megatron.core import parallel_state

    return parallel_state.get_tensor_model_parallel_group()


class FusedLinearLogprobs(torch.autograd.Function):
    """``lp [T]`` (fp32) from ``h``, ``W`` and per-segment lm_head LoRA; see the module docstring."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        h: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        plan: list[Piece],
        num_lora: int,
        *lora: torch.Tensor,
    ) -> torch.Tensor:
        us, bs = lora[:num_lora], lora[num_lora:]
        shard = weight.shape[0]
        start = tp_rank() * shard
        local = targets - start  # [T]
        inside = (local >= 0) & (local < shard)
        index = local.clamp(0, shard - 1)
        lse = torch.empty(h.shape[0], dtype=torch.float32, device=h.device)
        picked = torch.zeros(h.shape[0], dtype=torch.float32, device=h.device)
        for piece in plan:
            logits = _piece_logits(h, weight, us, bs, piece)  # [t, Vl]
            sl = slice(piece.start, piece.end)
            lse[sl] = torch.logsumexp(logits.float(), dim=-1)
            got = logits.gather(-1, index[sl, None])[:, 0].float()  # [t]
            picked[sl] = torch.where(inside[sl], got, torch.zeros((), dtype=got.dtype, device=got.device))
        if tp_size() > 1:
            group = _tp_group()
            parts = [torch.empty_like(lse) for _ in range(tp_size())]
            dist.all_gather(parts, lse, group=group)
            lse = torch.logsumexp(torch.stack(parts), dim=0)  # [T]
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)
        ctx.plan, ctx.num_lora = plan, num_lora
        ctx.save_for_backward(h, weight, targets, lse, *lora)
        return picked - lse  # [T]

    @staticmethod
    def backward(ctx: Any, grad_lp: torch.Tensor) -> tuple[torch.Tensor | None, ...]:  # type: ignore[override]
        h, weight, targets, lse, *lora = ctx.saved_tensors
        num_lora = ctx.num_lora
        us, bs = tuple(lora[:num_lora]), tuple(lora[num_lora:])
        need_h = ctx.needs_input_grad[0]
        need_u = [ctx.needs_input_grad[5 + i] for i in range(num_lora)]
        need_b = [ctx.needs_input_grad[5 + num_lora + i] for i in range(num_lora)]
        shard = weight.shape[0]
        local = targets - tp_rank() * shard
        inside = (local >= 0) & (local < shard)
        index = local.clamp(0, shard - 1)
        g = grad_lp.float()
        dh = torch.zeros_like(h) if need_h else None
        du = [torch.zeros_like(u) if need else None for u, need in zip(us, need_u, strict=True)]
        db = [
            torch.zeros_like(b, dtype=torch.float32) if need else None
            for b, need in zip(bs, need_b, strict=True)
        ]
        for piece in ctx.plan:
            sl = slice(piece.start, piece.end)
            logits = _piece_logits(h, weight, us, bs, piece)  # [t, Vl]
            grad = logits.float()  # [t, Vl]; in place from here: one fp32 temporary per piece
            del logits
            grad.sub_(lse[sl, None]).exp_().mul_(-g[sl, None])  # -g * softmax
            hit = torch.where(inside[sl], g[sl], torch.zeros((), dtype=g.dtype, device=g.device))
            grad.scatter_add_(-1, index[sl, None], hit[:, None])
            grad_c = grad.to(h.dtype)  # [t, Vl]
            del grad
            if dh is not None:
                dh[sl] = grad_c @ weight
            j = piece.lora
            if j >= 0:
                rows = slice(piece.start - piece.base, piece.end - piece.base)
                if du[j] is not None:
                    du[j][rows] = grad_c @ bs[j]  # type: ignore[index]
                if db[j] is not None:
                    db[j] += (grad_c.t() @ us[j][rows]).float()  # type: ignore[operator]
        grads_b = [None if d is None else d.to(b.dtype) for d, b in zip(db, bs, strict=True)]
        return (dh, None, None, None, None, *du, *grads_b)


def fused_target_logprobs(
    h: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    segments: list[tuple[int, int, int]],
    us: list[torch.Tensor],
    bs: list[torch.Tensor],
    chunk: int | None = None,
) -> torch.Tensor:
    """``log p(targets[t])`` for every packed token, differentiable in ``h``, ``us`` and ``bs``.

    Args:
        h: [T, H] hidden states in the compute dtype (already through the TP copy region).
        weight: [V/tp, H] this rank's output-layer shard (frozen: no gradient).
        targets: [T] int64 token ids over the full vocabulary.
        segments: ``(start, end, lora)`` covering ``[0, T)``; ``lora`` indexes ``us``/``bs`` or is -1.
        us: per LoRA entry, ``[end - start, r]``: the rows of the one segment that names it.
        bs: per LoRA entry, ``[V/tp, r]``, already scaled, in the compute dtype.
        chunk: tokens per piece (default ``chunk_tokens(V/tp)``).

    Returns:
        [T] fp32 log-probabilities.
    """
    plan = pieces(segments, chunk or chunk_tokens(weight.shape[0]))
    out: torch.Tensor = FusedLinearLogprobs.apply(h, weight, targets, plan, len(us), *us, *bs)
    return out


def lm_head_logprobs(
    model: Any, pool: Any, hidden: torch.Tensor, targets: torch.Tensor, chunk: int | None = None
) -> torch.Tensor:
    """Target log-probabilities of the packed stream from the decoder's output ``hidden``.

    Args:
        model: the megatron ``GPTModel`` (its output layer's weight, or the tied embedding).
        pool: the ``lora.AdapterPool`` whose ``routing.segments`` describe the stream.
        hidden: [T, 1, H] the final-norm hidden states (what the output layer would read).
        targets: [T] int64 target ids.

    Returns:
        [T] fp32, as ``-token_loss`` of the unfused model would be (within rounding).
    """
    from megatron.core.tensor_parallel import copy_to_tensor_model_parallel_region

    weight = (
        model.shared_embedding_or_output_weight()
        if model.share_embeddings_and_output_weights
        else model.output_layer.weight
    )  # [V/tp, H]
    rows = hidden.reshape(hidden.shape[0], hidden.shape[-1]).to(weight.dtype)  # [T, H]
    adapter = pool.adapter("output_layer")
    configs = pool.routing.configs
    segments: list[tuple[int, int, int]] = []
    us: list[torch.Tensor] = []
    bs: list[torch.Tensor] = []
    for seg in pool.routing.segments:
        config = configs[seg.slot]
        if not config.trains("unembed"):
            segments.append((seg.start, seg.end, -1))
            continue
        rank = config.rank
        a = adapter._a(seg.slot, rank, rows.dtype)  # [r, H]
        us.append(copy_to_tensor_model_parallel_region(rows[seg.start : seg.end] @ a.t()))  # [t, r]
        bs.append(adapter._b(seg.slot, rank, rows.dtype))  # [V/tp, r]
        segments.append((seg.start, seg.end, len(us) - 1))
    h = copy_to_tensor_model_parallel_region(rows)  # dh of every vocabulary shard is summed
    return fused_target_logprobs(h, weight, targets, segments, us, bs, chunk)
