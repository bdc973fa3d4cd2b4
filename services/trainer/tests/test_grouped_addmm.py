"""``grouped_addmm``: on CUDA, ``base + h B_gᵀ`` per row group in one kernel, within one bf16
rounding of the exact sum, with ``torch._grouped_mm``'s gradients, each group's values kept in
its own rows; elsewhere not offered (the caller adds as before)."""

from __future__ import annotations

import pytest
import torch

from services.trainer import grouped_addmm

cuda = pytest.mark.skipif(
    grouped_addmm.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton"
)


def test_the_kernel_is_not_offered_off_cuda() -> None:
    """On the CPU the caller keeps ``torch._grouped_mm`` and its addition."""
    assert not grouped_addmm.fused_supported(torch.zeros(4, 16, dtype=torch.bfloat16))


def _case(groups: list[int], n: int, k: int) -> tuple[torch.Tensor, ...]:
    """bf16 ``base [T, n]``, ``h [T, k]``, ``b [G, n, k]``, int32 cumulative ends of ``groups``
    rows each, and an output gradient."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    rows = sum(groups)
    offsets = torch.tensor(groups, device="cuda").cumsum(0).to(torch.int32)
    base = torch.randn(rows, n, generator=gen, device="cuda").to(torch.bfloat16)
    h = torch.randn(rows, k, generator=gen, device="cuda").to(torch.bfloat16)
    b = (0.2 * torch.randn(len(groups), n, k, generator=gen, device="cuda")).to(torch.bfloat16)
    grad = torch.randn(rows, n, generator=gen, device="cuda").to(torch.bfloat16)
    return base, h, b, offsets, grad


def _group_of_rows(offsets: torch.Tensor) -> torch.Tensor:
    sizes = torch.diff(offsets.long(), prepend=torch.zeros(1, dtype=torch.long, device=offsets.device))
    return torch.repeat_interleave(torch.arange(offsets.shape[0], device=offsets.device), sizes)


@cuda
def test_cuda_the_sum_is_within_one_bf16_rounding_of_the_exact_one() -> None:
    """Eight groups of uneven sizes (one empty, several sharing a tile of rows) and the widths of
    Qwen3-8B's fused QKV output with three parts of rank 32: every value within one bf16 step of
    the float64 ``base + h B_gᵀ``; the probe accepts the kernel."""
    base, h, b, offsets, _ = _case([256, 17, 0, 300, 64, 1, 190, 200], 6144, 96)
    assert grouped_addmm.fused_supported(h)
    got = grouped_addmm.grouped_addmm(base, h, b, offsets).double()
    exact = base.double() + torch.einsum("tk,tnk->tn", h.double(), b.double()[_group_of_rows(offsets)])
    step = torch.finfo(torch.bfloat16).eps
    assert bool(((got - exact).abs() <= step * exact.abs() + 1e-6 * float(exact.abs().max())).all())


@cuda
def test_cuda_the_gradients_are_torch_grouped_mms_within_one_rounding() -> None:
    """``base``'s gradient is the output's; ``h``'s and ``B``'s agree with autograd through
    ``torch._grouped_mm`` and the addition within one bf16 step."""
    base, h, b, offsets, grad = _case([100, 0, 157, 43], 2048, 64)
    mine = [t.clone().requires_grad_() for t in (base, h, b)]
    theirs = [t.clone().requires_grad_() for t in (base, h, b)]
    grouped_addmm.grouped_addmm(mine[0], mine[1], mine[2], offsets).backward(grad)
    grouped_addmm._reference(theirs[0], theirs[1], theirs[2], offsets).backward(grad)
    step = torch.finfo(torch.bfloat16).eps
    for m, t in zip(mine, theirs, strict=True):
        assert m.grad is not None and t.grad is not None
        got, want = m.grad.double(), t.grad.double()
        assert bool(((got - want).abs() <= step * want.abs() + 1e-6 * float(want.abs().max())).all())
    assert mine[0].grad is not None and torch.equal(mine[0].grad, grad)


@cuda
def test_cuda_a_non_finite_b_of_one_group_reaches_only_that_groups_rows() -> None:
    """A NaN and an infinity in group 1's ``B``, whose rows share 64-row tiles with groups 0 and
    2: the output and ``h``'s gradient are non-finite only in group 1's rows."""
    base, h, b, offsets, grad = _case([40, 50, 60], 512, 32)
    b[1, 3, 4] = float("nan")
    b[1, 9, 0] = float("inf")
    h_leaf = h.clone().requires_grad_()
    out = grouped_addmm.grouped_addmm(base, h_leaf, b, offsets)
    out.backward(grad)
    assert h_leaf.grad is not None
    group = _group_of_rows(offsets)
    for values in (out.detach(), h_leaf.grad):
        bad_rows = (~values.isfinite()).any(dim=1)
        assert bool(bad_rows[group == 1].all()) and not bool(bad_rows[group != 1].any())
