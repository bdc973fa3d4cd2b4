"""The planner service: its I/O. It reads the request and outcome streams, appends units and
results, and writes the queue records and model summaries; every decision is the pure core's
(planner.py and the modules it names).

Start-up is a replay through the same `Planner.apply` the live path uses: the newest snapshot (if
any), then every request, every unit and every outcome after the snapshot's positions, up to each
stream's last sequence. Results of requests that the replay finds finished are appended again
(`publish_once`: the server refuses a second result for a request, so those a previous process
published have no second effect). Then live consumption through the two durable consumers; what
they redeliver was folded by the replay already and has no effect. Invariant: a message is acked
only after everything it caused is durable (units appended, results appended).

Accepted to unit: `_on_batch` folds each message (`Planner.apply` → `state.evolve`), then
`_advance` asks `decide.decide` for units and appends each (`_emit_unit`), unless the coalescing
hold (hold.py) keeps one back a few milliseconds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import replace
from functools import partial
from typing import Any, Literal

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from infra import tracing
from infra.answers import answer
from infra.bus import Bus, ensure_durable, fetch_loop, kv_scan, last_seq, replay
from infra.streams import ensure_streams, planner_durables
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import SlotAssigned, UnitPlanned
from libs.contracts.records import ModelQueueRecord, QueueRecord, SeqClaim, TrainerStatus
from libs.contracts.requests import Rejected
from libs.contracts.work import AdoptSlot, BarrierUnit, InitSlot, PageIn, PageOut, Unit, WorkUnit
from libs.faults import crash_point
from services.planner import snapshot
from services.planner.completions import Completion
from services.planner.config import PlannerConfig
from services.planner.decide import WAIT_GROUP
from services.planner.facts import CommandArrived, Fact, OutcomeArrived, UnitEmitted
from services.planner.hold import Hold
from services.planner.inputs import GroupInfo
from services.planner.planner import Planner
from services.planner.snapshot import PlannerSnapshot, Positions
from services.planner.streams import SEALED

log = logging.getLogger("tinkerd.planner")

SLOW_BATCH_MS = 50.0  # a batch whose handling takes longer is logged with its phases

Stream = Literal["requests", "outcomes"]


def command_fact(msg: Msg) -> Fact:
    return CommandArrived(codec.command_decoder.decode(msg.data), msg.metadata.sequence.stream, now_ns())


def outcome_fact(msg: Msg) -> Fact:
    return OutcomeArrived(codec.outcome_decoder.decode(msg.data))


BATCHES: dict[Stream, tuple[Callable[[Msg], Fact], str]] = {
    "requests": (command_fact, "planner.requests_planned"),  # fault point: units appended, not acked
    "outcomes": (outcome_fact, "planner.outcomes_folded"),  # fault point: results appended, not acked
}
"""Per consumed stream: its message as a fact, and the fault point between advancing and acking."""


class Phases:
    """Where one batch's handling spent its time (lock wait, fold, each step of `_advance`),
    logged only when the whole took longer than SLOW_BATCH_MS: the planner's share of a call's
    latency is read from the log of a real run, not guessed."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.last = time.perf_counter_ns()
        self.spent: list[tuple[str, float]] = []

    def mark(self, phase: str) -> None:
        now = time.perf_counter_ns()
        self.spent.append((phase, (now - self.last) / 1e6))
        self.last = now

    def report(self) -> None:
        total = sum(ms for _, ms in self.spent)
        if total >= SLOW_BATCH_MS:
            parts = ", ".join(f"{phase} {ms:.1f}" for phase, ms in self.spent if ms >= 0.5)
            log.info("slow %s: %.1f ms (%s)", self.what, total, parts)


async def ensure_consumers(bus: Bus) -> None:
    for durable in planner_durables():
        await ensure_durable(bus, durable.stream, durable.config)  # after a kill -9: unacked come back at once


class PlannerService:
    def __init__(self, bus: Bus, config: PlannerConfig) -> None:
        self.bus = bus
        self.config = config
        self.planner = Planner(
            num_slots=config.num_slots,
            token_budget=config.token_budget,
            max_units_in_flight=config.max_units_in_flight,
        )
        self._lock = asyncio.Lock()
        self._paused: set[str] = set()  # create_model requests published as paused_capacity
        self._paused_why: dict[str, str] = {}  # ... and why (planner.WAIT_*)
        self._beats: dict[str, tuple[int, int]] = {}  # group -> (newest heartbeat, when we saw it change)
        self._summaries: dict[str, ModelQueueRecord] = {}  # last summary written per model
        self._positions = Positions()  # the last sequence folded, per stream
        self._snapshot_due_ns = 0
        self._slots_known = False  # until the group's trainer reported its slot count
        self._replayed: list[Completion] = []  # finished requests found by the replay
        self.hold = Hold(config.coalesce_ms, self._end_hold)

    async def start(self) -> None:
        await ensure_consumers(self.bus)
        saved = await snapshot.load(self.bus, self.config.trainer_group)
        if saved is not None:
            try:
                self.planner = Planner.restore(
                    saved.state,
                    num_slots=self.config.num_slots,
                    token_budget=self.config.token_budget,
                    max_units_in_flight=self.config.max_units_in_flight,
                )
            except (msgspec.ValidationError, msgspec.DecodeError) as exc:  # an unreadable state
                log.warning("planner snapshot cannot be read (%s); replaying the streams in full", exc)
                saved = None
        if saved is not None:
            self._positions = saved.positions
        replay_ns = now_ns()  # a hole found on replay gets a full gap timeout from now

        def on_request(msg: Msg) -> None:
            command = codec.command_decoder.decode(msg.data)
            self.planner.apply(CommandArrived(command, msg.metadata.sequence.stream, replay_ns))

        def on_unit(msg: Msg) -> None:
            unit = codec.unit_decoder.decode(msg.data)
            if not unit.group:  # written before trainer groups: it went to this planner's one group
                unit = msgspec.structs.replace(unit, group=self.config.trainer_group)
            self.planner.apply(UnitEmitted(unit))

        def on_outcome(msg: Msg) -> None:
            self.planner.apply(OutcomeArrived(codec.outcome_decoder.decode(msg.data)))

        # Requests, then units, then outcomes: each fact finds what it refers to already folded.
        counts, last = [], {}
        for stream, subject, handle, start in (
            (s.STREAM_REQUESTS, s.REQUESTS_ALL, on_request, self._positions.requests),
            (s.STREAM_WORK, s.WORK_ALL, on_unit, self._positions.work),  # every group's units
            (s.STREAM_OUTCOMES, s.OUTCOMES_ALL, on_outcome, self._positions.outcomes),
        ):
            last[stream] = await last_seq(self.bus, stream)
            counts.append(await replay(self.bus, stream, subject, last[stream], handle, from_seq=start + 1))
        self._positions = Positions(
            requests=max(self._positions.requests, last[s.STREAM_REQUESTS]),
            work=max(self._positions.work, last[s.STREAM_WORK]),
            outcomes=max(self._positions.outcomes, last[s.STREAM_OUTCOMES]),
        )
        self._replayed = self.planner.collect()  # published (again, at most once) before going live
        # Re-checked on _advance. Samples waiting for an engine are the gateway's records, not ours.
        self._paused = {
            owner for owner in map(ids.untoken, await self._queue_keys()) if not ids.is_sampler_id(owner)
        }
        log.info(
            "replayed %d requests, %d units, %d outcomes after snapshot %s",
            *counts,
            "none" if saved is None else saved.positions,
        )

    async def run(self, stop: asyncio.Event) -> None:
        requests = await self.bus.pull(s.REQUESTS_ALL, s.DURABLE_PLANNER_REQUESTS, s.STREAM_REQUESTS)
        outcomes = await self.bus.pull(s.OUTCOMES_ALL, s.DURABLE_PLANNER_OUTCOMES, s.STREAM_OUTCOMES)
        async with self._lock:
            await self._publish_completions(self._replayed)
            await self._advance()  # anything the replay left plannable
        log.info("planner ready")
        tasks: list[asyncio.Future[Any]] = [
            self.hold.start(),
            asyncio.create_task(fetch_loop(requests, partial(self._on_batch, stream="requests"), stop)),
            asyncio.create_task(fetch_loop(outcomes, partial(self._on_batch, stream="outcomes"), stop)),
            asyncio.create_task(self._seal_gaps(stop)),
            asyncio.create_task(self._learn_groups(stop)),
        ]
        stopping: asyncio.Future[Any] = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        self.hold.cancel()
        for task in [stopping, *tasks]:
            task.cancel()
        for task in [stopping, *tasks]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in done:
            if task is not stopping and task.exception() is not None:
                # A loop that died must not leave a live-looking planner: exit, be restarted, replay.
                raise RuntimeError("a planner loop failed") from task.exception()

    async def _on_batch(self, msgs: list[Msg], stream: Stream) -> None:
        """Fold a batch of one stream, advance, and only then ack it (what it caused is durable)."""
        to_fact, crash = BATCHES[stream]
        phases = Phases(f"{stream.removesuffix('s')} batch ({len(msgs)})")
        async with self._lock:
            phases.mark("lock wait")
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                self.planner.apply(to_fact(msg))
                folded = max(getattr(self._positions, stream), seq)
                self._positions = msgspec.structs.replace(self._positions, **{stream: folded})
            phases.mark("fold")
            await self._advance(phases)
            crash_point(crash)
            for msg in msgs:
                await msg.ack()
            phases.mark("ack")
        phases.report()

    async def _advance(self, phases: Phases | None = None) -> None:
        """Publish finished requests and every unit that became plannable (in order)."""
        phases = phases or Phases("advance")
        await self._publish_completions(self.planner.collect())
        phases.mark("results")
        if not self._slots_known:
            return  # nothing is planned before the trainer said how many adapter slots it has
        now, held = time.monotonic_ns(), set[str]()  # holds run on the loop's clock, not the wall's
        while (unit := self.planner.decide(skip=frozenset(held))) is not None:
            if isinstance(unit, WorkUnit) and self._holding(unit, now):
                held.add(unit.group)  # other groups' units still go now
                continue
            self.planner.apply(UnitEmitted(unit))
            await self._emit_unit(unit)
            if isinstance(unit, WorkUnit):
                self.hold.emitted(unit)
        phases.mark("decide and emit")
        await self._publish_completions(self.planner.collect())
        phases.mark("results")
        await self._publish_queue_state()
        phases.mark("queue state")
        await self._publish_model_summaries()
        phases.mark("model summaries")
        await self._maybe_snapshot()
        phases.mark("snapshot")

    def _holding(self, unit: WorkUnit, now: int) -> bool:
        """Whether the coalescing hold keeps `unit` back (hold.py; timing only)."""
        return self.hold.holding(unit, now, self.planner.state)

    async def _end_hold(self, group: str, until_ns: int) -> None:
        async with self._lock:
            if self.hold.due(group, until_ns):
                await self._advance()

    async def _maybe_snapshot(self) -> None:
        """Store the state at the current positions, at most every `snapshot_every_s`. Called with
        everything the state caused already durable (units appended, results published)."""
        every_s = self.config.snapshot_every_s
        if every_s <= 0 or now_ns() < self._snapshot_due_ns:
            return
        self._snapshot_due_ns = now_ns() + int(every_s * 1e9)
        record = PlannerSnapshot(positions=self._positions, state=self.planner.snapshot(), at_ns=now_ns())
        size = await snapshot.save(self.bus, self.config.trainer_group, record)
        log.debug("snapshot at %s (%d bytes)", self._positions, size)

    async def _publish_model_summaries(self) -> None:
        """Write each model's summary when it changed (operators read them: `tinkerd status`)."""
        kv = await self.bus.kv(s.KV_PLANNER)
        for stream in self.planner.changed_models():
            record = ModelQueueRecord(
                model_id=stream.model_id,
                slot=stream.slot,
                queued=len(stream.queue),
                buffered=len(stream.buffered),
                waiting_for_seq=stream.missing_seq,
                closed=stream.closed,
                paged=stream.paged,
                group=stream.group,
            )
            if self._summaries.get(stream.model_id) != record:
                await kv.put(ids.token(stream.model_id), codec.to_json(record))
                self._summaries[stream.model_id] = record

    async def _queue_keys(self) -> list[str]:
        return list(await kv_scan(self.bus, s.KV_QUEUE))

    async def _publish_queue_state(self) -> None:
        """Mark requests that wait for an adapter slot, so try_again says paused_capacity."""
        why = self.planner.waiting()
        waiting = set(why)
        if why == self._paused_why:
            return
        kv = await self.bus.kv(s.KV_QUEUE)
        for request_id in sorted(r for r in waiting if self._paused_why.get(r) != why[r]):
            base = self.planner.streams[ids.owner_of_request(request_id)].base_model
            if why[request_id] == WAIT_GROUP:
                reason = (
                    f"no trainer group serving base model {base!r} is ready (or the group holding this "
                    "model's state is lost); waiting for one to report, then this model is placed there"
                )
            else:
                reason = (
                    f"every adapter slot of the trainer groups serving {base!r} holds a model with work "
                    "in flight; waiting for one of them to finish, then this model gets its slot"
                )
            record = QueueRecord(
                request_id=request_id, queue_state="paused_capacity", reason=reason, since_ns=now_ns()
            )
            await kv.put(ids.token(request_id), codec.to_json(record))
            log.info("%s waits: %s", request_id, reason)
        for request_id in sorted(self._paused - waiting):
            with contextlib.suppress(KeyNotFoundError):
                await kv.delete(ids.token(request_id))
        self._paused, self._paused_why = waiting, why

    async def _emit_unit(self, unit: Unit) -> None:
        with tracing.span(
            "planner.unit", unit.traceparent, links=self.planner.state.unit_traces(unit), unit_id=unit.unit_id
        ) as ctx:
            unit = msgspec.structs.replace(unit, traceparent=ctx, at_ns=now_ns())
            ack = await self.bus.publish(
                s.work_subject(unit.group),
                codec.pack(unit),
                msg_id=unit.unit_id,
                traceparent=ctx,
            )
        self._positions = msgspec.structs.replace(self._positions, work=max(self._positions.work, ack.seq))
        if isinstance(unit, WorkUnit):
            models = sorted({item.model_id for item in unit.items})
            requests = sorted({item.request_id for item in unit.items})
            kind, tokens = ("forward" if unit.forward_only else unit.loss_fn), unit.num_tokens
        else:
            assert isinstance(unit, BarrierUnit)
            models = sorted({op.model_id for op in unit.ops})
            requests = sorted({op.request_id for op in unit.ops})
            kind = "+".join(sorted({str(type(op).__struct_config__.tag) for op in unit.ops}))
            tokens = 0
        if isinstance(unit, BarrierUnit):
            self._emit_slot_assignments(unit)
            adopts = [op for op in unit.ops if isinstance(op, AdoptSlot)]
            if adopts:
                log.warning(
                    "taking over %s from lost trainer group %s on group %s (unit %s; abandoned units: %s)",
                    ", ".join(op.model_id for op in adopts),
                    adopts[0].from_group,
                    unit.group,
                    unit.unit_id,
                    ", ".join(adopts[0].abandoned) or "none",
                )
        self.bus.emit_soon(
            UnitPlanned(
                unit_id=unit.unit_id,
                unit_kind=kind,
                models=models,
                requests=requests,
                num_tokens=tokens,
                model_id=models[0] if len(models) == 1 else "",
                at_ns=unit.at_ns,  # stamped before the publish: a trainer may start it before this is emitted
            )
        )

    def _emit_slot_assignments(self, unit: BarrierUnit) -> None:
        evicted = {op.slot: op.model_id for op in unit.ops if isinstance(op, PageOut)}
        for op in unit.ops:
            if isinstance(op, (InitSlot, PageIn, AdoptSlot)):
                reason = {InitSlot: "create", PageIn: "page_in", AdoptSlot: "takeover"}[type(op)]
                self.bus.emit_soon(
                    SlotAssigned(
                        model_id=op.model_id,
                        slot=op.slot,
                        reason=reason,
                        evicted=evicted.get(op.slot, ""),
                        group=unit.group,
                        moved=isinstance(op, AdoptSlot) or (isinstance(op, PageIn) and bool(op.source)),
                        from_group=op.from_group if isinstance(op, AdoptSlot) else "",
                        at_ns=now_ns(),
                    )
                )

    async def _publish_completions(self, completions: list[Completion]) -> None:
        for done in completions:
            cmd, body = done.pending.command, done.body
            if body is None:
                continue  # the publisher answers this one
            crash_point("planner.result_publishing")  # fault tests: die with results half-published
            await answer(  # answered before a crash: a replay's completion has no second effect
                self.bus,
                kind=done.pending.kind,
                body=body,
                tenant=cmd.tenant,
                model_id=done.model_id,
                request_id=cmd.request_id,
                seq_id=cmd.seq_id,
                traceparent=cmd.traceparent,
                started_ns=cmd.at_ns,
            )

    async def _learn_groups(self, stop: asyncio.Event) -> None:
        """Learn the trainer groups from their trainers' heartbeats (`tinker_trainers`): each
        group's base model and slot count (a planner configured with another number never assigns
        a slot the trainer lacks), and whether it is live (reported within `group_timeout_s`)."""
        while not stop.is_set():  # quickly until the first report, then every second
            reports: dict[str, list[TrainerStatus]] = {}
            for value in (await kv_scan(self.bus, s.KV_TRAINERS)).values():
                status = codec.from_json(value, TrainerStatus)
                reports.setdefault(status.group, []).append(status)
            await self._adopt_groups(reports, now_ns())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 1.0 if self._slots_known else 0.25)

    async def _adopt_groups(self, reports: dict[str, list[TrainerStatus]], now: int) -> None:
        fresh_after = now - int(self.config.group_timeout_s * 1e9)
        planner = self.planner
        async with self._lock:
            groups = {g: replace(info, live=False) for g, info in planner.groups.items()}
            if not self._slots_known:
                groups = {}  # the default group of a planner not told about any yet
            for group, statuses in reports.items():
                ready = [st for st in statuses if st.ready]
                if not ready:
                    if group in groups:
                        groups[group] = replace(groups[group], live=False)
                    continue
                num_slots = min(st.num_slots for st in ready)
                held = max(planner.state.slots.get(group, {}), default=-1)
                if held >= num_slots:
                    log.error(
                        "trainer group %s reports %d adapter slots, but slot %d is assigned; keeping %d until "
                        "it is freed", group, num_slots, held, held + 1,
                    )
                    num_slots = held + 1
                # Liveness by the planner's clock (hosts' clocks may differ): when did this group's
                # newest heartbeat last change, as seen from here?
                newest = max(st.updated_ns for st in ready)
                if self._beats.get(group, (None, 0))[0] != newest:
                    self._beats[group] = (newest, now)
                live = self._beats[group][1] >= fresh_after
                groups[group] = GroupInfo(num_slots=num_slots, base_model=ready[0].base_model, live=live)
            if not groups or groups == planner.groups:
                return
            for group, info in sorted(groups.items()):
                before = planner.groups.get(group) if self._slots_known else None
                if before is None or before.live != info.live or before.num_slots != info.num_slots:
                    log.info(
                        "trainer group %s (%s): %d adapter slots, %s",
                        group, info.base_model, info.num_slots, "live" if info.live else "LOST (no heartbeat)",
                    )
            planner.groups = groups
            self._slots_known = True
            await self._advance()

    async def _seal_gaps(self, stop: asyncio.Event) -> None:
        """Seal a seq_id that stayed missing past the timeout, so it cannot stall its model.

        The seal claims the seq_id in the identity table first: if the gateway claimed it, the
        real request is on its way and nothing is sealed.
        """
        interval = min(1.0, self.config.gap_timeout_s / 4)
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval)
            deadline = now_ns() - int(self.config.gap_timeout_s * 1e9)
            for stream in list(self.planner.streams.values()):
                missing = stream.missing_seq
                if missing is None or stream.gap_since_ns is None or stream.gap_since_ns > deadline:
                    continue
                await self._seal(stream.model_id, stream.tenant, missing)

    async def _seal(self, model_id: str, tenant: str, seq_id: int) -> None:
        request_id = ids.request_id(model_id, seq_id)
        kv = await self.bus.kv(s.KV_SEQ)
        claim = SeqClaim(
            request_id=request_id, fingerprint="sealed", kind="sealed", tenant=tenant, accepted_ns=now_ns()
        )
        try:
            await kv.create(ids.seq_key(model_id, seq_id), codec.to_json(claim))
        except KeyWrongLastSequenceError:
            # Claimed by the gateway. Normally its command follows at once; a claim this old whose
            # command never came means the gateway died between claim and append. Seal it anyway:
            # a late append carries the same Nats-Msg-Id, and the planner dedupes the seq_id.
            entry = await kv.get(ids.seq_key(model_id, seq_id))
            existing = codec.from_json(entry.value or b"{}", SeqClaim)
            if now_ns() - existing.accepted_ns < int(self.config.gap_timeout_s * 1e9):
                return
        error = (
            f"seq_id {seq_id} of model {model_id} never arrived within {self.config.gap_timeout_s:.0f}s; "
            "it was sealed as failed so later requests can run"
        )
        sealed = Rejected(
            kind=SEALED,
            error=error,
            tenant=tenant,
            model_id=model_id,
            request_id=request_id,
            seq_id=seq_id,
            at_ns=now_ns(),
        )
        log.warning(error)
        await self.bus.publish(s.request_subject(model_id), codec.pack(sealed), msg_id=request_id)


async def serve(config: PlannerConfig, stop: asyncio.Event) -> None:
    bus = await Bus.connect(config.nats_url, "planner")
    try:
        await ensure_streams(bus.js)
        service = PlannerService(bus, config)
        await service.start()
        await service.run(stop)
    finally:
        await bus.close()
