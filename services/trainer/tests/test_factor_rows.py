"""``factor_rows``: the block-diagonal ``B`` of a fused projection selects each row's own part
(on CUDA in one kernel, bit for bit ``torch.where``'s), and on CUDA the grouped path's factor
gradients add into their own slots' fp32 rows within one rounding, a NaN group's values never
reaching another slot."""

from __future__ import annotations

import pytest
import torch

from services.trainer import factor_rows

cuda = pytest.mark.skipif(
    factor_rows.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton"
)

U32 = torch.finfo(torch.float32).eps


def _parts(rows: int, parts: int, device: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Interleaved parts (as fused QKV rows are): ``part_mask [rows, parts]`` and ``row_part``."""
    row_part = (torch.arange(rows, device=device) * 5 % parts).to(torch.int32)
    return row_part.view(-1, 1) == torch.arange(parts, device=device).view(1, -1), row_part


def test_the_kernels_are_not_offered_off_cuda() -> None:
    """On the CPU the grouped path keeps its eager moves."""
    assert not factor_rows.fused_supported(torch.zeros(4, 16, dtype=torch.bfloat16))


def test_the_block_diagonal_puts_each_row_in_its_own_parts_columns_and_zeros_elsewhere() -> None:
    """Row ``o`` of ``B_bd`` holds ``b[o]`` in the columns of part ``p(o)`` and exact zeros in
    the others, even where ``b[o]`` is NaN (selected, never multiplied); without parts ``b``
    itself is returned."""
    mask, row_part = _parts(10, 3, "cpu")
    b = torch.randn(2, 10, 4, dtype=torch.bfloat16)
    b[1, 7, 2] = float("nan")
    got = factor_rows.block_diagonal(b, mask, row_part)
    assert got.shape == (2, 10, 12)
    for o in range(10):
        p = int(row_part[o])
        blocks = got[:, o].unflatten(-1, (3, 4))
        assert bool((blocks[:, p].isnan() == b[:, o].isnan()).all())
        assert torch.equal(blocks[:, p].nan_to_num(), b[:, o].nan_to_num())
        others = [q for q in range(3) if q != p]
        assert bool((blocks[:, others] == 0).all())
    assert factor_rows.block_diagonal(b, None, None) is b


@cuda
def test_cuda_the_block_diagonal_kernel_is_torch_wheres_bit_for_bit() -> None:
    """Fused QKV of Qwen3-8B (6,144 rows, three parts) for eight groups of rank 32, read through
    a strided view of wider rows as the compute rows are, and one group's ``B`` alone (the
    one-slot path): the kernel's output equals ``torch.where``'s exactly; the probe accepts."""
    mask, row_part = _parts(6144, 3, "cuda")
    wide = torch.randn(9, 6144, 64, device="cuda").to(torch.bfloat16)
    b = wide[:8, :, :32]
    assert factor_rows.fused_supported(b)
    expected = factor_rows._block_diagonal_where(b, mask)
    assert torch.equal(factor_rows.block_diagonal(b, mask, row_part), expected)
    one = b[3].contiguous()
    assert torch.equal(factor_rows.block_diagonal(one, mask, row_part), expected[3])


def _exact_sums(dest: torch.Tensor, added: torch.Tensor, slots: torch.Tensor, rank: int) -> torch.Tensor:
    exact = dest.double()
    exact[slots, :, :rank] += added
    return exact


@cuda
def test_cuda_a_gradients_add_into_their_own_slots_rows_within_one_rounding() -> None:
    """``A``'s gradients of fused gate/up (two parts, in = 4,096) for three groups of rank 24 in a
    pool of rank 32: group ``k``'s rows ``p*24 + i`` add into slot ``slots[k]``'s part ``p``, row
    ``i``, within one fp32 rounding of the float64 sum; the other slots' rows and the columns past
    the rank are untouched; a NaN of one group lands in its own slot only."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    pool, parts, top, rank, cols = 6, 2, 32, 24, 4096
    dest = torch.randn(pool, parts, top, cols, generator=gen, device="cuda")
    grads = torch.randn(3, parts * rank + 16, cols, generator=gen, device="cuda").to(torch.bfloat16)
    grads[1, 30, 9] = float("nan")
    groups = torch.tensor([2, 1, 0], device="cuda")
    slots = torch.tensor([5, 0, 3], device="cuda")
    exact = _exact_sums(
        dest, grads[:, : parts * rank].unflatten(1, (parts, rank)).double()[groups], slots, rank
    )
    got = dest.clone()
    factor_rows.add_a_grads(got, grads, groups, slots, rank)
    assert torch.equal(got[[1, 2, 4]], dest[[1, 2, 4]])
    assert torch.equal(got[:, :, rank:], dest[:, :, rank:])
    assert not bool(got[[3, 5]].isnan().any()) and bool(got[0].isnan().any())
    close = (got.double() - exact).abs() <= U32 * exact.abs()
    assert bool((close | (got.isnan() & exact.isnan())).all())


@cuda
def test_cuda_b_gradients_take_each_rows_own_part_and_scale_into_their_slots_rows() -> None:
    """``B``'s gradients of fused QKV (6,144 interleaved rows, three parts) for eight groups of
    rank 32 into a pool of eight slots, in an order of slots other than the groups': row ``o`` of
    group ``k`` takes columns ``p(o)*32 ..`` of the block-diagonal gradient, times its slot's
    scale, into ``slots[k]``'s row, within one fp32 rounding of the float64 sum."""
    gen = torch.Generator(device="cuda").manual_seed(1)
    pool, rows, top, rank, parts = 8, 6144, 32, 32, 3
    _, row_part = _parts(rows, parts, "cuda")
    dest = torch.randn(pool, rows, top, generator=gen, device="cuda")
    grads = torch.randn(pool, rows, parts * rank, generator=gen, device="cuda").to(torch.bfloat16)
    groups = torch.arange(pool, device="cuda")
    slots = torch.tensor([7, 6, 5, 4, 0, 1, 2, 3], device="cuda")
    scales = torch.tensor([1.0, 2.0, 0.5, 1.0, 4.0, 1.0, 1.0, 0.25], device="cuda")
    index = (row_part.long().view(-1, 1) * rank + torch.arange(rank, device="cuda")).expand(pool, -1, -1)
    added = grads.double().gather(2, index) * scales.double().view(-1, 1, 1)
    exact = _exact_sums(dest, added, slots, rank)
    got = dest.clone()
    factor_rows.add_b_grads(got, grads, groups, slots, scales, rank, row_part)
    assert bool(((got.double() - exact).abs() <= U32 * exact.abs()).all())
