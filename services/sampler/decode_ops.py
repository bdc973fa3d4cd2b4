"""The pieces of a decode step of the static-cache engine, each in torch and, on CUDA, in Triton.

A decode step feeds one token per row through fused weights (q/k/v in one matrix, gate/up in
one) with each row's own LoRA slot.  Every function here takes the same arguments on both
paths; ``use_triton(x)`` decides (CUDA tensors and Triton importable, unless
``TINKERD_SAMPLER_TRITON_OFF`` is set for a comparison).  The torch versions are the reference
the CUDA tests hold the kernels to, and what runs on the CPU.

* ``rms_norm``: optional residual add, then RMSNorm (fp32 statistics, as Hugging Face's).
* ``add_lora``: per-row LoRA over a fused group whose every slot's ``A`` is folded into the
  base weight: the projection's weight is ``[W; A]`` with ``A`` (slots * R, in), slot ``s``'s
  ``A`` of every member module in rows ``[out + s R, out + (s + 1) R)`` (member ``j``: ``[j r,
  (j + 1) r)`` of those), so one GEMM gives the base output ``y[:, :out]`` and every slot's
  ``x A^T`` in ``y[:, out:]``: the shrink costs no kernel of its own.  ``b``: (slots, out, r),
  each member's ``B`` over its output columns.  The expand reads, for each row, only its own
  slot's columns of ``y[:, out:]`` and its own slot's ``B``; rows of slot ``-1`` get nothing.
  A slot's values reach only its own columns (each GEMM output column is a dot product of its
  own weight row), and the kernel works per (slot, block), skipping slots no row uses, each
  program multiplying tiles of its own slot's rows only (the rows grouped by slot,
  ``group_rows``): no row's output is ever computed from another slot's values.
* ``qk_rope_cache``: per-head RMSNorm of q and k (Qwen3), rotary embedding, and the write of
  the step's k and v into the cache at each row's position.
* ``decode_attention``: each row's query heads against cache columns ``[0, length)`` of its own
  row (grouped-query heads share their KV head), in blocks of ``SPLIT`` columns whose partial
  softmax states are then combined; blocks past a row's length read nothing.
* ``silu_mul``: ``silu(gate) * up`` of the fused gate/up output.

In a step of at most ``FUSED_EXPAND_ROWS`` rows, the q/k/v and gate/up projections skip their
expand kernel: ``qk_rope_cache`` and ``silu_mul`` take a ``RowLora`` and add each row's LoRA
term to the columns they read, from the row's own slot's ``x A^T`` columns and ``B`` (no slot:
nothing), rounded as ``add_lora`` rounds it. Each row reads its slot's ``B`` itself, which at
small batches costs less than a kernel launch; at larger ones the grouped expand reads each
slot's ``B`` once per tile of its rows.
"""

from __future__ import annotations

import itertools
import math
import os
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

try:  # Triton ships with CUDA builds of torch; the CPU path never needs it.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None

SPLIT = 64
"""Cache columns per attention block (one program of the decode attention kernel)."""
GROUP_ROWS = 16
"""Rows of one slot that the LoRA expand kernel multiplies at once (a tile)."""
SMALL_CHUNK = 1024
"""Output columns per program of the LoRA expand kernel in a step of one row (larger steps take
up to 1024). Measured on an H200 at batch 1 against 128 columns: 5.83 against 5.87 ms per
replayed step (``bench/gpu_sampler.py``'s profile times the other choice)."""
SMALL_CHUNK_SLOTS = 128
"""The same for a step of 2 to ``GROUP_ROWS`` rows, of one slot or several: more, shorter
programs. Measured on an H200 at batch 8 against 1024 columns: 6.08 against 6.28 ms per replayed
step with one adapter, 6.28 against 6.46 with 8."""
ROW_PROGRAMS = 4
"""Programs sharing one slot's tiles (per slot and block of the LoRA kernels): one slot's many rows
are spread over them, and a slot with one tile leaves the others idle (1 and 4 measured on an H200:
docs/benchmarks.md, "The CUDA engine: decode steps")."""

SILU_LORA_BLOCK = 64
"""Columns per program of the ``silu · up`` kernel where it adds the gate/up LoRA terms (a
``(block, rank)`` tile of each of the row's two ``B``s per program; 1,024 without LoRA). At
batch 1 and 256 columns, Qwen3-8B's 12,288 columns made 48 programs on 132 SMs, each reading
32 KB of ``B``: 5.8 µs per layer. ``bench/gpu_sampler.py``'s profile times 256 beside it."""

FUSED_EXPAND_ROWS = 16
"""Steps of at most this many rows add the q/k/v and gate/up LoRA terms inside the kernels that
read those outputs next (``RowLora``); 0 turns it off (``bench/gpu_sampler.py``'s profile times
both)."""


@dataclass(frozen=True, slots=True)
class RowLora:
    """A folded projection's LoRA term, left for the kernel that reads its output next: ``b``
    (slots, out, r), each member's ``B`` over its output columns; ``slots`` (B,), each row's slot
    (-1: none); ``out`` base columns, member offsets ``bounds``, ``r_total`` columns per slot."""

    b: torch.Tensor
    slots: torch.Tensor
    out: int
    bounds: list[int]
    r_total: int

    def apply_torch(self, y: torch.Tensor) -> torch.Tensor:
        """``y[:, :out]`` plus each row's term (the torch path: a new tensor)."""
        return lora_expand_torch(y[:, None, :], self.out, self.b, self.slots, self.bounds, self.r_total)[:, 0, :]


def _row_lora_args(
    lora: RowLora | None, placeholder: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, int, int, int]:
    """A kernel's LoRA arguments: ``B``, each row's slot, the base columns, the columns per slot
    and the rank; without ``lora``, ``placeholder`` for the pointers (``HAS_LORA`` off: never read)."""
    if lora is None:
        return placeholder, placeholder, 0, 0, 1
    return lora.b, lora.slots, lora.out, lora.r_total, lora.b.shape[2]


def fuses_expand(x: torch.Tensor) -> bool:
    """Whether a step of rows ``x`` adds its q/k/v and gate/up LoRA terms in the next kernels."""
    return use_triton(x) and x.shape[0] <= FUSED_EXPAND_ROWS


def use_triton(x: torch.Tensor) -> bool:
    return triton is not None and x.is_cuda and not os.environ.get("TINKERD_SAMPLER_TRITON_OFF")


def _pow2_divisor(n: int, cap: int) -> int:
    """The largest power of two <= ``cap`` that divides ``n``."""
    d = 1
    while d * 2 <= cap and n % (d * 2) == 0:
        d *= 2
    return d


# ----------------------------------------------------------------------------- torch versions


def rms_norm_torch(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual): Hugging Face's RMSNorm (fp32 statistics, weight in x's dtype)."""
    if residual is not None:
        x = x + residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), x


def lora_expand_torch(
    y: torch.Tensor,
    out: int,
    b: torch.Tensor,
    slots: torch.Tensor,
    bounds: list[int],
    r_total: int | None = None,
) -> torch.Tensor:
    """``y[..., :out]`` plus each row's LoRA term, for the folded projection's output ``y``
    (k, T, out + span * R) of ``k`` rows with slots ``slots`` (k,), -1: none (a new tensor).

    ``bounds``: the members' output offsets plus ``out`` (``[0, 4096, 5120, 6144]`` for q/k/v).
    ``r_total``: R, the columns of one slot (by default ``y`` holds every slot of ``b``).
    """
    n_slots, _, rank = b.shape
    index = slots.clamp(min=0)
    width = r_total if r_total is not None else (y.shape[-1] - out) // n_slots
    shrunk = y[..., out:].unflatten(-1, (-1, width))  # (k, T, span, R): every slot's x A^T
    h = shrunk[torch.arange(len(slots), device=y.device), :, index]  # (k, T, R): the row's own slot
    parts = []
    for j, (lo, hi) in enumerate(itertools.pairwise(bounds)):
        bj = b[index, lo:hi]  # (k, n_j, r)
        parts.append(torch.bmm(h[..., j * rank : (j + 1) * rank], bj.transpose(1, 2)))
    delta = torch.cat(parts, dim=-1)
    return y[..., :out] + torch.where((slots >= 0)[:, None, None], delta, torch.zeros_like(delta))


def qk_heads_torch(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    heads: int,
    kv_heads: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q (k, H, T, D), k and v (k, KV, T, D) of the fused projection ``qkv`` (k, T, *);
    ``cos``/``sin`` (k, T, D)."""
    n, t, _ = qkv.shape
    d = cos.shape[-1]
    q, k, v = qkv.split([heads * d, kv_heads * d, kv_heads * d], dim=-1)
    q, k = q.reshape(n, t, heads, d), k.reshape(n, t, kv_heads, d)
    if q_norm is not None and k_norm is not None:
        q, k = rms_norm_torch(q, q_norm, eps)[0], rms_norm_torch(k, k_norm, eps)[0]
    q, k = q.transpose(1, 2), k.transpose(1, 2)
    v = v.reshape(n, t, kv_heads, d).transpose(1, 2)
    c, s = cos[:, None], sin[:, None]
    half = d // 2

    def rotate(x: torch.Tensor) -> torch.Tensor:
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    return q * c + rotate(q) * s, k * c + rotate(k) * s, v


def decode_attention_torch(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """o (B, H, D) of queries q (B, H, D) over columns ``[0, lengths)`` of cache rows ``[0, B)``."""
    b, heads, d = q.shape
    kv = k_cache.shape[1]
    keys, values = k_cache[:b, :, :window], v_cache[:b, :, :window]  # (B, KV, W, D)
    qg = q.reshape(b, kv, heads // kv, d)
    scores = torch.matmul(qg, keys.transpose(-1, -2)).float() * scale  # (B, KV, g, W)
    visible = torch.arange(window, device=q.device)[None, :] < lengths[:, None]
    scores = scores.masked_fill(~visible[:, None, None, :], -math.inf)
    probs = torch.softmax(scores, dim=-1).to(q.dtype)
    return torch.matmul(probs, values).reshape(b, heads, d)


def silu_mul_torch(gu: torch.Tensor) -> torch.Tensor:
    gate, up = gu.chunk(2, dim=-1)
    return F.silu(gate) * up


# ----------------------------------------------------------------------------- Triton kernels

if triton is not None:

    @triton.jit
    def _rms_norm_kernel(
        x_ptr, res_ptr, w_ptr, out_ptr, sum_ptr, n, res_stride, eps, HAS_RES: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0)
        if HAS_RES:
            x = (
                x.to(tl.float32) + tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0).to(tl.float32)
            ).to(x.dtype)
            tl.store(sum_ptr + row * n + cols, x, mask=mask)
        xf = x.to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(xf * xf, axis=0) / n + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        h = (xf * rstd).to(x.dtype).to(tl.float32) * w
        tl.store(out_ptr + row * n + cols, h.to(x.dtype), mask=mask)

    @triton.jit
    def _lora_expand_kernel(
        y_ptr, b_ptr, order_ptr, starts_ptr, y_stride, n_out, r_total, b1, b2, tile_step,
        RANK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
    ):  # fmt: skip
        # Rows ``order[starts[slot]:starts[slot + 1]]`` use the slot: only they are multiplied.
        slot = tl.program_id(0)
        c0 = tl.program_id(1) * CHUNK  # a chunk of columns inside one member's columns
        lo = tl.load(starts_ptr + slot) + tl.program_id(2) * BLOCK_M  # this program's first tile
        hi = tl.load(starts_ptr + slot + 1)
        if lo < hi:  # else the slot has no rows here: no work
            member = (c0 >= b1).to(tl.int32) + (c0 >= b2).to(tl.int32)
            rs = tl.arange(0, RANK)
            shrunk = n_out + slot * r_total + member * RANK  # this slot's and member's x A^T columns
            for m0 in range(lo, hi, tile_step):  # its tiles: every tile_step-th row from lo
                at = m0 + tl.arange(0, BLOCK_M)
                valid = at < hi
                rows = tl.load(order_ptr + at, mask=valid, other=0)
                hb = tl.load(y_ptr + rows[:, None] * y_stride + shrunk + rs[None, :], mask=valid[:, None], other=0.0)
                for n in tl.static_range(0, CHUNK, BLOCK_N):
                    ns = c0 + n + tl.arange(0, BLOCK_N)
                    cols = ns < n_out
                    bt = tl.load(
                        b_ptr + slot * n_out * RANK + ns[:, None] * RANK + rs[None, :],
                        mask=cols[:, None],
                        other=0.0,
                    )
                    delta = tl.dot(hb, tl.trans(bt))  # (M, N) fp32
                    dst = y_ptr + rows[:, None] * y_stride + ns[None, :]
                    keep = valid[:, None] & cols[None, :]
                    y = tl.load(dst, mask=keep, other=0.0)
                    tl.store(
                        dst, (y.to(tl.float32) + delta.to(hb.dtype).to(tl.float32)).to(y.dtype), mask=keep
                    )

    @triton.jit
    def _plus_row_lora(x, y_row, b_ptr, slot, n_out, r_total, member, cols, col_mask, RANK: tl.constexpr):
        # x (N,) columns ``cols`` of one row of a folded projection's output ``y_row``, plus the
        # row's LoRA term: its slot's x A^T columns of ``member`` times that slot's B rows ``cols``,
        # rounded to x's dtype before the sum as add_lora's kernel rounds it. Slot -1: x itself.
        use = slot >= 0
        s = tl.maximum(slot, 0)
        ks = tl.arange(0, RANK)
        h = tl.load(y_row + n_out + s * r_total + member * RANK + ks, mask=use, other=0.0).to(tl.float32)
        bt = tl.load(b_ptr + s * n_out * RANK + cols[:, None] * RANK + ks[None, :], mask=use & col_mask[:, None], other=0.0)
        delta = tl.sum(bt.to(tl.float32) * h[None, :], axis=1)
        summed = (x.to(tl.float32) + delta.to(x.dtype).to(tl.float32)).to(x.dtype)
        return tl.where(use, summed, x)

    @triton.jit
    def _qk_rope_cache_kernel(
        qkv_ptr, qw_ptr, kw_ptr, cos_ptr, sin_ptr, q_out_ptr, k_cache_ptr, v_cache_ptr, pos_ptr,
        b_ptr, slot_ptr, n_out, r_total, qkv_stride, cache_row, cache_head, cache_col, eps,
        HEADS: tl.constexpr, KV: tl.constexpr, D: tl.constexpr, HALF_P2: tl.constexpr, HAS_NORM: tl.constexpr,
        RANK: tl.constexpr, HAS_LORA: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)  # [0, H): q heads, [H, H + KV): k heads, then v heads
        half = tl.arange(0, HALF_P2)
        hm = half < D // 2
        base = qkv_ptr + row * qkv_stride + head * D
        x1 = tl.load(base + half, mask=hm, other=0.0)
        x2 = tl.load(base + D // 2 + half, mask=hm, other=0.0)
        if HAS_LORA:
            slot = tl.load(slot_ptr + row)
            member = (head >= HEADS).to(tl.int32) + (head >= HEADS + KV).to(tl.int32)
            y_row = qkv_ptr + row * qkv_stride
            x1 = _plus_row_lora(x1, y_row, b_ptr, slot, n_out, r_total, member, head * D + half, hm, RANK)
            x2 = _plus_row_lora(x2, y_row, b_ptr, slot, n_out, r_total, member, head * D + D // 2 + half, hm, RANK)
        pos = tl.load(pos_ptr + row)
        kv_head = head - HEADS
        if head >= HEADS + KV:  # v: into the cache as it is
            dst = v_cache_ptr + row * cache_row + (kv_head - KV) * cache_head + pos * cache_col
            tl.store(dst + half, x1, mask=hm)
            tl.store(dst + D // 2 + half, x2, mask=hm)
        else:
            f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
            if HAS_NORM:
                rstd = 1.0 / tl.sqrt((tl.sum(f1 * f1, axis=0) + tl.sum(f2 * f2, axis=0)) / D + eps)
                if head < HEADS:
                    w1 = tl.load(qw_ptr + half, mask=hm, other=0.0).to(tl.float32)
                    w2 = tl.load(qw_ptr + D // 2 + half, mask=hm, other=0.0).to(tl.float32)
                else:
                    w1 = tl.load(kw_ptr + half, mask=hm, other=0.0).to(tl.float32)
                    w2 = tl.load(kw_ptr + D // 2 + half, mask=hm, other=0.0).to(tl.float32)
                f1 = (f1 * rstd).to(x1.dtype).to(tl.float32) * w1
                f2 = (f2 * rstd).to(x1.dtype).to(tl.float32) * w2
                f1, f2 = f1.to(x1.dtype).to(tl.float32), f2.to(x1.dtype).to(tl.float32)
            c1 = tl.load(cos_ptr + row * D + half, mask=hm, other=0.0).to(tl.float32)
            c2 = tl.load(cos_ptr + row * D + D // 2 + half, mask=hm, other=0.0).to(tl.float32)
            s1 = tl.load(sin_ptr + row * D + half, mask=hm, other=0.0).to(tl.float32)
            s2 = tl.load(sin_ptr + row * D + D // 2 + half, mask=hm, other=0.0).to(tl.float32)
            o1 = (f1 * c1 - f2 * s1).to(x1.dtype)
            o2 = (f2 * c2 + f1 * s2).to(x1.dtype)
            if head < HEADS:
                dst = q_out_ptr + (row * HEADS + head) * D
            else:
                dst = k_cache_ptr + row * cache_row + kv_head * cache_head + pos * cache_col
            tl.store(dst + half, o1, mask=hm)
            tl.store(dst + D // 2 + half, o2, mask=hm)

    @triton.jit
    def _decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, len_ptr, acc_ptr, ml_ptr, cache_row, cache_head, cache_col, scale, nsplit,
        HEADS: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        D_P2: tl.constexpr, SPLIT_N: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        kvh = tl.program_id(1)
        split = tl.program_id(2)
        length = tl.load(len_ptr + row)
        start = split * SPLIT_N
        gs = tl.arange(0, BLOCK_G)
        ds = tl.arange(0, D_P2)
        dm = ds < D
        state = ml_ptr + ((row * KV + kvh) * nsplit + split) * BLOCK_G * 2
        if start >= length:  # past the row's filled columns: an empty block, nothing read
            tl.store(state + gs * 2, tl.full((BLOCK_G,), float("-inf"), tl.float32))
            tl.store(state + gs * 2 + 1, tl.zeros((BLOCK_G,), tl.float32))
        else:
            q = tl.load(
                q_ptr + (row * HEADS + kvh * G + gs[:, None]) * D + ds[None, :],
                mask=(gs[:, None] < G) & dm[None, :],
                other=0.0,
            )
            ns = start + tl.arange(0, SPLIT_N)
            visible = ns < length
            kv_base = row * cache_row + kvh * cache_head
            kv_mask = visible[:, None] & dm[None, :]
            k = tl.load(k_ptr + kv_base + ns[:, None] * cache_col + ds[None, :], mask=kv_mask, other=0.0)
            s = tl.dot(q, tl.trans(k)) * scale  # (G, N) fp32
            s = tl.where(visible[None, :], s, float("-inf"))
            m = tl.max(s, axis=1)
            p = tl.exp(s - m[:, None])
            l_sum = tl.sum(p, axis=1)
            v = tl.load(v_ptr + kv_base + ns[:, None] * cache_col + ds[None, :], mask=kv_mask, other=0.0)
            acc = tl.dot(p.to(v.dtype), v)  # (G, D) fp32
            out = acc_ptr + (((row * KV + kvh) * nsplit + split) * BLOCK_G + gs[:, None]) * D_P2 + ds[None, :]
            tl.store(out, acc)
            tl.store(state + gs * 2, m)
            tl.store(state + gs * 2 + 1, l_sum)

    @triton.jit
    def _attention_combine_kernel(
        acc_ptr, ml_ptr, o_ptr, nsplit,
        HEADS: tl.constexpr, KV: tl.constexpr, G: tl.constexpr, BLOCK_G: tl.constexpr, D: tl.constexpr,
        D_P2: tl.constexpr, BLOCK_S: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        head = tl.program_id(1)
        kvh = head // G
        g = head % G
        ss = tl.arange(0, BLOCK_S)
        ds = tl.arange(0, D_P2)
        cell = (row * KV + kvh) * nsplit + ss
        ok = ss < nsplit
        m = tl.load(ml_ptr + (cell * BLOCK_G + g) * 2, mask=ok, other=float("-inf"))
        lsum = tl.load(ml_ptr + (cell * BLOCK_G + g) * 2 + 1, mask=ok, other=0.0)
        top = tl.max(m, axis=0)
        weight = tl.where(ok & (lsum > 0), tl.exp(m - top), 0.0)
        acc = tl.load(
            acc_ptr + (cell[:, None] * BLOCK_G + g) * D_P2 + ds[None, :],
            mask=(ok & (lsum > 0))[:, None],
            other=0.0,
        )
        o = tl.sum(acc * weight[:, None], axis=0) / tl.sum(lsum * weight, axis=0)
        tl.store(o_ptr + (row * HEADS + head) * D + ds, o.to(o_ptr.dtype.element_ty), mask=ds < D)

    @triton.jit
    def _silu_mul_kernel(
        gu_ptr, out_ptr, n, gu_stride, b_ptr, slot_ptr, r_total,
        BLOCK: tl.constexpr, RANK: tl.constexpr, HAS_LORA: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        y_row = gu_ptr + row * gu_stride
        g = tl.load(y_row + cols, mask=mask, other=0.0)
        u = tl.load(y_row + n + cols, mask=mask, other=0.0)
        if HAS_LORA:
            slot = tl.load(slot_ptr + row)
            g = _plus_row_lora(g, y_row, b_ptr, slot, 2 * n, r_total, 0, cols, mask, RANK)
            u = _plus_row_lora(u, y_row, b_ptr, slot, 2 * n, r_total, 1, n + cols, mask, RANK)
        g = g.to(tl.float32)
        act = (g / (1.0 + tl.exp(-g))).to(u.dtype).to(tl.float32)
        tl.store(out_ptr + row * n + cols, (act * u.to(tl.float32)).to(u.dtype), mask=mask)


# ----------------------------------------------------------------------------- dispatch


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(normed, x + residual) of rows ``x`` (B, n), contiguous; ``residual``'s rows may be strided
    (a folded projection's base columns)."""
    if not use_triton(x):
        return rms_norm_torch(x, weight, eps, residual)
    b, n = x.shape
    out = torch.empty_like(x)
    total = torch.empty_like(x) if residual is not None else x
    kernel: Any = _rms_norm_kernel
    kernel[(b,)](
        x, residual if residual is not None else x, weight, out, total, n,
        residual.stride(0) if residual is not None else n, eps, HAS_RES=residual is not None, BLOCK=triton.next_power_of_2(n), num_warps=8,
    )  # fmt: skip
    return out, total


def group_rows(slots: torch.Tensor, n_slots: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(order, starts): the rows sorted by slot, and where each slot's rows begin in that order
    (``order[starts[s]:starts[s + 1]]`` are the rows of slot ``s``; rows of slot -1 come first and
    belong to none). On the device, with no host sync: a decode step computes it once for all
    its projections."""
    order = torch.argsort(slots, stable=True)
    bounds = torch.arange(n_slots + 1, device=slots.device, dtype=slots.dtype)
    starts = torch.searchsorted(slots[order], bounds)
    return order.to(torch.int32), starts.to(torch.int32)


def add_lora(
    y: torch.Tensor,
    out: int,
    b: torch.Tensor,
    slots: torch.Tensor,
    bounds: list[int],
    groups: tuple[torch.Tensor, torch.Tensor] | None = None,
    r_total: int | None = None,
) -> torch.Tensor:
    """The base columns of a folded projection's output ``y`` (B, out + span * R) plus each
    row's LoRA term: ``y[:, :out]`` updated in place on the Triton path (a strided view), a new
    tensor on the torch path. ``span``: the slots whose ``x A^T`` columns ``y`` holds (the
    first ``span`` of ``b``'s; every row's slot is below it). ``r_total``: the columns of one
    slot (R; by default ``y`` holds every slot). ``groups``: ``group_rows(slots, b.shape[0])``,
    when the caller has it already."""
    if not use_triton(y):
        return lora_expand_torch(y[:, None, :], out, b, slots, bounds, r_total)[:, 0, :]
    nrows = y.shape[0]
    _, _, rank = b.shape
    if r_total is None:
        r_total = (y.shape[1] - out) // b.shape[0]
    n_slots = (y.shape[1] - out) // r_total  # the span: slots at or above it have no rows here
    sizes = [hi - lo for lo, hi in itertools.pairwise(bounds)]
    cuts = [*bounds[1:-1], out, out][:2]
    order, starts = groups if groups is not None else group_rows(slots, n_slots)
    # Each slot's rows in tiles of GROUP_ROWS, spread over up to ROW_PROGRAMS programs per (slot, block)
    programs = min(ROW_PROGRAMS, triton.cdiv(nrows, GROUP_ROWS))
    chunk = (SMALL_CHUNK if nrows == 1 else SMALL_CHUNK_SLOTS) if nrows <= GROUP_ROWS else 1024
    for size in sizes[:-1]:  # a chunk never spans two members (the last one may end short)
        chunk = min(chunk, _pow2_divisor(size, 1024))
    chunk = min(chunk, triton.next_power_of_2(sizes[-1]))
    expand: Any = _lora_expand_kernel
    expand[(n_slots, triton.cdiv(out, chunk), programs)](
        y, b, order, starts, y.stride(0), out, r_total, cuts[0], cuts[1], programs * GROUP_ROWS,
        RANK=rank, BLOCK_M=GROUP_ROWS, BLOCK_N=min(128, chunk), CHUNK=chunk, num_warps=4,
    )  # fmt: skip
    return y[:, :out]


def qk_rope_cache(
    qkv: torch.Tensor,
    q_norm: torch.Tensor | None,
    k_norm: torch.Tensor | None,
    eps: float,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    positions: torch.Tensor,
    heads: int,
    kv_heads: int,
    lora: RowLora | None = None,
) -> torch.Tensor:
    """q (B, H, D) of one token per row; its k and v written into cache rows ``[0, B)`` at
    ``positions``.  ``cos``/``sin``: (B, D); caches (rows, KV, columns, D) of one layer.
    ``lora``: ``qkv`` is the whole folded output, whose LoRA term is added here."""
    b = qkv.shape[0]
    d = cos.shape[-1]
    if not use_triton(qkv):
        if lora is not None:
            qkv = lora.apply_torch(qkv)
        q, k, v = qk_heads_torch(
            qkv[:, None], q_norm, k_norm, eps, cos[:, None], sin[:, None], heads, kv_heads
        )
        rows = torch.arange(b, device=qkv.device)
        k_cache[rows, :, positions] = k[:, :, 0, :]
        v_cache[rows, :, positions] = v[:, :, 0, :]
        return q[:, :, 0, :]
    q_out = torch.empty(b, heads, d, device=qkv.device, dtype=qkv.dtype)
    lora_b, row_slots, n_out, r_total, rank = _row_lora_args(lora, cos)
    kernel: Any = _qk_rope_cache_kernel
    kernel[(b, heads + 2 * kv_heads)](
        qkv, q_norm if q_norm is not None else cos, k_norm if k_norm is not None else cos,
        cos, sin, q_out, k_cache, v_cache, positions, lora_b, row_slots, n_out, r_total,
        qkv.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), eps,
        HEADS=heads, KV=kv_heads, D=d, HALF_P2=triton.next_power_of_2(d // 2), HAS_NORM=q_norm is not None,
        RANK=rank, HAS_LORA=lora is not None, num_warps=1,
    )  # fmt: skip
    return q_out


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    lengths: torch.Tensor,
    scale: float,
    window: int,
) -> torch.Tensor:
    """o (B, H, D): each row's queries over its own cache columns ``[0, length)``."""
    if not use_triton(q):
        return decode_attention_torch(q, k_cache, v_cache, lengths, scale, window)
    b, heads, d = q.shape
    kv = k_cache.shape[1]
    g = heads // kv
    block_g = max(16, triton.next_power_of_2(g))
    nsplit = triton.cdiv(window, SPLIT)
    d_p2 = triton.next_power_of_2(d)
    acc = torch.empty(b, kv, nsplit, block_g, d_p2, device=q.device, dtype=torch.float32)
    ml = torch.empty(b, kv, nsplit, block_g, 2, device=q.device, dtype=torch.float32)
    attn: Any = _decode_attention_kernel
    attn[(b, kv, nsplit)](
        q, k_cache, v_cache, lengths, acc, ml, k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        scale, nsplit, HEADS=heads, KV=kv, G=g, BLOCK_G=block_g, D=d, D_P2=d_p2, SPLIT_N=SPLIT, num_warps=4,
    )  # fmt: skip
    o = torch.empty_like(q)
    combine: Any = _attention_combine_kernel
    combine[(b, heads)](
        acc, ml, o, nsplit, HEADS=heads, KV=kv, G=g, BLOCK_G=block_g, D=d, D_P2=d_p2,
        BLOCK_S=triton.next_power_of_2(nsplit), num_warps=4,
    )  # fmt: skip
    return o


def silu_mul(gu: torch.Tensor, lora: RowLora | None = None) -> torch.Tensor:
    """``silu(gate) * up`` of rows ``gu`` (B, 2F) = [gate | up] (rows may be strided).
    ``lora``: ``gu`` is the whole folded output (B, 2F + span * R), whose LoRA term is added here."""
    if not use_triton(gu):
        return silu_mul_torch(lora.apply_torch(gu) if lora is not None else gu)
    b = gu.shape[0]
    n = (lora.out if lora is not None else gu.shape[1]) // 2
    out = torch.empty(b, n, device=gu.device, dtype=gu.dtype)
    block = SILU_LORA_BLOCK if lora is not None else 1024
    lora_b, row_slots, _, r_total, rank = _row_lora_args(lora, gu)
    kernel: Any = _silu_mul_kernel
    kernel[(b, triton.cdiv(n, block))](
        gu, out, n, gu.stride(0), lora_b, row_slots, r_total,
        BLOCK=block, RANK=rank, HAS_LORA=lora is not None, num_warps=4,
    )  # fmt: skip
    return out
