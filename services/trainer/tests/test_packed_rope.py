"""RoPE for packed batches (``packed_rope``) against megatron's own functions: the host-sync-free
THD path on the CPU, and on CUDA the fused kernel, bit for bit in both directions."""

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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=cuda)])
def test_packed_rope_equals_megatron_per_document_forward_and_backward(device: str) -> None:
    """Three documents (300, 1 and 211 tokens) of 32 query heads of 128, the heads a strided view
    (as q sits inside the fused qkv): output and input gradient equal megatron's per-document
    function bit for bit (on CUDA through the fused kernel, on the CPU through megatron's math)."""
    dtype = torch.bfloat16
    gen = torch.Generator(device=device).manual_seed(0)
    cu = torch.tensor([0, 300, 301, 512], dtype=torch.int32, device=device)
    total, heads, dim = 512, 32, 128
    qkv = torch.randn(total, heads + 16, dim, generator=gen, device=device).to(dtype)
    grad = torch.randn(total, heads, dim, generator=gen, device=device).to(dtype)
    freqs = _freqs(1024, dim, device)
    got_t = qkv[:, :heads].detach().requires_grad_()
    ref_t = qkv[:, :heads].detach().clone().requires_grad_()
    if device == "cuda":
        assert packed_rope.probe_mismatch(got_t.device, dtype, dim) == ""
        assert packed_rope.fused_rope_supported(got_t, freqs, False, False)
    got = packed_rope._rope_thd(got_t, cu, freqs)
    ref = _megatron_thd(ref_t, cu, freqs)
    assert torch.equal(got, ref)
    got.backward(grad)
    ref.backward(grad)
    assert got_t.grad is not None and ref_t.grad is not None
    assert torch.equal(got_t.grad, ref_t.grad)


@cuda
def test_the_kernel_probe_accepts_inside_a_forward_only_call(monkeypatch: pytest.MonkeyPatch) -> None:
    """The probe runs a backward: made first inside a forward-only call (no grad, inference
    mode) it still accepts the kernel on this device."""
    freqs = _freqs(64, 128, "cuda")
    for context in (torch.no_grad, torch.inference_mode):
        monkeypatch.setattr(packed_rope, "_FUSED_OK", {})
        with context():
            t = torch.zeros(8, 4, 128, device="cuda", dtype=torch.bfloat16)
            assert packed_rope.fused_rope_supported(t, freqs, False, False)
