"""What one unit does to the engine, the page store and the saves it starts.

``Executor.execute`` runs in the trainer's worker thread. It dispatches over the unit and op
unions with ``match``; every op answers with an ``OpOutcome``. A save or an export copies the
slot and yields a ``PendingSave`` (``state/checkpoints.py``) whose files the service writes in
the background and hands to the publisher. A barrier's ops run in ``barrier_order``.
``replaying`` is True while recovery re-executes units whose outcomes already exist: the slot
state is rebuilt, and nothing is written or handed off a second time, except the saves named in
``redo`` (their files never reached the publisher before a crash).

A takeover (``AdoptSlot``) runs the ``adopt`` callable the service gives the executor
(services/trainer/adoption.py, which replays a lost group's units on this executor through
``run_work`` and ``run_op``); this module never imports it.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from collections.abc import Callable, Collection
from pathlib import Path

import msgspec
import numpy as np

from libs.checkpoints.state_format import TrainingStateMeta
from libs.contracts.common import now_ns
from libs.contracts.events import ModelPagedIn, ModelPagedOut, OperationEvent
from libs.contracts.ids import HANDOFF
from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
from libs.contracts.work import (
    AdoptSlot,
    BarrierUnit,
    DiscardSlot,
    DropPaged,
    ExportSlot,
    FailRequest,
    InitSlot,
    LoadSlot,
    PageIn,
    PageOut,
    ReleaseSlot,
    SaveSlot,
    SlotOp,
    StepSlot,
    Unit,
    WorkUnit,
)
from libs.faults import crash_point
from services.trainer.engine import DatumInput, DatumOutput, TrainerEngine
from services.trainer.slot_state import SlotState
from services.trainer.state import checkpoints
from services.trainer.state.checkpoints import PendingSave, read_training_state
from services.trainer.state.paging import Moved, PageStore

log = logging.getLogger("tinkerd.trainer")


class UserError(Exception):
    """The caller's mistake (a checkpoint of another base model, ...): category ``user``."""


class ReportedError(Exception):
    """A server-side failure whose message is written for the caller (category ``server``)."""


Adopt = Callable[["Executor", str, AdoptSlot, bool], None]
"""Runs a takeover op: (executor, unit id, op, replaying). Raises ``ReportedError`` when the
model's state cannot be rebuilt."""


def _no_adoption(executor: Executor, unit_id: str, op: AdoptSlot, replaying: bool) -> None:
    raise ReportedError(f"this trainer cannot take over model {op.model_id} (no takeover configured)")


def barrier_phases(ops: list[SlotOp]) -> tuple[list[SlotOp], list[StepSlot], list[SlotOp]]:
    """A barrier's ops in the three phases a trainer runs them in: a takeover unit's page-outs
    and adoptions first (the steps it runs again need the adopted state); then the optimizer
    steps, fused in one call; then every other op in order."""
    adopts = [i for i, op in enumerate(ops) if isinstance(op, AdoptSlot)]
    first = list(ops[: adopts[-1] + 1]) if adopts else []
    rest = ops[len(first) :]
    return first, [op for op in rest if isinstance(op, StepSlot)], [op for op in rest if not isinstance(op, StepSlot)]


def barrier_order(ops: list[SlotOp]) -> list[SlotOp]:
    """The order ``barrier_phases`` runs a barrier's ops in, as one list."""
    first, steps, rest = barrier_phases(ops)
    return [*first, *steps, *rest]


def _read_state(directory: Path) -> tuple[SlotState, TrainingStateMeta]:
    """A training checkpoint the caller named; what is wrong with it is the caller's to fix."""
    try:
        return read_training_state(directory)
    except ValueError as exc:
        raise UserError(str(exc)) from exc


def default_seed(model_id: str) -> int:
    """The adapter seed of a model created without one: stable per model id."""
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little") & 0x7FFFFFFF


class Executor:
    """Applies units to the engine; keeps which model owns which slot, and the paged-out ones."""

    def __init__(
        self,
        engine: TrainerEngine,
        base_model: str,
        data_dir: Path,
        pages: PageStore,
        adopt: Adopt = _no_adoption,
        handover: bool = False,
    ) -> None:
        self.engine = engine
        self.handover = handover  # ephemeral exports handed over from memory (state/checkpoints.py)
        self.base_model = base_model
        self.data_dir = data_dir
        self.pages = pages
        self.adopt = adopt
        self.slot_models: dict[int, str] = {}
        self.events: list[OperationEvent] = []  # emitted by the service after the unit

    def execute(
        self, unit: Unit, replaying: bool, redo: Collection[str] = ()
    ) -> tuple[Outcome, list[PendingSave]]:
        """Run ``unit``; its outcome and the saves it started (``redo``: see the module doc)."""
        started = now_ns()
        if not replaying:
            crash_point("trainer.executing")  # fault tests: killed or wedged mid-unit
        match unit:
            case WorkUnit():
                return self.run_work(unit, started), []
            case BarrierUnit():
                return self._barrier(unit, replaying, redo, started)

    # --- forward_backward / forward ------------------------------------------------------
    def run_work(self, unit: WorkUnit, started: int = 0) -> WorkOutcome:
        """A forward_backward / forward unit's datums on their slots."""
        datums = [
            DatumInput(
                slot=item.slot,
                tokens=item.datum.token_array().astype(np.int64),
                loss_inputs={name: t.numpy() for name, t in item.datum.inputs.items()},
            )
            for item in unit.items
        ]
        config = {k: float(v) for k, v in unit.loss_config.items() if not isinstance(v, str)}
        results: list[DatumOutcome] = []
        try:
            outputs = self.engine.forward_backward(datums, unit.loss_fn, config, unit.forward_only)
            for item, out in zip(unit.items, outputs, strict=True):
                results.append(_datum_outcome(item.request_id, item.index, out))
        except ValueError:
            # Isolate the bad datum(s): the others run alone, so one tenant's error never fails another's.
            for item, datum in zip(unit.items, datums, strict=True):
                try:
                    out = self.engine.forward_backward([datum], unit.loss_fn, config, unit.forward_only)[0]
                    results.append(_datum_outcome(item.request_id, item.index, out))
                except ValueError as exc:
                    # The datum ran alone, so the engine calls it data[0]: name its place in the request.
                    error = str(exc).replace("data[0]", f"data[{item.index}]", 1)
                    results.append(DatumOutcome(item.request_id, item.index, b"", 0.0, error=error))
        except Exception as exc:
            log.exception("unit %s failed", unit.unit_id)
            return WorkOutcome(
                unit_id=unit.unit_id,
                error=f"trainer error: {type(exc).__name__}: {exc}",
                started_ns=started,
                finished_ns=now_ns(),
            )
        return WorkOutcome(unit_id=unit.unit_id, datums=results, started_ns=started, finished_ns=now_ns())

    # --- barriers: in barrier_order, the steps fused in one call ---------------------------
    def _barrier(
        self, unit: BarrierUnit, replaying: bool, redo: Collection[str], started: int
    ) -> tuple[BarrierOutcome, list[PendingSave]]:
        outcomes: list[OpOutcome] = []
        saves: list[PendingSave] = []
        first, steps, rest = barrier_phases(unit.ops)
        for op in first:
            outcomes.append(self._guarded(unit, op, replaying, redo, saves))
        if steps:
            try:
                outcomes += self._steps(steps)
            except Exception as exc:
                log.exception("optimizer step of unit %s failed", unit.unit_id)
                for step in steps:  # never leave half a window behind for the next step to apply
                    with contextlib.suppress(Exception):
                        self.engine.discard_grads(step.slot)
                outcomes += [
                    OpOutcome(
                        model_id=step.model_id,
                        request_id=step.request_id,
                        ok=False,
                        error=f"optimizer step failed ({type(exc).__name__}: {exc}); the accumulated "
                        "gradients were discarded: resubmit the batch's forward_backward calls, then optim_step",
                        category="server",
                    )
                    for step in steps
                ]
        for op in rest:
            outcomes.append(self._guarded(unit, op, replaying, redo, saves))
        return BarrierOutcome(unit_id=unit.unit_id, ops=outcomes, started_ns=started, finished_ns=now_ns()), saves

    def _guarded(
        self, unit: BarrierUnit, op: SlotOp, replaying: bool, redo: Collection[str], saves: list[PendingSave]
    ) -> OpOutcome:
        """One op; what it raises becomes its failed outcome (the unit's other ops still run)."""
        try:
            if isinstance(op, (SaveSlot, ExportSlot)):
                return self._save(unit, op, replaying, redo, saves)
            return self.run_op(unit, op, replaying)
        except Exception as exc:
            log.exception("op %s of unit %s failed", type(op).__name__, unit.unit_id)
            clear = isinstance(exc, (UserError, ReportedError))
            return OpOutcome(
                model_id=op.model_id,
                request_id=op.request_id,
                ok=False,
                error=str(exc) if clear else f"{type(exc).__name__}: {exc}",
                category="user" if isinstance(exc, UserError) else "server",
            )

    def _save(
        self,
        unit: BarrierUnit,
        op: SaveSlot | ExportSlot,
        replaying: bool,
        redo: Collection[str],
        saves: list[PendingSave],
    ) -> OpOutcome:
        """Copy the slot for the save (its files are written behind the unit path); the publisher
        answers its future once they are fsynced."""
        if not replaying or op.request_id in redo:
            handover = self.handover and not replaying  # a redo's engine answer is long gone: files only
            saves.append(
                checkpoints.prepare(self.engine, self.base_model, self.data_dir, unit.unit_id, op, handover)
            )
        return _handed_off(op)

    def _steps(self, steps: list[StepSlot]) -> list[OpOutcome]:
        reports = self.engine.optim_step({op.slot: op.adam for op in steps})
        out = []
        for op in steps:
            report = reports[op.slot]
            # Keys the cookbook never writes itself: it logs its own `step` and `learning_rate`
            # columns and merges these metrics over them (docs/semantics.md §5).
            metrics = {"grad_norm": report.grad_norm, "optimizer_step": float(report.step)}
            if report.applied:
                out.append(
                    OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True, metrics=metrics)
                )
            else:
                out.append(
                    OpOutcome(
                        model_id=op.model_id,
                        request_id=op.request_id,
                        ok=False,
                        metrics=metrics,
                        error=f"optimizer step skipped: {report.reason}; the accumulated gradients were "
                        "discarded and the weights are unchanged",
                        category="user",
                    )
                )
        return out

    def run_op(self, unit: BarrierUnit, op: object, replaying: bool) -> OpOutcome:
        """One op of a barrier other than a save (``execute`` runs those); raises on failure."""
        match op:
            case InitSlot(restore=None):
                lora = op.lora
                if lora.seed is None:
                    lora = msgspec.structs.replace(lora, seed=default_seed(op.model_id))
                self.engine.init_slot(op.slot, lora)
            case InitSlot(restore=restore) if restore is not None:
                state, meta = _read_state(Path(restore.directory))
                if meta.base_model != self.base_model:
                    raise UserError(f"checkpoint base model {meta.base_model!r} differs from {self.base_model!r}")
                self.engine.init_slot(op.slot, meta.lora)
                self.engine.set_slot_state(op.slot, state, with_optimizer=restore.with_optimizer)
            case LoadSlot(restore=restore):
                state, _ = _read_state(Path(restore.directory))
                self.engine.set_slot_state(op.slot, state, with_optimizer=restore.with_optimizer)
            case ReleaseSlot():
                self.engine.release_slot(op.slot)
                self.slot_models.pop(op.slot, None)
            case PageOut():
                moved = self.pages.page_out(self.engine, op.slot, op.model_id)
                self.slot_models.pop(op.slot, None)
                if op.export:
                    self.pages.export(op.model_id, self.data_dir / op.export)
                self._moved(ModelPagedOut, op, moved)
            case PageIn():
                if op.source:
                    moved = self.pages.page_in_from(self.engine, op.slot, op.model_id, self.data_dir / op.source)
                else:
                    moved = self.pages.page_in(self.engine, op.slot, op.model_id)
                self.slot_models[op.slot] = op.model_id
                self._moved(ModelPagedIn, op, moved)
            case AdoptSlot():
                self.adopt(self, unit.unit_id, op, replaying)
                self.pages.drop(op.model_id)  # a stale copy from an earlier stay here
                if op.slot in self.engine.pool.configs:
                    self.slot_models[op.slot] = op.model_id
                return OpOutcome(
                    model_id=op.model_id, request_id=op.request_id, ok=True, info={"adopted_from": op.from_group}
                )
            case DropPaged():
                self.pages.drop(op.model_id)
            case DiscardSlot(reason=reason):
                self.engine.discard_grads(op.slot)
                error = (
                    f"{reason}: this window's gradients were discarded and no step was applied; resubmit the "
                    "batch's forward_backward calls, then optim_step again"
                )
                return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=False, error=error)
            case FailRequest(error=error, category=category):
                return OpOutcome(
                    model_id=op.model_id, request_id=op.request_id, ok=False, error=error, category=category
                )
            case _:
                raise TypeError(f"unknown op {type(op).__name__}")
        if isinstance(op, InitSlot):
            self.slot_models[op.slot] = op.model_id
        return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True)

    def _moved(self, event: type[ModelPagedOut] | type[ModelPagedIn], op: PageOut | PageIn, moved: Moved) -> None:
        self.events.append(
            event(model_id=op.model_id, slot=op.slot, bytes=moved.nbytes, ms=moved.ms, where=moved.where, at_ns=now_ns())
        )

def _datum_outcome(request_id: str, index: int, out: DatumOutput) -> DatumOutcome:
    k = int(out.logprobs.shape[1]) if out.logprobs.ndim == 2 else 0
    return DatumOutcome(
        request_id, index, out.logprobs.astype("<f4").tobytes(), out.loss, k=k, metrics=out.metrics
    )


def _handed_off(op: SaveSlot | ExportSlot) -> OpOutcome:
    """The op's future is answered by the publisher once the files are published."""
    return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True, info={HANDOFF: "publisher"})
