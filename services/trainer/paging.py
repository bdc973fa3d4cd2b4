"""Paged-out models: their complete training state, outside the adapter slots.

A model that holds no slot (the planner paged it out to make room, see
``services/planner/planner.py``) keeps everything it needs to resume exactly: LoRA weights,
AdamW moments and step, accumulated gradients and whether they are pending. ``capture``
takes that state out of a slot, ``restore`` puts it into one; on CPU fp32 training after a
round trip is bit-identical to training that never left its slot.

``PageStore`` holds the captured states: in host memory up to ``host_budget_bytes``, and
the least recently paged-out ones beyond it as files under ``DATA/trainer/<group>/paged/``.
Neither copy has to survive a crash: recovery restores the newest snapshot, which holds
every paged model of its time (``snapshots.take``), and replays the page-outs after it.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgspec
import torch
from safetensors.torch import load_file, save

from libs.contracts.common import LoraConfig
from libs.contracts.ids import token
from services.trainer.engine import TrainerEngine
from services.trainer.slot_state import SlotState

log = logging.getLogger("tinkerd.trainer")


class PagedMeta(msgspec.Struct, frozen=True):
    """What the tensors of a paged state do not say themselves."""

    model_id: str
    lora: LoraConfig
    step: int
    pending: bool  # gradients accumulated since the last optim_step


@dataclass
class PagedState:
    meta: PagedMeta
    tensors: dict[str, torch.Tensor]  # adapter.*, exp_avg.*, exp_avg_sq.*, grad.*

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def capture(engine: TrainerEngine, slot: int, model_id: str, for_snapshot: bool = False) -> PagedState:
    """The slot's complete training state (CPU tensors, copies). ``for_snapshot``: the copies are
    in the engine's ``snapshot_buffers``, valid until the next snapshot's capture of the slot."""
    state = engine.get_slot_state(slot, for_snapshot=for_snapshot)
    tensors = {f"adapter.{k}": v for k, v in state.adapter.items()}
    tensors |= {f"exp_avg.{k}": v for k, v in state.exp_avg.items()}
    tensors |= {f"exp_avg_sq.{k}": v for k, v in state.exp_avg_sq.items()}
    tensors |= {f"grad.{k}": v for k, v in engine.get_slot_grads(slot, for_snapshot=for_snapshot).items()}
    meta = PagedMeta(model_id, state.config, state.step, engine.has_pending_grads(slot))
    return PagedState(meta, tensors)


def restore(engine: TrainerEngine, slot: int, paged: PagedState) -> None:
    """Put a captured state into ``slot``, replacing whatever it held."""

    def part(prefix: str) -> dict[str, torch.Tensor]:
        return {k.removeprefix(prefix): v for k, v in paged.tensors.items() if k.startswith(prefix)}

    meta = paged.meta  # set_slot_state replaces everything: no fresh (random) init needed first
    state = SlotState(meta.lora, meta.step, part("adapter."), part("exp_avg."), part("exp_avg_sq."))
    engine.set_slot_state(slot, state, with_optimizer=True)
    engine.set_slot_grads(slot, part("grad."), meta.pending)


def encode(paged: PagedState) -> bytes:
    """One safetensors file: the tensors, and the meta as its metadata."""
    tensors = {k: v.contiguous() for k, v in paged.tensors.items()}
    return save(tensors, metadata={"tinkerd": msgspec.json.encode(paged.meta).decode()})


def decode(path: Path) -> PagedState:
    from safetensors import safe_open

    with safe_open(str(path), framework="pt") as f:
        meta = msgspec.json.decode(f.metadata()["tinkerd"], type=PagedMeta)
    return PagedState(meta, load_file(str(path)))


@dataclass(frozen=True)
class Moved:
    """One page-out or page-in, for its event."""

    nbytes: int
    ms: float
    where: str  # "host" | "disk"


class PageStore:
    """Paged-out states by model: host memory first, files beyond the budget."""

    def __init__(self, root: Path, host_budget_bytes: int) -> None:
        self.root = root
        self.host_budget_bytes = host_budget_bytes
        self._host: OrderedDict[str, PagedState] = OrderedDict()  # oldest page-out first
        self._files: dict[str, Path] = {}

    def __contains__(self, model_id: str) -> bool:
        return model_id in self._host or model_id in self._files

    @property
    def models(self) -> list[str]:
        return sorted({*self._host, *self._files})

    @property
    def host_bytes(self) -> int:
        return sum(p.nbytes for p in self._host.values())

    def page_out(self, engine: TrainerEngine, slot: int, model_id: str) -> Moved:
        started = time.perf_counter()
        paged = capture(engine, slot, model_id)
        engine.release_slot(slot)
        self.drop(model_id)
        self._host[model_id] = paged
        spilled = self._spill()
        where = "disk" if model_id in spilled else "host"
        return Moved(paged.nbytes, (time.perf_counter() - started) * 1000, where)

    def page_in(self, engine: TrainerEngine, slot: int, model_id: str) -> Moved:
        started = time.perf_counter()
        where = "host" if model_id in self._host else "disk"
        paged = self._host.pop(model_id, None) or decode(self._files[model_id])
        restore(engine, slot, paged)
        self.drop(model_id)
        return Moved(paged.nbytes, (time.perf_counter() - started) * 1000, where)

    def export(self, model_id: str, path: Path) -> None:
        """Write the paged state (just paged out) to ``path`` durably (fsync), for another trainer
        group to page in: the hand-over of a model between groups (a shared directory)."""
        paged = self._host.get(model_id)
        data = encode(paged) if paged is not None else self._files[model_id].read_bytes()
        _write(path, data, sync=True)

    def page_in_from(self, engine: TrainerEngine, slot: int, model_id: str, path: Path) -> Moved:
        """Page in a state another group exported to ``path``; any copy of this store is stale."""
        started = time.perf_counter()
        paged = decode(path)
        restore(engine, slot, paged)
        self.drop(model_id)
        return Moved(paged.nbytes, (time.perf_counter() - started) * 1000, "disk")

    def drop(self, model_id: str) -> None:
        self._host.pop(model_id, None)
        path = self._files.pop(model_id, None)
        if path is not None and path.parent == self.root:
            path.unlink(missing_ok=True)  # a snapshot's own link to it stays

    def file_of(self, model_id: str) -> Path | None:
        """The file a paged state lives in (it may also be in host memory), if it has one."""
        return self._files.get(model_id)

    def state_of(self, model_id: str) -> PagedState | None:
        """The paged state, when it is in host memory."""
        return self._host.get(model_id)

    def durable(self, model_id: str) -> Path:
        """The paged state as a file, written now if it was only in host memory (which keeps its
        copy): a snapshot links it instead of writing it again, so each page-out is written to
        disk at most once however many snapshots follow."""
        path = self._files.get(model_id)
        if path is None:
            path = self.root / f"{token(model_id)}.safetensors"
            _write(path, encode(self._host[model_id]))
            self._files[model_id] = path
        return path

    def adopt(self, model_id: str, path: Path) -> None:
        """Know a paged state by its file (restored from a snapshot, or re-linked by one)."""
        old = self._files.get(model_id)
        self._files[model_id] = path
        if old is not None and old != path and old.parent == self.root:
            old.unlink(missing_ok=True)

    def _spill(self) -> set[str]:
        """Write the oldest host states to disk until host memory is within budget."""
        spilled: set[str] = set()
        held = self.host_bytes
        while self._host and held > self.host_budget_bytes:
            model_id = next(iter(self._host))
            try:
                self.durable(model_id)
            except OSError as exc:  # a full disk: keep it in memory, over budget
                log.warning("could not spill paged model %s to disk (%s); it stays in memory", model_id, exc)
                break
            held -= self._host.pop(model_id).nbytes
            spilled.add(model_id)
        return spilled


def write_durably(path: Path, data: bytes) -> None:
    """Write a state file whole or not at all, and fsync it (another group may read it next)."""
    _write(path, data, sync=True)


def _write(path: Path, data: bytes, sync: bool = False) -> None:
    """Written whole or not at all. A cache file needs no fsync (a crash loses nothing it needs);
    an export (``sync``) does: another group reads it after this one acknowledged the page-out."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}")
    with open(tmp, "wb") as f:
        f.write(data)
        if sync:
            f.flush()
            os.fsync(f.fileno())
    os.replace(tmp, path)
