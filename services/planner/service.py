"""The planner service: folds the request and outcome streams, emits units, publishes results.

Start-up is a replay through the same `Planner.apply` the live path uses: the newest snapshot (if
any), then every request, every unit and every outcome after the snapshot's positions, up to each
stream's last sequence. Results of requests that the replay finds finished are appended again
(`publish_once`: the server refuses a second result for a request, so those a previous process
published have no second effect). Then live consumption through the two durable consumers; what
they redeliver was folded by the replay already and has no effect. Invariant: a message is acked
only after everything it caused is durable (units appended, results appended).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import msgspec
from nats.aio.msg import Msg
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError

from infra import tracing
from infra.bus import Bus, ensure_durable, fetch_loop, kv_scan, last_seq, replay
from infra.streams import ensure_streams, planner_durables
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import RequestCompleted, RequestFailed, SlotAssigned, UnitPlanned
from libs.contracts.records import ModelQueueRecord, QueueRecord, SeqClaim, TrainerStatus
from libs.contracts.requests import Rejected
from libs.contracts.results import Failure, RequestResult
from libs.contracts.work import BarrierUnit, InitSlot, PageIn, PageOut, Unit, WorkUnit
from libs.faults import crash_point
from services.planner import snapshot
from services.planner.config import PlannerConfig
from services.planner.planner import (
    PAUSED_CAPACITY,
    CommandArrived,
    Completion,
    OutcomeArrived,
    Planner,
    UnitEmitted,
)
from services.planner.snapshot import PlannerSnapshot, Positions
from services.planner.streams import SEALED

log = logging.getLogger("tinkerd.planner")


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
        self._summaries: dict[str, ModelQueueRecord] = {}  # last summary written per model
        self._positions = Positions()  # the last sequence folded, per stream
        self._snapshot_due_ns = 0
        self._slots_known = False  # until the group's trainer reported its slot count
        self._replayed: list[Completion] = []  # finished requests found by the replay
        # Coalescing (see _holding): the models of the last work unit, and when a hold ends.
        self._cohort: frozenset[str] = frozenset()
        self._hold_until_ns = 0
        self._hold_timers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        await ensure_consumers(self.bus)
        saved = await snapshot.load(self.bus, self.config.trainer_group)
        if saved is not None:
            self.planner = Planner.restore(saved.state)
            self.planner.state.num_slots = self.config.num_slots
            self.planner.state.token_budget = self.config.token_budget
            self.planner.state.max_units_in_flight = self.config.max_units_in_flight
            self._positions = saved.positions
        replay_ns = now_ns()  # a hole found on replay gets a full gap timeout from now

        def on_request(msg: Msg) -> None:
            command = codec.command_decoder.decode(msg.data)
            self.planner.apply(CommandArrived(command, msg.metadata.sequence.stream, replay_ns))

        def on_unit(msg: Msg) -> None:
            self.planner.apply(UnitEmitted(codec.unit_decoder.decode(msg.data)))

        def on_outcome(msg: Msg) -> None:
            self.planner.apply(OutcomeArrived(codec.outcome_decoder.decode(msg.data)))

        # Requests, then units, then outcomes: each fact finds what it refers to already folded.
        counts, last = [], {}
        for stream, subject, handle, start in (
            (s.STREAM_REQUESTS, s.REQUESTS_ALL, on_request, self._positions.requests),
            (s.STREAM_WORK, s.work_subject(self.config.trainer_group), on_unit, self._positions.work),
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
            owner for owner in map(s.untoken, await self._queue_keys()) if not ids.is_sampler_id(owner)
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
        tasks = [
            asyncio.create_task(fetch_loop(requests, self._on_requests, stop, wait_s=0.5)),
            asyncio.create_task(fetch_loop(outcomes, self._on_outcomes, stop, wait_s=0.5)),
            asyncio.create_task(self._seal_gaps(stop)),
            asyncio.create_task(self._learn_slots(stop)),
        ]
        stopping = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait([stopping, *tasks], return_when=asyncio.FIRST_COMPLETED)
        for timer in list(self._hold_timers):
            timer.cancel()
        for task in [stopping, *tasks]:
            task.cancel()
        for task in [stopping, *tasks]:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        for task in done:
            if task is not stopping and task.exception() is not None:
                # A loop that died must not leave a live-looking planner: exit, be restarted, replay.
                raise RuntimeError("a planner loop failed") from task.exception()

    async def _on_requests(self, msgs: list[Msg]) -> None:
        async with self._lock:
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                command = codec.command_decoder.decode(msg.data)
                self.planner.apply(CommandArrived(command, seq, now_ns()))
                self._positions = msgspec.structs.replace(
                    self._positions, requests=max(self._positions.requests, seq)
                )
            await self._advance()
            crash_point("planner.requests_planned")  # fault tests: units appended, requests not acked
            for msg in msgs:
                await msg.ack()

    async def _on_outcomes(self, msgs: list[Msg]) -> None:
        async with self._lock:
            for msg in msgs:
                seq = msg.metadata.sequence.stream
                self.planner.apply(OutcomeArrived(codec.outcome_decoder.decode(msg.data)))
                self._positions = msgspec.structs.replace(
                    self._positions, outcomes=max(self._positions.outcomes, seq)
                )
            await self._advance()
            crash_point("planner.outcomes_folded")  # fault tests: results appended, outcomes not acked
            for msg in msgs:
                await msg.ack()

    async def _advance(self) -> None:
        """Publish finished requests and every unit that became plannable (in order)."""
        await self._publish_completions(self.planner.collect())
        if not self._slots_known:
            return  # nothing is planned before the trainer said how many adapter slots it has
        if not self._holding(now_ns()):
            for unit in self.planner.plan():
                await self._emit_unit(unit)
                if isinstance(unit, WorkUnit):
                    self._cohort = frozenset(item.model_id for item in unit.items)
                    self._hold_until_ns = 0
        await self._publish_completions(self.planner.collect())
        await self._publish_queue_state()
        await self._publish_model_summaries()
        await self._maybe_snapshot()

    def _holding(self, now: int) -> bool:
        """Whether to hold the next work unit back, so that tenants stepping in lockstep share it.

        Eight tenants sending forward_backward at the same moment reach the planner milliseconds
        apart; planned on arrival, the first would run alone and the other seven after it. So
        while nothing is in flight and the next unit is a work unit, it waits for the models
        packed with it last time that have not sent their next call yet: until they all have,
        or `coalesce_ms` after the hold began. A model that does not come drops out of the
        cohort with the unit that leaves without it, so a tenant training alone never waits.
        Timing only: what is decided stays `decide()`'s, and replay never holds.
        """
        if (
            self.config.coalesce_ms <= 0
            or len(self._cohort) < 2
            or self.planner.state.inflight
            or not isinstance(self.planner.decide(), WorkUnit)
            or not self.planner.awaited(self._cohort)
        ):
            self._hold_until_ns = 0
            return False
        if self._hold_until_ns == 0:
            self._hold_until_ns = now + int(self.config.coalesce_ms * 1e6)
            timer = asyncio.create_task(self._end_hold(self._hold_until_ns))
            self._hold_timers.add(timer)
            timer.add_done_callback(self._hold_timers.discard)
        return now < self._hold_until_ns

    async def _end_hold(self, until_ns: int) -> None:
        await asyncio.sleep(max(0.0, (until_ns - now_ns()) / 1e9))  # a deadline, not synchronisation
        async with self._lock:
            if self._hold_until_ns == until_ns:
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
            )
            if self._summaries.get(stream.model_id) != record:
                await kv.put(s.token(stream.model_id), codec.to_json(record))
                self._summaries[stream.model_id] = record

    async def _queue_keys(self) -> list[str]:
        return list(await kv_scan(self.bus, s.KV_QUEUE))

    async def _publish_queue_state(self) -> None:
        """Mark requests that wait for an adapter slot, so try_again says paused_capacity."""
        waiting = set(self.planner.waiting_for_capacity())
        if waiting == self._paused:
            return
        kv = await self.bus.kv(s.KV_QUEUE)
        for request_id in sorted(waiting - self._paused):
            reason = (
                f"all {self.config.num_slots} adapter slots hold models with work in flight; "
                "waiting for one of them to finish, then this model gets its slot"
            )
            record = QueueRecord(
                request_id=request_id, queue_state=PAUSED_CAPACITY, reason=reason, since_ns=now_ns()
            )
            await kv.put(s.token(request_id), codec.to_json(record))
            log.info("%s waits for a free adapter slot", request_id)
        for request_id in sorted(self._paused - waiting):
            with contextlib.suppress(KeyNotFoundError):
                await kv.delete(s.token(request_id))
        self._paused = waiting

    async def _emit_unit(self, unit: Unit) -> None:
        with tracing.span(
            "planner.unit", unit.traceparent, links=self.planner.unit_traces(unit), unit_id=unit.unit_id
        ) as ctx:
            unit = msgspec.structs.replace(unit, traceparent=ctx, at_ns=now_ns())
            ack = await self.bus.publish(
                s.work_subject(self.config.trainer_group),
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
            if isinstance(op, (InitSlot, PageIn)):
                self.bus.emit_soon(
                    SlotAssigned(
                        model_id=op.model_id,
                        slot=op.slot,
                        reason="create" if isinstance(op, InitSlot) else "page_in",
                        evicted=evicted.get(op.slot, ""),
                        at_ns=now_ns(),
                    )
                )

    async def _publish_completions(self, completions: list[Completion]) -> None:
        for done in completions:
            cmd = done.pending.command
            if done.body is None:
                continue  # the publisher answers this one
            result = RequestResult(
                kind=done.pending.kind,
                body=done.body,
                tenant=cmd.tenant,
                model_id=done.model_id,
                request_id=cmd.request_id,
                seq_id=cmd.seq_id,
                at_ns=now_ns(),
                traceparent=cmd.traceparent,
            )
            crash_point("planner.result_publishing")  # fault tests: die with results half-published
            if not await self.bus.publish_once(
                s.result_subject(cmd.request_id), codec.pack(result), msg_id=cmd.request_id
            ):
                continue  # published before a crash: a replay's completion has no second effect
            duration_ms = (now_ns() - cmd.at_ns) / 1e6 if cmd.at_ns else 0.0
            if isinstance(done.body, Failure):
                event: RequestCompleted | RequestFailed = RequestFailed(
                    kind=done.pending.kind,
                    error=done.body.error,
                    category=done.body.category,
                    duration_ms=duration_ms,
                    model_id=done.model_id,
                    request_id=cmd.request_id,
                    seq_id=cmd.seq_id,
                    tenant=cmd.tenant,
                    at_ns=now_ns(),
                )
            else:
                event = RequestCompleted(
                    kind=done.pending.kind,
                    duration_ms=duration_ms,
                    model_id=done.model_id,
                    request_id=cmd.request_id,
                    seq_id=cmd.seq_id,
                    tenant=cmd.tenant,
                    at_ns=now_ns(),
                )
            self.bus.emit_soon(event)

    async def _learn_slots(self, stop: asyncio.Event) -> None:
        """Take the slot count from the group's trainer itself (its heartbeat in `tinker_trainers`),
        so a planner configured with another number never assigns a slot the trainer lacks."""
        while not stop.is_set():  # quickly until the first report, then every 5 s
            reported = set()
            for value in (await kv_scan(self.bus, s.KV_TRAINERS)).values():
                status = codec.from_json(value, TrainerStatus)
                if status.group == self.config.trainer_group and status.ready:
                    reported.add(status.num_slots)
            if reported:
                await self._adopt_slots(min(reported))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), 5.0 if self._slots_known else 0.25)

    async def _adopt_slots(self, num_slots: int) -> None:
        state = self.planner.state
        if num_slots == state.num_slots and self._slots_known:
            return
        async with self._lock:
            if num_slots == state.num_slots:
                self._slots_known = True
                await self._advance()
                return
            held = max(state.slots, default=-1)
            if held >= num_slots:
                log.error(
                    "trainer group %s reports %d adapter slots, but slot %d is assigned; keeping %d until "
                    "it is freed", self.config.trainer_group, num_slots, held, state.num_slots,
                )
                return
            log.info(
                "trainer group %s has %d adapter slots (planner configured with %d): planning with %d",
                self.config.trainer_group, num_slots, state.num_slots, num_slots,
            )
            state.num_slots = num_slots
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
            await kv.create(s.seq_key(model_id, seq_id), codec.to_json(claim))
        except KeyWrongLastSequenceError:
            # Claimed by the gateway. Normally its command follows at once; a claim this old whose
            # command never came means the gateway died between claim and append. Seal it anyway:
            # a late append carries the same Nats-Msg-Id, and the planner dedupes the seq_id.
            entry = await kv.get(s.seq_key(model_id, seq_id))
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
