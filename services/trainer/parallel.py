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

import torch
import torch.distributed as dist


def ensure_model_parallel(device: str) -> int:
    """Initialise torch.distributed and megatron's model-parallel state if needed.

    Args:
        device: ``"cpu"`` (gloo) or ``"cuda"`` (NCCL).

    Returns:
        The tensor-parallel size (the world size).
    """
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
