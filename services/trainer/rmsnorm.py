"""RMSNorm with a frozen weight, on CUDA in one Triton kernel per direction.

Every norm of the model (each layer's two, Qwen3's per-head ``q``/``k`` norms, the final one) is
``y = x · rsqrt(mean(x²) + eps) · w`` over the last dim, and the trainer never trains ``w``. On
CUDA megatron's unfused spec runs ``torch.nn.RMSNorm``, whose kernels are general (a weight
gradient, any layout) and in a 4,096-token step of the 8B shape took 12.6 ms over its 289 calls,
about twice what reading and writing their tensors takes at the GPU's copy bandwidth.
``RMSNorm`` is that module with the same parameter (``weight``, so checkpoints and the module
tree stay megatron's) whose forward, on CUDA with a frozen weight, runs ``_RMSNormFunction``:
the forward reads each row once and keeps ``rsqrt`` per row (fp32), the backward reads the row
and its gradient once and writes only the input's gradient,
``dx = rstd · (w·dy − x̂ · mean(w·dy·x̂))`` with ``x̂ = x · rstd``. Rows of up to ``MAX_WIDTH``
columns are one block each; several short rows (the per-head norms' 128) share a program.

Arithmetic: fp32 from the dtype's values, one rounding to the dtype at the end, as torch's
kernels; the sums' order differs, so a value may differ from the eager path's by one rounding
step. A probe at first use per device and dtype checks that bound (forward and backward, NaN
and infinity where eager has them); where it fails, the eager path runs and the reason is logged
once. Elsewhere (CPU, a weight that requires a gradient, a wider row) the module is
``torch.nn.RMSNorm`` as is. ``services/trainer/tests/test_rmsnorm.py`` checks both paths.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from services.trainer.probes import KernelProbe, beyond_one_step, largest_finite
from services.trainer.triton_support import tl, triton

MAX_WIDTH = 16384
"""The widest row one program normalises (Qwen3-8B's hidden size is 4,096)."""

ELEMENTS_PER_PROGRAM = 4096
"""Rows per program: as many as fit this many elements (32 rows of a 128-wide head)."""


class RMSNorm(nn.RMSNorm):
    """The norm module megatron's layer spec builds (``config, hidden_size, eps``): a
    ``torch.nn.RMSNorm`` whose forward takes the fused kernels where they apply."""

    def __init__(self, config: Any, hidden_size: int, eps: float = 1e-5, **_: Any) -> None:
        super().__init__(normalized_shape=hidden_size, eps=eps)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None and not self.weight.requires_grad and fused_supported(x):
            eps = self.eps if self.eps is not None else torch.finfo(x.dtype).eps  # as torch's default
            return _RMSNormFunction.apply(x, self.weight, eps)
        return super().forward(x)


def fused_supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``x``: CUDA, Triton, a row of at most ``MAX_WIDTH``
    columns, and a probe that found them within one rounding step of the eager path on this
    device and dtype."""
    if triton is None or not x.is_cuda or x.shape[-1] > MAX_WIDTH:
        return False
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return False
    return FUSED.usable(x.device, x.dtype)


def _mismatch(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernels may not serve this device and dtype ("" where, on rows of 4,096 and of
    128 columns, forward and backward agree with ``torch.nn.RMSNorm`` to one rounding step of
    ``dtype``, plus 1e-6 of the largest value, and non-finite values sit where eager has them)."""
    gen = torch.Generator(device=device).manual_seed(0)
    problems = []
    for rows, width in ((9, 4096), (70, 128)):
        x = (3 * torch.randn(rows, width, generator=gen, device=device)).to(dtype)
        x[1, 5] = float("nan")
        x[2, 7] = float("inf")
        weight = (1 + 0.5 * torch.randn(width, generator=gen, device=device)).to(dtype)
        grad = torch.randn(rows, width, generator=gen, device=device).to(dtype)
        eager = nn.RMSNorm(width, eps=1e-6, device=device, dtype=dtype)
        with torch.no_grad():
            eager.weight.copy_(weight)
        eager.weight.requires_grad_(False)
        got_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
        got, ref = _RMSNormFunction.apply(got_x, weight, 1e-6), eager(ref_x)
        got.backward(grad)
        ref.backward(grad)
        assert got_x.grad is not None and ref_x.grad is not None
        problems += [
            beyond_one_step(f"forward ({width} wide)", got, ref, 1e-6 * largest_finite(ref)),
            beyond_one_step(f"backward ({width} wide)", got_x.grad, ref_x.grad, 1e-6 * largest_finite(ref_x.grad)),
        ]
    return "; ".join(p for p in problems if p)


FUSED = KernelProbe("RMSNorm's Triton kernels", "torch.nn.RMSNorm", _mismatch)


def _launch(rows: int, width: int) -> tuple[tuple[int], int, int, int]:
    """(grid, rows per program, block width, warps) for ``rows`` rows of ``width`` columns."""
    block = triton.next_power_of_2(width)
    per_program = max(1, ELEMENTS_PER_PROGRAM // block)
    warps = 8 if block * per_program >= 4096 else 4
    return (triton.cdiv(rows, per_program),), per_program, block, warps


class _RMSNormFunction(torch.autograd.Function):
    """``x · rsqrt(mean(x²) + eps) · w`` over the last dim, saving ``x`` and the per-row
    ``rsqrt`` (fp32); no gradient for ``w``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        width = x.shape[-1]
        rows = x.reshape(-1, width)
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        out = torch.empty(rows.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(rows.shape[0], dtype=torch.float32, device=x.device)
        grid, per_program, block, warps = _launch(rows.shape[0], width)
        kernel: Any = _rmsnorm_forward_kernel
        kernel[grid](
            rows, weight, out, rstd, rows.shape[0], width, rows.stride(0), eps,
            ROWS=per_program, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        ctx.save_for_backward(rows, weight, rstd)
        ctx.shape = x.shape
        return out.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        rows, weight, rstd = ctx.saved_tensors
        width = rows.shape[1]
        dy = grad.reshape(-1, width)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        grid, per_program, block, warps = _launch(rows.shape[0], width)
        kernel: Any = _rmsnorm_backward_kernel
        kernel[grid](
            rows, weight, dy, rstd, dx, rows.shape[0], width, rows.stride(0), dy.stride(0),
            ROWS=per_program, BLOCK=block, num_warps=warps,
        )  # fmt: skip
        return dx.view(ctx.shape), None, None


if triton is not None:

    @triton.jit
    def _rmsnorm_forward_kernel(
        x_ptr, w_ptr, out_ptr, rstd_ptr, rows, width, x_stride, eps, ROWS: tl.constexpr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)  # [ROWS]
        cols = tl.arange(0, BLOCK)
        inside = (row[:, None] < rows) & (cols[None, :] < width)
        x = tl.load(x_ptr + row[:, None] * x_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        rstd = 1.0 / tl.sqrt_rn(tl.sum(x * x, axis=1) / width + eps)  # [ROWS]
        y = w[None, :] * (rstd[:, None] * x)
        tl.store(out_ptr + row[:, None] * width + cols[None, :], y.to(out_ptr.dtype.element_ty), mask=inside)
        tl.store(rstd_ptr + row, rstd, mask=row < rows)

    @triton.jit
    def _rmsnorm_backward_kernel(
        x_ptr, w_ptr, dy_ptr, rstd_ptr, dx_ptr, rows, width, x_stride, dy_stride,
        ROWS: tl.constexpr, BLOCK: tl.constexpr,
    ):  # fmt: skip
        # dx: contiguous [rows, width]
        row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        inside = (row[:, None] < rows) & (cols[None, :] < width)
        x = tl.load(x_ptr + row[:, None] * x_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + row[:, None] * dy_stride + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + cols, mask=cols < width, other=0.0).to(tl.float32)
        rstd = tl.load(rstd_ptr + row, mask=row < rows, other=0.0)
        x_hat = x * rstd[:, None]
        w_dy = w[None, :] * dy
        mean = tl.sum(x_hat * w_dy, axis=1) / width  # [ROWS]
        dx = (w_dy - x_hat * mean[:, None]) * rstd[:, None]
        tl.store(dx_ptr + row[:, None] * width + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=inside)
