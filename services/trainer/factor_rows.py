"""The grouped path's LoRA factors moved into and out of the grouped matmuls' layouts, on CUDA in
one Triton kernel each.

A step of several slots multiplies each segment of the packed stream by its own slot's factors
(``lora.SlotAdapter._grouped``): ``A_g [w, in]`` and, for a fused projection (QKV, gate/up), the
block-diagonal ``B_g [out, w]`` whose row ``o`` holds ``B[o]`` in the columns of its part
``p(o)`` and zeros elsewhere. Two moves surround those matmuls:

- forward, ``block_diagonal``: ``B_bd [G, out, parts*r]`` from the groups' ``B [G, out, r]``
  (the one-slot path's ``[out, parts*r]`` likewise);
- backward, ``add_a_grads`` and ``add_b_grads``: each group's factor gradient (``[G, w, in]``
  for ``A``; ``[G, out, w]`` for ``B``, of which each row's own part's block is taken) added into
  its slot's fp32 row of ``PooledRows.grads``, ``B``'s times the slot's ``alpha/rank``.

In eager torch the first is a ``where`` over a broadcast mask, and the second a gather followed
by an addition of bf16 into fp32 through a view whose slots lie a whole pool row apart (every
tensor of an adapter): torch splits such an addition into kernels of 32-bit offsets, each of the
general strided kind. At 16x256 of 8 tenants on an H100 that took 4.9 ms of additions, 1.4 ms of
gathers and 2.2 ms of ``where`` a step, against one tenant's 1.3 ms of additions for the same
tokens. Each kernel here reads its input once and writes its output once.

Isolation: a program reads one group's values and writes one slot's rows; no arithmetic combines
two groups, and ``block_diagonal`` selects (a masked load), it never multiplies. The additions
assume the groups' slots are distinct, as the grouped path's are (one segment per slot:
``packing.pack`` merges a slot's datums, a static step has one segment per slot).

On CUDA with Triton and bf16, after a probe at first use per device found the block diagonal
equal to the eager one bit for bit and the additions within one fp32 rounding of float64 sums
(a NaN group's values kept in its own slot's row); elsewhere the caller's eager path serves.
``services/trainer/tests/test_factor_rows.py`` checks both.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.probes import KernelProbe
from services.trainer.triton_support import tl, triton

ELEMENTS_PER_PROGRAM = 2048
"""Values one program moves: rows of the block times its (power-of-two) columns."""


def fused_supported(t: torch.Tensor) -> bool:
    """Whether the kernels serve ``t``'s device: CUDA, Triton, a bf16 ``t``, and a probe there
    that found them agreeing with the eager moves."""
    if triton is None or not t.is_cuda or t.dtype != torch.bfloat16:
        return False
    return FUSED.usable(t.device)


def block_diagonal(
    b: torch.Tensor, part_mask: torch.Tensor | None, row_part: torch.Tensor | None
) -> torch.Tensor:
    """``B_bd [.., out, parts*r]`` from ``b [.., out, r]`` (2 or 3 dims): row ``o`` holds
    ``b[.., o, :]`` in the columns of its part, zeros elsewhere (``part_mask [out, parts]`` is the
    one-hot of each row's part, ``row_part [out]`` int32 the part itself; both None: ``b``).

    The zeros are constants and the entries of ``b`` are selected, never multiplied, so the
    gradient of ``b`` is the selected entries of ``B_bd``'s gradient, whatever the others hold.
    On CUDA (``fused_supported``) one kernel writes a new contiguous tensor; elsewhere
    ``torch.where`` does."""
    if part_mask is None or row_part is None:
        return b
    if b.dim() in (2, 3) and fused_supported(b):
        stacked = b if b.dim() == 3 else b.unsqueeze(0)
        return _block_diagonal_fused(stacked, row_part, part_mask.shape[1]).view(*b.shape[:-1], -1)
    return _block_diagonal_where(b, part_mask)


def _block_diagonal_where(b: torch.Tensor, part_mask: torch.Tensor) -> torch.Tensor:
    out, parts = part_mask.shape
    picked = torch.where(
        part_mask.view(out, parts, 1), b.unsqueeze(-2), b.new_zeros(())
    )  # [.., out, parts, r]
    return picked.flatten(-2)  # [.., out, parts*r]


def _block_diagonal_fused(b: torch.Tensor, row_part: torch.Tensor, parts: int) -> torch.Tensor:
    """``_block_diagonal_where`` of ``b [G, out, r]`` (any strides, the last one 1) in one
    kernel: a new contiguous ``[G, out, parts*r]``."""
    groups, rows, rank = b.shape
    width = parts * rank
    out = torch.empty(groups, rows, width, dtype=b.dtype, device=b.device)
    if out.numel() == 0:
        return out
    if b.stride(2) != 1:
        b = b.contiguous()
    block_c = triton.next_power_of_2(width)
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_c)
    kernel: Any = _block_diagonal_kernel
    kernel[(triton.cdiv(rows, block_r), groups)](
        b, row_part, out, rows, rank, width, b.stride(0), b.stride(1),
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
    return out


def add_a_grads(
    dest: torch.Tensor, grads: torch.Tensor, groups: torch.Tensor, slots: torch.Tensor, rank: int
) -> None:
    """``dest[slots[k], p, i, :] += grads[groups[k], p*rank + i, :]`` for every part ``p`` and
    ``i < rank``: ``A``'s gradients ``[G, w, in]`` into the slots' rows ``dest [S, parts, R, in]``
    (a view of the fp32 gradient rows; ``rank <= R``)."""
    _, parts, _, cols = dest.shape
    _launch(dest, grads, groups, slots, None, None, rows=parts * rank, cols=cols, rank=rank,
            rows_per_part=rank, dest_part_stride=dest.stride(1), dest_row_stride=dest.stride(2))  # fmt: skip


def add_b_grads(
    dest: torch.Tensor,
    grads: torch.Tensor,
    groups: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor,
    rank: int,
    row_part: torch.Tensor | None,
) -> None:
    """``dest[slots[k], o, :rank] += scales[k] * grads[groups[k], o, q(o)*rank : (q(o)+1)*rank]``
    with ``q(o) = row_part[o]`` (0 without parts): ``B``'s gradients ``[G, out, w]`` (of the
    block-diagonal ``B`` where ``row_part`` is given) into the slots' rows ``dest [S, out, R]``."""
    rows = dest.shape[1]
    _launch(dest, grads, groups, slots, scales, row_part, rows=rows, cols=rank, rank=rank,
            rows_per_part=rows, dest_part_stride=0, dest_row_stride=dest.stride(1))  # fmt: skip


def _launch(
    dest: torch.Tensor,
    grads: torch.Tensor,
    groups: torch.Tensor,
    slots: torch.Tensor,
    scales: torch.Tensor | None,
    row_part: torch.Tensor | None,
    *,
    rows: int,
    cols: int,
    rank: int,
    rows_per_part: int,
    dest_part_stride: int,
    dest_row_stride: int,
) -> None:
    assert dest.dtype == torch.float32 and dest.stride(-1) == 1, "the slots' rows: fp32, unit last stride"
    if groups.shape[0] == 0 or rows == 0 or cols == 0:
        return
    if grads.stride(-1) != 1:
        grads = grads.contiguous()
    block_c = min(1024, triton.next_power_of_2(cols))
    block_r = max(1, ELEMENTS_PER_PROGRAM // block_c)
    tiles = triton.cdiv(rows, block_r) * triton.cdiv(cols, block_c)
    kernel: Any = _add_into_rows_kernel
    kernel[(tiles, groups.shape[0])](
        dest, grads, groups, slots, slots if scales is None else scales, slots if row_part is None else row_part,
        rows, cols, rank, rows_per_part, dest.stride(0), dest_part_stride, dest_row_stride,
        grads.stride(0), grads.stride(1),
        HAS_SCALES=scales is not None, HAS_PARTS=row_part is not None,
        BLOCK_R=block_r, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip


def _mismatch(device: torch.device) -> str:
    """Why the kernels may not serve this device ("" where, on three slots of a pool of five with
    a rank below the pool's, three interleaved parts and one group whose gradients hold a NaN,
    ``block_diagonal`` equals the eager one bit for bit, the additions are within one fp32
    rounding step of float64 sums, and the NaN stays in its own slot's rows)."""
    gen = torch.Generator(device=device).manual_seed(0)
    pool, parts, top, rank, cols, rows = 5, 3, 8, 6, 300, 70

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen, device=device)

    row_part = (torch.arange(rows, device=device) * 7 % parts).to(torch.int32)
    part_mask = row_part.view(-1, 1) == torch.arange(parts, device=device).view(1, -1)
    b = randn(4, rows, top).to(torch.bfloat16)[:3, :, :rank]  # strided, as the compute rows' view is
    if not torch.equal(_block_diagonal_fused(b, row_part, parts), _block_diagonal_where(b, part_mask)):
        return "the block diagonal differs from torch.where's"
    groups = torch.tensor([2, 0, 1], device=device)
    slots = torch.tensor([4, 1, 2], device=device)  # group 0's gradients (with the NaN) go to slot 1
    scales = torch.tensor([0.5, 2.0, 4.0], device=device)
    a_grads = randn(3, parts * rank + 2, cols).to(torch.bfloat16)
    b_grads = randn(3, rows, parts * rank + 2).to(torch.bfloat16)
    a_grads[0, 3, 5] = b_grads[0, 3, 5] = float("nan")  # both within what the additions read
    index = (row_part.long().view(-1, 1) * rank + torch.arange(rank, device=device)).expand(3, -1, -1)
    cases = [
        (
            "A",
            randn(pool, parts, top, cols),
            lambda d: add_a_grads(d, a_grads, groups, slots, rank),
            a_grads[:, : parts * rank].unflatten(1, (parts, rank)).double()[groups],
        ),
        (
            "B",
            randn(pool, rows, top),
            lambda d: add_b_grads(d, b_grads, groups, slots, scales, rank, row_part),
            b_grads.double().gather(2, index)[groups] * scales.double().view(-1, 1, 1),
        ),
    ]
    problems = []
    for name, dest, add, added in cases:
        exact = dest.double()
        exact[slots, :, :rank] += added
        got = dest.clone()
        add(got)
        others = torch.arange(pool, device=device) != 1
        if bool(got[others].isnan().any()):
            problems.append(f"{name}: a NaN of one group reached another slot's rows")
        g = got.double()
        close = (g - exact).abs() <= torch.finfo(torch.float32).eps * exact.abs()
        if not bool((close | (g.isnan() & exact.isnan())).all()):
            problems.append(f"{name}: additions beyond one fp32 rounding step of the float64 sums")
    return "; ".join(problems)


FUSED = KernelProbe(
    "the grouped path's factor kernels", "torch.where, gathers and strided additions", _mismatch
)


if triton is not None:

    @triton.jit
    def _block_diagonal_kernel(
        b_ptr, row_part_ptr, out_ptr, rows, rank, width, b_group_stride, b_row_stride,
        BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # out: contiguous [G, rows, width]; a column's part is column // rank
        group = tl.program_id(1).to(tl.int64)
        i = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        c = tl.arange(0, BLOCK_C)
        row_in = i < rows
        part = tl.load(row_part_ptr + i, mask=row_in, other=-1)
        inside = row_in[:, None] & (c < width)[None, :]
        mine = inside & ((c // rank)[None, :] == part[:, None])
        value = tl.load(
            b_ptr + group * b_group_stride + i[:, None].to(tl.int64) * b_row_stride + (c % rank)[None, :],
            mask=mine,
            other=0.0,
        )  # the other parts' columns are never read: constant zeros
        tl.store(out_ptr + (group * rows + i[:, None]) * width + c[None, :], value, mask=inside)

    @triton.jit
    def _add_into_rows_kernel(
        dest_ptr, src_ptr, groups_ptr, slots_ptr, scales_ptr, row_part_ptr,
        rows, cols, rank, rows_per_part, dest_slot_stride, dest_part_stride, dest_row_stride,
        src_group_stride, src_row_stride,
        HAS_SCALES: tl.constexpr, HAS_PARTS: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr,
    ):  # fmt: skip
        # one program: a BLOCK_R x BLOCK_C tile of one group's (rows, cols), into its slot's row
        k = tl.program_id(1)
        col_tiles = tl.cdiv(cols, BLOCK_C)
        tile = tl.program_id(0)
        i = (tile // col_tiles) * BLOCK_R + tl.arange(0, BLOCK_R)
        j = (tile % col_tiles) * BLOCK_C + tl.arange(0, BLOCK_C)
        row_in = i < rows
        inside = row_in[:, None] & (j < cols)[None, :]
        group = tl.load(groups_ptr + k).to(tl.int64)
        slot = tl.load(slots_ptr + k).to(tl.int64)
        src_col = j[None, :].to(tl.int64)
        if HAS_PARTS:
            part = tl.load(row_part_ptr + i, mask=row_in, other=0).to(tl.int64)
            src_col = src_col + (part * rank)[:, None]
        wide = i[:, None].to(tl.int64)
        src = tl.load(
            src_ptr + group * src_group_stride + wide * src_row_stride + src_col, mask=inside, other=0.0
        )
        value = src.to(tl.float32)
        if HAS_SCALES:
            value = value * tl.load(scales_ptr + k)
        dest = (
            dest_ptr
            + slot * dest_slot_stride
            + (wide // rows_per_part) * dest_part_stride
            + (wide % rows_per_part) * dest_row_stride
            + j[None, :]
        )
        tl.store(dest, tl.load(dest, mask=inside, other=0.0) + value, mask=inside)
