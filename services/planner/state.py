"""What the planner knows, and the one function that changes it: `evolve(state, fact)`.

`PlannerState` is a fold of facts (facts.py) and nothing else: no trainer groups, no limits, no
clock but the `now_ns` a command carries. It is encoded as the planner's snapshot. `evolve` is its
only writer, for the live path and a replay alike; what it returns says which requests the fact
finished (completions.py renders their results) and which models it touched.

Why a replay that folds every command, then every unit, then every outcome reaches the live
state: every fact kept about a gradient window is fixed when its command is sequenced
(streams.py), and a unit's side effects on residency (slots, paged, group) are applied when the
unit is emitted, not when its outcome comes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from libs.contracts.ids import owner_of_request, page_request_id
from libs.contracts.outcomes import BarrierOutcome, DatumOutcome, OpOutcome, Outcome, WorkOutcome
from libs.contracts.requests import CreateModel, Rejected
from libs.contracts.results import DatumResult
from libs.contracts.work import (
    AdoptSlot,
    BarrierUnit,
    DiscardSlot,
    DropPaged,
    InitSlot,
    PageIn,
    PageOut,
    ReleaseSlot,
    SlotOp,
    StepSlot,
    Unit,
    WorkUnit,
)
from services.planner.completions import Completion
from services.planner.facts import (
    DEFAULT_GROUP,
    CommandArrived,
    Fact,
    Member,
    OutcomeArrived,
    UnitEmitted,
    unit_id,
    unit_number,
)
from services.planner.streams import ModelStream, Pending

LOST_STATE = "lost its training state"
"""How a model's close reason starts when its state could not be moved or rebuilt."""


@dataclass
class PlannerState:
    """Everything the planner knows: a fold of facts, encoded as its snapshot.

    Snapshots written when the state also held `num_slots`, `token_budget` and
    `max_units_in_flight` still restore: the decoder ignores fields it does not know.
    """

    streams: dict[str, ModelStream] = field(default_factory=dict)
    slots: dict[str, dict[int, str]] = field(default_factory=dict)  # group -> slot -> model_id
    units_emitted: int = 0
    inflight: dict[str, list[Member]] = field(default_factory=dict)  # emitted, outcome not folded
    inflight_group: dict[str, str] = field(default_factory=dict)  # unit_id -> its group, likewise
    inflight_ops: dict[str, list[SlotOp]] = field(default_factory=dict)  # barrier unit_id -> its ops, likewise

    def __post_init__(self) -> None:
        # Models with commands queued or buffered: the only ones a decision looks at, so its cost
        # does not grow with idle models. Derived from the state (not a field: never encoded).
        self.active: dict[str, None] = {
            m: None for m, stream in self.streams.items() if stream.queue or stream.buffered
        }

    # --- reads --------------------------------------------------------------------------------
    def active_streams(self) -> list[ModelStream]:
        return [self.streams[m] for m in list(self.active)]

    def next_unit_id(self) -> str:
        return unit_id(self.units_emitted)

    def busy_models(self) -> set[str]:
        """Models with a unit in flight (emitted, outcome not folded): never paged out."""
        return {model_id for members in self.inflight.values() for model_id, _, _ in members}

    def find(self, model_id: str, request_id: str) -> Pending | None:
        stream = self.streams.get(model_id)
        if stream is None:
            return None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending
        return None

    def find_with_stream(self, request_id: str) -> tuple[Pending | None, ModelStream | None]:
        stream = self.streams.get(owner_of_request(request_id))
        if stream is None:
            return None, None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending, stream
        return None, stream

    def unit_traces(self, unit: Unit) -> list[str]:
        """The trace contexts of every request a unit serves (a packed unit serves many traces)."""
        traces: list[str] = []
        requests = (
            [(i.model_id, i.request_id) for i in unit.items]
            if isinstance(unit, WorkUnit)
            else [(op.model_id, op.request_id) for op in unit.ops]
        )
        for model_id, request_id in dict.fromkeys(requests):
            pending = self.find(model_id, request_id)
            if pending is not None and pending.command.traceparent and pending.command.traceparent not in traces:
                traces.append(pending.command.traceparent)
        return traces


@dataclass
class Change:
    """What one fact did: the requests it finished (in seq_id order per model), the models whose
    summary may have changed."""

    completed: list[Completion] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)


def evolve(state: PlannerState, fact: Fact) -> Change | None:
    """Fold one fact; None if it had no effect (a duplicate command, a unit seen before, an
    outcome of a unit already folded or abandoned)."""
    change = Change()
    match fact:
        case CommandArrived(command=command, arrival=arrival, now_ns=now):
            changed = _stream(state, command.model_id).accept(command, arrival, now) is not None
            state.active[command.model_id] = None
        case UnitEmitted(unit=unit):
            changed = _apply_unit(state, unit, change)
        case OutcomeArrived(outcome=outcome):
            changed = _apply_outcome(state, outcome)
    if not changed:
        return None
    _settle(state, change)
    return change


# --- units ------------------------------------------------------------------------------------
def _apply_unit(state: PlannerState, unit: Unit, change: Change) -> bool:
    number = unit_number(unit.unit_id)
    if number < state.units_emitted:
        return False  # seen already
    state.units_emitted = number + 1
    models = [i.model_id for i in unit.items] if isinstance(unit, WorkUnit) else [op.model_id for op in unit.ops]
    for model_id in models:
        _stream(state, model_id).last_used = number
        change.touched.add(model_id)
    state.inflight_group[unit.unit_id] = unit.group or DEFAULT_GROUP
    match unit:
        case WorkUnit(items=items):
            state.inflight[unit.unit_id] = [(i.model_id, i.request_id, i.index) for i in items]
            for item in items:
                pending = state.find(item.model_id, item.request_id)
                if pending is not None:
                    pending.issued = max(pending.issued, item.index + 1)
        case BarrierUnit(ops=ops):
            reissued = _abandon(state, ops)
            state.inflight[unit.unit_id] = [(op.model_id, op.request_id, -1) for op in ops]
            state.inflight_ops[unit.unit_id] = list(ops)
            for op in ops:
                _stream(state, op.model_id)
                pending = state.find(op.model_id, op.request_id)
                if pending is not None:
                    pending.barrier_issued = True
                if isinstance(op, AdoptSlot) or (op.model_id, op.request_id) not in reissued:
                    _barrier_side_effects(state, op, unit.group)
    return True


def _abandon(state: PlannerState, ops: list[SlotOp]) -> set[tuple[str, str]]:
    """A takeover's units (`AdoptSlot.abandoned`) stop counting: their outcomes, if any come,
    are ignored; their datums go back to the queue to be planned again; their barrier ops are
    re-issued in the takeover unit itself (returned: their side effects happened already)."""
    reissued: set[tuple[str, str]] = set()
    for abandoned in dict.fromkeys(u for op in ops if isinstance(op, AdoptSlot) for u in op.abandoned):
        members = state.inflight.pop(abandoned, None)
        state.inflight_group.pop(abandoned, None)
        state.inflight_ops.pop(abandoned, None)
        for model_id, request_id, index in members or []:
            if index < 0:
                reissued.add((model_id, request_id))
                continue
            pending = state.find(model_id, request_id)
            if pending is not None:
                pending.issued = min(pending.issued, index)
    return reissued


def _barrier_side_effects(state: PlannerState, op: SlotOp, group: str) -> None:
    """What emitting a barrier op does to the state (live and on replay alike)."""
    stream = state.streams.get(op.model_id)
    if stream is None:
        return
    match op:
        case InitSlot() | PageIn():
            stream.slot, stream.paged, stream.group = op.slot, False, group
            state.slots.setdefault(group, {})[op.slot] = op.model_id
        case AdoptSlot(from_group=lost):
            held = state.slots.get(lost, {})
            if stream.slot is not None and held.get(stream.slot) == stream.model_id:
                del held[stream.slot]  # the lost group's slot is free for it when it is back
            stream.slot, stream.paged, stream.group, stream.page_file = op.slot, False, group, ""
            state.slots.setdefault(group, {})[op.slot] = op.model_id
        case PageOut():
            _free(state, stream)
            stream.paged, stream.page_file = True, op.export
        case StepSlot() | DiscardSlot():
            stream.consume_window()
        case ReleaseSlot():
            _free(state, stream)
            stream.close("was unloaded")
        case DropPaged():
            stream.paged = False
            stream.close("was unloaded")


def _free(state: PlannerState, stream: ModelStream) -> None:
    """Give the stream's slot back (only if it still holds it: replay folds outcomes late). A
    stream that holds a slot was placed, so its own `group` names where."""
    held = state.slots.get(stream.group, {})
    if stream.slot is not None and held.get(stream.slot) == stream.model_id:
        del held[stream.slot]
    stream.slot = None


# --- outcomes ---------------------------------------------------------------------------------
def _apply_outcome(state: PlannerState, outcome: Outcome) -> bool:
    members = state.inflight.pop(outcome.unit_id, None)
    state.inflight_group.pop(outcome.unit_id, None)
    ops = state.inflight_ops.pop(outcome.unit_id, None) or []
    if members is None:
        return False  # a redelivery of an outcome already folded, or of an abandoned unit
    match outcome:
        case WorkOutcome():
            _fold_work(state, outcome, members)
        case BarrierOutcome():
            _fold_adoptions(state, outcome, ops)
            _fold_barrier(state, outcome, members)
    return True


def _fold_work(state: PlannerState, outcome: WorkOutcome, members: list[Member]) -> None:
    """Every member datum gets exactly one result: its own, or the unit's failure."""
    by_key: dict[tuple[str, int], DatumOutcome] = {}
    for got in outcome.datums:
        by_key.setdefault((got.request_id, got.index), got)
    for _model_id, request_id, index in members:
        pending, stream = state.find_with_stream(request_id)
        if pending is None or stream is None or index >= pending.num_datums:
            continue
        pending.done += 1
        datum = by_key.get((request_id, index))
        if datum is None or datum.error is not None or outcome.error is not None:
            if stream.closed_reason.startswith(LOST_STATE):  # say why, not the empty slot's symptom
                error, category = f"model {stream.model_id} {stream.closed_reason}; this request did not run", "server"
            elif datum is not None and datum.error is not None:
                error, category = datum.error, "user"
            else:
                error = outcome.error or f"the trainer returned no result for data[{index}]"
                category = "server"
            if pending.error is None:
                pending.error, pending.category = error, category
            if pending.trains:
                stream.poison_window(pending.window, f"forward_backward seq_id {pending.command.seq_id} failed")
        else:
            pending.outputs[index] = DatumResult(datum.logprobs, datum.loss, datum.k, datum.metrics)
            if pending.trains:
                stream.mark_dirty(pending.window)


def _fold_adoptions(state: PlannerState, outcome: BarrierOutcome, ops: list[SlotOp]) -> None:
    """A model whose state did not move (a takeover that could not rebuild it, a page-out or a
    page-in that failed) holds no usable slot: it is closed, and what it has queued fails, saying
    why, instead of running on a slot that does not hold it."""
    failed = {o.model_id: o for o in outcome.ops if not o.ok and o.request_id == page_request_id(o.model_id)}
    for op in ops:
        stream = state.streams.get(op.model_id)
        if not isinstance(op, (AdoptSlot, PageIn, PageOut)) or stream is None:
            continue
        if (got := failed.get(op.model_id)) is None:
            continue
        error = got.error or "failed"
        if isinstance(op, AdoptSlot):
            reason = (
                f"{LOST_STATE}: trainer group {op.from_group} was lost and the state could "
                f"not be rebuilt from its files ({error})"
            )
        elif isinstance(op, PageIn):
            reason = f"{LOST_STATE}: it could not be paged in on trainer group {stream.group} ({error})"
        else:
            reason = f"{LOST_STATE}: it could not be paged out of trainer group {stream.group} ({error})"
        if stream.slot == op.slot:
            _free(state, stream)
        stream.paged = False
        stream.close(reason)
        state.active[stream.model_id] = None


def _fold_barrier(state: PlannerState, outcome: BarrierOutcome, members: list[Member]) -> None:
    by_request: dict[str, OpOutcome] = {}
    for op in outcome.ops:
        by_request.setdefault(op.request_id, op)
    for model_id, request_id, _ in members:
        pending, stream = state.find_with_stream(request_id)
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
                _free(state, stream)
                stream.close(f"failed to start ({op.error or 'failed'})")
        if not op.ok:
            pending.error = op.error or "failed"
            pending.category = op.category
        pending.metrics, pending.info = dict(op.metrics), dict(op.info)


# --- after every fact -------------------------------------------------------------------------
def _settle(state: PlannerState, change: Change) -> None:
    """A closed model fails what it can no longer run, and finished requests leave their queues,
    in seq_id order."""
    for stream in state.active_streams():
        change.touched.add(stream.model_id)
        if stream.closed:
            _fail_unstarted(stream)
        for pending in stream.pop_completed():
            cmd = pending.command
            if isinstance(cmd, Rejected):
                pending.error, pending.category = cmd.error, cmd.category
            change.completed.append(Completion(pending, stream.model_id))
        if not stream.queue and not stream.buffered:
            del state.active[stream.model_id]


def _fail_unstarted(stream: ModelStream) -> None:
    """A closed model runs nothing more: whatever was not handed to a trainer fails now (what was
    handed over completes through its outcome)."""
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


def _stream(state: PlannerState, model_id: str) -> ModelStream:
    stream = state.streams.get(model_id)
    if stream is None:
        stream = state.streams[model_id] = ModelStream(model_id)
    return stream
