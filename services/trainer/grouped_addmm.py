"""``base + h B_gᵀ`` over row groups in one kernel: the LoRA output of a step of several slots.

In a step of several slots the adapters' second factor is one grouped matmul (each group of rows,
a slot's segment, times its own ``B``), ``torch._grouped_mm``, whose output ``[T, out]`` is then
added to the frozen linear's: a kernel that reads both and writes a third tensor. At 16x256 of 8
tenants on the H200 that addition took 9 ms of a 287 ms step, most of what separates it from the
same tokens of one tenant (whose ``addmm`` adds ``base`` in the GEMM's epilogue).
``grouped_addmm`` is the epilogue for the grouped case: one Triton kernel reads ``base``, ``h``
and each group's ``B`` tile and writes the sum once, accumulating in fp32 and rounding once. Its
backward is the gradients ``torch._grouped_mm`` would form (``h``'s and ``B``'s, grouped matmuls
again; ``B``'s written in its own layout) and ``base``'s, the output gradient itself.

Isolation: a row takes its own group's product by selection (``tl.where``), never by a sum with
masked-out terms, so a non-finite ``B`` of one group cannot reach another group's rows even
where a tile of rows spans two groups.

On CUDA with Triton and bf16 (where ``torch._grouped_mm`` runs), after a probe at first use per
device found the kernel within one rounding of the exact sum, its gradients within one rounding
of ``torch._grouped_mm``'s autograd and a NaN group isolated; elsewhere the caller adds as before.
``services/trainer/tests/test_grouped_addmm.py`` checks it.
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.probes import KernelProbe, beyond_one_step, largest_finite
from services.trainer.triton_support import tl, triton

BLOCK_M, BLOCK_N, BLOCK_K = 64, 128, 32


def fused_supported(h: torch.Tensor) -> bool:
    """Whether ``grouped_addmm`` serves ``h``'s device: CUDA, Triton, bf16, and a probe there
    that found the kernel agreeing with the exact sum and ``torch._grouped_mm``'s gradients."""
    if triton is None or not h.is_cuda or h.dtype != torch.bfloat16:
        return False
    return FUSED.usable(h.device, h.dtype)


def grouped_addmm(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``out[t] = base[t] + h[t] @ b[g(t)]ᵀ`` with ``g(t)`` the group whose rows hold ``t``.

    Args:
        base: [T, N] the frozen linear's output.
        h: [T, K] the first factor's output.
        b: [G, N, K] each group's second factor.
        offsets: [G] int32, each group's end row (cumulative; the last is T).

    Returns:
        [T, N] in ``base``'s dtype, differentiable in ``base``, ``h`` and ``b``.
    """
    return _GroupedAddmm.apply(base, h, b, offsets)


def _reference(base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """What the caller computes without the kernel: a grouped matmul, then the addition."""
    return base + torch._grouped_mm(h, b.transpose(1, 2), offs=offsets).to(base.dtype)


def _mismatch(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernel may not serve this device ("" where, on 300 rows in five groups (one empty,
    one whose ``B`` holds a NaN), the sum is within one rounding step of the float64 one, the NaN
    stays in its group's rows, and the gradients are within one rounding step (plus 1e-6 of the
    largest) of ``torch._grouped_mm``'s)."""
    gen = torch.Generator(device=device).manual_seed(0)
    rows, n, k = 300, 200, 48
    offsets = torch.tensor([70, 70, 150, 229, rows], dtype=torch.int32, device=device)
    base = torch.randn(rows, n, generator=gen, device=device).to(dtype)
    h = torch.randn(rows, k, generator=gen, device=device).to(dtype)
    b = (0.2 * torch.randn(offsets.shape[0], n, k, generator=gen, device=device)).to(dtype)
    b[3, 5, 7] = float("nan")  # rows 150..228
    grad = torch.randn(rows, n, generator=gen, device=device).to(dtype)
    leaves = [t.clone().requires_grad_() for t in (base, h, b)]
    refs = [t.clone().requires_grad_() for t in (base, h, b)]
    got = grouped_addmm(leaves[0], leaves[1], leaves[2], offsets)
    ref = _reference(refs[0], refs[1], refs[2], offsets)
    got.backward(grad)
    ref.backward(grad)
    sizes = torch.diff(offsets.long(), prepend=torch.zeros(1, dtype=torch.long, device=device))
    group = torch.repeat_interleave(torch.arange(offsets.shape[0], device=device), sizes)
    exact = base.double() + torch.einsum("tk,tnk->tn", h.double(), b.double()[group])
    outside = group != 3
    if bool(got[outside].isnan().any()) or not bool(got[~outside].isnan().any()):
        return "lets a NaN of one group's B reach another group's rows, or loses it in its own"
    step = torch.finfo(dtype).eps
    g, e = got[outside].detach().double(), exact[outside]
    if not bool(((g - e).abs() <= step * e.abs() + 1e-6 * float(e.abs().max())).all()):
        return "sum differs from the exact one by more than one rounding step"
    problems = []
    for name, mine, theirs in zip(("base", "h", "b"), leaves, refs, strict=True):
        assert mine.grad is not None and theirs.grad is not None
        slack = 1e-6 * largest_finite(theirs.grad)
        problems.append(beyond_one_step(f"gradient of {name}", mine.grad, theirs.grad, slack))
    return "; ".join(p for p in problems if p)


FUSED = KernelProbe("grouped_addmm's Triton kernel", "torch._grouped_mm and an addition", _mismatch)


class _GroupedAddmm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, base: torch.Tensor, h: torch.Tensor, b: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
        rows, n = base.shape
        k = h.shape[1]
        out = torch.empty(rows, n, dtype=base.dtype, device=base.device)
        kernel: Any = _grouped_addmm_kernel
        grid = (triton.cdiv(rows, BLOCK_M), triton.cdiv(n, BLOCK_N))
        kernel[grid](
            base, h, b, offsets, out, rows, n, k, offsets.shape[0],
            base.stride(0), base.stride(1), h.stride(0), h.stride(1), b.stride(0), b.stride(1), b.stride(2),
            BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K, num_warps=4,
        )  # fmt: skip
        ctx.save_for_backward(h, b, offsets)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, Any, Any, None]:
        h, b, offsets = ctx.saved_tensors
        # the gradients of ``grouped_mm(h, bᵀ)``: h's a grouped matmul by the groups' B, b's one
        # per group over its rows (a grouped matmul ragged along K, in b's own layout)
        dh = torch._grouped_mm(grad, b, offs=offsets) if ctx.needs_input_grad[1] else None
        db = torch._grouped_mm(grad.t(), h, offs=offsets) if ctx.needs_input_grad[2] else None  # [G, out, w]
        return grad, dh, db, None


if triton is not None:

    @triton.jit
    def _grouped_addmm_kernel(
        base_ptr, h_ptr, b_ptr, offsets_ptr, out_ptr, rows, n, k, groups,
        base_s0, base_s1, h_s0, h_s1, b_s0, b_s1, b_s2,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        # out: contiguous [rows, n]
        first = tl.program_id(0) * BLOCK_M
        r = first + tl.arange(0, BLOCK_M)
        c = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        r_in, c_in = r < rows, c < n
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, groups):
            start = tl.load(offsets_ptr + g - 1, mask=g > 0, other=0)
            end = tl.load(offsets_ptr + g)
            if (end > first) & (start < first + BLOCK_M) & (end > start):  # this tile holds rows of g
                part = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for k0 in range(0, k, BLOCK_K):
                    kk = k0 + tl.arange(0, BLOCK_K)
                    h = tl.load(
                        h_ptr + r[:, None].to(tl.int64) * h_s0 + kk[None, :] * h_s1,
                        mask=r_in[:, None] & (kk[None, :] < k),
                        other=0.0,
                    )  # [BLOCK_M, BLOCK_K]
                    bt = tl.load(
                        b_ptr + g * b_s0 + c[None, :] * b_s1 + kk[:, None] * b_s2,
                        mask=(kk[:, None] < k) & c_in[None, :],
                        other=0.0,
                    )  # [BLOCK_K, BLOCK_N]: b[g, c, kk] transposed
                    part = tl.dot(h, bt, part)
                mine = (r >= start) & (r < end)
                acc = tl.where(mine[:, None], part, acc)  # selected, never summed across groups
        inside = r_in[:, None] & c_in[None, :]
        base = tl.load(base_ptr + r[:, None].to(tl.int64) * base_s0 + c[None, :] * base_s1, mask=inside, other=0.0)
        total = base.to(tl.float32) + acc
        tl.store(out_ptr + r[:, None].to(tl.int64) * n + c[None, :], total.to(out_ptr.dtype.element_ty), mask=inside)
