"""Taking over a model of a lost trainer group (`AdoptSlot`): its state rebuilt from files alone.

The planner decides a takeover when a group stopped reporting (services/planner/takeover.py,
`takeover_unit`); a live group of the same base runs the unit. For each `AdoptSlot` this
trainer rebuilds the model, alone, in its new slot from the lost group's durable data:

1. ``gather`` (async, on the bus): the lost group's units that count, i.e. every unit on its work
   subject that has an outcome on its outcome subject and is not in `abandoned`; and the newest
   complete snapshot of that group older than its first abandoned unit (a snapshot taken after
   an abandoned unit ran would hold work that no longer counts).
2. ``rebuild`` (the worker thread): the model's state from that snapshot (resident or paged
   there), then a re-execution, restricted to the model, of every unit that counts after the
   snapshot's work sequence: its datums of a work unit as a unit of their own, its optimizer
   steps, discards, creates and loads; page-outs and page-ins move its state in and out of the
   new slot; saves and exports are skipped (their files exist). Nothing is published for them.
3. The rebuilt state is written durably to ``adopted_path`` before the outcome, so a restart of
   this group replays the takeover from that file (not from the lost group, whose snapshots
   move on once it is back).

``Takeovers`` is the executor's ``adopt`` callable (services/trainer/execute.py, given by the
service): this module replays the lost group's units on the executor through its public
``run_work`` and ``run_op``, in the executor's own ``barrier_order``; the executor never
imports this module.

Numerics: the model's datums run without the tenants they were packed with, so the GEMM shapes
differ and the rebuilt state agrees with the one the lost group held within fp32 rounding
(docs/semantics.md §7), not bit for bit.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
from nats.aio.msg import Msg

from infra.bus import Bus, last_seq, replay
from libs.checkpoints import layout
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.work import (
    AdoptSlot,
    BarrierUnit,
    DiscardSlot,
    DropPaged,
    InitSlot,
    LoadSlot,
    PageIn,
    PageOut,
    ReleaseSlot,
    StepSlot,
    Unit,
    WorkUnit,
)
from services.trainer.execute import Executor, ReportedError, barrier_order
from services.trainer.slot_state import SlotState
from services.trainer.state import files, slots, snapshots

log = logging.getLogger("tinkerd.trainer")


class AdoptionError(ReportedError):
    """The model's state cannot be rebuilt from the lost group's files."""


@dataclass
class Source:
    """What a takeover of models from one lost group reads."""

    snapshot: Path | None = None
    base_seq: int = 0  # the snapshot's work sequence (0: none, replay from the start)
    units: list[Unit] = field(default_factory=list)  # the units that count after it, in order


def adopted_path(data_dir: Path, model_id: str, unit_id: str) -> Path:
    """Where the takeover unit `unit_id` writes the state it rebuilt for `model_id`."""
    return layout.adopted_file(data_dir, model_id, unit_id)


async def gather(bus: Bus, data_dir: Path, lost: str, abandoned: list[str]) -> Source:
    """The lost group's snapshot and the units that count after it (see the module doc)."""
    outcomes: set[str] = set()

    def on_outcome(msg: Msg) -> None:
        outcomes.add(codec.outcome_decoder.decode(msg.data).unit_id)

    await replay(bus, s.STREAM_OUTCOMES, s.outcome_subject(lost), await last_seq(bus, s.STREAM_OUTCOMES), on_outcome)
    skip = set(abandoned)
    units: list[tuple[int, Unit]] = []
    seen: set[str] = set()
    first_abandoned: int | None = None

    def on_unit(msg: Msg) -> None:
        nonlocal first_abandoned
        unit = codec.unit_decoder.decode(msg.data)
        seq = msg.metadata.sequence.stream
        if unit.unit_id in skip:
            first_abandoned = seq if first_abandoned is None else min(first_abandoned, seq)
        elif unit.unit_id in outcomes and unit.unit_id not in seen:
            seen.add(unit.unit_id)
            units.append((seq, unit))

    await replay(bus, s.STREAM_WORK, s.work_subject(lost), await last_seq(bus, s.STREAM_WORK), on_unit)
    source = Source()
    for directory in reversed(snapshots.complete(data_dir, lost)):
        work_seq = int(directory.name)
        if first_abandoned is None or work_seq < first_abandoned:
            source = Source(directory, work_seq)
            break
    source.units = [unit for seq, unit in units if seq > source.base_seq]
    return source


class Rebuild:
    """One model's state, followed through the lost group's units in its new slot."""

    def __init__(self, executor: Executor, op: AdoptSlot) -> None:
        self.executor = executor
        self.engine = executor.engine
        self.op = op
        self.slot = op.slot
        self.in_slot = False
        self.held: SlotState | None = None  # paged out on the lost group

    def start(self, state: SlotState | None) -> None:
        if state is not None:
            slots.restore(self.engine, self.slot, state)
            self.in_slot, self.held = True, None

    def unit(self, unit: Unit) -> None:
        mid, slot = self.op.model_id, self.slot
        match unit:
            case WorkUnit(forward_only=False, items=items):
                mine = [msgspec.structs.replace(i, slot=slot) for i in items if i.model_id == mid]
                if mine and self.in_slot:
                    self.executor.run_work(msgspec.structs.replace(unit, items=mine))
            case BarrierUnit(ops=ops):
                for op in barrier_order(ops):  # as the lost group ran them
                    if op.model_id == mid:
                        self._op(unit, op)

    def _op(self, unit: BarrierUnit, op: object) -> None:
        engine, slot = self.engine, self.slot
        match op:
            case StepSlot(adam=adam) if self.in_slot:
                engine.optim_step({slot: adam})
            case DiscardSlot() if self.in_slot:
                engine.discard_grads(slot)
            case InitSlot() | LoadSlot():
                self.executor.run_op(unit, msgspec.structs.replace(op, slot=slot), True)
                self.in_slot = True
            case PageOut() if self.in_slot:
                self.held = slots.capture(engine, slot)
                engine.release_slot(slot)
                self.in_slot = False
            case PageIn(source=source) if source:
                self.start(files.read(self.executor.data_dir / source)[1])
            case PageIn() if self.held is not None:
                self.start(self.held)
            case AdoptSlot():  # the lost group had itself taken this model over
                path = adopted_path(self.executor.data_dir, op.model_id, unit.unit_id)
                if path.exists():
                    self.start(files.read(path)[1])
            case ReleaseSlot() | DropPaged():
                if self.in_slot:
                    engine.release_slot(slot)
                self.in_slot, self.held = False, None

    def finish(self) -> bool:
        """Leave the state in the slot; False when there was none to rebuild."""
        if not self.in_slot and self.held is not None:
            self.start(self.held)
        return self.in_slot


def rebuild(executor: Executor, unit_id: str, op: AdoptSlot, source: Source) -> None:
    """Rebuild `op.model_id` in `op.slot` from `source` and write it to `adopted_path`.

    Raises:
        AdoptionError: no state of the model was found (and it is not `fresh`).
    """
    started = time.perf_counter()
    work = Rebuild(executor, op)
    try:
        if source.snapshot is not None:
            state, resident = snapshots.model_state(source.snapshot, op.model_id)
            if resident:
                work.start(state)
            else:
                work.held = state  # paged out there: a later page-in (or the end) puts it in
    except (msgspec.ValidationError, msgspec.DecodeError, OSError) as exc:
        raise AdoptionError(f"group {op.from_group}'s snapshot {source.snapshot} cannot be read ({exc})") from exc
    for unit in source.units:
        work.unit(unit)
    if not work.finish():
        if op.fresh:
            return  # its create (or move) runs next in the same unit
        raise AdoptionError(
            f"no state of model {op.model_id} was found in trainer group {op.from_group}'s snapshots "
            "or units"
        )
    files.write(adopted_path(executor.data_dir, op.model_id, unit_id), slots.capture(executor.engine, op.slot), op.model_id)
    log.info(
        "adopted %s from lost group %s into slot %d in %.0f ms (snapshot %s, %d later units of that group)",
        op.model_id,
        op.from_group,
        op.slot,
        (time.perf_counter() - started) * 1000,
        source.snapshot.name if source.snapshot else "none",
        len(source.units),
    )


def replay_adoption(executor: Executor, unit_id: str, op: AdoptSlot) -> None:
    """Recovery of this group: the takeover's rebuilt state, from its file."""
    path = adopted_path(executor.data_dir, op.model_id, unit_id)
    if path.exists():
        slots.restore(executor.engine, op.slot, files.read(path)[1])
    elif not op.fresh:
        raise AdoptionError(f"the state adopted for {op.model_id} by unit {unit_id} is missing ({path})")


class Takeovers:
    """The executor's ``adopt``: what each lost group's files and streams say (``gather``, set by
    the service before a takeover unit runs), and the rebuild or its replay."""

    def __init__(self) -> None:
        self.sources: dict[str, Source] = {}  # by lost group

    def __call__(self, executor: Executor, unit_id: str, op: AdoptSlot, replaying: bool) -> None:
        if replaying:
            replay_adoption(executor, unit_id, op)
        else:
            rebuild(executor, unit_id, op, self.sources[op.from_group])
