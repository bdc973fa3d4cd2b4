"""Rebuilding a trainer group's slots after a restart: the newest snapshot, then replay.

Slot state is a fold over the group's work stream: the newest internal snapshot (a file set
under the data directory, ``snapshots.py``) covers the units up to its work sequence; every
later unit that already has an outcome is re-executed without emitting anything. CPU fp32 is
deterministic, so the adapters, optimizer moments and pending gradients come back exactly.
A save whose unit has an outcome but whose request has no result yet (the trainer died before
its files were written and handed to the publisher: they are written behind the unit path) is
redone from the replayed state, which is the state it copied (``Recovered.saves``); so is an
ephemeral export that was answered by its handover but whose files never reached the publisher
(its sampler record names no directory yet).
Recovery also collects the units another group's takeover abandoned (`AdoptSlot.abandoned` of
units on any group's work subject, `from_group` this one): the service skips them when they are
redelivered (services/trainer/adoption.py).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import msgspec
import nats.js.errors
from nats.aio.msg import Msg

from infra.bus import Bus, has_message, last_seq, replay
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.records import SamplerRecord
from libs.contracts.work import AdoptSlot, BarrierUnit, ExportSlot, SaveSlot, Unit
from services.trainer.execute import Executor
from services.trainer.state import snapshots
from services.trainer.state.checkpoints import PendingSave

log = logging.getLogger("tinkerd.trainer")


@dataclass
class Recovered:
    """Where replay left the group: which units are done, and the last work sequence applied."""

    completed: set[str] = field(default_factory=set)
    abandoned: set[str] = field(default_factory=set)  # units of this group another group took over
    base_seq: int = 0  # the snapshot's work sequence (0: none)
    last_work_seq: int = 0
    replayed: int = 0
    saves: list[PendingSave] = field(default_factory=list)  # saves to write again, in order


async def recover(bus: Bus, executor: Executor, group: str, data_dir: Path) -> Recovered:
    state = Recovered()
    snapshot = snapshots.latest(data_dir, group)
    if snapshot is not None:
        try:
            state.base_seq, executor.slot_models = await asyncio.to_thread(
                snapshots.restore, executor.engine, executor.pages, snapshot
            )
        except (msgspec.ValidationError, msgspec.DecodeError, OSError) as exc:  # e.g. an older format
            log.warning("snapshot %s cannot be read (%s); replaying the whole work stream", snapshot.name, exc)
            state.base_seq, executor.slot_models = 0, {}
        log.info(
            "restored snapshot %s (%d slots, %d paged)",
            snapshot.name,
            len(executor.slot_models),
            len(executor.pages.models),
        )
    state.last_work_seq = state.base_seq

    def on_outcome(msg: Msg) -> None:
        state.completed.add(codec.outcome_decoder.decode(msg.data).unit_id)

    outcomes_last = await last_seq(bus, s.STREAM_OUTCOMES)
    await replay(bus, s.STREAM_OUTCOMES, s.outcome_subject(group), outcomes_last, on_outcome)
    units: list[tuple[int, Unit]] = []
    seen: set[str] = set()

    def on_unit(msg: Msg) -> None:
        unit = codec.unit_decoder.decode(msg.data)
        if unit.unit_id in state.completed and unit.unit_id not in seen:
            seen.add(unit.unit_id)  # a unit appended twice (a late redelivery) ran once
            units.append((msg.metadata.sequence.stream, unit))

    work_last = await last_seq(bus, s.STREAM_WORK)
    await replay(bus, s.STREAM_WORK, s.work_subject(group), work_last, on_unit, from_seq=state.base_seq + 1)

    def on_any_unit(msg: Msg) -> None:
        unit = codec.unit_decoder.decode(msg.data)
        if isinstance(unit, BarrierUnit):
            for op in unit.ops:
                if isinstance(op, AdoptSlot) and op.from_group == group:
                    state.abandoned.update(op.abandoned)

    # Takeovers of this group's models (while it was lost) come after its snapshot: the units
    # they abandoned are skipped from now on (services/trainer/adoption.py).
    await replay(bus, s.STREAM_WORK, s.WORK_ALL, work_last, on_any_unit, from_seq=state.base_seq + 1)
    redo = await unanswered_saves(bus, [unit for _, unit in units])
    for seq, unit in units:
        _, saves = await asyncio.to_thread(executor.execute, unit, True, redo)
        state.saves += saves
        state.last_work_seq = seq
    executor.events.clear()  # replayed page moves were reported when they first ran
    state.replayed = len(units)
    return state


async def unanswered_saves(bus: Bus, units: list[Unit]) -> set[str]:
    """The request ids of the saves in ``units`` that have no result yet, and of the ephemeral
    exports answered by a handover whose files never reached the publisher."""
    ops = [
        op
        for unit in units
        if isinstance(unit, BarrierUnit)
        for op in unit.ops
        if isinstance(op, (SaveSlot, ExportSlot))
    ]
    redo = set()
    for op in ops:
        if not await has_message(bus, s.STREAM_RESULTS, s.result_subject(op.request_id)) or (isinstance(op, ExportSlot) and op.sampling_session_id and not await _durable(bus, op.sampling_session_id)):
            redo.add(op.request_id)
    return redo


async def _durable(bus: Bus, sampler_id: str) -> bool:
    """Whether an ephemeral export's files reached the publisher (its sampler names a directory)."""
    kv = await bus.kv(s.KV_SAMPLERS)
    try:
        entry = await kv.get(ids.token(sampler_id))
    except nats.js.errors.KeyNotFoundError:
        return True  # the sampler is gone (its session ended): nothing left to serve
    record = codec.from_json(entry.value or b"{}", SamplerRecord)
    return record.adapter_dir is not None
