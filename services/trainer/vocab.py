"""Log-probabilities of K target columns from vocab-sharded logits (top-K cross-entropy).

The model's fused path returns ``-log p(target)`` for one target per position. Top-K targets
(``target_tokens`` of shape [N, K]) need K log-probabilities per position, so the engine takes
the logits instead and computes, per TP rank holding vocabulary rows [start, start + V/tp):

    m      = max over the full vocabulary (all-reduce MAX; no gradient needed: lse is exact)
    lse    = m + log(sum_ranks sum_v exp(x_v - m))          (all-reduce SUM, identity backward)
    lp_k   = sum_ranks [x_{t_k} if t_k in this shard else 0] - lse

Memory: one [T, V/tp] fp32 temporary (the exponentials), as the fused cross-entropy has, not
K of them.

On CUDA at TP=1 the same quantities come from one Triton kernel per direction
(``_TargetLogprobs``): the forward reads each row of logits once (a running max and sum of
exponentials in fp32) and keeps only ``lse``; the backward reads the row again and writes its
gradient, ``g_k`` at each target minus ``(sum_k g_k) * softmax``, rounded once to the logits'
dtype. The eager path instead makes an fp32 copy of the logits and about six more passes over
``[T, V]`` fp32 tensors (8 GB of traffic per 4,096 tokens of a 152k vocabulary). Both compute in
fp32 from the same values; they differ in the order of the sum of exponentials (fp32 rounding)
and in the gradient's one rounding (the eager path rounds an fp32 gradient). A NaN or infinite
logit makes its row's log-probabilities NaN on both.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from services.trainer.parallel import tp_rank, tp_size
from services.trainer.probes import KernelProbe
from services.trainer.triton_support import tl, triton

BLOCK = 2048
"""Vocabulary columns per iteration of one row's program."""


def _all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum over the TP group whose backward is the identity: every rank goes on to compute the
    same loss from the (replicated) sum, so each shard's gradient is the sum's gradient as is
    (an all-reducing backward would count it tp times). The identity at TP=1."""
    if tp_size() == 1:
        return value
    from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region

    return reduce_from_tensor_model_parallel_region(value)


def target_logprobs(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log p(targets[t, k])`` for every position and column.

    Args:
        local_logits: [T, V/tp] this rank's vocabulary shard of the logits.
        targets: [T, K] int64 token ids over the full vocabulary.

    Returns:
        [T, K] fp32 log-probabilities, differentiable in ``local_logits``.
    """
    if kernel_supported(local_logits):
        return _TargetLogprobs.apply(local_logits, targets)
    return _eager_target_logprobs(local_logits, targets)


def _eager_target_logprobs(local_logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``target_logprobs`` in torch operations, any device and TP size."""
    logits = local_logits.float()  # [T, Vl]
    shard = logits.shape[-1]
    start = tp_rank() * shard
    peak = logits.detach().max(dim=-1).values  # [T]
    if tp_size() > 1:
        from megatron.core import parallel_state

        dist.all_reduce(peak, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
    total = _all_reduce_sum(torch.exp(logits - peak[:, None]).sum(dim=-1))  # [T]
    lse = peak + torch.log(total)  # [T]
    local = targets - start  # [T, K]
    inside = (local >= 0) & (local < shard)
    picked = logits.gather(-1, local.clamp(0, shard - 1)) * inside  # [T, K]
    return _all_reduce_sum(picked) - lse[:, None]  # [T, K]


def kernel_supported(local_logits: torch.Tensor) -> bool:
    """Whether ``_TargetLogprobs`` takes these logits: CUDA with Triton, TP=1, a float dtype, and
    a probe at first use per device and dtype that found the kernels agreeing with the eager path
    (``_mismatch``; otherwise the eager path runs, and why is logged once)."""
    if not (
        triton is not None
        and local_logits.is_cuda
        and tp_size() == 1
        and local_logits.dim() == 2
        and local_logits.dtype in (torch.bfloat16, torch.float16, torch.float32)
    ):
        return False
    return KERNELS.usable(local_logits.device, local_logits.dtype)


def _mismatch(device: torch.device, dtype: torch.dtype) -> str:
    """Why the kernels may not serve this device and dtype: "" where, on 5 rows of 3,000 columns
    with 2 targets each (one row holding a NaN), the log-probabilities agree with the eager
    path's within 1e-4, the gradient within one rounding step of ``dtype`` (plus 1e-6 of the
    largest output gradient), and the NaN row is NaN in both."""
    gen = torch.Generator(device=device).manual_seed(0)
    logits = (3 * torch.randn(5, 3000, generator=gen, device=device)).to(dtype)
    logits[2, 17] = float("nan")
    targets = torch.randint(0, 3000, (5, 2), generator=gen, device=device)
    grad = torch.randn(5, 2, generator=gen, device=device)
    got_x, ref_x = logits.clone().requires_grad_(), logits.clone().requires_grad_()
    got = _TargetLogprobs.apply(got_x, targets)
    ref = _eager_target_logprobs(ref_x, targets)
    got.backward(grad)
    ref.backward(grad)
    assert got_x.grad is not None and ref_x.grad is not None
    rows = [0, 1, 3, 4]
    if not (bool(got[2].isnan().all()) and bool(got_x.grad[2].isnan().all())):
        return "does not make a row with a NaN logit NaN"
    if float((got[rows] - ref[rows]).detach().abs().max()) > 1e-4:
        return "log-probabilities differ from the eager path's by more than 1e-4"
    g, r = got_x.grad[rows].double(), ref_x.grad[rows].double()
    slack = torch.finfo(dtype).eps * r.abs() + 1e-6 * float(grad.abs().max())
    if not bool(((g - r).abs() <= slack).all()):
        return "gradient differs from the eager path's by more than one rounding step"
    return ""


KERNELS = KernelProbe("target_logprobs' Triton kernels", "the eager path", _mismatch)


class _TargetLogprobs(torch.autograd.Function):
    """``log_softmax(logits)[t, targets[t, k]]`` in fp32, saving the logits (already alive) and
    ``lse [T]``. A target outside ``[0, V)`` reads 0 (as the eager path's mask does)."""

    @staticmethod
    def forward(ctx: Any, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        targets = targets.contiguous()
        rows, vocab = logits.shape
        k = targets.shape[1]
        lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
        out = torch.empty(rows, k, dtype=torch.float32, device=logits.device)
        kernel: Any = _target_logprobs_forward_kernel
        kernel[(rows,)](logits, targets, lse, out, vocab, logits.stride(0), k, BLOCK=BLOCK, num_warps=8)
        ctx.save_for_backward(logits, targets, lse)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        logits, targets, lse = ctx.saved_tensors
        rows, vocab = logits.shape
        grad = grad.float().contiguous()
        out = torch.empty(rows, vocab, dtype=logits.dtype, device=logits.device)
        kernel: Any = _target_logprobs_backward_kernel
        k = targets.shape[1]
        kernel[(rows,)](
            logits, targets, lse, grad, out, vocab, logits.stride(0), k,
            BLOCK=BLOCK, K_P2=triton.next_power_of_2(k), num_warps=8,
        )  # fmt: skip
        return out, None


if triton is not None:

    @triton.jit
    def _target_logprobs_forward_kernel(x_ptr, t_ptr, lse_ptr, out_ptr, vocab, x_stride, k, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        # per lane: the largest logit seen and the sum of exponentials relative to it
        peak = tl.full([BLOCK], -float("inf"), tl.float32)
        total = tl.zeros([BLOCK], tl.float32)
        nan_seen = tl.zeros([BLOCK], tl.int32)  # max and sum need not propagate NaN: counted apart
        for start in range(0, vocab, BLOCK):
            x = tl.load(x_row + start + cols, mask=start + cols < vocab, other=-float("inf")).to(tl.float32)
            nan_seen = nan_seen | (x != x).to(tl.int32)
            new_peak = tl.maximum(peak, x)
            empty = new_peak == -float("inf")  # nothing but -inf in this lane yet: its sum stays 0
            rescale = tl.where(empty, 0.0, tl.exp(peak - new_peak))
            total = total * rescale + tl.where(empty, 0.0, tl.exp(x - new_peak))
            peak = new_peak
        row_peak = tl.max(peak, axis=0)
        lane = tl.where(peak == -float("inf"), 0.0, total * tl.exp(peak - row_peak))
        lse = row_peak + tl.log(tl.sum(lane, axis=0))
        lse = tl.where(tl.max(nan_seen, axis=0) > 0, float("nan"), lse)
        tl.store(lse_ptr + row, lse)
        for j in range(0, k):
            target = tl.load(t_ptr + row * k + j)
            inside = (target >= 0) & (target < vocab)
            picked = tl.load(x_row + tl.where(inside, target, 0)).to(tl.float32)
            tl.store(out_ptr + row * k + j, tl.where(inside, picked, 0.0) - lse)

    @triton.jit
    def _target_logprobs_backward_kernel(
        x_ptr, t_ptr, lse_ptr, g_ptr, out_ptr, vocab, x_stride, k, BLOCK: tl.constexpr, K_P2: tl.constexpr
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        x_row = x_ptr + row * x_stride
        cols = tl.arange(0, BLOCK)
        lse = tl.load(lse_ptr + row)
        ks = tl.arange(0, K_P2)
        weight = tl.sum(tl.load(g_ptr + row * k + ks, mask=ks < k, other=0.0), axis=0)  # sum_k g_k
        for start in range(0, vocab, BLOCK):
            at = start + cols
            x = tl.load(x_row + at, mask=at < vocab, other=0.0).to(tl.float32)
            d = -weight * tl.exp(x - lse)
            for j in range(0, k):
                target = tl.load(t_ptr + row * k + j)
                d += tl.where(at == target, tl.load(g_ptr + row * k + j), 0.0)
            tl.store(out_ptr + row * vocab + at, d.to(out_ptr.dtype.element_ty), mask=at < vocab)
