"""Export and import one slot's complete training state, independent of the TP size.

``SlotState`` is the one type of a model's training state outside its slot: config, step
counter, adapter tensors, AdamW moments and, when it was taken with them, the accumulated
gradients and whether they are pending (an optimizer step has not consumed them yet).  Tensors
are in the *full* megatron layout (TP=1: ``linear_qkv`` rows interleaved per GQA group,
``linear_fc1`` as ``[gate; up]``), cut to the slot's rank, on CPU, keyed like
``decoder.layers.0.self_attention.linear_qkv.lora_A``.

Invariant: ``set_slot_state(get_slot_state(s), with_optimizer=True)`` reproduces the slot
bit for bit (values are copied, never recomputed), so training continues exactly as if it had
never stopped; with ``with_optimizer=False`` the moments and step counter start from zero.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from libs.contracts.common import LoraConfig
from services.trainer.convert import ShardKind, shard, unshard
from services.trainer.lora import AdapterPool
from services.trainer.optim import SlotAdamW
from services.trainer.parallel import tp_all_gather, tp_rank, tp_size


@dataclass
class SlotState:
    """Everything needed to resume one slot (see module docstring for the layout)."""

    config: LoraConfig
    step: int
    adapter: dict[str, torch.Tensor]
    exp_avg: dict[str, torch.Tensor] = field(default_factory=dict)
    exp_avg_sq: dict[str, torch.Tensor] = field(default_factory=dict)
    grads: dict[str, torch.Tensor] = field(default_factory=dict)  # empty: not taken (or none)
    pending: bool = False  # gradients accumulated since the last optimizer step

    @property
    def nbytes(self) -> int:
        tables = (self.adapter, self.exp_avg, self.exp_avg_sq, self.grads)
        return sum(t.numel() * t.element_size() for table in tables for t in table.values())


def _host_copy(value: torch.Tensor) -> torch.Tensor:
    """A CPU tensor that shares no memory with ``value``: one device-to-host copy, or a clone on CPU."""
    return value.clone() if value.device.type == "cpu" else value.cpu()


def _full(local: torch.Tensor, kind: ShardKind) -> torch.Tensor:
    """The full-layout tensor (gathered over TP); ``local`` itself, not a copy, without TP."""
    parts = tp_all_gather(local)
    return parts[0] if len(parts) == 1 else unshard(parts, kind)


class HostBuffers:
    """Host tensors that a snapshot's copies of the slots' state are made into, kept and reused
    by the next snapshot (pinned when the state is on CUDA: device-to-host copies into pinned
    memory run at the link's speed, into pageable memory several times slower).

    A snapshot's tensors are these buffers: they stay valid until the next ``copy`` of the same
    slot and tensor, so a caller must be done with one snapshot's tensors (written them) before it
    captures the next. ``wait`` makes the copies issued so far complete (they are asynchronous on
    CUDA)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str, str], torch.Tensor] = {}
        self._pending = False

    def copy(self, slot: int, table: str, name: str, value: torch.Tensor) -> torch.Tensor:
        key = (slot, table, name)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = None
            if value.device.type == "cuda":
                try:
                    buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu", pin_memory=True)
                except RuntimeError:  # no pinned memory left: pageable (slower copies, same bytes)
                    buffer = None
            if buffer is None:
                buffer = torch.empty(value.shape, dtype=value.dtype, device="cpu")
            self._buffers[key] = buffer
        buffer.copy_(value, non_blocking=value.device.type == "cuda")
        self._pending = self._pending or value.device.type == "cuda"
        return buffer

    def wait(self) -> None:
        if self._pending:
            torch.cuda.current_stream().synchronize()
            self._pending = False

    def retain(self, slots: set[int]) -> None:
        """Drop the buffers of slots outside ``slots`` (released since)."""
        for key in [k for k in self._buffers if k[0] not in slots]:
            del self._buffers[key]

    @property
    def nbytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._buffers.values())


class PinnedPool:
    """Pinned host buffers that saves copy a slot into, kept for the next save (pinning a buffer
    costs about as much as copying into pageable memory, so it is done once): a device-to-host
    copy into pinned memory runs at the link's speed, several times faster than into pageable
    memory, and it stalls the unit path for that long. At most ``keep`` buffers are kept free."""

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        self._free: list[torch.Tensor] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes`` (the smallest free one that fits)."""
        with self._lock:
            # by index: list.remove would compare tensors elementwise
            fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
            if fits:
                return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def give(self, buffer: torch.Tensor) -> None:
        with self._lock:
            self._free.append(buffer)
            self._free.sort(key=lambda b: b.numel(), reverse=True)
            del self._free[self.keep :]


def to_pinned(state: SlotState, pool: PinnedPool) -> tuple[SlotState, torch.Tensor]:
    """A copy of ``state``'s device tensors in one pinned buffer from ``pool`` (complete on
    return), and that buffer, to be given back once the copy is no longer read."""
    tables = (state.adapter, state.exp_avg, state.exp_avg_sq)
    align = 64
    sizes = [-(-t.numel() * t.element_size() // align) * align for table in tables for t in table.values()]
    buffer = pool.take(max(1, sum(sizes)))
    copies: list[dict[str, torch.Tensor]] = []
    offset = 0
    for table in tables:
        copied: dict[str, torch.Tensor] = {}
        for name, tensor in table.items():
            nbytes = tensor.numel() * tensor.element_size()
            view = buffer[offset : offset + nbytes].view(tensor.dtype).view(tensor.shape)
            view.copy_(tensor, non_blocking=True)
            copied[name] = view
            offset += -(-nbytes // align) * align
        copies.append(copied)
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.current_stream().synchronize()
    adapter, exp_avg, exp_avg_sq = copies
    return SlotState(state.config, state.step, adapter, exp_avg, exp_avg_sq), buffer


def get_slot_state(
    pool: AdapterPool,
    optimizer: SlotAdamW,
    slot: int,
    with_optimizer: bool = True,
    host: HostBuffers | None = None,
    gather_only: bool = False,
) -> SlotState:
    """Gather ``slot``'s state over TP (a collective: every rank must call it). Without
    ``with_optimizer`` the moments are left out (empty; an export needs the adapter alone).
    With ``host`` the tensors are copies in its buffers (complete on return), else new tensors.
    ``gather_only``: join the gathers and copy nothing to the host (a TP follower, whose result
    is discarded: only rank 0 writes snapshots); the tensors are left on the device."""
    if slot not in pool.configs:
        raise KeyError(f"slot {slot} is not initialised")
    adapter: dict[str, torch.Tensor] = {}
    exp_avg: dict[str, torch.Tensor] = {}
    exp_avg_sq: dict[str, torch.Tensor] = {}
    for tensor in pool.slot_tensors(slot):
        parts = [(adapter, tensor.value())]
        if with_optimizer:
            m, v = optimizer.moments(tensor)
            parts += [(exp_avg, m), (exp_avg_sq, v)]
        for table, local in parts:
            if gather_only:
                table[tensor.name] = _full(local.detach(), tensor.kind)
            elif host is None:
                table[tensor.name] = _host_copy(unshard(tp_all_gather(local.detach()), tensor.kind))
            else:
                full = _full(local.detach(), tensor.kind)
                label = "adapter" if table is adapter else "exp_avg" if table is exp_avg else "exp_avg_sq"
                table[tensor.name] = host.copy(slot, label, tensor.name, full)
    if host is not None and not gather_only:
        host.wait()
    return SlotState(pool.configs[slot], optimizer.steps.get(slot, 0), adapter, exp_avg, exp_avg_sq)


def set_slot_state(
    pool: AdapterPool, optimizer: SlotAdamW, slot: int, state: SlotState, with_optimizer: bool
) -> None:
    """Load ``state`` into ``slot`` (replacing whatever it held); gradients start at zero."""
    pool.clear_slot(slot)
    optimizer.reset_slot(slot)
    pool.configs[slot] = state.config
    tensors = pool.slot_tensors(slot)
    expected = {t.name for t in tensors}
    if set(state.adapter) != expected:
        pool.clear_slot(slot)
        missing, extra = sorted(expected - set(state.adapter)), sorted(set(state.adapter) - expected)
        raise ValueError(f"slot state does not fit its config: missing {missing[:3]}, unexpected {extra[:3]}")
    rank, size = tp_rank(), tp_size()
    with torch.no_grad():
        for tensor in tensors:
            target = tensor.value()
            piece = shard(state.adapter[tensor.name], tensor.kind, rank, size)
            if piece.shape != target.shape:
                pool.clear_slot(slot)
                raise ValueError(
                    f"{tensor.name}: shape {tuple(piece.shape)} != expected {tuple(target.shape)}"
                )
            target.copy_(piece)
            if with_optimizer:
                m, v = optimizer.moments(tensor)
                m.copy_(shard(state.exp_avg[tensor.name], tensor.kind, rank, size))
                v.copy_(shard(state.exp_avg_sq[tensor.name], tensor.kind, rank, size))
    if with_optimizer and state.step:
        optimizer.steps[slot] = state.step


def get_slot_grads(
    pool: AdapterPool, slot: int, host: HostBuffers | None = None, gather_only: bool = False
) -> dict[str, torch.Tensor]:
    """The slot's accumulated gradients in the same full layout as ``SlotState.adapter``
    (zeros where nothing accumulated yet); a collective like ``get_slot_state``. ``host``,
    ``gather_only``: as there."""
    grads: dict[str, torch.Tensor] = {}
    for tensor in pool.slot_tensors(slot):
        g = tensor.grad()
        local = torch.zeros_like(tensor.value()) if g is None else g
        if gather_only:
            grads[tensor.name] = _full(local.detach(), tensor.kind)
        elif host is None:
            grads[tensor.name] = unshard(tp_all_gather(local.detach()), tensor.kind).cpu().clone()
        else:
            grads[tensor.name] = host.copy(slot, "grad", tensor.name, _full(local.detach(), tensor.kind))
    if host is not None and not gather_only:
        host.wait()
    return grads


def set_slot_grads(pool: AdapterPool, slot: int, grads: dict[str, torch.Tensor]) -> None:
    """Restore accumulated gradients saved by ``get_slot_grads`` (recovery of a mid-window slot)."""
    rank, size = tp_rank(), tp_size()
    for tensor in pool.slot_tensors(slot):
        if tensor.param.grad is None:
            tensor.param.grad = torch.zeros_like(tensor.param)
        with torch.no_grad():
            tensor.param.grad[tensor.index].copy_(shard(grads[tensor.name], tensor.kind, rank, size))
