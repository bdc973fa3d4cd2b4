"""The planner's pure core: fold commands and outcomes, emit work units and barrier units.

Rules (see docs/semantics.md):
- Seed = the oldest ready thing by global arrival. If it is a datum, the unit packs every ready
  datum of the same class (forward_only, loss_fn, canonical loss config) across all models, oldest
  first, under a token budget; a datum over the budget ships alone. A large request is split by
  the same rule. If it is an optim_step, every ready optim_step of every model joins one barrier
  unit; any other barrier runs alone.
- A window whose forward_backward failed is poisoned: its optim_step discards the accumulated
  gradients (never a partial step) and fails, saying what to resubmit.
- save_state with gradients pending is a user error; save_weights_for_sampler neither applies nor
  discards them.
- create_model takes the lowest free adapter slot; with none free it waits (queue_state
  "paused_capacity") until a model is unloaded.

Deterministic: the same commands and outcomes in the same order give the same units.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from libs.contracts.outcomes import BarrierOutcome, Outcome, WorkOutcome
from libs.contracts.requests import (
    CreateModel,
    ForwardBackward,
    LoadWeights,
    ModelCommand,
    OptimStep,
    Rejected,
    SaveForSampler,
    SaveWeights,
    UnloadModel,
)
from libs.contracts.results import DatumResult, Failure, ForwardBackwardResult, JsonResult, ResultBody
from libs.contracts.work import (
    BarrierUnit,
    DiscardSlot,
    ExportSlot,
    FailRequest,
    InitSlot,
    LoadSlot,
    ReleaseSlot,
    SaveSlot,
    SlotOp,
    StepSlot,
    Unit,
    UnitItem,
    WorkUnit,
)
from services.planner.streams import ModelStream, Pending

HANDOFF = "handoff"
"""OpOutcome.info key: the request's result will be published by another service (the publisher)."""


@dataclass(frozen=True)
class Completion:
    """A request the planner has finished; `body` None means another service publishes it."""

    pending: Pending
    model_id: str
    body: ResultBody | None


@dataclass
class Planner:
    num_slots: int
    token_budget: int = 16_384
    streams: dict[str, ModelStream] = field(default_factory=dict)
    slots: dict[int, str] = field(default_factory=dict)  # slot -> model_id
    units_emitted: int = 0
    _unit_members: dict[str, list[tuple[str, str, int]]] = field(default_factory=dict)

    # --- folding inputs -----------------------------------------------------------------------
    def on_command(self, command: ModelCommand, arrival: int, now_ns: int = 0) -> bool:
        stream = self.streams.get(command.model_id)
        if stream is None:
            stream = self.streams[command.model_id] = ModelStream(command.model_id)
        return stream.accept(command, arrival, now_ns)

    def on_outcome(self, outcome: Outcome) -> list[Completion]:
        if isinstance(outcome, WorkOutcome):
            self._fold_work(outcome)
        else:
            self._fold_barrier(outcome)
        self._unit_members.pop(outcome.unit_id, None)
        return self._collect_completions()

    def mark_emitted(self, unit: Unit) -> None:
        """Replay: a unit found in the work stream was already emitted; don't plan it again."""
        self.units_emitted = max(self.units_emitted, unit_number(unit.unit_id) + 1)
        if isinstance(unit, WorkUnit):
            for item in unit.items:
                pending = self._find(item.model_id, item.request_id)
                if pending is not None:
                    pending.issued = max(pending.issued, item.index + 1)
        else:
            for op in unit.ops:
                pending = self._find(op.model_id, op.request_id)
                if pending is not None:
                    pending.barrier_issued = True
                    self._apply_barrier_side_effects(op)

    # --- planning -----------------------------------------------------------------------------
    def plan(self) -> list[Unit]:
        """Every unit that can be emitted now, in emission order."""
        units: list[Unit] = []
        while (unit := self._next_unit()) is not None:
            units.append(unit)
        return units

    def collect(self) -> list[Completion]:
        """Requests that completed without a trainer (rejected seq_ids) or whose outcome arrived."""
        return self._collect_completions()

    def _next_unit(self) -> Unit | None:
        """Seed on the oldest ready datum or barrier; build the unit that seed calls for."""
        best_rows: Pending | None = None
        best_barrier: tuple[ModelStream, Pending] | None = None
        best_arrival: int | None = None
        for stream in self.streams.values():
            if stream.closed:
                continue
            for pending in stream.open_window():
                if pending.issued < pending.num_datums and (best_arrival is None or pending.arrival < best_arrival):
                    best_arrival, best_rows, best_barrier = pending.arrival, pending, None
            barrier = stream.ready_barrier()
            ready = barrier is not None and self._barrier_can_run(stream, barrier)
            if barrier is not None and ready and (best_arrival is None or barrier.arrival < best_arrival):
                best_arrival, best_rows, best_barrier = barrier.arrival, None, (stream, barrier)
        if best_rows is not None:
            return self._work_unit(best_rows)
        if best_barrier is not None:
            return self._barrier_unit(*best_barrier)
        return None

    def _barrier_can_run(self, stream: ModelStream, pending: Pending) -> bool:
        if isinstance(pending.command, CreateModel):
            return stream.slot is not None or self._free_slot() is not None
        return True

    def _free_slot(self) -> int | None:
        for slot in range(self.num_slots):
            if slot not in self.slots:
                return slot
        return None

    def _work_unit(self, seed: Pending) -> WorkUnit:
        command = seed.command
        assert isinstance(command, ForwardBackward)
        key = loss_class(command)
        rows: list[tuple[int, int, ModelStream, Pending]] = []
        for stream in self.streams.values():
            if stream.closed:
                continue
            for pending in stream.open_window():
                cmd = pending.command
                if isinstance(cmd, ForwardBackward) and loss_class(cmd) == key:
                    for index in range(pending.issued, pending.num_datums):
                        rows.append((pending.arrival, index, stream, pending))
        rows.sort(key=lambda row: (row[0], row[1]))
        items: list[UnitItem] = []
        tokens = 0
        for _, index, stream, pending in rows:
            if index != pending.issued:
                continue  # datums of one request are issued in order
            assert isinstance(pending.command, ForwardBackward) and stream.slot is not None
            datum = pending.command.data[index]
            if items and tokens + datum.num_tokens > self.token_budget:
                break
            items.append(UnitItem(stream.model_id, pending.command.request_id, index, stream.slot, datum))
            tokens += datum.num_tokens
            pending.issued += 1
        unit_id = self._next_unit_id()
        self._unit_members[unit_id] = [(i.model_id, i.request_id, i.index) for i in items]
        return WorkUnit(
            unit_id=unit_id,
            forward_only=command.forward_only,
            loss_fn=command.loss_fn,
            loss_config=command.loss_config,
            items=sorted(items, key=lambda i: (i.slot, i.request_id, i.index)),
            traceparent=command.traceparent,
        )

    def _barrier_unit(self, stream: ModelStream, head: Pending) -> BarrierUnit:
        ops: list[SlotOp] = [self._barrier_op(stream, head)]
        if isinstance(head.command, OptimStep):
            for other in self.streams.values():
                if other is stream or other.closed:
                    continue
                barrier = other.ready_barrier()
                if barrier is not None and isinstance(barrier.command, OptimStep):
                    ops.append(self._barrier_op(other, barrier))
        unit_id = self._next_unit_id()
        return BarrierUnit(unit_id=unit_id, ops=ops, traceparent=head.command.traceparent)

    def _barrier_op(self, stream: ModelStream, pending: Pending) -> SlotOp:
        """Decide what a barrier does, given the model's window state; marks it issued."""
        pending.barrier_issued = True
        cmd = pending.command
        rid, mid = cmd.request_id, stream.model_id
        op: SlotOp
        if isinstance(cmd, CreateModel):
            slot = self._free_slot() if stream.slot is None else stream.slot
            assert slot is not None
            op = InitSlot(model_id=mid, request_id=rid, slot=slot, lora=cmd.lora, restore=cmd.restore)
        elif stream.slot is None or not stream.created:
            op = FailRequest(model_id=mid, request_id=rid, error=f"model {mid} is not loaded")
        elif isinstance(cmd, OptimStep):
            if stream.poisoned:
                op = DiscardSlot(model_id=mid, request_id=rid, slot=stream.slot, reason=stream.poisoned)
            else:
                op = StepSlot(model_id=mid, request_id=rid, slot=stream.slot, adam=cmd.adam)
        elif isinstance(cmd, SaveWeights):
            if stream.pending_grads:
                op = FailRequest(
                    model_id=mid,
                    request_id=rid,
                    error="save_state while gradients are pending: call optim_step (or discard the "
                    "batch) first, then save_state again",
                )
            else:
                op = SaveSlot(
                    model_id=mid,
                    request_id=rid,
                    slot=stream.slot,
                    tinker_path=f"tinker://{mid}/weights/{cmd.name}",
                    tenant=stream.tenant,
                    ttl_s=cmd.ttl_s,
                    user_metadata=cmd.user_metadata,
                )
        elif isinstance(cmd, SaveForSampler):
            path = f"tinker://{mid}/sampler_weights/{cmd.name}" if cmd.name else None
            op = ExportSlot(
                model_id=mid,
                request_id=rid,
                slot=stream.slot,
                tinker_path=path,
                sampling_session_id=cmd.sampling_session_id,
                tenant=stream.tenant,
                ttl_s=cmd.ttl_s,
            )
        elif isinstance(cmd, LoadWeights):
            if stream.pending_grads:
                op = FailRequest(model_id=mid, request_id=rid, error="load_state while gradients are pending: call optim_step first")
            else:
                op = LoadSlot(model_id=mid, request_id=rid, slot=stream.slot, restore=cmd.restore)
        elif isinstance(cmd, UnloadModel):
            op = ReleaseSlot(model_id=mid, request_id=rid, slot=stream.slot)
        else:
            op = FailRequest(model_id=mid, request_id=rid, error=f"unsupported command {type(cmd).__name__}")
        self._apply_barrier_side_effects(op)
        return op

    def _apply_barrier_side_effects(self, op: SlotOp) -> None:
        """Book-keeping that must happen when a barrier is emitted (and again on replay)."""
        stream = self.streams.get(op.model_id)
        if stream is None:
            return
        if isinstance(op, InitSlot):
            stream.slot = op.slot
            self.slots[op.slot] = op.model_id
        elif isinstance(op, (StepSlot, DiscardSlot)):
            stream.pending_grads = False
            stream.poisoned = None
        elif isinstance(op, ReleaseSlot):
            self.slots.pop(op.slot, None)
            stream.closed = True

    def _next_unit_id(self) -> str:
        unit_id = f"u{self.units_emitted:012d}"
        self.units_emitted += 1
        return unit_id

    # --- outcomes -----------------------------------------------------------------------------
    def _fold_work(self, outcome: WorkOutcome) -> None:
        members = self._unit_members.get(outcome.unit_id)
        seen: set[tuple[str, int]] = set()
        for datum in outcome.datums:
            seen.add((datum.request_id, datum.index))
            pending, stream = self._find_with_stream(datum.request_id)
            if pending is None or stream is None:
                continue
            pending.done += 1
            if datum.error is not None or outcome.error is not None:
                pending.error = pending.error or datum.error or outcome.error
                pending.category = "user" if datum.error else "server"
                if not _forward_only(pending):
                    stream.poisoned = stream.poisoned or f"forward_backward seq_id {pending.command.seq_id} failed"
            else:
                pending.outputs[datum.index] = DatumResult(datum.logprobs, datum.loss)
                cmd = pending.command
                if isinstance(cmd, ForwardBackward) and not cmd.forward_only:
                    stream.pending_grads = True
        if outcome.error is not None and members:
            for _model_id, request_id, index in members:
                if (request_id, index) in seen:
                    continue
                pending, stream = self._find_with_stream(request_id)
                if pending is None or stream is None:
                    continue
                pending.done += 1
                pending.error = pending.error or outcome.error
                pending.category = "server"
                if not _forward_only(pending):
                    stream.poisoned = stream.poisoned or f"forward_backward seq_id {pending.command.seq_id} failed"

    def _fold_barrier(self, outcome: BarrierOutcome) -> None:
        for op in outcome.ops:
            pending, stream = self._find_with_stream(op.request_id)
            if pending is None or stream is None:
                continue
            pending.finished = True
            cmd = pending.command
            if isinstance(cmd, CreateModel):
                if op.ok:
                    stream.created = True
                else:
                    if stream.slot is not None:
                        self.slots.pop(stream.slot, None)
                    stream.slot = None
                    stream.closed = True
            if not op.ok:
                pending.error = op.error or "failed"
                pending.category = op.category
            pending.metrics, pending.info = dict(op.metrics), dict(op.info)

    def _collect_completions(self) -> list[Completion]:
        done: list[Completion] = []
        for stream in self.streams.values():
            if stream.closed:
                self._fail_unstarted(stream)
            for pending in stream.pop_completed():
                cmd = pending.command
                if isinstance(cmd, Rejected):
                    pending.error, pending.category = cmd.error, cmd.category
                    if pending.is_window:
                        # Popped at the head: its window's barrier has not been issued yet.
                        stream.poisoned = stream.poisoned or f"forward_backward seq_id {cmd.seq_id} was rejected"
                done.append(Completion(pending, stream.model_id, self._result_body(stream, pending)))
        return done

    @staticmethod
    def _fail_unstarted(stream: ModelStream) -> None:
        """A closed model runs nothing more: commands not yet handed to a trainer fail."""
        for pending in stream.queue:
            if pending.issued == 0 and not pending.barrier_issued and not pending.complete:
                pending.error = pending.error or f"model {stream.model_id} is closed (unloaded or failed to start)"
                pending.done = pending.num_datums
                pending.finished = True

    def _result_body(self, stream: ModelStream, pending: Pending) -> ResultBody | None:
        if pending.error is not None:
            return Failure(error=pending.error, category=pending.category)
        cmd = pending.command
        metrics, info = pending.metrics, pending.info
        if isinstance(cmd, ForwardBackward):
            outputs = [o for o in pending.outputs if o is not None]
            return ForwardBackwardResult(outputs=outputs, metrics={"loss:sum": float(sum(o.loss for o in outputs))})
        if info.get(HANDOFF):
            return None
        if isinstance(cmd, CreateModel):
            return JsonResult(body={"model_id": stream.model_id, "type": "create_model"})
        if isinstance(cmd, OptimStep):
            return JsonResult(body={"metrics": dict(metrics), "type": "optim_step"})
        if isinstance(cmd, LoadWeights):
            return JsonResult(body={"path": cmd.restore.tinker_path, "type": "load_weights"})
        if isinstance(cmd, UnloadModel):
            return JsonResult(body={"model_id": stream.model_id, "type": "unload_model"})
        return JsonResult(body={k: v for k, v in info.items()})

    def unit_traces(self, unit: Unit) -> list[str]:
        """The trace contexts of every request a unit serves (a packed unit serves many traces)."""
        traces: list[str] = []
        requests = (
            [(i.model_id, i.request_id) for i in unit.items] if isinstance(unit, WorkUnit) else [(op.model_id, op.request_id) for op in unit.ops]
        )
        for model_id, request_id in dict.fromkeys(requests):
            pending = self._find(model_id, request_id)
            if pending is not None and pending.command.traceparent and pending.command.traceparent not in traces:
                traces.append(pending.command.traceparent)
        return traces

    # --- lookup -------------------------------------------------------------------------------
    def _find(self, model_id: str, request_id: str) -> Pending | None:
        stream = self.streams.get(model_id)
        if stream is None:
            return None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending
        return None

    def _find_with_stream(self, request_id: str) -> tuple[Pending | None, ModelStream | None]:
        model_id = model_of_request(request_id)
        stream = self.streams.get(model_id)
        if stream is None:
            return None, None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending, stream
        return None, stream


def _forward_only(pending: Pending) -> bool:
    return isinstance(pending.command, ForwardBackward) and pending.command.forward_only


def model_of_request(request_id: str) -> str:
    """Request ids are `{model_id}:{seq_id}` (deterministic from the SDK's own coordinates)."""
    return request_id.rsplit(":", 1)[0]


def unit_number(unit_id: str) -> int:
    return int(unit_id.lstrip("u"))


def loss_class(command: ForwardBackward) -> tuple[object, ...]:
    """Datums may share a unit only when this key is equal."""
    config = tuple(sorted((k, msgspec.json.encode(v)) for k, v in command.loss_config.items()))
    return (command.forward_only, command.loss_fn, config)
