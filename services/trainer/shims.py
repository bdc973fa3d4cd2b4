"""Every patch megatron-core 0.16.1 needs to run on a CPU-only host, in one place.

megatron-core assumes CUDA in a few spots that the trainer's forward/backward path touches even
with ``use_cpu_initialization=True`` and all fused kernels disabled.  ``apply_cpu_shims()``
replaces exactly those spots with CPU-safe equivalents.

On the trainer's own path (``perform_initialization=False``, packed attention from
``attention.py`` instead of ``DotProductAttention``) only the RoPE patch is strictly required;
the RNG tracker and memory-buffer patches keep megatron's stock modules usable on CPU too
(tests, experiments) and cost nothing.

Invariant: the shims are applied only when CUDA is unavailable, at most once per process
(calling ``apply_cpu_shims`` again is a no-op), and each one changes where a tensor lives or
which RNG is forked, never the arithmetic.  On a GPU host nothing here runs.
"""

from __future__ import annotations

import contextlib
import operator
from collections.abc import Callable, Iterator
from functools import reduce
from typing import Any

import torch

_APPLIED = False


class CpuRngStatesTracker:
    """A CPU stand-in for megatron's ``CudaRNGStatesTracker`` (same duck-typed interface).

    Why: ``CudaRNGStatesTracker.add``/``fork`` call ``torch.cuda.get_rng_state`` and
    ``torch.cuda.manual_seed``, which raise on a CPU-only torch; megatron's
    ``DotProductAttention`` and weight initialisation fork the tracker unconditionally.
    Named states here are CPU generator states, forked with ``torch.get_rng_state``.
    """

    def __init__(self) -> None:
        self.reset()

    def is_initialized(self) -> bool:
        return self._is_initialized

    def reset(self) -> None:
        self._is_initialized = False
        self.states_: dict[str, torch.Tensor] = {}
        self.seeds_: set[int] = set()

    def get_states(self) -> dict[str, torch.Tensor]:
        return dict(self.states_)

    def set_states(self, states: dict[str, torch.Tensor]) -> None:
        self._is_initialized = True
        self.states_ = states

    def add(self, name: str, seed: int) -> None:
        self._is_initialized = True
        if seed in self.seeds_:
            raise RuntimeError(f"rng seed {seed} already exists")
        if name in self.states_:
            raise RuntimeError(f"rng state {name} already exists")
        self.seeds_.add(seed)
        saved = torch.get_rng_state()
        torch.manual_seed(seed)
        self.states_[name] = torch.get_rng_state()
        torch.set_rng_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = "model-parallel-rng") -> Iterator[None]:
        if name not in self.states_:
            raise RuntimeError(f"rng state {name} is not added")
        saved = torch.get_rng_state()
        torch.set_rng_state(self.states_[name])
        try:
            yield
        finally:
            self.states_[name] = torch.get_rng_state()
            torch.set_rng_state(saved)


def _install_cpu_rng_tracker() -> None:
    from megatron.core.tensor_parallel import random as mp_random

    tracker = CpuRngStatesTracker()
    # Same three named states megatron's model_parallel_cuda_manual_seed registers.
    tracker.add(mp_random._MODEL_PARALLEL_RNG_TRACKER_NAME, 2718)
    tracker.add(mp_random._DATA_PARALLEL_RNG_TRACKER_NAME, 1234)
    tracker.add(mp_random._EXPERT_PARALLEL_RNG_TRACKER_NAME, 3141)
    mp_random._CUDA_RNG_STATE_TRACKER = tracker
    mp_random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True


def _patch_rotary_get_emb() -> None:
    """Why: ``RotaryEmbedding.get_emb`` moves ``inv_freq`` to ``torch.cuda.current_device()``
    on its first call, even when the module was built with ``use_cpu_initialization``."""
    from megatron.core.models.common.embeddings import rotary_pos_embedding as rope

    def get_emb(self: Any, max_seq_len: int, offset: int = 0) -> torch.Tensor:
        freqs = self.get_freqs_non_repeated(max_seq_len, offset)  # [s, dim/2]
        if not self.rotary_interleaved:
            emb = torch.cat((freqs, freqs), dim=-1)  # [s, dim]
        else:
            emb = torch.stack((freqs.view(-1, 1), freqs.view(-1, 1)), dim=-1).view(freqs.shape[0], -1)
        return emb[:, None, None, :]  # [s, 1, 1, dim]

    rope.RotaryEmbedding.get_emb = get_emb


def _patch_global_memory_buffer() -> None:
    """Why: ``GlobalMemoryBuffer.get_tensor`` allocates on ``torch.cuda.current_device()``;
    megatron's ``DotProductAttention`` takes its score buffer from it."""
    from megatron.core import utils as mc_utils

    def get_tensor(
        self: Any,
        tensor_shape: tuple[int, ...],
        dtype: torch.dtype,
        name: str,
        mem_alloc_context: Callable[[], Any] | None = None,
    ) -> torch.Tensor:
        required = reduce(operator.mul, tensor_shape, 1)
        key = (name, dtype)
        if self.buffer.get(key) is None or self.buffer[key].numel() < required:
            self.buffer[key] = torch.empty(required, dtype=dtype, device="cpu", requires_grad=False)
        return self.buffer[key][0:required].view(*tensor_shape)

    mc_utils.GlobalMemoryBuffer.get_tensor = get_tensor


def apply_cpu_shims() -> bool:
    """Apply every CPU patch once; returns True when the shims are (now or already) active."""
    global _APPLIED
    if torch.cuda.is_available():
        return False
    if _APPLIED:
        return True
    _install_cpu_rng_tracker()
    _patch_rotary_get_emb()
    _patch_global_memory_buffer()
    _APPLIED = True
    return True
