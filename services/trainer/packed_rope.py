"""RoPE for packed (THD) batches without host synchronisation (a patch of megatron-core 0.16.1),
and on CUDA in one Triton kernel per call, forward and backward.

megatron's `rope_utils._apply_rotary_pos_emb_thd` reads the document lengths back to the host
(`.tolist()` and a size comparison) twice per layer, then slices and concatenates the frequencies
document by document: on a GPU that is a stall per layer. Positions restart at 0 in every
document, so the same frequencies are `freqs[pos]` with `pos = t - cu_seqlens[doc(t)]`, computed
on the device once per forward. At context-parallel size 1 the result is bit-identical; other
CP sizes keep megatron's function.

megatron then rotates with about a dozen elementwise kernels per call (cos, sin, their casts,
two products, the half rotation's negation and concatenation, a sum, a final concatenation), and
as many again in the backward, for q and for k of every layer. On CUDA, for the full-width,
non-interleaved rotation Qwen3 and Llama use, ``_FusedRope`` does each direction in one kernel.
It follows megatron's arithmetic: the cos and sin tables are megatron's own
(``(cos(freqs) * mscale).to(dtype)``, built once per forward), every product is rounded to the
tensor's dtype before the sum, and the sum once more. In bf16 each rounding is done on the bits
(to nearest, ties to even), so no choice of the compiler's (a conversion's rounding mode, a fused
multiply-add) can change a result. With Triton's own conversions instead, the kernel differed from
megatron's in one value of seven on an H200; with these, Triton's interpreter on the CPU gives
megatron's values bit for bit, forward and backward, in bf16 and fp16. The kernel is
used only on a device where a probe at first use found it, forward and backward and value by
value, at least as close to the exact rotation of the same inputs and tables (float64) as
megatron's own function (``services/trainer/tests/test_packed_rope.py`` checks both directions
on CUDA).
"""

from __future__ import annotations

from typing import Any

import torch

from services.trainer.attention import document_ids
from services.trainer.probes import KernelProbe
from services.trainer.triton_support import tl, triton

_cache: dict[str, Any] = {"key": None, "positions": None, "tables": None, "tables_key": None}
_original: Any = None


def forget() -> None:
    """Drop the per-forward cache (positions and cos/sin tables), which is keyed by the identity of
    the forward's ``cu_seqlens``: a caller that refills one such tensor in place calls this first."""
    _cache.update(key=None, positions=None, tables=None, tables_key=None)


def _positions(cu_seqlens: torch.Tensor, total: int, device: torch.device) -> torch.Tensor:
    if _cache["key"] is not cu_seqlens:  # every layer of one forward shares the same tensor
        doc = document_ids(cu_seqlens, total)  # [T]
        _cache.update(key=cu_seqlens, positions=torch.arange(total, device=device) - cu_seqlens.long()[doc])
    return _cache["positions"]


def _tables(
    freqs: torch.Tensor, positions: torch.Tensor, dtype: torch.dtype, mscale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's cos and sin tables for these positions, ``[T, d]`` in ``dtype`` (once per forward)."""
    cached = _cache["tables_key"]
    if cached is None or not (
        cached[0] is freqs and cached[1] is positions and cached[2] == dtype and cached[3] == mscale
    ):
        tables = _cos_sin(freqs[positions].reshape(positions.shape[0], freqs.shape[-1]), dtype, mscale)
        _cache.update(tables_key=(freqs, positions, dtype, mscale), tables=tables)
    return _cache["tables"]


def _cos_sin(freqs: torch.Tensor, dtype: torch.dtype, mscale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """megatron's ``(cos(freqs) * mscale).to(dtype)`` and the same of sin, elementwise."""
    return (torch.cos(freqs) * mscale).to(dtype), (torch.sin(freqs) * mscale).to(dtype)


def fused_rope_supported(t: torch.Tensor, freqs: torch.Tensor, rotary_interleaved: bool, mla: bool) -> bool:
    """Whether ``_FusedRope`` takes this call: CUDA, Triton, the full-width non-interleaved
    rotation, and a kernel that proved at least as accurate as megatron's function on this device,
    dtype and head size (``FUSED``, once each; otherwise megatron's own math runs)."""
    if not (
        triton is not None
        and t.is_cuda
        and not rotary_interleaved
        and not mla
        and t.dim() == 3
        and freqs.shape[-1] == t.shape[-1]
        and t.shape[-1] % 2 == 0
        and (t.shape[-1] // 2) & (t.shape[-1] // 2 - 1) == 0  # a power of two halves
    ):
        return False
    return FUSED.usable(t.device, t.dtype, t.shape[-1])


def _mismatch(device: torch.device, dtype: torch.dtype, dim: int) -> str:
    """Why the fused kernel may not serve this device, dtype and head size ("" where, on a small
    strided input, forward and backward, each of its values is at least as close to the exact
    rotation as megatron's function's)."""
    from megatron.core.models.common.embeddings import rope_utils

    gen = torch.Generator(device=device).manual_seed(0)
    tokens, heads = 37, 3
    x = torch.randn(tokens, heads + 2, dim, generator=gen, device=device).to(dtype)[:, :heads]
    grad = torch.randn(tokens, heads, dim, generator=gen, device=device).to(dtype)
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    f = torch.outer(torch.arange(tokens, device=device, dtype=torch.float32), inv)
    freqs = torch.cat([f, f], dim=-1)[:, None, None, :]
    cos, sin = _cos_sin(freqs[:, 0, 0], dtype, 1.0)  # [T, d], the tables a forward builds
    got_x, ref_x = x.detach().requires_grad_(), x.detach().clone().requires_grad_()
    got = _FusedRope.apply(got_x, cos, sin)
    ref = rope_utils._apply_rotary_pos_emb_bshd(ref_x.unsqueeze(1), freqs).squeeze(1)
    got.backward(grad)
    ref.backward(grad)
    got_grad, ref_grad = got_x.grad, ref_x.grad
    assert got_grad is not None and ref_grad is not None
    parts = [
        less_accurate("forward", got, ref, exact_rotation(x, cos, sin, backward=False)),
        less_accurate("backward", got_grad, ref_grad, exact_rotation(grad, cos, sin, backward=True)),
    ]
    return "; ".join(part for part in parts if part)


FUSED = KernelProbe("RoPE's Triton kernel", "megatron's elementwise path", _mismatch)


def less_accurate(name: str, got: torch.Tensor, ref: torch.Tensor, exact: torch.Tensor) -> str:
    """How many values of ``got`` are further from ``exact`` than ``ref``'s ("" if none is)."""
    worse = ~((got.double() - exact).abs() <= (ref.double() - exact).abs())  # a NaN is worse
    if not bool(worse.any()):
        return ""
    differ = int((got != ref).sum())
    return (
        f"{name}: {int(worse.sum())} of {got.numel()} values further from the exact rotation than "
        f"megatron's ({differ} differ from megatron's)"
    )


def exact_rotation(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    """``t [T, heads, d]`` rotated by the tables ``[T, d]`` in float64, without rounding between
    the steps: ``t * cos + rotate_half(t) * sin`` (``backward``: its transpose, the gradient's
    rotation ``g * cos + rotate_half^T(g * sin)``), for the values the tables hold."""
    x, c, s = t.double(), cos.double()[:, None, :], sin.double()[:, None, :]
    half = x.shape[-1] // 2
    if backward:
        y = x * s
        turned = torch.cat([y[..., half:], -y[..., :half]], dim=-1)
        return x * c + turned
    return x * c + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * s


def _rope_thd(
    t: torch.Tensor,
    cu_seqlens: torch.Tensor,
    freqs: torch.Tensor,
    rotary_interleaved: bool = False,
    multi_latent_attention: bool = False,
    mscale: float = 1.0,
    cp_group: Any = None,
) -> torch.Tensor:
    from megatron.core.models.common.embeddings import rope_utils

    if cp_group is not None and cp_group.size() > 1:
        return _original(t, cu_seqlens, freqs, rotary_interleaved, multi_latent_attention, mscale, cp_group)
    positions = _positions(cu_seqlens, t.shape[0], t.device)
    if fused_rope_supported(t, freqs, rotary_interleaved, multi_latent_attention):
        cos, sin = _tables(freqs, positions, t.dtype, mscale)
        return _FusedRope.apply(t, cos, sin)
    return rope_utils._apply_rotary_pos_emb_bshd(
        t.unsqueeze(1),  # [T, 1, heads, d]
        freqs[positions],  # [T, 1, 1, d]
        rotary_interleaved=rotary_interleaved,
        multi_latent_attention=multi_latent_attention,
        mscale=mscale,
    ).squeeze(1)


class _FusedRope(torch.autograd.Function):
    """``t * cos + rotate_half(t) * sin`` for ``t: [T, heads, d]`` and tables ``[T, d]``."""

    @staticmethod
    def forward(ctx: Any, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(cos, sin)
        return _rotate(t, cos, sin, backward=False)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        cos, sin = ctx.saved_tensors
        return _rotate(grad, cos, sin, backward=True), None, None


def _rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> torch.Tensor:
    if t.stride(-1) != 1:
        t = t.contiguous()
    tokens, heads, dim = t.shape
    out = torch.empty((tokens, heads, dim), dtype=t.dtype, device=t.device)
    block_h = min(16, triton.next_power_of_2(heads))
    kernel: Any = _rope_kernel
    kernel[(tokens, triton.cdiv(heads, block_h))](
        t, cos, sin, out, t.stride(0), t.stride(1), out.stride(0), out.stride(1), heads,
        HALF=dim // 2, BLOCK_H=block_h, BACKWARD=backward, BF16=t.dtype == torch.bfloat16,
    )  # fmt: skip
    return out


if triton is not None:

    @triton.jit
    def _nearest_bf16(x):
        """The bf16 value nearest fp32 ``x`` (ties to even), as fp32: done on the bits, so no
        compiler's choice of conversion or contraction can change it. Infinities stay; a NaN is
        kept as it is (the carry would turn the GPU's NaN, all mantissa bits set, into -0)."""
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
        return tl.where(x == x, bits.to(tl.float32, bitcast=True), x)

    @triton.jit
    def _rounded(x, kind: tl.constexpr, BF16: tl.constexpr):
        """``x`` rounded to ``kind`` and back to fp32."""
        if BF16:
            return _nearest_bf16(x)
        else:
            return x.to(kind).to(tl.float32)

    @triton.jit
    def _rope_kernel(
        x_ptr, cos_ptr, sin_ptr, out_ptr, x_st, x_sh, o_st, o_sh, heads,
        HALF: tl.constexpr, BLOCK_H: tl.constexpr, BACKWARD: tl.constexpr, BF16: tl.constexpr,
    ):  # fmt: skip
        # megatron: out = t * cos + cat(-t2, t1) * sin, each product and the sum rounded to the
        # dtype. Its backward: g * cos + cat(g2 * sin2, -(g1 * sin1)), rounded the same way.
        tok = tl.program_id(0)
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, HALF)
        keep = (h < heads)[:, None]
        src = x_ptr + tok * x_st + h[:, None] * x_sh + d[None, :]
        x1 = tl.load(src, mask=keep, other=0.0)
        x2 = tl.load(src + HALF, mask=keep, other=0.0)
        kind = x1.dtype
        row = tok * (2 * HALF) + d
        c1 = tl.load(cos_ptr + row)[None, :].to(tl.float32)
        c2 = tl.load(cos_ptr + row + HALF)[None, :].to(tl.float32)
        s1 = tl.load(sin_ptr + row)[None, :].to(tl.float32)
        s2 = tl.load(sin_ptr + row + HALF)[None, :].to(tl.float32)
        f1, f2 = x1.to(tl.float32), x2.to(tl.float32)
        a1 = _rounded(f1 * c1, kind, BF16)
        a2 = _rounded(f2 * c2, kind, BF16)
        if BACKWARD:
            o1 = a1 + _rounded(f2 * s2, kind, BF16)
            o2 = a2 - _rounded(f1 * s1, kind, BF16)
        else:
            o1 = a1 - _rounded(f2 * s1, kind, BF16)
            o2 = a2 + _rounded(f1 * s2, kind, BF16)
        dst = out_ptr + tok * o_st + h[:, None] * o_sh + d[None, :]
        # the sums rounded as the products were; the stores' conversions are then exact
        tl.store(dst, _rounded(o1, kind, BF16).to(kind), mask=keep)
        tl.store(dst + HALF, _rounded(o2, kind, BF16).to(kind), mask=keep)


def install() -> None:
    """Idempotent."""
    global _original
    from megatron.core.models.common.embeddings import rope_utils

    if _original is None:
        _original = rope_utils._apply_rotary_pos_emb_thd
        rope_utils._apply_rotary_pos_emb_thd = _rope_thd
