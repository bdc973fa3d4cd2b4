"""Triton, where it is installed: CUDA builds of torch ship it; the CPU path never needs it.

Each kernel module imports ``triton``, ``tl`` (and ``libdevice``) from here and defines its
kernels under ``if triton is not None:``; without Triton the three are None and the modules'
eager paths serve.
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice
except ImportError:  # pragma: no cover - CPU-only installs
    triton = None
    tl = None
    libdevice = None

__all__ = ["libdevice", "tl", "triton"]
