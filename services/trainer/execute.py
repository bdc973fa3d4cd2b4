"""What one unit does to the engine: a pure function of the unit and the slots' state.

``Executor.execute`` runs in the trainer's worker thread. It dispatches over the unit and op
unions with ``match``; every op answers with an ``OpOutcome``, and a save or an export also
yields a ``PublishCommand`` for the publisher. ``replaying`` is True while recovery
re-executes units whose outcomes already exist: the slot state is rebuilt, but no file is
written and nothing is handed off a second time.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
from pathlib import Path

import msgspec
import numpy as np

from libs.checkpoints.state_format import TrainingStateMeta
from libs.contracts.common import now_ns
from libs.contracts.events import ModelPagedIn, ModelPagedOut, OperationEvent
from libs.contracts.ids import HANDOFF
from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
from libs.contracts.publish import PublishCommand
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
from services.trainer import adoption
from services.trainer.checkpoint_files import StorageError, write_checkpoint
from services.trainer.engine import DatumInput, DatumOutput, TrainerEngine
from services.trainer.paging import Moved, PageStore
from services.trainer.slot_state import SlotState
from services.trainer.state_io import read_training_state

log = logging.getLogger("tinkerd.trainer")


class UserError(Exception):
    """The caller's mistake (a checkpoint of another base model, ...): category ``user``."""


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

    def __init__(self, engine: TrainerEngine, base_model: str, data_dir: Path, pages: PageStore) -> None:
        self.engine = engine
        self.base_model = base_model
        self.data_dir = data_dir
        self.pages = pages
        self.slot_models: dict[int, str] = {}
        self.events: list[OperationEvent] = []  # emitted by the service after the unit
        # what a takeover unit reads, by lost group (adoption.gather, set by the service first)
        self.adoptions: dict[str, adoption.Source] = {}

    def execute(self, unit: Unit, replaying: bool) -> tuple[Outcome, list[PublishCommand]]:
        started = now_ns()
        if not replaying:
            crash_point("trainer.executing")  # fault tests: killed or wedged mid-unit
        match unit:
            case WorkUnit():
                return self._work(unit, started), []
            case BarrierUnit():
                return self._barrier(unit, replaying, started)

    # --- forward_backward / forward ------------------------------------------------------
    def _work(self, unit: WorkUnit, started: int) -> WorkOutcome:
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

    # --- barriers: steps first (one fused call), then every other op in order ------------
    def _barrier(
        self, unit: BarrierUnit, replaying: bool, started: int
    ) -> tuple[BarrierOutcome, list[PublishCommand]]:
        outcomes: list[OpOutcome] = []
        publishes: list[PublishCommand] = []
        # A takeover unit first pages out its victims and adopts its models (in order): the steps
        # it runs again need the adopted state.
        adopts = [i for i, op in enumerate(unit.ops) if isinstance(op, AdoptSlot)]
        first = unit.ops[: adopts[-1] + 1] if adopts else []
        for op in first:
            outcome, publish = self._guarded(unit, op, replaying)
            outcomes.append(outcome)
        steps = [op for op in unit.ops if isinstance(op, StepSlot)]
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
        for op in unit.ops[len(first) :]:
            if isinstance(op, StepSlot):
                continue
            outcome, publish = self._guarded(unit, op, replaying)
            outcomes.append(outcome)
            if publish is not None:
                publishes.append(publish)
        return BarrierOutcome(
            unit_id=unit.unit_id, ops=outcomes, started_ns=started, finished_ns=now_ns()
        ), publishes

    def _guarded(self, unit: BarrierUnit, op: SlotOp, replaying: bool) -> tuple[OpOutcome, PublishCommand | None]:
        """One op; what it raises becomes its failed outcome (the unit's other ops still run)."""
        try:
            return self._op(unit, op, replaying)
        except Exception as exc:
            log.exception("op %s of unit %s failed", type(op).__name__, unit.unit_id)
            clear = isinstance(exc, (UserError, StorageError, adoption.AdoptionError))
            return (
                OpOutcome(
                    model_id=op.model_id,
                    request_id=op.request_id,
                    ok=False,
                    error=str(exc) if clear else f"{type(exc).__name__}: {exc}",
                    category="user" if isinstance(exc, UserError) else "server",
                ),
                None,
            )

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

    def _op(self, unit: BarrierUnit, op: object, replaying: bool) -> tuple[OpOutcome, PublishCommand | None]:
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
                if replaying:
                    adoption.replay_adoption(self, unit.unit_id, op)
                else:
                    adoption.rebuild(self, unit.unit_id, op, self.adoptions[op.from_group])
                self.pages.drop(op.model_id)  # a stale copy from an earlier stay here
                if op.slot in self.engine.pool.configs:
                    self.slot_models[op.slot] = op.model_id
                return OpOutcome(
                    model_id=op.model_id, request_id=op.request_id, ok=True, info={"adopted_from": op.from_group}
                ), None
            case DropPaged():
                self.pages.drop(op.model_id)
            case DiscardSlot(reason=reason):
                self.engine.discard_grads(op.slot)
                error = (
                    f"{reason}: this window's gradients were discarded and no step was applied; resubmit the "
                    "batch's forward_backward calls, then optim_step again"
                )
                return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=False, error=error), None
            case FailRequest(error=error, category=category):
                return OpOutcome(
                    model_id=op.model_id, request_id=op.request_id, ok=False, error=error, category=category
                ), None
            case SaveSlot() | ExportSlot():
                if replaying:  # the files and the publication already happened
                    return _handed_off(op), None
                publish = write_checkpoint(self.engine, self.base_model, self.data_dir, unit.unit_id, op)
                return _handed_off(op), publish
            case _:
                raise TypeError(f"unknown op {type(op).__name__}")
        if isinstance(op, InitSlot):
            self.slot_models[op.slot] = op.model_id
        return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True), None

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
