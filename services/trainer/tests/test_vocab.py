"""``vocab.target_logprobs``' CUDA kernels (TP=1) against float64 log-softmax of the same logits:
log-probabilities and gradients, K targets per position, and a NaN row kept to itself."""

from __future__ import annotations

import pytest
import torch

from services.trainer import vocab
from services.trainer.parallel import ensure_model_parallel

cuda = pytest.mark.skipif(vocab.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton")


def _exact(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 ``log_softmax(logits).gather(targets)`` and its gradient for ``grad``."""
    leaf = logits.double().requires_grad_()
    lp = torch.log_softmax(leaf, dim=-1).gather(-1, targets)
    lp.backward(grad.double())
    assert leaf.grad is not None
    return lp.detach(), leaf.grad


def _kernel(logits: torch.Tensor, targets: torch.Tensor, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    leaf = logits.detach().clone().requires_grad_()
    assert vocab.kernel_supported(leaf)
    lp = vocab.target_logprobs(leaf, targets)
    lp.backward(grad)
    assert leaf.grad is not None
    return lp.detach(), leaf.grad


def _inputs(rows: int, columns: int, k: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator(device="cuda").manual_seed(0)
    logits = (3 * torch.randn(rows, columns, generator=gen, device="cuda")).to(dtype)
    targets = torch.randint(0, columns, (rows, k), generator=gen, device="cuda")
    grad = torch.randn(rows, k, generator=gen, device="cuda")
    return logits, targets, grad


@cuda
@pytest.mark.parametrize("k", [1, 3])
def test_cuda_kernel_matches_float64_on_fp32_logits(k: int) -> None:
    """fp32 logits of 300 positions over 5,000 columns (not a multiple of the kernel's block), K
    targets each: log-probabilities within 1e-5 absolute, the gradient within 1e-6 absolute of
    float64's (softmax entries below 1, fp32 arithmetic)."""
    ensure_model_parallel("cuda")
    logits, targets, grad = _inputs(300, 5000, k, torch.float32)
    lp, lp_grad = _kernel(logits, targets, grad)
    want, want_grad = _exact(logits, targets, grad)
    assert lp.dtype == torch.float32 and lp.shape == (300, k)
    assert float((lp.double() - want).abs().max()) <= 1e-5
    assert float((lp_grad.double() - want_grad).abs().max()) <= 1e-6 * float(grad.abs().max()) * k


@cuda
def test_cuda_kernel_on_bf16_logits_rounds_only_the_gradient() -> None:
    """bf16 logits at Qwen3's vocabulary (151,936): log-probabilities are fp32 of the bf16
    values (within 1e-4 of float64's), the gradient is float64's rounded once to bf16 (relative
    2^-8, plus fp32's error on tiny entries)."""
    ensure_model_parallel("cuda")
    logits, targets, grad = _inputs(64, 151_936, 1, torch.bfloat16)
    lp, lp_grad = _kernel(logits, targets, grad)
    want, want_grad = _exact(logits, targets, grad)
    assert lp_grad.dtype == torch.bfloat16
    assert float((lp.double() - want).abs().max()) <= 1e-4
    error = (lp_grad.double() - want_grad).abs()
    assert bool((error <= 2.0**-8 * want_grad.abs() + 1e-6 * float(grad.abs().max())).all())


@cuda
def test_cuda_kernel_keeps_a_nan_logit_in_its_own_row() -> None:
    """A NaN logit in row 3 makes row 3's log-probabilities and gradient NaN; every other row's
    are exactly those of the same logits without it."""
    ensure_model_parallel("cuda")
    logits, targets, grad = _inputs(16, 3000, 2, torch.bfloat16)
    clean, clean_grad = _kernel(logits, targets, grad)
    logits[3, 1234] = float("nan")
    lp, lp_grad = _kernel(logits, targets, grad)
    assert bool(lp[3].isnan().all()) and bool(lp_grad[3].isnan().all())
    others = [r for r in range(16) if r != 3]
    assert torch.equal(lp[others], clean[others]) and torch.equal(lp_grad[others], clean_grad[others])
