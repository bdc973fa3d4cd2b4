"""Core attention for packed (THD) batches with per-document causal masking.

The engine packs several datums into one token stream: ``T = sum(len_d)`` tokens, positions
restarting at 0 for each document, boundaries given by ``PackedSeqParams.cu_seqlens_q``.
These modules plug into megatron's ``SelfAttention`` as its ``core_attention`` submodule (the
slot megatron fills with ``DotProductAttention``); megatron has already projected q/k/v,
applied qk-norm and per-document RoPE before calling them.

Backends (``EngineConfig.attention_backend`` picks one by its key in ``ATTENTION_BACKENDS``):

    sdpa_per_document    one causal SDPA call per document (a Python loop; CPU default)
    sdpa_block_diagonal  one SDPA call with a dense [T, T] block-diagonal mask (tests)
    flex_attention       ``torch.nn.attention.flex_attention`` with a per-document causal
                         ``BlockMask``: one fused kernel, no [T, T] score matrix; compiled on
                         CUDA; on CPU eager, unfused and forward only (torch has no CPU
                         backward for it), so there it serves tests and ``logits`` alone
    varlen_flash         ``torch.nn.attention.varlen.varlen_attn``: FlashAttention-2 over the
                         packed stream with ``cu_seqlens``; CUDA only (the GPU choice)
    varlen_flash_cudnn   ``varlen_flash``, except that a stream which is one document of at
                         least ``CUDNN_MIN_TOKENS`` goes through cuDNN's fused attention (SDPA's
                         cuDNN backend, dense causal); CUDA only

Invariant: a token attends to itself and the earlier tokens of its own document only, never
across a document boundary; query heads map to key/value groups as megatron and Hugging Face
do (head ``h`` uses group ``h // (heads / groups)``).  Backends differ only in speed (and in
rounding), so a GPU backend replaces the CPU ones by configuration alone.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
import itertools
import math
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from services.trainer.probes import KernelProbe


def _split_heads(config: Any, tp_world: int) -> tuple[int, int, int]:
    heads = config.num_attention_heads // tp_world
    groups = config.num_query_groups // tp_world
    head_dim = config.kv_channels
    return heads, groups, head_dim


class _PackedAttentionBase(nn.Module):
    """Shared constructor: megatron builds core attention with these keyword arguments."""

    def __init__(
        self,
        config: Any,
        layer_number: int,
        attn_mask_type: Any,
        attention_type: str,
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection: Any = None,
    ) -> None:
        super().__init__()
        tp_world = pg_collection.tp.size() if pg_collection is not None else config.tensor_model_parallel_size
        self.heads, self.groups, self.head_dim = _split_heads(config, tp_world)
        self.scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(self.head_dim)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            # Unpacked [s, b, heads, d]: every batch row is one document.
            s, b = query.shape[0], query.shape[1]
            bounds = [0, s]
            outs = [
                self._attend(query[:, i], key[:, i], value[:, i], bounds)  # [s, heads, d]
                for i in range(b)
            ]
            return torch.stack(outs, dim=1).reshape(s, b, -1)  # [s, b, heads*d]
        bounds = [int(x) for x in packed_seq_params.cu_seqlens_q.tolist()]
        out = self._attend(query, key, value, bounds)  # [T, heads, d]
        return out.reshape(out.shape[0], -1)  # [T, heads*d]

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        raise NotImplementedError


class PerDocumentSdpa(_PackedAttentionBase):
    """Causal SDPA run once per document of the packed stream (O(sum len^2) memory)."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        rep = self.heads // self.groups
        outs = []
        for start, end in itertools.pairwise(bounds):
            if start == end:  # an empty document (a padded batch's spare boundary)
                continue
            qd = q[start:end].transpose(0, 1)  # [heads, t, d]
            kd = k[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, t, d]
            vd = v[start:end].transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, t, d]
            od = F.scaled_dot_product_attention(qd, kd, vd, is_causal=True, scale=self.scale)  # [heads, t, d]
            outs.append(od.transpose(0, 1))  # [t, heads, d]
        return torch.cat(outs, dim=0)  # [T, heads, d]


class BlockDiagonalSdpa(_PackedAttentionBase):
    """One SDPA call over the whole stream with a block-diagonal causal mask (O(T^2) memory)."""

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bounds: list[int]) -> torch.Tensor:
        rep = self.heads // self.groups
        total = q.shape[0]
        lengths = torch.tensor([e - s for s, e in itertools.pairwise(bounds)], device=q.device)
        doc = torch.repeat_interleave(torch.arange(len(lengths), device=q.device), lengths)  # [T]
        pos = torch.arange(total, device=q.device)  # [T]
        allowed = (doc[:, None] == doc[None, :]) & (pos[None, :] <= pos[:, None])  # [T, T]
        qt = q.transpose(0, 1)  # [heads, T, d]
        kt = k.transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, T, d]
        vt = v.transpose(0, 1).repeat_interleave(rep, dim=0)  # [heads, T, d]
        out = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=self.scale)  # [heads, T, d]
        return out.transpose(0, 1)  # [T, heads, d]


class _FusedPackedAttention(_PackedAttentionBase):
    """Base of the fused backends: the whole stream in one kernel call, no host sync.

    Both layouts megatron hands over become one packed stream ``[T, heads, d]`` with int32
    ``cu_seqlens`` on the device: THD as is (``max_seqlen_q`` comes from the engine, so the
    boundaries never travel to the host), unpacked ``[s, b, heads, d]`` as ``b`` documents
    of ``s`` tokens.
    """

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        attn_mask_type: Any = None,
        attention_bias: torch.Tensor | None = None,
        packed_seq_params: Any = None,
    ) -> torch.Tensor:
        if packed_seq_params is None:
            s, b = query.shape[0], query.shape[1]
            q, k, v = (x.transpose(0, 1).reshape(b * s, *x.shape[2:]) for x in (query, key, value))
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)  # [b + 1]
            out = self._attend_packed(q, k, v, cu, s, cache_key=None)  # [b*s, heads, d]
            return out.reshape(b, s, -1).transpose(0, 1)  # [s, b, heads*d]
        cu = packed_seq_params.cu_seqlens_q
        max_len = packed_seq_params.max_seqlen_q
        if max_len is None:
            max_len = int((cu[1:] - cu[:-1]).max())
        out = self._attend_packed(query, key, value, cu.to(torch.int32), int(max_len), cache_key=cu)
        return out.reshape(out.shape[0], -1)  # [T, heads*d]

    def _attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        cache_key: torch.Tensor | None,
    ) -> torch.Tensor:
        raise NotImplementedError


def document_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """``doc[t]`` = index of the document holding token ``t`` (device-side, no host sync)."""
    lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()  # [D]
    docs = torch.arange(lengths.shape[0], device=cu_seqlens.device)  # [D]
    return torch.repeat_interleave(docs, lengths, output_size=total)  # [T]


class _BlockMaskCache:
    """The last ``BlockMask`` built, keyed by the identity of the ``cu_seqlens`` tensor.

    Every layer of one forward receives the same ``PackedSeqParams`` object, so the mask is
    built once per forward instead of once per layer.  The cache holds a strong reference to
    its key, so a later tensor can never reuse the key's id while the entry lives.
    """

    def __init__(self) -> None:
        self.key: torch.Tensor | None = None
        self.total = -1
        self.mask: Any = None

    def get(self, key: torch.Tensor | None, total: int, build: Callable[[], Any]) -> Any:
        if key is not None and key is self.key and total == self.total:
            return self.mask
        mask = build()
        if key is not None:
            self.key, self.total, self.mask = key, total, mask
        return mask


_FLEX_MASKS = _BlockMaskCache()
_FLEX_COMPILED: Callable[..., Any] | None = None
FLEX_BLOCK = 128
"""flex_attention's tile; on CUDA the stream is padded to a multiple of it (fewer recompiles)."""


def _flex_pads(q: torch.Tensor) -> bool:
    """Whether the stream is padded to a multiple of ``FLEX_BLOCK`` (CUDA: the compiled kernel)."""
    return q.is_cuda


def _flex_kernel(device: torch.device) -> Callable[..., Any]:
    """``flex_attention`` compiled once per process on CUDA; the eager reference elsewhere."""
    global _FLEX_COMPILED
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return flex_attention
    if _FLEX_COMPILED is None:
        _FLEX_COMPILED = torch.compile(flex_attention)
    return _FLEX_COMPILED


class FlexDocumentAttention(_FusedPackedAttention):
    """flex_attention with a per-document causal ``BlockMask`` (GQA native, no repeat).

    The mask keeps ``(q, kv)`` iff both tokens lie in one document and ``kv <= q``; tiles of
    the [T, T] grid that no pair of one document touches are skipped entirely, so the work is
    ``sum_d len_d^2 / 2`` up to tile granularity and no score matrix is materialised (on CUDA).
    Padding tokens (CUDA only) form their own document of id -1 and are cut off the output.
    """

    def _attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        cache_key: torch.Tensor | None,
    ) -> torch.Tensor:
        from torch.nn.attention.flex_attention import create_block_mask

        total = q.shape[0]
        padded = total
        if _flex_pads(q) and total % FLEX_BLOCK:
            padded = total + FLEX_BLOCK - total % FLEX_BLOCK

        def build() -> Any:
            doc = document_ids(cu_seqlens, total)  # [T]
            if padded != total:
                doc = F.pad(doc, (0, padded - total), value=-1)  # [T_pad]

            def same_doc_causal(b: Any, h: Any, q_idx: Any, kv_idx: Any) -> Any:
                return (doc[q_idx] == doc[kv_idx]) & (kv_idx <= q_idx)

            return create_block_mask(same_doc_causal, None, None, padded, padded, device=q.device)

        mask = _FLEX_MASKS.get(cache_key, total, build)

        def heads_first(x: torch.Tensor) -> torch.Tensor:  # [T, h, d] -> [1, h, T_pad, d]
            x = x if x.is_contiguous() else x.contiguous()  # one layout: one compiled kernel
            if padded != total:
                x = F.pad(x, (0, 0, 0, 0, 0, padded - total))
            return x.transpose(0, 1).unsqueeze(0)

        out = _flex_kernel(q.device)(
            heads_first(q),
            heads_first(k),
            heads_first(v),
            block_mask=mask,
            scale=self.scale,
            enable_gqa=self.heads != self.groups,
        )  # [1, heads, T_pad, d]
        return out[0, :, :total].transpose(0, 1)  # [T, heads, d]


@functools.cache
def _varlen_call() -> tuple[Callable[..., Any], dict[str, Any], bool]:
    """``varlen_attn`` and the keyword arguments that make it causal in this torch.

    torch releases spell causality ``is_causal=True`` (older) or ``window_size=(-1, 0)``
    (newer); only some accept ``enable_gqa``.  FlashAttention takes fewer key/value heads
    than query heads natively, so GQA needs no copy either way.
    """
    from torch.nn.attention.varlen import varlen_attn

    params = inspect.signature(varlen_attn).parameters
    causal: dict[str, Any] = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    return varlen_attn, causal, "enable_gqa" in params


class VarlenFlashAttention(_FusedPackedAttention):
    """FlashAttention-2 over the packed stream via ``torch.nn.attention.varlen.varlen_attn``.

    One kernel for all documents, driven by ``cu_seqlens``; memory ``O(T)``.  CUDA (bf16 or
    fp16) only: on CPU tensors it raises, so a CPU engine must pick another backend.
    """

    def _attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        cache_key: torch.Tensor | None,
    ) -> torch.Tensor:
        if not q.is_cuda:
            raise RuntimeError(
                "attention backend 'varlen_flash' needs CUDA tensors; use 'sdpa_per_document' on CPU"
            )
        fn, causal, takes_gqa = _varlen_call()
        extra = {"enable_gqa": True} if takes_gqa and self.heads != self.groups else {}
        q, k, v = (x if x.is_contiguous() else x.contiguous() for x in (q, k, v))
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, scale=self.scale, **causal, **extra)


CUDNN_MIN_TOKENS = 2048
"""The shortest one-document stream ``varlen_flash_cudnn`` hands to cuDNN: below it a step is
bound by the host, where cuDNN's call costs more than FlashAttention's."""

_MAX_SEQLEN_EXACT: contextvars.ContextVar[bool] = contextvars.ContextVar("max_seqlen_exact", default=True)


@contextlib.contextmanager
def max_seqlen_rounded() -> Iterator[None]:
    """Forwards within pass a ``max_seqlen`` rounded up rather than their longest document's
    length (the static steps of ``step_graphs.py``): a stream whose ``max_seqlen`` equals its
    length may then hold several documents, so no stream is taken for one document."""
    token = _MAX_SEQLEN_EXACT.set(False)
    try:
        yield
    finally:
        _MAX_SEQLEN_EXACT.reset(token)


def one_long_document(max_len: int, total: int) -> bool:
    """Whether a stream of ``total`` tokens whose ``max_seqlen`` is ``max_len`` is one document of
    at least ``CUDNN_MIN_TOKENS``: known on the host, with no sync, where ``max_seqlen`` is the
    longest document's length (outside ``max_seqlen_rounded``)."""
    return _MAX_SEQLEN_EXACT.get() and max_len == total >= CUDNN_MIN_TOKENS


def cudnn_attention_usable(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    """Whether SDPA's cuDNN backend runs a causal GQA attention here, forward and backward, within
    bf16 error of the fp32 math (tried once per device, dtype and head size, on a small input)."""
    if device.type != "cuda" or not torch.backends.cuda.cudnn_sdp_enabled():
        return False
    return CUDNN.usable(device, dtype, head_dim)


def _cudnn_mismatch(device: torch.device, dtype: torch.dtype, head_dim: int) -> str:
    """Why SDPA's cuDNN backend may not serve here ("" where its output and input gradients are
    each within 2 % relative error of the fp32 math's, on 256 tokens of 4 query and 2 key heads)."""
    gen = torch.Generator(device=device).manual_seed(0)
    q, k, v = (torch.randn(256, h, head_dim, generator=gen, device=device) for h in (4, 2, 2))
    g = torch.randn(256, 4, head_dim, generator=gen, device=device)
    scale = 1.0 / math.sqrt(head_dim)
    want = [x.requires_grad_() for x in (q, k, v)]
    ref = _causal_sdpa(want[0], want[1], want[2], scale, cudnn=False)
    ref_grads = torch.autograd.grad(ref, want, g)
    got_in = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
    got = _causal_sdpa(got_in[0], got_in[1], got_in[2], scale, cudnn=True)
    got_grads = torch.autograd.grad(got, got_in, g.to(dtype))
    for name, a, b in zip(("output", "dq", "dk", "dv"), [got, *got_grads], [ref, *ref_grads], strict=True):
        rel = torch.linalg.vector_norm(a.double() - b.double()) / torch.linalg.vector_norm(b.double())
        if not bool(rel < 2e-2):  # NaN fails too
            return f"{name} differs from fp32 by a relative error of {float(rel):.3g}"
    return ""


CUDNN = KernelProbe("SDPA's cuDNN attention", "FlashAttention", _cudnn_mismatch)


def _causal_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, cudnn: bool) -> torch.Tensor:
    """Causal attention of one document, ``q [T, heads, d]``, ``k``/``v [T, groups, d]`` to
    ``[T, heads, d]``; with ``cudnn``, by SDPA's cuDNN backend only (it raises where that cannot
    run). Key/value heads are repeated to the query heads (the cuDNN backend takes no GQA)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rep = q.shape[1] // k.shape[1]
    qt = q.transpose(0, 1).unsqueeze(0)  # [1, heads, T, d]: the [T, heads, d] layout, as strides
    kt, vt = (x.repeat_interleave(rep, dim=1).transpose(0, 1).unsqueeze(0) for x in (k, v))
    backends = [SDPBackend.CUDNN_ATTENTION] if cudnn else [SDPBackend.MATH]
    with sdpa_kernel(backends):
        out = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)  # [1, heads, T, d]
    return out[0].transpose(0, 1)  # [T, heads, d]


class VarlenFlashCudnnAttention(VarlenFlashAttention):
    """``VarlenFlashAttention``, but a stream that is one document of at least ``CUDNN_MIN_TOKENS``
    (an ``Nx1`` step of one long sequence) runs cuDNN's fused attention instead: Hopper's cuDNN
    kernels outrun FlashAttention-2 on long causal documents. Whether the stream is one document
    is known on the host (``one_long_document``), so the choice costs no sync; cuDNN is used only
    where ``cudnn_attention_usable`` found it working at first use."""

    def _attend_packed(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu_seqlens: torch.Tensor,
        max_len: int,
        cache_key: torch.Tensor | None,
    ) -> torch.Tensor:
        if (
            q.is_cuda
            and one_long_document(max_len, q.shape[0])
            and cudnn_attention_usable(q.device, q.dtype, q.shape[-1])
        ):
            return _causal_sdpa(q, k, v, self.scale, cudnn=True)
        return super()._attend_packed(q, k, v, cu_seqlens, max_len, cache_key)


ATTENTION_BACKENDS: dict[str, type[nn.Module]] = {
    "sdpa_per_document": PerDocumentSdpa,
    "sdpa_block_diagonal": BlockDiagonalSdpa,
    "flex_attention": FlexDocumentAttention,
    "varlen_flash": VarlenFlashAttention,
    "varlen_flash_cudnn": VarlenFlashCudnnAttention,
}
