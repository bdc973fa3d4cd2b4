"""RoPE for packed batches (``packed_rope``) against megatron's own functions: the host-sync-free
THD path on the CPU bit for bit, and on CUDA the fused kernel, value by value at least as close to
the exact rotation as megatron's, in both directions."""

from __future__ import annotations

import pytest
import torch

from services.trainer import packed_rope

cuda = pytest.mark.skipif(
    packed_rope.triton is None or not torch.cuda.is_available(), reason="needs CUDA and Triton"
)


def _freqs(max_len: int, dim: int, device: str) -> torch.Tensor:
    inv = 1.0 / (1_000_000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    f = torch.outer(torch.arange(max_len, dtype=torch.float32, device=device), inv)
    return torch.cat([f, f], dim=-1)[:, None, None, :]  # [max_len, 1, 1, dim], megatron's layout


def _megatron_thd(t: torch.Tensor, cu: torch.Tensor, freqs: torch.Tensor) -> torch.Tensor:
    """megatron's own THD RoPE: document by document, from position 0 in each."""
    from megatron.core.models.common.embeddings import rope_utils

    out = []
    for lo, hi in zip(cu[:-1].tolist(), cu[1:].tolist(), strict=True):
        piece = t[lo:hi].unsqueeze(1)
        out.append(rope_utils._apply_rotary_pos_emb_bshd(piece, freqs[: hi - lo]).squeeze(1))
    return torch.cat(out)


def _documents(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Three documents (300, 1 and 211 tokens) of 32 query heads of 128, the heads a strided view
    (as q sits inside the fused qkv): boundaries, q, a gradient, frequencies."""
    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, 300, 301, 512], dtype=torch.int32, device=device)
    total, heads, dim = 512, 32, 128
    qkv = torch.randn(total, heads + 16, dim, generator=gen, device=device).to(torch.bfloat16)
    grad = torch.randn(total, heads, dim, generator=gen, device=device).to(torch.bfloat16)
    return cu, qkv[:, :heads], grad, _freqs(1024, dim, device)


def _both(t: torch.Tensor, cu: torch.Tensor, freqs: torch.Tensor, grad: torch.Tensor) -> list[torch.Tensor]:
    """``packed_rope``'s and megatron's per-document output and input gradient."""
    got_t, ref_t = t.detach().requires_grad_(), t.detach().clone().requires_grad_()
    got, ref = packed_rope._rope_thd(got_t, cu, freqs), _megatron_thd(ref_t, cu, freqs)
    got.backward(grad)
    ref.backward(grad)
    assert got_t.grad is not None and ref_t.grad is not None
    return [got, ref, got_t.grad, ref_t.grad]


def test_packed_rope_on_the_cpu_equals_megatron_per_document_forward_and_backward() -> None:
    """Without the kernel (megatron's math over device-side positions): output and input gradient
    equal megatron's per-document function bit for bit."""
    cu, t, grad, freqs = _documents("cpu")
    got, ref, got_grad, ref_grad = _both(t, cu, freqs, grad)
    assert torch.equal(got, ref) and torch.equal(got_grad, ref_grad)


@cuda
def test_cuda_fused_rope_is_at_least_as_close_to_the_exact_rotation_as_megatron_forward_and_backward() -> None:
    """The probe accepts the kernel on this GPU, and through it each output and input-gradient
    value is at least as close to the float64 rotation of the same bf16 inputs and tables as
    megatron's per-document function's."""
    cu, t, grad, freqs = _documents("cuda")
    assert packed_rope.FUSED.mismatch(t.device, torch.bfloat16, t.shape[-1]) == ""
    assert packed_rope.fused_rope_supported(t, freqs, False, False)
    got, ref, got_grad, ref_grad = _both(t, cu, freqs, grad)
    positions = packed_rope._positions(cu, t.shape[0], t.device)
    cos, sin = packed_rope._cos_sin(freqs[positions].reshape(t.shape[0], -1), torch.bfloat16, 1.0)
    exact = packed_rope.exact_rotation(t, cos, sin, backward=False)
    exact_grad = packed_rope.exact_rotation(grad, cos, sin, backward=True)
    assert packed_rope.less_accurate("forward", got, ref, exact) == ""
    assert packed_rope.less_accurate("backward", got_grad, ref_grad, exact_grad) == ""


def test_the_probes_criterion_accepts_one_rounding_and_refuses_truncation() -> None:
    """``less_accurate``, the kernel's acceptance test: a result rounded once from the exact
    rotation (where megatron rounds each product, then the sum) is never worse than megatron's;
    one truncated toward zero is; a NaN is."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(64, 4, 128, generator=gen).to(torch.bfloat16)
    angles = torch.rand(64, 128, generator=gen) * 6.0
    cos, sin = packed_rope._cos_sin(angles, torch.bfloat16, 1.0)
    half = 64
    two_roundings = x * cos[:, None] + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin[:, None]
    exact = packed_rope.exact_rotation(x, cos, sin, backward=False)
    one_rounding = exact.to(torch.bfloat16)
    truncated = exact.float().view(torch.int32).bitwise_and(-65536).view(torch.float32).to(torch.bfloat16)
    assert not torch.equal(one_rounding, two_roundings)  # the two roundings do differ somewhere
    assert packed_rope.less_accurate("forward", two_roundings, two_roundings, exact) == ""
    assert packed_rope.less_accurate("forward", one_rounding, two_roundings, exact) == ""
    assert packed_rope.less_accurate("forward", truncated, two_roundings, exact) != ""
    with_nan = one_rounding.clone()
    with_nan[0, 0, 0] = float("nan")
    assert packed_rope.less_accurate("forward", with_nan, two_roundings, exact) != ""


@cuda
def test_the_kernel_probe_accepts_inside_a_forward_only_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs a backward: made first inside a forward-only call (no grad, inference
    mode) it still accepts the kernel on this device."""
    freqs = _freqs(64, 128, "cuda")
    for context in (torch.no_grad, torch.inference_mode):
        monkeypatch.setattr(packed_rope.FUSED, "verdicts", {})
        with context():
            t = torch.zeros(8, 4, 128, device="cuda", dtype=torch.bfloat16)
            assert packed_rope.fused_rope_supported(t, freqs, False, False)


@cuda
def test_cuda_fused_rope_keeps_nan_and_inf_where_megatron_does() -> None:
    """Non-finite inputs (a tenant whose activations overflowed) stay non-finite through the
    kernel, as through megatron's function: the same values are NaN and the same are infinite,
    forward and backward."""
    cu, t, grad, freqs = _documents("cuda")
    t = t.clone()
    t[3, 1, 5], t[4, 2, 70], t[300, 0, 0] = float("nan"), float("inf"), -float("inf")
    grad = grad.clone()
    grad[10, 3, 7] = float("nan")
    assert packed_rope.fused_rope_supported(t, freqs, False, False)
    got, ref, got_grad, ref_grad = _both(t, cu, freqs, grad)
    for a, b in ((got, ref), (got_grad, ref_grad)):
        assert torch.equal(a.isnan(), b.isnan()) and bool(a.isnan().any())
        assert torch.equal(a.isinf(), b.isinf())
