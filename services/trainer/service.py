"""The trainer service: executes units from its group's work subject, in order, exactly once.

This module is the consuming loop: it pulls one unit at a time from the group's durable,
runs it on the ``Executor`` (``execute.py``) in a worker thread under a watchdog, hands the
saves it copied to the background writer (``saves.py``: each save's ``PublishCommand`` goes out
once its files are fsynced), publishes the outcome, acks, and takes a snapshot now and then: the
unit path waits only while the slots' state is copied to host memory; the snapshot is written on
a background thread while the next units run (``state/snapshots.py``), one at a time, and never
while a save is being written (recovery must replay a save that was not handed off).
Start-up rebuilds the slots first (``recovery.py``); a unit whose outcome already exists is
only acked, so a redelivery never has a second effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import socket
import time
from pathlib import Path

import msgspec
import torch
import torch.distributed as dist
from nats.aio.msg import Msg

from infra import tracing
from infra.bus import Bus, ensure_durable, fetch_loop
from infra.streams import ensure_streams, trainer_durable
from libs.checkpoints import layout
from libs.contracts import codec, ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import ServiceEvent, UnitFinished, UnitStarted
from libs.contracts.outcomes import Outcome, WorkOutcome
from libs.contracts.publish import PublishCommand
from libs.contracts.records import TrainerStatus
from libs.contracts.work import AdoptSlot, BarrierUnit, StepSlot, Unit
from libs.faults import crash_point
from libs.models.registry import resolve_base_model
from services.trainer import adoption, group
from services.trainer.config import TrainerConfig
from services.trainer.engine import EngineConfig, TrainerEngine
from services.trainer.execute import Executor
from services.trainer.handover import Shelf, remove_orphan_segments
from services.trainer.recovery import recover
from services.trainer.saves import BackgroundSaves
from services.trainer.state import snapshots as trainer_snapshots
from services.trainer.state.checkpoints import PendingSave
from services.trainer.state.paging import PageStore

log = logging.getLogger("tinkerd.trainer")

WEDGED_EXIT_CODE = 70  # a unit outlived unit_timeout_s


class TrainerService:
    def __init__(self, bus: Bus, config: TrainerConfig, engine: TrainerEngine, base_model: str) -> None:
        self.bus = bus
        self.config = config
        self.engine = engine
        self.base_model = base_model
        self.data_dir = Path(config.data_dir).expanduser().resolve()
        pages = PageStore(layout.page_store_dir(self.data_dir, config.group), config.host_page_budget_bytes)
        self.takeovers = adoption.Takeovers()
        self.executor = Executor(
            engine, base_model, self.data_dir, pages, adopt=self.takeovers, handover=config.handover
        )
        shelf = Shelf(config.handover_keep_s, config.handover_limit)
        self.saves = BackgroundSaves(self._hand_off, config.save_writers, shelf)
        self.trainer_id = config.trainer_id or f"{config.group}-{socket.gethostname()}-{os.getpid()}"
        self.completed: set[str] = set()
        self.abandoned: set[str] = set()  # this group's units another group took over (skipped)
        self.last_work_seq = 0
        self.steps_since_snapshot = 0
        self.last_snapshot_at = time.monotonic()
        self.snapshot_work_seq, self.snapshot_ns = 0, now_ns()
        # the snapshot being written: its contents, the write (directory, seconds), the steps it covers
        self._writing: tuple[trainer_snapshots.Captured, asyncio.Future[tuple[Path, float]], int] | None = (
            None
        )
        self.ready = False

    # --- start-up ---------------------------------------------------------------------------
    async def ensure_consumer(self) -> None:
        durable = trainer_durable(self.config.group)
        await ensure_durable(self.bus, durable.stream, durable.config)

    async def recover(self) -> int:
        """Rebuild every slot (see recovery.py); returns how many units were re-executed."""
        removed = remove_orphan_segments()  # handovers of trainers killed before they let them go
        if removed:
            log.info("removed %d handover segments of trainers that are gone", removed)
        state = await recover(self.bus, self.executor, self.config.group, self.data_dir)
        self.completed = state.completed
        self.abandoned = state.abandoned
        self.snapshot_work_seq, self.last_work_seq = state.base_seq, state.last_work_seq
        for save in state.saves:  # never handed off before the restart: written now
            await self.saves.submit(save)
        return state.replayed

    # --- the loop ---------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        sub = await self.bus.pull(
            s.work_subject(self.config.group), s.durable_trainer(self.config.group), s.STREAM_WORK
        )
        heartbeat = asyncio.create_task(self._heartbeat(stop))
        await self.bus.emit(
            ServiceEvent(service="trainer", what="ready", detail=self.trainer_id, at_ns=now_ns())
        )
        try:
            await fetch_loop(sub, self._on_units, stop, batch=1)
        finally:
            await self.saves.drain()  # every save copied is written and handed off
            self.saves.close()
            await self._finish_snapshot(wait=True)  # a snapshot being written is completed
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    async def _on_units(self, msgs: list[Msg]) -> None:
        for msg in msgs:
            unit = codec.unit_decoder.decode(msg.data)
            seq = msg.metadata.sequence.stream
            if unit.unit_id in self.completed:
                await msg.ack()  # redelivered after its outcome was published: no second effect
                self.last_work_seq = max(self.last_work_seq, seq)
                continue
            if unit.unit_id in self.abandoned:
                # Taken over by another group while this one was lost: its work was planned again
                # there, so running it here would do it twice (a save: publish it twice).
                log.info("unit %s was abandoned when this group was lost; skipping it", unit.unit_id)
                await msg.ack()
                self.last_work_seq = max(self.last_work_seq, seq)
                continue
            await self._gather_adoptions(unit)
            self.bus.emit_soon(UnitStarted(unit_id=unit.unit_id, trainer=self.trainer_id, at_ns=now_ns()))
            started = now_ns()
            if unit.at_ns and (waited_ms := (started - unit.at_ns) / 1e6) >= 50:
                log.info("unit %s started %.1f ms after the planner emitted it", unit.unit_id, waited_ms)
            working = asyncio.create_task(self._keep_alive(msg))
            try:
                with tracing.span(
                    "trainer.execute", unit.traceparent, unit_id=unit.unit_id, trainer=self.trainer_id
                ) as ctx:
                    outcome, saves = await self._run_with_watchdog(unit)
            finally:
                working.cancel()
            executed = time.perf_counter()
            for event in self.executor.events:
                self.bus.emit_soon(event)
            self.executor.events.clear()
            for save in saves:  # written behind the unit path; handed off once fsynced
                command = msgspec.structs.replace(save.command, traceparent=ctx)
                await self.saves.submit(dataclasses.replace(save, command=command))
            await self.bus.publish(
                s.outcome_subject(self.config.group), codec.pack(outcome), msg_id=unit.unit_id
            )
            crash_point("trainer.outcome_published")  # fault tests: outcome appended, unit not acked
            if (handoff_ms := (time.perf_counter() - executed) * 1e3) >= 50:
                log.info("unit %s: outcome published %.1f ms after execute ended", unit.unit_id, handoff_ms)
            self.completed.add(unit.unit_id)
            await msg.ack()
            self.last_work_seq = seq
            if isinstance(unit, BarrierUnit):
                self.steps_since_snapshot += sum(isinstance(op, StepSlot) for op in unit.ops)
            await self._maybe_snapshot()
            ok = not (isinstance(outcome, WorkOutcome) and outcome.error)
            self.bus.emit_soon(
                UnitFinished(
                    unit_id=unit.unit_id,
                    trainer=self.trainer_id,
                    duration_ms=(now_ns() - started) / 1e6,
                    ok=ok,
                    at_ns=now_ns(),
                )
            )

    async def _hand_off(self, command: PublishCommand) -> None:
        """A save's files are fsynced (or, with a handover, its adapter is readable from here): the
        publisher makes them a version and answers the save."""
        msg_id = ids.handover_msg_id(command.request_id) if command.handover else command.request_id
        await self.bus.publish(s.publish_subject(command.model_id), codec.pack(command), msg_id=msg_id)

    async def _gather_adoptions(self, unit: Unit) -> None:
        """Before a takeover unit: read what each lost group's files and streams say (adoption.py)."""
        sources = self.takeovers.sources
        sources.clear()
        if not isinstance(unit, BarrierUnit):
            return
        for op in unit.ops:
            if isinstance(op, AdoptSlot) and op.from_group not in sources:
                started = time.perf_counter()
                source = await adoption.gather(self.bus, self.data_dir, op.from_group, op.abandoned)
                sources[op.from_group] = source
                log.info(
                    "taking over from lost group %s: read its streams in %.0f ms (snapshot %s, %d units after it)",
                    op.from_group,
                    (time.perf_counter() - started) * 1000,
                    source.snapshot.name if source.snapshot else "none",
                    len(source.units),
                )

    async def _run_with_watchdog(self, unit: Unit) -> tuple[Outcome, list[PendingSave]]:
        """Execute in a worker thread; a unit that outlives `unit_timeout_s` ends the process.

        A wedged compute thread cannot be cancelled, and the event loop would go on reporting
        progress for it forever. Exiting hands the unit back: the supervisor restarts the
        trainer, which rebuilds its state and gets the unacknowledged unit again.
        """
        work = asyncio.ensure_future(asyncio.to_thread(self.executor.execute, unit, False))
        done, _ = await asyncio.wait([work], timeout=self.config.unit_timeout_s)
        if not done:
            log.error(
                "unit %s is still running after %.0f s (unit_timeout_s): the trainer is wedged; "
                "exiting so that it is restarted and the unit delivered again",
                unit.unit_id,
                self.config.unit_timeout_s,
            )
            logging.shutdown()
            os._exit(WEDGED_EXIT_CODE)
        return work.result()

    async def _maybe_snapshot(self) -> None:
        """Between two units: complete a finished background write, and start a snapshot when one
        is due and none is being written."""
        await self._finish_snapshot(wait=False)
        if self._writing is not None or self.saves.pending:
            return  # a snapshot must not cover a save whose files are not handed off yet
        due_steps = self.steps_since_snapshot >= self.config.snapshot_every_steps
        due_time = time.monotonic() - self.last_snapshot_at >= self.config.snapshot_every_s
        if not (due_steps or (due_time and self.steps_since_snapshot)):
            return
        started = time.monotonic()
        try:
            captured = await asyncio.to_thread(
                trainer_snapshots.capture,
                self.engine,
                dict(self.executor.slot_models),
                self.executor.pages,
                self.data_dir,
                self.config.group,
                self.last_work_seq,
            )
        except OSError as exc:  # a full disk: recovery replays from the previous snapshot instead
            log.warning("could not write an internal snapshot (%s); training goes on without it", exc)
            self.last_snapshot_at = time.monotonic()
            return
        captured_s = time.monotonic() - started
        log.info(
            "snapshot %012d captured in %.1f s (%.1f GB); writing it",
            captured.index.work_seq,
            captured_s,
            captured.nbytes / 1e9,
        )
        writing = asyncio.ensure_future(asyncio.to_thread(self._write_snapshot, captured))
        self._writing = (captured, writing, self.steps_since_snapshot)
        self.steps_since_snapshot = 0  # units from here on are after the snapshot
        self.last_snapshot_at = time.monotonic()

    def _write_snapshot(self, captured: trainer_snapshots.Captured) -> tuple[Path, float]:
        started = time.monotonic()
        directory = trainer_snapshots.write(captured, self.data_dir, self.config.group)
        return directory, time.monotonic() - started

    async def _finish_snapshot(self, wait: bool) -> None:
        """If the background write is done (or, with ``wait``, once it is): adopt its links and
        collect old snapshots (``snapshots.finish``), or count its steps again if it failed."""
        if self._writing is None:
            return
        captured, writing, steps = self._writing
        if not writing.done() and not wait:
            return
        self._writing = None
        try:
            directory, write_s = await writing
            await asyncio.to_thread(
                trainer_snapshots.finish,
                captured,
                directory,
                self.executor.pages,
                self.data_dir,
                self.config.group,
            )
        except OSError as exc:  # a full disk: recovery replays from the previous snapshot instead
            log.warning("could not write an internal snapshot (%s); training goes on without it", exc)
            self.steps_since_snapshot += steps  # still not covered by a snapshot
            self.last_snapshot_at = time.monotonic()
            return
        self.snapshot_work_seq, self.snapshot_ns = captured.index.work_seq, now_ns()
        log.info("snapshot %s written in the background in %.1f s", directory.name, write_s)

    async def _keep_alive(self, msg: Msg) -> None:
        while True:
            await asyncio.sleep(15)  # a long unit: tell JetStream we are still working on it
            await msg.in_progress()

    async def _heartbeat(self, stop: asyncio.Event) -> None:
        kv = await self.bus.kv(s.KV_TRAINERS)
        while not stop.is_set():
            status = TrainerStatus(
                trainer_id=self.trainer_id,
                group=self.config.group,
                ready=self.ready,
                base_model=self.base_model,
                num_slots=self.config.num_slots,
                slots_used=len(self.executor.slot_models),
                updated_ns=now_ns(),
                snapshot_work_seq=self.snapshot_work_seq,
                snapshot_ns=self.snapshot_ns,
                last_work_seq=self.last_work_seq,
            )
            with contextlib.suppress(Exception):
                await kv.put(ids.token(self.trainer_id), codec.to_json(status))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.heartbeat_s)
        with contextlib.suppress(Exception):
            await kv.delete(ids.token(self.trainer_id))


def resolve_device(config: TrainerConfig) -> str:
    return config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")


def build_engine(config: TrainerConfig, device: str) -> tuple[TrainerEngine, str]:
    """This process's engine (its shard, in a TP group) and the base model's name."""
    model = resolve_base_model(config.base_model, Path(config.data_dir).expanduser().resolve())
    engine = TrainerEngine(
        EngineConfig(
            base_model_dir=str(model.path),
            num_slots=config.num_slots,
            max_lora_rank=config.max_lora_rank,
            device=device,
            attention_backend=config.attention_backend,
            fused_cross_entropy=config.fused_cross_entropy,
            step_graphs=config.step_graphs,
            step_graph_max_tokens=config.step_graph_max_tokens,
        )
    )
    return engine, model.name


def follow_rank(config: TrainerConfig) -> None:
    """Ranks 1..N-1 of a TP group: no bus, no files; run rank 0's engine calls (group.py)."""
    group.die_with_parent()
    device = resolve_device(config)
    control = group.init_rank(device, config.unit_timeout_s)
    engine, _ = build_engine(config, device)
    log.info("rank %d of %d ready (%s); following rank 0", dist.get_rank(), dist.get_world_size(), device)
    group.follow(engine, control)
    dist.destroy_process_group()


async def serve(config: TrainerConfig, stop: asyncio.Event) -> None:
    """The trainer: a lone process, or rank 0 of a TP group (the group's only consumer)."""
    device = resolve_device(config)
    leader: group.Leader | None = None
    control = None
    if group.rank_env(os.environ) is not None:
        group.die_with_parent()
        control = await asyncio.to_thread(group.init_rank, device, config.unit_timeout_s)
    engine, base_model = await asyncio.to_thread(build_engine, config, device)
    if control is not None:
        leader = group.lead(engine, control)
    bus = await Bus.connect(config.nats_url, "trainer")
    try:
        await ensure_streams(bus.js)
        service = TrainerService(bus, config, engine, base_model)
        await service.ensure_consumer()
        replayed = await service.recover()
        log.info(
            "trainer %s ready (%s, %d slots, tp=%d); replayed %d units",
            service.trainer_id,
            device,
            config.num_slots,
            engine.tp_size,
            replayed,
        )
        service.ready = True
        await service.run(stop)
    finally:
        await bus.close()
        if leader is not None:
            await asyncio.to_thread(leader.close)
            dist.destroy_process_group()  # a gloo group left to the interpreter's exit can abort it
