"""Paged-out models: their complete training state, outside the adapter slots.

A model that holds no slot (the planner paged it out to make room, see
``services/planner/planner.py``) keeps everything it needs to resume exactly: its ``SlotState``
with gradients and whether they are pending (``slots.capture``); ``slots.restore`` puts it back.

``PageStore`` holds the captured states: in host memory up to ``host_budget_bytes``, and
the least recently paged-out ones beyond it as files (``files.py``) under
``DATA/trainer/<group>/paged/``. Neither copy has to survive a crash: recovery restores the
newest snapshot, which holds every paged model of its time (``snapshots.take``), and replays the
page-outs after it.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from libs.checkpoints import layout
from services.trainer.engine import TrainerEngine
from services.trainer.slot_state import SlotState
from services.trainer.state import files, slots

log = logging.getLogger("tinkerd.trainer")


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
        self._host: OrderedDict[str, SlotState] = OrderedDict()  # oldest page-out first
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
        paged = slots.capture(engine, slot)
        engine.release_slot(slot)
        self.drop(model_id)
        self._host[model_id] = paged
        spilled = self._spill()
        where = "disk" if model_id in spilled else "host"
        return Moved(paged.nbytes, (time.perf_counter() - started) * 1000, where)

    def page_in(self, engine: TrainerEngine, slot: int, model_id: str) -> Moved:
        started = time.perf_counter()
        where = "host" if model_id in self._host else "disk"
        paged = self._host.pop(model_id, None) or files.read(self._files[model_id])[1]
        slots.restore(engine, slot, paged)
        self.drop(model_id)
        return Moved(paged.nbytes, (time.perf_counter() - started) * 1000, where)

    def export(self, model_id: str, path: Path) -> None:
        """Write the paged state (just paged out) to ``path`` durably (fsync), for another trainer
        group to page in: the hand-over of a model between groups (a shared directory)."""
        paged = self._host.get(model_id)
        if paged is None:
            paged = files.read(self._files[model_id])[1]
        files.write(path, paged, model_id, sync=True)

    def page_in_from(self, engine: TrainerEngine, slot: int, model_id: str, path: Path) -> Moved:
        """Page in a state another group exported to ``path``; any copy of this store is stale."""
        started = time.perf_counter()
        _, paged = files.read(path)
        slots.restore(engine, slot, paged)
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

    def state_of(self, model_id: str) -> SlotState | None:
        """The paged state, when it is in host memory."""
        return self._host.get(model_id)

    def durable(self, model_id: str) -> Path:
        """The paged state as a file, written now if it was only in host memory (which keeps its
        copy): a snapshot links it instead of writing it again, so each page-out is written to
        disk at most once however many snapshots follow."""
        path = self._files.get(model_id)
        if path is None:
            path = layout.paged_file(self.root, model_id)
            files.write(path, self._host[model_id], model_id, sync=False)  # a cache: no fsync
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
