"""The planner's pure core: fold commands and outcomes, emit work units and barrier units.

Rules (see docs/semantics.md):
- Seed = the oldest ready thing by global arrival. If it is a datum, the unit packs every ready
  datum of the same class (forward_only, loss_fn, canonical loss config) across all models, oldest
  first, under a token budget; a datum over the budget ships alone. A large request is split by
  the same rule. If it is an optim_step, every ready optim_step of every model joins one barrier
  unit; any other barrier runs alone.
- A window whose forward_backward failed (or was rejected, or whose seq_id was sealed) is
  poisoned: its optim_step discards the accumulated gradients (never a partial step) and fails,
  saying what to resubmit.
- save_state (and load_state) with gradients pending is a user error; save_weights_for_sampler
  neither applies nor discards them.
- create_model takes the lowest free adapter slot; with none free it waits (queue_state
  "paused_capacity") until a model is unloaded.
- Every sequenced request completes exactly once: a closed model (failed create, unloaded) fails
  whatever it can no longer run.

Deterministic: the same commands and outcomes in the same order give the same units, and a fresh
planner that folds every command, then `mark_emitted` for every unit already emitted, then every
outcome, plans the same next units as the planner that saw them interleaved.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
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

PAUSED_CAPACITY = "paused_capacity"

SAVE_WITH_PENDING_GRADS = (
    "save_state while gradients are pending: forward_backward ran since the last optim_step; "
    "call optim_step first, then save_state again"
)
LOAD_WITH_PENDING_GRADS = (
    "load_state while gradients are pending: forward_backward ran since the last optim_step; "
    "call optim_step first, then load_state again"
)

Member = tuple[str, str, int]
"""(model_id, request_id, datum index) of a unit's item; index -1 for a barrier op."""


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
    _inflight: dict[str, list[Member]] = field(default_factory=dict)  # emitted, outcome not folded
    # Replay: units already emitted for requests not folded yet (the request stream is replayed
    # only up to its ack floor): request_id -> (datums issued, barrier issued).
    _premarked: dict[str, tuple[int, bool]] = field(default_factory=dict)
    # ...and outcomes of such units that arrived before those requests did (folded once they have).
    _deferred: dict[str, Outcome] = field(default_factory=dict)

    # --- folding inputs -----------------------------------------------------------------------
    def on_command(self, command: ModelCommand, arrival: int, now_ns: int = 0) -> bool:
        """Sequence a command; False if its seq_id was already seen (a duplicate has no effect)."""
        sequenced = self._stream(command.model_id).accept(command, arrival, now_ns)
        if sequenced is None:
            return False
        for pending in sequenced:
            mark = self._premarked.pop(pending.command.request_id, None)
            if mark is not None:
                pending.issued = max(pending.issued, mark[0])
                pending.barrier_issued = pending.barrier_issued or mark[1]
        for unit_id, outcome in list(self._deferred.items()):
            if not self._awaits_requests(unit_id):
                del self._deferred[unit_id]
                self._fold(outcome)  # its completions are picked up by the next collect()
        return True

    def on_outcome(self, outcome: Outcome) -> list[Completion]:
        """Fold a trainer outcome; an outcome for a unit already folded (a redelivery) has no effect."""
        if self._awaits_requests(outcome.unit_id):
            self._deferred[outcome.unit_id] = outcome  # replay: its requests are redelivered later
            return []
        self._fold(outcome)
        return self._collect_completions()

    def _awaits_requests(self, unit_id: str) -> bool:
        members = self._inflight.get(unit_id)
        return bool(self._premarked) and members is not None and any(m[1] in self._premarked for m in members)

    def _fold(self, outcome: Outcome) -> None:
        members = self._inflight.pop(outcome.unit_id, None)
        if members is None:
            return
        if isinstance(outcome, WorkOutcome):
            self._fold_work(outcome, members)
        else:
            self._fold_barrier(outcome, members)

    def mark_emitted(self, unit: Unit) -> None:
        """Replay: a unit found in the work stream was already emitted; don't plan it again."""
        if unit_number(unit.unit_id) < self.units_emitted:
            return  # seen already
        self.units_emitted = unit_number(unit.unit_id) + 1
        if isinstance(unit, WorkUnit):
            self._inflight[unit.unit_id] = [(i.model_id, i.request_id, i.index) for i in unit.items]
            for item in unit.items:
                pending = self._find(item.model_id, item.request_id)
                if pending is not None:
                    pending.issued = max(pending.issued, item.index + 1)
                else:
                    issued, barrier = self._premarked.get(item.request_id, (0, False))
                    self._premarked[item.request_id] = (max(issued, item.index + 1), barrier)
            return
        self._inflight[unit.unit_id] = [(op.model_id, op.request_id, -1) for op in unit.ops]
        for op in unit.ops:
            self._stream(op.model_id)
            pending = self._find(op.model_id, op.request_id)
            if pending is not None:
                pending.barrier_issued = True
            else:
                self._premarked[op.request_id] = (0, True)
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

    def waiting_for_capacity(self) -> list[str]:
        """Request ids of create_models that wait for a free adapter slot (queue_state paused_capacity)."""
        waiting = []
        for stream in self.streams.values():
            head = None if stream.closed else stream.ready_barrier()
            if isinstance(head, Pending) and not self._barrier_can_run(stream, head):
                waiting.append(head.command.request_id)
        return sorted(waiting)

    def _next_unit(self) -> Unit | None:
        """Seed on the oldest ready datum or barrier; build the unit that seed calls for."""
        best_rows: Pending | None = None
        best_barrier: tuple[ModelStream, Pending] | None = None
        best_arrival: int | None = None
        for stream in self.streams.values():
            if stream.closed:
                continue
            for pending in stream.open_window():
                if pending.issued < pending.num_datums and (
                    best_arrival is None or pending.arrival < best_arrival
                ):
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
            assert isinstance(pending.command, ForwardBackward) and stream.slot is not None
            datum = pending.command.data[index]
            if items and tokens + datum.num_tokens > self.token_budget:
                break  # strictly oldest first: nothing younger jumps over a datum that did not fit
            items.append(UnitItem(stream.model_id, pending.command.request_id, index, stream.slot, datum))
            tokens += datum.num_tokens
            pending.issued += 1
        unit_id = self._next_unit_id()
        self._inflight[unit_id] = [(i.model_id, i.request_id, i.index) for i in items]
        return WorkUnit(
            unit_id=unit_id,
            forward_only=command.forward_only,
            loss_fn=command.loss_fn,
            loss_config=command.loss_config,
            items=sorted(items, key=lambda i: (i.slot, i.request_id, i.index)),
            traceparent=command.traceparent,
        )

    def _barrier_unit(self, stream: ModelStream, head: Pending) -> BarrierUnit:
        chosen = [(stream, head)]
        if isinstance(head.command, OptimStep):
            for other in self.streams.values():
                if other is stream or other.closed:
                    continue
                barrier = other.ready_barrier()
                if barrier is not None and isinstance(barrier.command, OptimStep):
                    chosen.append((other, barrier))
        chosen.sort(key=lambda pair: pair[1].arrival)  # independent of stream insertion order
        ops = [self._barrier_op(s, p) for s, p in chosen]
        unit_id = self._next_unit_id()
        self._inflight[unit_id] = [(op.model_id, op.request_id, -1) for op in ops]
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
            poison = stream.poison.get(pending.window)
            if poison is not None:
                reason = f"the gradient window before optim_step seq_id {cmd.seq_id} is incomplete ({poison})"
                op = DiscardSlot(model_id=mid, request_id=rid, slot=stream.slot, reason=reason)
            else:
                op = StepSlot(model_id=mid, request_id=rid, slot=stream.slot, adam=cmd.adam)
        elif isinstance(cmd, SaveWeights):
            if pending.window in stream.dirty:
                op = FailRequest(model_id=mid, request_id=rid, error=SAVE_WITH_PENDING_GRADS)
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
            segment = "external_weights" if cmd.external else "sampler_weights"
            path = f"tinker://{mid}/{segment}/{cmd.name}" if cmd.name else None
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
            if pending.window in stream.dirty:
                op = FailRequest(model_id=mid, request_id=rid, error=LOAD_WITH_PENDING_GRADS)
            else:
                op = LoadSlot(model_id=mid, request_id=rid, slot=stream.slot, restore=cmd.restore)
        elif isinstance(cmd, UnloadModel):
            op = ReleaseSlot(model_id=mid, request_id=rid, slot=stream.slot)
        else:
            op = FailRequest(
                model_id=mid,
                request_id=rid,
                error=f"unsupported command {type(cmd).__name__}",
                category="server",
            )
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
            stream.consume_window()
        elif isinstance(op, ReleaseSlot):
            self._free(stream)
            stream.close("was unloaded")

    def _free(self, stream: ModelStream) -> None:
        """Give the stream's slot back (only if it still holds it: replay folds outcomes late)."""
        if stream.slot is not None and self.slots.get(stream.slot) == stream.model_id:
            del self.slots[stream.slot]
        stream.slot = None

    def _next_unit_id(self) -> str:
        unit_id = f"u{self.units_emitted:012d}"
        self.units_emitted += 1
        return unit_id

    # --- outcomes -----------------------------------------------------------------------------
    def _fold_work(self, outcome: WorkOutcome, members: list[Member]) -> None:
        """Every member datum gets exactly one result: its own, or the unit's failure."""
        by_key: dict[tuple[str, int], DatumOutcome] = {}
        for got in outcome.datums:
            by_key.setdefault((got.request_id, got.index), got)
        for _model_id, request_id, index in members:
            pending, stream = self._find_with_stream(request_id)
            if pending is None or stream is None or index >= pending.num_datums:
                continue
            pending.done += 1
            datum = by_key.get((request_id, index))
            if datum is None or datum.error is not None or outcome.error is not None:
                if datum is not None and datum.error is not None:
                    error, category = datum.error, "user"
                else:
                    error = outcome.error or f"the trainer returned no result for data[{index}]"
                    category = "server"
                if pending.error is None:
                    pending.error, pending.category = error, category
                if pending.trains:
                    stream.poison_window(
                        pending.window, f"forward_backward seq_id {pending.command.seq_id} failed"
                    )
            else:
                pending.outputs[index] = DatumResult(datum.logprobs, datum.loss)
                if pending.trains:
                    stream.mark_dirty(pending.window)

    def _fold_barrier(self, outcome: BarrierOutcome, members: list[Member]) -> None:
        by_request: dict[str, OpOutcome] = {}
        for op in outcome.ops:
            by_request.setdefault(op.request_id, op)
        for model_id, request_id, _ in members:
            pending, stream = self._find_with_stream(request_id)
            if pending is None or stream is None or pending.finished:
                continue
            op = by_request.get(request_id) or OpOutcome(
                model_id=model_id,
                request_id=request_id,
                ok=False,
                error="the trainer returned no outcome for this request",
                category="server",
            )
            pending.finished = True
            if isinstance(pending.command, CreateModel):
                if op.ok:
                    stream.created = True
                else:
                    self._free(stream)
                    stream.close(f"failed to start ({op.error or 'failed'})")
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
                done.append(Completion(pending, stream.model_id, self._result_body(stream, pending)))
        return done

    @staticmethod
    def _fail_unstarted(stream: ModelStream) -> None:
        """A closed model runs nothing more: whatever was not handed to a trainer fails now
        (what was handed over completes through its outcome)."""
        error = (
            f"model {stream.model_id} {stream.closed_reason}; this request did not run. "
            "Create a new model (or load a checkpoint into one) and resubmit."
        )
        for pending in stream.queue:
            if pending.complete:
                continue
            if pending.is_window and pending.issued < pending.num_datums:
                pending.done += pending.num_datums - pending.issued
                pending.issued = pending.num_datums
                pending.error = pending.error or error
            elif not pending.is_window and not pending.barrier_issued:
                pending.barrier_issued = pending.finished = True
                pending.error = pending.error or error

    def _result_body(self, stream: ModelStream, pending: Pending) -> ResultBody | None:
        if pending.error is not None:
            return Failure(error=pending.error, category=pending.category)
        cmd = pending.command
        metrics, info = pending.metrics, pending.info
        if isinstance(cmd, ForwardBackward):
            outputs = [o for o in pending.outputs if o is not None]
            return ForwardBackwardResult(
                outputs=outputs, metrics={"loss:sum": float(sum(o.loss for o in outputs))}
            )
        if info.get(HANDOFF):
            return None
        if isinstance(cmd, CreateModel) and cmd.restore is not None:  # create mode of load_weights
            path = cmd.restore.tinker_path
            return JsonResult(body={"model_id": stream.model_id, "path": path, "type": "load_weights"})
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
            [(i.model_id, i.request_id) for i in unit.items]
            if isinstance(unit, WorkUnit)
            else [(op.model_id, op.request_id) for op in unit.ops]
        )
        for model_id, request_id in dict.fromkeys(requests):
            pending = self._find(model_id, request_id)
            if (
                pending is not None
                and pending.command.traceparent
                and pending.command.traceparent not in traces
            ):
                traces.append(pending.command.traceparent)
        return traces

    # --- lookup -------------------------------------------------------------------------------
    def _stream(self, model_id: str) -> ModelStream:
        stream = self.streams.get(model_id)
        if stream is None:
            stream = self.streams[model_id] = ModelStream(model_id)
        return stream

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


def model_of_request(request_id: str) -> str:
    """Request ids are `{model_id}:{seq_id}` (deterministic from the SDK's own coordinates)."""
    return request_id.rsplit(":", 1)[0]


def unit_number(unit_id: str) -> int:
    return int(unit_id.lstrip("u"))


def loss_class(command: ForwardBackward) -> tuple[object, ...]:
    """Datums may share a unit only when this key is equal."""
    config = tuple(
        sorted(
            (k, v if isinstance(v, str) else msgspec.json.encode(float(v)))
            for k, v in command.loss_config.items()
        )
    )
    return (command.forward_only, command.loss_fn, config)
