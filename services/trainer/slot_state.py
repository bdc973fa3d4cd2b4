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

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any

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


SNAPSHOT_TABLES = ("adapter", "exp_avg", "exp_avg_sq", "grad")
"""The tables a snapshot copies of a slot (``get_slot_state`` and ``get_slot_grads`` with ``host``)."""

BufferLayout = list[tuple[str, str, tuple[int, ...], torch.dtype]]
"""(table, tensor name, full-layout shape, dtype) of each host copy of a slot."""


def host_layout(pool: AdapterPool, slot: int, tables: tuple[str, ...] = SNAPSHOT_TABLES) -> BufferLayout:
    """The host copies a snapshot makes of ``slot``'s tensors (or of ``tables`` of them): every
    tensor the slot trains in the full layout, once per table."""
    size = tp_size()
    layout: BufferLayout = []
    for tensor in pool.slot_tensors(slot):
        value = tensor.value()
        shape = list(value.shape)
        if size > 1 and tensor.kind in (ShardKind.COLUMN, ShardKind.COLUMN_GLU):
            shape[0] *= size
        elif size > 1 and tensor.kind is ShardKind.ROW:
            shape[1] *= size
        layout += [(table, tensor.name, tuple(shape), value.dtype) for table in tables]
    return layout


class _Background:
    """Jobs run in submission order on one daemon thread, started on first use.

    Not a ``ThreadPoolExecutor``: its workers are joined at interpreter exit, so a trainer told to
    stop would first finish pinning every queued buffer (seconds a slot); these jobs only
    allocate memory, which dies with the process."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._jobs: queue.SimpleQueue[tuple[Future[None], Callable[..., None], tuple[Any, ...]]] = (
            queue.SimpleQueue()
        )
        self._thread: threading.Thread | None = None

    def submit(self, job: Callable[..., None], *args: Any) -> Future[None]:
        future: Future[None] = Future()
        self._jobs.put((future, job, args))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name=self._name, daemon=True)
            self._thread.start()
        return future

    def _run(self) -> None:
        while True:
            future, job, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    job(*args)
                    future.set_result(None)
                except BaseException as exc:  # handed to whoever waits on the future
                    future.set_exception(exc)


PINNING = threading.Lock()
"""Held while host memory is pinned (``cudaHostAlloc``). Recording a CUDA graph holds it too
(``step_graphs.py``): pinning from another thread during a capture would break the capture."""


def _host_buffer(shape: tuple[int, ...], dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    """An uninitialised host tensor, pinned if asked and possible (else pageable: slower
    device-to-host copies, the same bytes)."""
    if pinned:
        try:
            with PINNING:
                return torch.empty(shape, dtype=dtype, device="cpu", pin_memory=True)
        except RuntimeError:  # no pinned memory left
            pass
    return torch.empty(shape, dtype=dtype, device="cpu")


class HostBuffers:
    """Host tensors that a snapshot's copies of the slots' state are made into, kept and reused
    by the next snapshot (pinned when the state is on CUDA: device-to-host copies into pinned
    memory run at the link's speed, into pageable memory several times slower).

    Pinning memory costs about as much time as a copy into pageable memory (1.6 s a slot for the
    8B shape at rank 32), so ``prepare`` allocates a slot's buffers on a background thread as soon
    as the slot holds a model; a snapshot's copy of the slot then finds them (it waits for a
    preparation still running, and allocates what is missing itself).

    A snapshot's tensors are these buffers: they stay valid until the next ``copy`` of the same
    slot and tensor, so a caller must be done with one snapshot's tensors (written them) before it
    captures the next. ``wait`` makes the copies issued so far complete (they are asynchronous on
    CUDA)."""

    def __init__(self) -> None:
        self._buffers: dict[tuple[int, str, str], torch.Tensor] = {}
        self._pending = False
        self._lock = threading.Lock()  # ``_buffers`` is shared with the preparing thread
        self._preparing: dict[int, Future[None]] = {}
        self._worker = _Background("snapshot-buffers")

    def prepare(self, slot: int, layout: BufferLayout, pinned: bool) -> None:
        """Allocate, on a background thread, the buffers a snapshot of ``slot`` will copy into
        (``host_layout``); buffers of the right shape already there are kept."""
        # one thread, in order: the newest preparation of a slot finishes after its older ones
        self._preparing[slot] = self._worker.submit(self._allocate, slot, layout, pinned)

    def _allocate(self, slot: int, layout: BufferLayout, pinned: bool) -> None:
        for table, name, shape, dtype in layout:
            key = (slot, table, name)
            with self._lock:
                have = self._buffers.get(key)
            if have is None or have.shape != shape or have.dtype != dtype:
                buffer = _host_buffer(shape, dtype, pinned)
                with self._lock:
                    self._buffers[key] = buffer

    def ready(self) -> None:
        """Wait for every preparation started so far."""
        for slot in list(self._preparing):
            self._preparing.pop(slot).result()

    def copy(self, slot: int, table: str, name: str, value: torch.Tensor) -> torch.Tensor:
        preparing = self._preparing.pop(slot, None)
        if preparing is not None:
            preparing.result()
        key = (slot, table, name)
        with self._lock:
            buffer = self._buffers.get(key)
        if buffer is None or buffer.shape != value.shape or buffer.dtype != value.dtype:
            buffer = _host_buffer(tuple(value.shape), value.dtype, value.device.type == "cuda")
            with self._lock:
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
        with self._lock:
            for key in [k for k in self._buffers if k[0] not in slots]:
                del self._buffers[key]

    def holds(self, slot: int, table: str, name: str) -> torch.Tensor | None:
        """The buffer kept for one tensor of ``slot`` (None: none yet)."""
        with self._lock:
            return self._buffers.get((slot, table, name))

    @property
    def nbytes(self) -> int:
        with self._lock:
            return sum(b.numel() * b.element_size() for b in self._buffers.values())


def _pinned_bytes(nbytes: int) -> torch.Tensor:
    with PINNING:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


PINNED_ALIGN = 64
"""Each tensor of a ``to_pinned`` copy starts at a multiple of this many bytes of its buffer."""


def pinned_nbytes(layout: BufferLayout) -> int:
    """The size of a ``to_pinned`` buffer for the tensors of ``layout``."""
    return sum(
        -(-torch.Size(shape).numel() * dtype.itemsize // PINNED_ALIGN) * PINNED_ALIGN
        for _, _, shape, dtype in layout
    )


class PinnedPool:
    """Pinned host buffers that saves copy a slot into, kept for the next save (pinning a buffer
    costs about as much as copying into pageable memory, so it is done once): a device-to-host
    copy into pinned memory runs at the link's speed, several times faster than into pageable
    memory, and it stalls the unit path for that long. At most ``keep`` buffers are kept free.
    ``prepare`` allocates buffers ahead, on a background thread, so that not even a model's
    first save pins memory on the unit path."""

    def __init__(self, keep: int = 4, allocate: Callable[[int], torch.Tensor] | None = None) -> None:
        """``allocate(nbytes)``: a new buffer (default: pinned uint8; tests pass another)."""
        self.keep = keep
        self._new = allocate or _pinned_bytes
        self._free: list[torch.Tensor] = []
        self._coming: list[int] = []  # sizes ``prepare`` is allocating
        self._cond = threading.Condition()
        self._worker = _Background("pinned-pool")

    def prepare(self, nbytes: int, count: int = 1) -> None:
        """Make ``count`` (at most ``keep``) free buffers of at least ``nbytes`` exist, allocating
        the missing ones on a background thread."""
        with self._cond:
            have = sum(b.numel() >= nbytes for b in self._free) + sum(c >= nbytes for c in self._coming)
            missing = max(0, min(count, self.keep) - have)
            self._coming += [nbytes] * missing
        for _ in range(missing):
            self._worker.submit(self._allocate, nbytes)

    def _allocate(self, nbytes: int) -> None:
        try:
            buffer: torch.Tensor | None = self._new(nbytes)
        except RuntimeError:  # no pinned memory left: a save allocates its own
            buffer = None
        with self._cond:
            self._coming.remove(nbytes)
            if buffer is not None:
                self._keep(buffer)
            self._cond.notify_all()

    def ready(self) -> None:
        """Wait until every allocation ``prepare`` started has finished."""
        with self._cond:
            self._cond.wait_for(lambda: not self._coming)

    def take(self, nbytes: int) -> torch.Tensor:
        """A pinned uint8 buffer of at least ``nbytes``: the smallest free one that fits, one
        being prepared that will fit, or a new one."""
        with self._cond:
            while True:
                # by index: list.remove would compare tensors elementwise
                fits = [i for i, b in enumerate(self._free) if b.numel() >= nbytes]
                if fits:
                    return self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                if not any(c >= nbytes for c in self._coming):
                    break
                self._cond.wait()
        return self._new(nbytes)

    def give(self, buffer: torch.Tensor) -> None:
        with self._cond:
            self._keep(buffer)

    def _keep(self, buffer: torch.Tensor) -> None:
        self._free.append(buffer)
        self._free.sort(key=lambda b: b.numel(), reverse=True)
        del self._free[self.keep :]

    @property
    def free(self) -> list[int]:
        """The sizes of the free buffers, largest first."""
        with self._cond:
            return [b.numel() for b in self._free]


def to_pinned(state: SlotState, pool: PinnedPool) -> tuple[SlotState, torch.Tensor]:
    """A copy of ``state``'s device tensors in one pinned buffer from ``pool`` (complete on
    return), and that buffer, to be given back once the copy is no longer read."""
    tables = (state.adapter, state.exp_avg, state.exp_avg_sq)
    align = PINNED_ALIGN
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
