"""The MLP's gated activation ``silu(gate) * up``, on CUDA in one Triton kernel per direction.

megatron's unfused MLP splits ``linear_fc1``'s output ``[.., 2F]`` into ``gate`` and ``up`` and
runs ``F.silu(gate) * up``: a silu kernel and a product forward, and backward a product, a
``silu_backward``, a second product and a concatenation of the two halves' gradients into one
``[.., 2F]`` tensor — five passes over ``[T, F]``-sized tensors where one would do, and the
silu output kept alive for the backward. megatron's own fused path (``bias_activation_fusion``)
goes through ``torch.compile``, which recompiles for new token counts; its transformer-engine
path needs transformer-engine. ``SwiGLU`` is the module megatron's MLP builds as its activation
(``MLPSubmodules.activation_func`` with ``use_te_activation_func``): on CUDA it runs
``_SwiGLUFunction`` (one kernel forward, one backward, only the input saved), elsewhere the same
eager expression megatron would.

The kernels follow the eager arithmetic: the same fp32 expressions of the dtype's values (CUDA's
``expf`` through libdevice, correctly rounded division), and the same roundings to the dtype —
the forward rounds ``silu(gate)`` before the product (as ``F.silu`` returns it), the backward
rounds ``dy * up`` before ``silu``'s derivative and computes ``dy * silu(gate)`` from the rounded
activation. Only a compiler's choice to fuse a multiply-add can move an fp32 result by an ulp,
so a value differs from the eager path's by at most one rounding step of the dtype. A probe at
first use per device and dtype checks that on a small input (forward and backward, NaN and
infinity where eager has them); where it fails, the eager path runs and the reason is logged
once. ``services/trainer/tests/test_swiglu.py`` checks both paths.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.probes import KernelProbe, beyond_one_step
from services.trainer.triton_support import libdevice, tl, triton

BLOCK = 1024
"""Columns of one row per program (a row of Qwen3-8B's MLP has 12,288)."""


def swiglu_eager(x: torch.Tensor) -> torch.Tensor:
    """megatron's unfused ``glu``: ``silu(gate) * up`` of ``x = [gate | up]`` (last dim)."""
    gate, up = torch.chunk(x, 2, dim=-1)
    return F.silu(gate) * up


class SwiGLU(nn.Module):
    """The activation module of megatron's MLP (built with ``config``, which it does not need)."""

    def __init__(self, config: Any = None) -> None:
        super().__init__()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if fused_supported(x):
            return _SwiGLUFunction.apply(x)
        return swiglu_eager(x)


def fused_supported(x: torch.Tensor) -> bool:
    """Whether the Triton kernels take ``x``: CUDA, Triton, an even last dim, and a probe that
    found them within one rounding step of the eager path on this device and dtype."""
    if triton is None or not x.is_cuda or x.shape[-1] % 2 or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    return FUSED.usable(x.device, x.dtype)


def _mismatch(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernels may not serve this device and dtype ("" where forward and backward agree
    with the eager path to one rounding step of ``dtype``, non-finite values included)."""
    gen = torch.Generator(device=device).manual_seed(0)
    x = (4 * torch.randn(37, 2 * 1100, generator=gen, device=device)).to(dtype)
    x[0, :4] = torch.tensor([float("nan"), float("inf"), -float("inf"), 90.0])
    x[1, 1100:1104] = torch.tensor([float("nan"), float("inf"), -float("inf"), 0.0])
    grad = torch.randn(37, 1100, generator=gen, device=device).to(dtype)
    got_x, ref_x = x.clone().requires_grad_(), x.clone().requires_grad_()
    got, ref = _SwiGLUFunction.apply(got_x), swiglu_eager(ref_x)
    got.backward(grad)
    ref.backward(grad)
    assert got_x.grad is not None and ref_x.grad is not None
    tiny = torch.finfo(dtype).tiny
    parts = [
        beyond_one_step("forward", got, ref, tiny),
        beyond_one_step("backward", got_x.grad, ref_x.grad, tiny),
    ]
    return "; ".join(p for p in parts if p)


FUSED = KernelProbe("SwiGLU's Triton kernels", "megatron's eager path", _mismatch)


class _SwiGLUFunction(torch.autograd.Function):
    """``silu(gate) * up`` of ``x = [gate | up]``, saving only ``x``."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        if rows.stride(-1) != 1:
            rows = rows.contiguous()
        ctx.save_for_backward(rows)
        ctx.shape = x.shape
        n = rows.shape[1] // 2
        out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
        kernel: Any = _swiglu_forward_kernel
        kernel[(rows.shape[0], triton.cdiv(n, BLOCK))](rows, out, n, rows.stride(0), BLOCK=BLOCK, num_warps=4)
        return out.view(*x.shape[:-1], n)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (rows,) = ctx.saved_tensors
        n = rows.shape[1] // 2
        dy = grad.reshape(-1, n)
        if dy.stride(-1) != 1:
            dy = dy.contiguous()
        dx = torch.empty(rows.shape, dtype=rows.dtype, device=rows.device)
        kernel: Any = _swiglu_backward_kernel
        kernel[(rows.shape[0], triton.cdiv(n, BLOCK))](
            rows, dy, dx, n, rows.stride(0), dy.stride(0), BLOCK=BLOCK, num_warps=4
        )  # dx is contiguous: its row stride is 2n
        return dx.view(ctx.shape)


if triton is not None:

    @triton.jit
    def _swiglu_forward_kernel(x_ptr, out_ptr, n, x_stride, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
        gf = g.to(tl.float32)
        act = tl.math.div_rn(gf, 1.0 + libdevice.exp(-gf)).to(g.dtype, fp_downcast_rounding="rtne")  # F.silu's
        out = (act.to(tl.float32) * u.to(tl.float32)).to(g.dtype, fp_downcast_rounding="rtne")
        tl.store(out_ptr + row * n + cols, out, mask=mask)

    @triton.jit
    def _swiglu_backward_kernel(x_ptr, dy_ptr, dx_ptr, n, x_stride, dy_stride, BLOCK: tl.constexpr):
        # dx: contiguous [rows, 2n]
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n
        g = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)
        u = tl.load(x_ptr + row * x_stride + n + cols, mask=mask, other=0.0)
        dy = tl.load(dy_ptr + row * dy_stride + cols, mask=mask, other=0.0).to(tl.float32)
        gf = g.to(tl.float32)
        denominator = 1.0 + libdevice.exp(-gf)
        sig = tl.math.div_rn(1.0, denominator)
        act = tl.math.div_rn(gf, denominator).to(g.dtype, fp_downcast_rounding="rtne").to(tl.float32)  # as forward
        d_act = (dy * u.to(tl.float32)).to(g.dtype, fp_downcast_rounding="rtne").to(tl.float32)  # rounded, as eager
        d_gate = d_act * sig * (1.0 + gf * (1.0 - sig))  # silu_backward
        d_up = dy * act
        tl.store(dx_ptr + row * 2 * n + cols, d_gate.to(g.dtype, fp_downcast_rounding="rtne"), mask=mask)
        tl.store(dx_ptr + row * 2 * n + n + cols, d_up.to(g.dtype, fp_downcast_rounding="rtne"), mask=mask)
