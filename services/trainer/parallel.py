"""Process groups for the trainer: one tensor-parallel group spanning the whole world.

The engine is SPMD: every rank of the tensor-parallel (TP) group receives the same calls with
the same arguments.  This module owns the torch.distributed / megatron ``parallel_state`` setup
and the few collectives the engine needs outside megatron's own layers.

Invariant: after ``ensure_model_parallel()`` returns, ``torch.distributed`` is initialised
(gloo on CPU, NCCL on GPU) and megatron's TP size equals the world size (no data or pipeline
parallelism); a lone process gets a private one-rank group through an in-memory store: no
rendezvous port (gloo's own listener binds a port of the kernel's choice).
"""

from __future__ import annotations

import importlib
import sys
from typing import Any

import torch
import torch.distributed as dist


def import_megatron() -> None:
    """Import megatron-core with its fusion decorators left as the plain functions they wrap.

    Importing ``megatron.core`` applies ``torch.compile`` as a decorator to about forty fused
    functions (``megatron.core.jit.jit_fuser``: bias-GELU, bias-SwiGLU, bias-dropout-add, ...),
    and the first ``torch.compile`` imports TorchDynamo: about 4 s of CPU in every trainer process
    and rank, at every start and restart. The trainer's ``TransformerConfig`` switches each of those
    fusions off (``model.build_model``), so none of them is ever called. Megatron's own switch,
    ``megatron.core.jit.disable_jit_fuser``, can only run once megatron is imported, after the
    decorators ran; so while megatron is first imported ``torch.compile`` is a decorator that
    returns its function unchanged (what ``disable_jit_fuser`` makes ``jit_fuser``), and it is
    put back right after. A no-op once megatron is loaded.
    """
    if "megatron.core" in sys.modules:
        return
    compile_ = torch.compile

    def as_is(model: Any = None, **_: Any) -> Any:
        return model if model is not None else (lambda fn: fn)

    torch.compile = as_is  # type: ignore[assignment]
    try:
        importlib.import_module("megatron.core")
    finally:
        torch.compile = compile_


def ensure_model_parallel(device: str) -> int:
    """Initialise torch.distributed and megatron's model-parallel state if needed.

    Args:
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).

    Returns:
        The tensor-parallel size (the world size).
    """
    import_megatron()
    from megatron.core import parallel_state

    if not dist.is_initialized():
        # A lone process: an in-memory store avoids picking a port.
        backend = "nccl" if device == "cuda" else "gloo"
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    world = dist.get_world_size()
    if device == "cuda":
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    if not parallel_state.model_parallel_is_initialized():
        parallel_state.initialize_model_parallel(tensor_model_parallel_size=world)
    tp = int(parallel_state.get_tensor_model_parallel_world_size())
    if tp != world:
        raise RuntimeError(f"trainer needs TP size == world size, got tp={tp} world={world}")
    return tp


def tp_rank() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_rank())


def tp_size() -> int:
    from megatron.core import parallel_state

    return int(parallel_state.get_tensor_model_parallel_world_size())


def tp_all_reduce_sum(value: torch.Tensor) -> torch.Tensor:
    """Sum ``value`` over the TP group in place (a no-op at TP=1) and return it."""
    from megatron.core import parallel_state

    if tp_size() > 1:
        dist.all_reduce(value, op=dist.ReduceOp.SUM, group=parallel_state.get_tensor_model_parallel_group())
    return value


def tp_all_gather(value: torch.Tensor) -> list[torch.Tensor]:
    """Every rank's ``value`` (same shape on all ranks), in rank order."""
    from megatron.core import parallel_state

    if tp_size() == 1:
        return [value]
    parts = [torch.empty_like(value) for _ in range(tp_size())]
    dist.all_gather(parts, value.contiguous(), group=parallel_state.get_tensor_model_parallel_group())
    return parts
