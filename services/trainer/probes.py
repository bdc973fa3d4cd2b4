"""A fast path serves a device only after it has proved itself there.

The trainer's fused kernels (the Triton kernels of ``swiglu``, ``vocab`` and ``packed_rope``) and
the library paths it prefers (SDPA's cuDNN backend, ``torch._grouped_mm``) may fail to build on a
GPU, or compute something else than the eager path on some device, dtype or shape. Each is tried
at its first use per key (device and dtype, plus any shape the kernel depends on): its own
comparison runs a small input through the fast path and a reference, forward and backward, with
autograd on even when the first use is inside a forward-only call. The verdict is kept for the
process. Where the comparison reports a difference or raises, the fallback serves, and one warning
says why.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

log = logging.getLogger(__name__)


class KernelProbe:
    """One fast path's verdicts, one per key, each from its comparison at the key's first use."""

    def __init__(self, name: str, fallback: str, compare: Callable[..., str]) -> None:
        """``compare(*key)`` returns "" where the fast path agrees with its reference, else why not."""
        self.name = name
        self.fallback = fallback
        self.compare = compare
        self.verdicts: dict[tuple[Any, ...], bool] = {}

    def usable(self, *key: Any) -> bool:
        """Whether the fast path serves ``key`` (compared once, at this first call)."""
        if key not in self.verdicts:
            why = self.mismatch(*key)
            if why:
                where = ", ".join(str(part) for part in key)
                log.warning("%s not used on %s, %s serves instead: %s", self.name, where, self.fallback, why)
            self.verdicts[key] = not why
        return self.verdicts[key]

    def mismatch(self, *key: Any) -> str:
        """The comparison's answer for ``key`` ("" where the fast path agrees), a failure to build
        or run included, with autograd on."""
        try:
            with torch.inference_mode(False), torch.enable_grad():
                return self.compare(*key)
        except Exception as exc:  # any failure to build or run (Triton and torch raise several types)
            return f"failed: {type(exc).__name__}: {exc}"


def largest_finite(t: torch.Tensor) -> float:
    """The largest finite ``|value|`` of ``t`` (0 where none is finite)."""
    finite = t.detach().double()[t.isfinite()]
    return float(finite.abs().max()) if finite.numel() else 0.0


def beyond_one_step(name: str, got: torch.Tensor, ref: torch.Tensor, absolute: float) -> str:
    """How many values of ``got`` differ from ``ref`` by more than one rounding step of their
    dtype (relative ``2**-mantissa``) plus ``absolute``, or where one is finite and the other
    not, or a different infinity ("" if none does)."""
    g, r = got.detach().double(), ref.detach().double()
    step = torch.finfo(ref.dtype).eps  # one step of the mantissa at 1.0
    close = g.isfinite() & r.isfinite() & ((g - r).abs() <= step * r.abs() + absolute)
    bad = ~((g.isnan() & r.isnan()) | (g.isinf() & (g == r)) | close)
    if not bool(bad.any()):
        return ""
    return f"{name}: {int(bad.sum())} of {got.numel()} values beyond one rounding step of the eager path"
