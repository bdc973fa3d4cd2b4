"""The trainer service: executes units from its group's work subject, in order, exactly once.

Recovery is replay: on start the trainer folds the outcome stream (which units already have an
outcome), then re-executes those units in work-stream order without emitting anything, which
rebuilds every slot's adapter, optimizer state and pending gradients exactly (CPU fp32 is
deterministic). Then it consumes the durable consumer: a unit whose outcome already exists is
only acked, so a redelivery never has a second effect.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import os
import socket
import time
from pathlib import Path

import msgspec
import numpy as np
import torch
from nats.aio.msg import Msg

from infra import tracing
from infra.bus import Bus, ensure_durable, fetch_loop, last_seq, replay
from infra.streams import ensure_streams, trainer_durable
from libs.checkpoints import layout
from libs.checkpoints import state_format as fmt
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.common import LoraSpec, now_ns
from libs.contracts.events import ServiceEvent, UnitFinished, UnitStarted
from libs.contracts.ids import HANDOFF
from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
from libs.contracts.records import TrainerStatus
from libs.contracts.snapshots import PublishSnapshot
from libs.contracts.work import (
    BarrierUnit,
    DiscardSlot,
    ExportSlot,
    FailRequest,
    InitSlot,
    LoadSlot,
    ReleaseSlot,
    SaveSlot,
    StepSlot,
    Unit,
    WorkUnit,
)
from libs.faults import crash_point
from libs.models.registry import resolve_base_model
from services.trainer import snapshots as trainer_snapshots
from services.trainer.config import TrainerConfig
from services.trainer.engine import AdamParams, DatumInput, EngineConfig, TrainerEngine
from services.trainer.state_io import peft_files, read_training_state, training_state_files

log = logging.getLogger("tinkerd.trainer")

WEDGED_EXIT_CODE = 70  # a unit outlived unit_timeout_s


def default_seed(model_id: str) -> int:
    return int.from_bytes(hashlib.sha256(model_id.encode()).digest()[:4], "little") & 0x7FFFFFFF


class TrainerService:
    def __init__(self, bus: Bus, config: TrainerConfig, engine: TrainerEngine, base_model: str) -> None:
        self.bus = bus
        self.config = config
        self.engine = engine
        self.base_model = base_model
        self.data_dir = Path(config.data_dir).expanduser().resolve()
        self.trainer_id = config.trainer_id or f"{config.group}-{socket.gethostname()}-{os.getpid()}"
        self.completed: set[str] = set()
        self.slot_models: dict[int, str] = {}
        self.last_work_seq = 0
        self.snapshot_work_seq = 0
        self.snapshot_ns = 0
        self.steps_since_snapshot = 0
        self.last_snapshot_at = time.monotonic()
        self.snapshot_work_seq, self.snapshot_ns = self.last_work_seq, now_ns()
        self.ready = False

    # --- start-up ---------------------------------------------------------------------------
    async def ensure_consumer(self) -> None:
        durable = trainer_durable(self.config.group)
        await ensure_durable(self.bus, durable.stream, durable.config)

    async def recover(self) -> int:
        """Rebuild slot state: newest internal snapshot, then re-execute later units that have outcomes."""
        snapshot = trainer_snapshots.latest(self.data_dir, self.config.group)
        base_seq = 0
        if snapshot is not None:
            base_seq, self.slot_models = await asyncio.to_thread(
                trainer_snapshots.restore, self.engine, snapshot
            )
            log.info("restored snapshot %s (%d slots)", snapshot.name, len(self.slot_models))
        self.last_work_seq = self.snapshot_work_seq = base_seq

        def on_outcome(msg: Msg) -> None:
            self.completed.add(codec.outcome_decoder.decode(msg.data).unit_id)

        outcomes_last = await last_seq(self.bus, s.STREAM_OUTCOMES)
        await replay(
            self.bus, s.STREAM_OUTCOMES, s.outcome_subject(self.config.group), outcomes_last, on_outcome
        )
        units: list[tuple[int, Unit]] = []
        seen: set[str] = set()

        def on_unit(msg: Msg) -> None:
            unit = codec.unit_decoder.decode(msg.data)
            if unit.unit_id in self.completed and unit.unit_id not in seen:
                seen.add(unit.unit_id)  # a unit appended twice (a late redelivery) ran once
                units.append((msg.metadata.sequence.stream, unit))

        work_last = await last_seq(self.bus, s.STREAM_WORK)
        await replay(
            self.bus,
            s.STREAM_WORK,
            s.work_subject(self.config.group),
            work_last,
            on_unit,
            from_seq=base_seq + 1,
        )
        for seq, unit in units:
            await asyncio.to_thread(self.execute, unit, True)
            self.last_work_seq = seq
        return len(units)

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
            await fetch_loop(sub, self._on_units, stop, batch=1, wait_s=1.0)
        finally:
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
            self.bus.emit_soon(UnitStarted(unit_id=unit.unit_id, trainer=self.trainer_id, at_ns=now_ns()))
            started = now_ns()
            working = asyncio.create_task(self._keep_alive(msg))
            try:
                with tracing.span(
                    "trainer.execute", unit.traceparent, unit_id=unit.unit_id, trainer=self.trainer_id
                ) as ctx:
                    outcome, publishes = await self._run_with_watchdog(unit)
            finally:
                working.cancel()
            publishes = [msgspec.structs.replace(p, traceparent=ctx) for p in publishes]
            for publish in publishes:
                await self.bus.publish(
                    s.publish_subject(publish.model_id), codec.pack(publish), msg_id=publish.request_id
                )
            if publishes:
                crash_point("trainer.save_handed_off")  # fault tests: published, no outcome yet
            await self.bus.publish(
                s.outcome_subject(self.config.group), codec.pack(outcome), msg_id=unit.unit_id
            )
            crash_point("trainer.outcome_published")  # fault tests: outcome appended, unit not acked
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

    async def _run_with_watchdog(self, unit: Unit) -> tuple[Outcome, list[PublishSnapshot]]:
        """Execute in a worker thread; a unit that outlives `unit_timeout_s` ends the process.

        A wedged compute thread cannot be cancelled, and the event loop would go on reporting
        progress for it forever. Exiting hands the unit back: the supervisor restarts the
        trainer, which rebuilds its state and gets the unacknowledged unit again.
        """
        work = asyncio.ensure_future(asyncio.to_thread(self.execute, unit, False))
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
        due_steps = self.steps_since_snapshot >= self.config.snapshot_every_steps
        due_time = time.monotonic() - self.last_snapshot_at >= self.config.snapshot_every_s
        if not (due_steps or (due_time and self.steps_since_snapshot)):
            return
        try:
            await asyncio.to_thread(
                trainer_snapshots.take,
                self.engine,
                dict(self.slot_models),
                self.data_dir,
                self.config.group,
                self.last_work_seq,
            )
        except OSError as exc:  # a full disk: recovery replays from the previous snapshot instead
            log.warning("could not write an internal snapshot (%s); training goes on without it", exc)
            self.last_snapshot_at = time.monotonic()
            return
        self.steps_since_snapshot = 0
        self.last_snapshot_at = time.monotonic()
        self.snapshot_work_seq, self.snapshot_ns = self.last_work_seq, now_ns()

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
                slots_used=len(self.slot_models),
                updated_ns=now_ns(),
                snapshot_work_seq=self.snapshot_work_seq,
                snapshot_ns=self.snapshot_ns,
                last_work_seq=self.last_work_seq,
            )
            with contextlib.suppress(Exception):
                await kv.put(s.token(self.trainer_id), codec.to_json(status))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.config.heartbeat_s)
        with contextlib.suppress(Exception):
            await kv.delete(s.token(self.trainer_id))

    # --- execution (runs in a worker thread; pure function of the unit and slot state) --------
    def execute(self, unit: Unit, replaying: bool) -> tuple[Outcome, list[PublishSnapshot]]:
        started = now_ns()
        if not replaying:
            crash_point("trainer.executing")  # fault tests: killed or wedged mid-unit
        if isinstance(unit, WorkUnit):
            return self._work(unit, started), []
        return self._barrier(unit, replaying, started)

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
                results.append(
                    DatumOutcome(item.request_id, item.index, out.logprobs.astype("<f4").tobytes(), out.loss)
                )
        except ValueError:
            # Isolate the bad datum(s): the others run alone, so one tenant's error never fails another's.
            for item, datum in zip(unit.items, datums, strict=True):
                try:
                    out = self.engine.forward_backward([datum], unit.loss_fn, config, unit.forward_only)[0]
                    results.append(
                        DatumOutcome(
                            item.request_id, item.index, out.logprobs.astype("<f4").tobytes(), out.loss
                        )
                    )
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

    def _barrier(
        self, unit: BarrierUnit, replaying: bool, started: int
    ) -> tuple[BarrierOutcome, list[PublishSnapshot]]:
        outcomes: list[OpOutcome] = []
        publishes: list[PublishSnapshot] = []
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
        for op in unit.ops:
            if isinstance(op, StepSlot):
                continue
            try:
                outcome, publish = self._op(unit, op, replaying)
            except Exception as exc:
                log.exception("op %s of unit %s failed", type(op).__name__, unit.unit_id)
                outcome, publish = (
                    OpOutcome(
                        model_id=op.model_id,
                        request_id=op.request_id,
                        ok=False,
                        error=str(exc) if isinstance(exc, (UserError, StorageError)) else f"{type(exc).__name__}: {exc}",
                        category="user" if isinstance(exc, UserError) else "server",
                    ),
                    None,
                )
            outcomes.append(outcome)
            if publish is not None:
                publishes.append(publish)
        return BarrierOutcome(
            unit_id=unit.unit_id, ops=outcomes, started_ns=started, finished_ns=now_ns()
        ), publishes

    def _steps(self, steps: list[StepSlot]) -> list[OpOutcome]:
        params = {
            op.slot: AdamParams(
                learning_rate=op.adam.learning_rate,
                beta1=op.adam.beta1,
                beta2=op.adam.beta2,
                eps=op.adam.eps,
                weight_decay=op.adam.weight_decay,
                grad_clip_norm=op.adam.grad_clip_norm,
            )
            for op in steps
        }
        reports = self.engine.optim_step(params)
        out = []
        for op in steps:
            report = reports[op.slot]
            metrics = {
                "grad_norm": report.grad_norm,
                # not "learning_rate"/"step": the cookbook merges these into its own metrics row
                "optim/learning_rate": op.adam.learning_rate,
                "optim/step": float(report.step),
            }
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

    def _op(self, unit: BarrierUnit, op: object, replaying: bool) -> tuple[OpOutcome, PublishSnapshot | None]:
        if isinstance(op, InitSlot):
            lora = op.lora
            seed = lora.seed if lora.seed is not None else default_seed(op.model_id)
            if op.restore is not None:
                state, meta = read_training_state(Path(op.restore.directory))
                if meta.base_model != self.base_model:
                    raise_user(f"checkpoint base model {meta.base_model!r} differs from {self.base_model!r}")
                self.engine.init_slot(
                    op.slot, meta.rank, meta.seed, meta.train_attn, meta.train_mlp, meta.train_unembed
                )
                self.engine.set_slot_state(op.slot, state, with_optimizer=op.restore.with_optimizer)
            else:
                self.engine.init_slot(
                    op.slot, lora.rank, seed, lora.train_attn, lora.train_mlp, lora.train_unembed
                )
            self.slot_models[op.slot] = op.model_id
            return ok(op), None
        if isinstance(op, DiscardSlot):
            self.engine.discard_grads(op.slot)
            error = (
                f"{op.reason}: this window's gradients were discarded and no step was applied; resubmit the "
                "batch's forward_backward calls, then optim_step again"
            )
            return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=False, error=error), None
        if isinstance(op, FailRequest):
            return OpOutcome(
                model_id=op.model_id, request_id=op.request_id, ok=False, error=op.error, category=op.category
            ), None
        if isinstance(op, ReleaseSlot):
            self.engine.release_slot(op.slot)
            self.slot_models.pop(op.slot, None)
            return ok(op), None
        if isinstance(op, LoadSlot):
            state, meta = read_training_state(Path(op.restore.directory))
            self.engine.set_slot_state(op.slot, state, with_optimizer=op.restore.with_optimizer)
            return ok(op), None
        if isinstance(op, (SaveSlot, ExportSlot)):
            return self._save(unit, op, replaying)
        raise TypeError(f"unknown op {type(op).__name__}")

    def _save(
        self, unit: BarrierUnit, op: SaveSlot | ExportSlot, replaying: bool
    ) -> tuple[OpOutcome, PublishSnapshot | None]:
        handoff = OpOutcome(
            model_id=op.model_id, request_id=op.request_id, ok=True, info={HANDOFF: "publisher"}
        )
        if replaying:
            return handoff, None  # the files and the publication already happened
        state = self.engine.get_slot_state(op.slot)
        lora = LoraSpec(
            rank=state.config.rank,
            seed=state.config.seed,
            train_attn=state.config.train_attn,
            train_mlp=state.config.train_mlp,
            train_unembed=state.config.train_unembed,
        )
        staging = layout.staging_dir(self.data_dir, unit.unit_id, op.request_id)
        if isinstance(op, SaveSlot):
            meta = fmt.TrainingStateMeta(
                base_model=self.base_model,
                model_id=op.model_id,
                tenant=op.tenant,
                rank=lora.rank,
                seed=state.config.seed,
                train_attn=lora.train_attn,
                train_mlp=lora.train_mlp,
                train_unembed=lora.train_unembed,
                step=state.step,
            )
            files = training_state_files(state, meta)
            kind, sampler_id, metadata = "training", None, op.user_metadata
        else:
            tensors, adapter_config = self.engine.export_peft(op.slot)
            adapter_config["base_model_name_or_path"] = self.base_model
            snapshot_meta = fmt.SnapshotMeta(
                base_model=self.base_model,
                model_id=op.model_id,
                tenant=op.tenant,
                rank=lora.rank,
                step=state.step,
            )
            files = peft_files(tensors, adapter_config, snapshot_meta)
            kind, sampler_id, metadata = "sampler", op.sampling_session_id, None
        try:
            layout.write_dir_atomically(staging, files)
        except OSError as exc:
            what = "save_state" if isinstance(op, SaveSlot) else "save_weights_for_sampler"
            kept = f"; {op.tinker_path} still holds its previous version" if op.tinker_path else ""
            raise StorageError(
                f"{what} failed: the server could not write the checkpoint files "
                f"({exc.strerror or exc}); nothing was saved{kept}. Free disk space on the server, "
                "then save again"
            ) from exc
        publish = PublishSnapshot(
            kind=kind,
            staging_dir=str(staging),
            base_model=self.base_model,
            lora=lora,
            step=state.step,
            tinker_path=op.tinker_path,
            sampling_session_id=sampler_id,
            ttl_s=op.ttl_s,
            user_metadata=metadata,
            version=unit.unit_id,
            model_id=op.model_id,
            request_id=op.request_id,
            tenant=op.tenant,
            at_ns=now_ns(),
        )
        return handoff, publish


class UserError(Exception):
    pass


class StorageError(Exception):
    """The data directory refused a write (a full disk, ...): a server error with a clear text."""


def raise_user(message: str) -> None:
    raise UserError(message)


def ok(op: InitSlot | ReleaseSlot | LoadSlot) -> OpOutcome:
    return OpOutcome(model_id=op.model_id, request_id=op.request_id, ok=True)


async def serve(config: TrainerConfig, stop: asyncio.Event) -> None:
    data_dir = Path(config.data_dir).expanduser().resolve()
    model = resolve_base_model(config.base_model, data_dir)
    device = config.device if config.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
    engine = await asyncio.to_thread(
        TrainerEngine,
        EngineConfig(
            base_model_dir=str(model.path),
            num_slots=config.num_slots,
            max_lora_rank=config.max_lora_rank,
            device=device,
        ),
    )
    bus = await Bus.connect(config.nats_url, "trainer")
    try:
        await ensure_streams(bus.js)
        service = TrainerService(bus, config, engine, model.name)
        await service.ensure_consumer()
        replayed = await service.recover()
        log.info(
            "trainer %s ready (%s, %d slots); replayed %d units",
            service.trainer_id,
            device,
            config.num_slots,
            replayed,
        )
        service.ready = True
        await service.run(stop)
    finally:
        await bus.close()
