"""The planner's pure core: a fold of commands, emitted units and outcomes, and a decision.

The planner's whole state (`PlannerState`) is a fold of three facts, `CommandArrived`,
`UnitEmitted` and `OutcomeArrived`, through one function, `Planner.apply`. The live service and a
replay after a restart call the same `apply`: the live path decides a unit (`Planner.decide`, pure:
it reads the state and changes nothing), appends it to the work stream and applies its
`UnitEmitted`; a replay applies every command, then every unit, then every outcome found in the
streams, up to their last sequence. Both reach the same state, because every fact the state keeps
about a window is fixed when its command is sequenced (see streams.py), not by the order in which
outcomes are folded. A snapshot (`Planner.snapshot`) is that state at known stream positions, so
a restart replays only what came after it.

Rules (see docs/semantics.md):
- Seed = the oldest ready thing by global arrival. If it is a datum, the unit packs every ready
  datum of the same class (forward_only, loss_fn, canonical loss config) across all models, oldest
  first, under a token budget; a datum over the budget ships alone. A large request is split by
  the same rule. If it is an optim_step, every ready optim_step of every model joins one barrier
  unit; any other barrier runs alone.
- A window whose forward_backward failed (or was rejected, or whose seq_id was sealed) is
  poisoned: its optim_step discards the accumulated gradients (never a partial step) and fails,
  saying what to resubmit.
- save_state and save_weights_for_sampler with gradients pending save the current weights (and
  optimizer state) and neither apply nor discard the gradients: the next optim_step steps the
  whole window. load_state with gradients pending is a user error (the gradients belong to the
  weights it would replace).
- Residency: a model holds an adapter slot only while it needs one. A create, or the next command
  of a paged-out model, takes the lowest free slot; with none free, the barrier that gives it a
  slot first pages out the least recently used resident model with nothing in flight (idle ones
  before ones with queued work), whose complete training state the trainer keeps. With every slot
  held by a model with work in flight it waits (queue_state "paused_capacity").
- Trainer groups: each group serves one base model with its own slots; a model is placed on one
  group (its create goes to the live group of its base with a free slot and the least load, see
  `_placement`) and every unit names its group. With more than one group for a base, each
  page-out also exports the state to a file under the data directory, so the model may page in
  on another group (a free slot there before a page-out at home); a group whose trainer stopped
  reporting is not placed on, its models whose state is exported move to live groups, and its
  resident models with work are taken over by a live group (`_takeover_unit`: a unit of
  `AdoptSlot` ops that names the lost group's units it abandons, so a replay needs no clock).
- Every sequenced request completes exactly once: a closed model (failed create, unloaded) fails
  whatever it can no longer run.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import msgspec

from libs.contracts.ids import HANDOFF, owner_of_request, page_request_id, tinker_path, token
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
from libs.contracts.results import (
    CreateModelResponse,
    DatumResult,
    Failure,
    ForwardBackwardResult,
    LoadWeightsResponse,
    OptimStepResponse,
    ResultBody,
    UnloadModelResponse,
)
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
    UnitItem,
    WorkUnit,
)
from services.planner.streams import ModelStream, Pending

PAUSED_CAPACITY = "paused_capacity"
DEFAULT_GROUP = "default"

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


# --- facts ------------------------------------------------------------------------------------
class CommandArrived(msgspec.Struct, frozen=True, tag="command"):
    """A command read from the request stream at `arrival` (its stream sequence)."""

    command: ModelCommand
    arrival: int
    now_ns: int = 0  # when it was read: starts a gap's timeout


class UnitEmitted(msgspec.Struct, frozen=True, tag="unit"):
    """A unit appended to the work stream (decided by this planner, or found there on replay)."""

    unit: Unit


class OutcomeArrived(msgspec.Struct, frozen=True, tag="outcome"):
    """A trainer's outcome of a unit, read from the outcome stream."""

    outcome: Outcome


Fact = CommandArrived | UnitEmitted | OutcomeArrived


@dataclass
class GroupInfo:
    """A trainer group as its trainers report it (an input of decisions, not part of the fold)."""

    num_slots: int
    base_model: str = ""  # "" serves any base model (a planner not told otherwise)
    live: bool = True  # its trainer reported recently


@dataclass
class PlannerState:
    """Everything the planner knows: a fold of facts, encodable as a snapshot."""

    num_slots: int
    token_budget: int = 16_384
    max_units_in_flight: int = 0  # 0: no limit
    streams: dict[str, ModelStream] = field(default_factory=dict)
    slots: dict[str, dict[int, str]] = field(default_factory=dict)  # group -> slot -> model_id
    units_emitted: int = 0
    inflight: dict[str, list[Member]] = field(default_factory=dict)  # emitted, outcome not folded
    inflight_group: dict[str, str] = field(default_factory=dict)  # unit_id -> its group, likewise
    inflight_ops: dict[str, list[SlotOp]] = field(default_factory=dict)  # barrier unit_id -> its ops, likewise


class Planner:
    """The fold (`apply`), the decision (`decide`) and what the service reads off the state."""

    def __init__(
        self,
        num_slots: int,
        token_budget: int = 16_384,
        state: PlannerState | None = None,
        max_units_in_flight: int = 0,
    ) -> None:
        self.state = state or PlannerState(
            num_slots=num_slots, token_budget=token_budget, max_units_in_flight=max_units_in_flight
        )
        # The trainer groups decisions may use (from their heartbeats); one default group else.
        self.groups: dict[str, GroupInfo] = {DEFAULT_GROUP: GroupInfo(self.state.num_slots)}
        self._outbox: list[Completion] = []  # finished requests not collected yet
        # Models with commands queued or buffered: the only ones a decision looks at, so its
        # cost does not grow with idle models (derived from the state, never encoded).
        self._active: dict[str, None] = {
            m: None for m, stream in self.state.streams.items() if stream.queue or stream.buffered
        }
        self._touched: set[str] = set()  # models whose summary may have changed (changed_models)

    @property
    def streams(self) -> dict[str, ModelStream]:
        return self.state.streams

    # --- the fold -----------------------------------------------------------------------------
    def apply(self, fact: Fact) -> bool:
        """Fold one fact; False if it had no effect (a duplicate command, a unit seen before, an
        outcome of a unit already folded). Requests it finished are queued for `collect`."""
        match fact:
            case CommandArrived(command=command, arrival=arrival, now_ns=now):
                changed = self._stream(command.model_id).accept(command, arrival, now) is not None
                self._active[command.model_id] = None
            case UnitEmitted(unit=unit):
                changed = self._apply_unit(unit)
            case OutcomeArrived(outcome=outcome):
                changed = self._apply_outcome(outcome)
        if changed:
            self._settle()
        return changed

    def _apply_unit(self, unit: Unit) -> bool:
        state = self.state
        if unit_number(unit.unit_id) < state.units_emitted:
            return False  # seen already
        state.units_emitted = unit_number(unit.unit_id) + 1
        models = [i.model_id for i in unit.items] if isinstance(unit, WorkUnit) else [op.model_id for op in unit.ops]
        for model_id in models:
            self._stream(model_id).last_used = unit_number(unit.unit_id)
            self._touched.add(model_id)
        state.inflight_group[unit.unit_id] = unit.group or DEFAULT_GROUP
        match unit:
            case WorkUnit(items=items):
                state.inflight[unit.unit_id] = [(i.model_id, i.request_id, i.index) for i in items]
                for item in items:
                    pending = self._find(item.model_id, item.request_id)
                    if pending is not None:
                        pending.issued = max(pending.issued, item.index + 1)
            case BarrierUnit(ops=ops):
                reissued = self._abandon(ops)
                state.inflight[unit.unit_id] = [(op.model_id, op.request_id, -1) for op in ops]
                state.inflight_ops[unit.unit_id] = list(ops)
                for op in ops:
                    self._stream(op.model_id)
                    pending = self._find(op.model_id, op.request_id)
                    if pending is not None:
                        pending.barrier_issued = True
                    if isinstance(op, AdoptSlot) or (op.model_id, op.request_id) not in reissued:
                        self._apply_barrier_side_effects(op, unit.group)
        return True

    def _abandon(self, ops: list[SlotOp]) -> set[tuple[str, str]]:
        """A takeover's units (`AdoptSlot.abandoned`) stop counting: their outcomes, if any come,
        are ignored; their datums go back to the queue to be planned again; their barrier ops are
        re-issued in the takeover unit itself (returned: their side effects happened already)."""
        reissued: set[tuple[str, str]] = set()
        state = self.state
        for unit_id in dict.fromkeys(u for op in ops if isinstance(op, AdoptSlot) for u in op.abandoned):
            members = state.inflight.pop(unit_id, None)
            state.inflight_group.pop(unit_id, None)
            state.inflight_ops.pop(unit_id, None)
            for model_id, request_id, index in members or []:
                if index < 0:
                    reissued.add((model_id, request_id))
                    continue
                pending = self._find(model_id, request_id)
                if pending is not None:
                    pending.issued = min(pending.issued, index)
        return reissued

    def _apply_outcome(self, outcome: Outcome) -> bool:
        members = self.state.inflight.pop(outcome.unit_id, None)
        self.state.inflight_group.pop(outcome.unit_id, None)
        ops = self.state.inflight_ops.pop(outcome.unit_id, None) or []
        if members is None:
            return False  # a redelivery of an outcome already folded, or of an abandoned unit
        match outcome:
            case WorkOutcome():
                self._fold_work(outcome, members)
            case BarrierOutcome():
                self._fold_adoptions(outcome, ops)
                self._fold_barrier(outcome, members)
        return True

    def _settle(self) -> None:
        """After every fact: a closed model fails what it can no longer run, and finished
        requests leave their queues for the outbox, in seq_id order."""
        for stream in self._active_streams():
            self._touched.add(stream.model_id)
            if stream.closed:
                self._fail_unstarted(stream)
            for pending in stream.pop_completed():
                cmd = pending.command
                if isinstance(cmd, Rejected):
                    pending.error, pending.category = cmd.error, cmd.category
                self._outbox.append(Completion(pending, stream.model_id, self._result_body(stream, pending)))
            if not stream.queue and not stream.buffered:
                del self._active[stream.model_id]

    def _active_streams(self) -> list[ModelStream]:
        return [self.state.streams[m] for m in list(self._active)]

    def changed_models(self) -> list[ModelStream]:
        """The models a fact touched since the last call (their queue summary may have changed)."""
        touched, self._touched = self._touched, set()
        return [self.state.streams[m] for m in sorted(touched) if m in self.state.streams]

    def collect(self) -> list[Completion]:
        """The requests finished since the last call (each exactly once), oldest fact first."""
        done, self._outbox = self._outbox, []
        return done

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The state, encoded (msgpack); take it only when `collect` has been drained."""
        assert not self._outbox, "snapshot with uncollected completions"
        return msgspec.msgpack.encode(self.state)

    @classmethod
    def restore(cls, data: bytes) -> Planner:
        state = msgspec.msgpack.decode(data, type=PlannerState)
        return cls(state.num_slots, state.token_budget, state)

    # --- the decision -------------------------------------------------------------------------
    def decide(self, skip: frozenset[str] = frozenset()) -> Unit | None:
        """The next unit to emit, or None; pure: the state changes only when it is applied.

        The oldest runnable command of all models goes first (by arrival). A resident model's
        runs now; a model that holds no slot (a create, or a paged-out model) first gets one:
        a free slot, or the least recently used slot of a model with nothing in flight, which
        is paged out in the same barrier. Groups in `skip` get nothing (the service holds them).

        Nothing is decided for a group while `max_units_in_flight` of its units wait for their
        outcomes: calls that arrive meanwhile (other tenants' forward_backward, typically) are
        packed into one unit when an outcome frees the pipeline, instead of one small unit each.
        """
        full = self._full_groups() | skip
        best_rows: tuple[ModelStream, Pending] | None = None
        best_barrier: tuple[ModelStream, Pending] | None = None
        best_arrival: int | None = None
        waiting: list[tuple[int, ModelStream, Pending]] = []
        lost: dict[str, None] = {}  # lost groups with a resident model that has work
        busy: set[str] | None = None
        for stream in self._active_streams():
            if stream.closed:
                continue
            head = stream.oldest_runnable()
            if self._on_lost_group(stream):
                if busy is None:
                    busy = self._busy_models()
                if head is not None or stream.model_id in busy:
                    lost[stream.group] = None  # taken over by a live group (`_takeover_unit`)
                continue
            if head is None:
                continue
            if self._needs_slot(stream, head):
                waiting.append((head.arrival, stream, head))
                continue
            if self._group_of(stream) in full:
                continue  # its group's pipeline is full: decided when an outcome frees it
            if best_arrival is not None and head.arrival >= best_arrival:
                continue
            best_arrival = head.arrival
            if head.is_window:
                best_rows, best_barrier = (stream, head), None
            else:
                best_rows, best_barrier = None, (stream, head)
        for group in sorted(lost):
            takeover = self._takeover_unit(group, full)
            if takeover is not None:
                return takeover
        unit = self._placing_unit(waiting, best_arrival, full)
        if unit is not None:
            return unit
        if best_rows is not None:
            return self._work_unit(*best_rows)
        if best_barrier is not None:
            return self._barrier_unit(*best_barrier)
        return None

    def _placing_unit(
        self, waiting: list[tuple[int, ModelStream, Pending]], before: int | None, full: set[str]
    ) -> BarrierUnit | None:
        """The residency unit of the oldest model waiting for a slot that can be placed now (and
        arrived before `before`, the oldest runnable resident command). A model that cannot be
        placed blocks the younger ones that compete for its groups (no overtaking on the same
        slots), not those of other groups: a create on a lost or full group never holds up one
        on a free group."""
        blocked: set[str] = set()
        for arrival, stream, head in sorted(waiting, key=lambda w: w[0]):
            if before is not None and arrival >= before:
                break
            groups = set(self._candidate_groups(stream, head))
            if groups & blocked:
                continue
            unit = self._residency_unit(stream, head)
            if unit is not None and unit.group not in full:
                return unit
            blocked |= groups
            if blocked >= set(self.groups):
                break  # nothing younger can be placed either (one group: after the first)
        return None

    def plan(self) -> list[Unit]:
        """Decide and apply every unit that can be emitted now, in emission order (the caller
        appends them to the work stream in this order)."""
        units: list[Unit] = []
        while (unit := self.decide()) is not None:
            self.apply(UnitEmitted(unit))
            units.append(unit)
        return units

    def _full_groups(self) -> set[str]:
        """Groups with `max_units_in_flight` units awaiting outcomes (none when there is no limit)."""
        limit = self.state.max_units_in_flight
        if not limit:
            return set()
        counts: dict[str, int] = {}
        for group in self.state.inflight_group.values():
            counts[group] = counts.get(group, 0) + 1
        return {group for group, count in counts.items() if count >= limit}

    def awaited(self, cohort: frozenset[str]) -> set[str]:
        """The resident models of `cohort` with no datum ready to issue: the ones whose next
        forward_backward has not arrived yet (the service may hold a unit back for them)."""
        awaited = set()
        for model_id in cohort:
            stream = self.state.streams.get(model_id)
            if stream is None or stream.closed or stream.slot is None:
                continue  # could not join the unit anyway
            if not any(p.issued < p.num_datums for p in stream.open_window()):
                awaited.add(model_id)
        return awaited

    def waiting_for_capacity(self) -> list[str]:
        """Request ids that wait for an adapter slot (queue_state paused_capacity): the oldest
        runnable command of each model that holds none while no slot can be freed."""
        return sorted(r for r, why in self.waiting().items() if why == WAIT_SLOTS)

    def waiting(self) -> dict[str, str]:
        """Request ids that wait to be placed, and why: `WAIT_SLOTS` (every slot of the groups
        that could take it holds a model with work in flight) or `WAIT_GROUP` (no live trainer
        group serves its base model, or holds its state)."""
        waiting: dict[str, str] = {}
        busy = self._busy_models()
        for stream in self._active_streams():
            head = None if stream.closed else stream.oldest_runnable()
            if head is not None and self._on_lost_group(stream):
                if self._takeover_unit(stream.group, set()) is None:
                    base = stream.base_model
                    others = any(
                        g != stream.group and info.live and info.base_model in ("", base)
                        for g, info in self.groups.items()
                    )
                    waiting[head.command.request_id] = WAIT_SLOTS if others else WAIT_GROUP
                continue
            if head is None or not self._needs_slot(stream, head):
                continue
            if not self._candidate_groups(stream, head):
                waiting[head.command.request_id] = WAIT_GROUP
            elif self._placement(stream, head, busy) is None:
                waiting[head.command.request_id] = WAIT_SLOTS
        return waiting

    @staticmethod
    def _needs_slot(stream: ModelStream, head: Pending) -> bool:
        if stream.slot is not None:
            return False
        if isinstance(head.command, CreateModel):
            return True
        return stream.paged and not isinstance(head.command, UnloadModel)

    def _free_slot(self, group: str) -> int | None:
        held = self.state.slots.get(group, {})
        info = self.groups.get(group)
        for slot in range(info.num_slots if info is not None else 0):
            if slot not in held:
                return slot
        return None

    def _candidate_groups(self, stream: ModelStream, head: Pending) -> list[str]:
        """The groups `stream` may be placed on now, preferred first: for a create, the live groups
        of its base model, least loaded first; for a page-in, its own group, then (only when its
        state was exported) the other live groups of its base, least loaded first."""
        base = stream.base_model
        live = [g for g, info in self.groups.items() if info.live and info.base_model in ("", base)]
        by_load = sorted(live, key=lambda g: (self._load(g), g))
        if isinstance(head.command, CreateModel):
            return by_load
        home = self._group_of(stream)
        if not stream.page_file:
            return [home] if home in live else []  # only its own group holds its state: wait for it
        return [*([home] if home in live else []), *(g for g in by_load if g != home)]

    def _on_lost_group(self, stream: ModelStream) -> bool:
        """Resident on a group whose trainers stopped reporting: nothing more is emitted for it
        there; once it has work, it is taken over by a live group (`_takeover_unit`)."""
        info = self.groups.get(stream.group) if stream.slot is not None else None
        return info is not None and not info.live

    def _takeover_unit(self, lost: str, full: set[str]) -> BarrierUnit | None:
        """Move the resident models of the lost group `lost` that have work (queued, or in one of
        its units still awaiting an outcome) to one live group of the same base model.

        Every unit of `lost` still in flight is abandoned (named in each `AdoptSlot`), so every
        model with a member in one of them moves in this unit too: the lost group, when it is
        back, skips those units whole. The unit: page-outs of the new group's victims, one
        `AdoptSlot` per model that stays open, then the abandoned units' barrier ops again
        (retargeted at the new slots); the abandoned datums go back to the queue."""
        state = self.state
        abandoned = sorted((u for u, g in state.inflight_group.items() if g == lost), key=unit_number)
        busy = self._busy_models()
        moving = {
            s.model_id
            for s in self._active_streams()
            if s.slot is not None and s.group == lost and (s.oldest_runnable() is not None or s.model_id in busy)
        }
        for unit_id in abandoned:
            moving |= {m for m, _, _ in state.inflight[unit_id]}
        streams = [state.streams[m] for m in sorted(moving)]
        adopters = [s for s in streams if not s.closed]
        base = self.groups[lost].base_model
        live = [
            g for g, info in self.groups.items()
            if g != lost and info.live and info.base_model in ("", base) and g not in full
        ]
        for group in sorted(live, key=lambda g: (self._load(g), g)):
            held = state.slots.get(group, {})
            free = [slot for slot in range(self.groups[group].num_slots) if slot not in held]
            victims: list[ModelStream] = []
            if len(free) < len(adopters):
                resident = (state.streams[m] for m in held.values())
                candidates = sorted(
                    (s for s in resident if s.model_id not in busy and s.model_id not in moving and s.created),
                    key=self._victim_key,
                )
                victims = candidates[: len(adopters) - len(free)]
                if len(free) + len(victims) < len(adopters):
                    continue
            return self._takeover_ops(lost, group, abandoned, adopters, free, victims)
        return None

    def _takeover_ops(
        self,
        lost: str,
        group: str,
        abandoned: list[str],
        adopters: list[ModelStream],
        free: list[int],
        victims: list[ModelStream],
    ) -> BarrierUnit:
        unit_id = self._next_unit_id()
        ops: list[SlotOp] = []
        slots = [*free, *(v.slot for v in victims if v.slot is not None)][: len(adopters)]
        for victim in victims:
            assert victim.slot is not None
            export = export_path(victim.model_id, unit_id) if self._exports(victim) else ""
            ops.append(
                PageOut(model_id=victim.model_id, request_id=page_request_id(victim.model_id), slot=victim.slot, export=export)
            )
        again = [op for u in abandoned for op in self.state.inflight_ops.get(u, [])]
        # a model whose create or move onto the lost group was itself abandoned may have no state
        # there: the InitSlot / PageIn run again after its AdoptSlot gives it one
        placing = {op.model_id for op in again if isinstance(op, InitSlot) or (isinstance(op, PageIn) and op.source)}
        new_slot = {}
        for stream, slot in zip(adopters, sorted(slots), strict=True):
            new_slot[stream.model_id] = slot
            ops.append(
                AdoptSlot(
                    model_id=stream.model_id,
                    request_id=page_request_id(stream.model_id),
                    slot=slot,
                    from_group=lost,
                    abandoned=abandoned,
                    fresh=not stream.created or stream.model_id in placing,
                )
            )
        for op in again:
            redo = _reissued(op, new_slot.get(op.model_id))
            if redo is not None:
                ops.append(redo)
        traceparent = next((s.queue[0].command.traceparent for s in adopters if s.queue), "")
        return BarrierUnit(unit_id=unit_id, group=group, ops=ops, traceparent=traceparent)

    def _group_of(self, stream: ModelStream) -> str:
        """The group that holds `stream`'s state; a model never placed (its create failed or never
        came) has its barriers (failures) run by the first live group."""
        if stream.group:
            return stream.group
        live = sorted(g for g, info in self.groups.items() if info.live)
        return live[0] if live else min(self.groups, default=DEFAULT_GROUP)

    def _load(self, group: str) -> tuple[int, int]:
        """A group's load: resident models with queued work, then resident models."""
        held = self.state.slots.get(group, {}).values()
        return sum(m in self._active for m in held), len(held)

    def _placement(
        self, stream: ModelStream, head: Pending, busy: set[str]
    ) -> tuple[str, int, ModelStream | None] | None:
        """(group, slot, victim to page out first or None) for `stream`, or None if it must wait:
        a free slot in the first candidate group that has one, else the best victim of all the
        candidate groups (idle first, then least recently used: as with one group)."""
        groups = self._candidate_groups(stream, head)
        for group in groups:
            slot = self._free_slot(group)
            if slot is not None:
                return group, slot, None
        victims = [(v, g) for g in groups if (v := self._victim(stream, busy, g)) is not None]
        if not victims:
            return None
        victim, group = min(victims, key=lambda pair: (*self._victim_key(pair[0]), groups.index(pair[1])))
        assert victim.slot is not None
        return group, victim.slot, victim

    def _exports(self, stream: ModelStream) -> bool:
        """Whether a page-out of `stream` exports its state: more than one group serves its base."""
        base = stream.base_model
        return sum(info.base_model in ("", base) for info in self.groups.values()) > 1

    def _busy_models(self) -> set[str]:
        """Models with a unit in flight (emitted, outcome not folded): never paged out."""
        return {model_id for members in self.state.inflight.values() for model_id, _, _ in members}

    def _victim(self, needy: ModelStream, busy: set[str], group: str) -> ModelStream | None:
        """The resident model of `group` to page out: nothing in flight; idle ones (nothing
        runnable) first, then the least recently used."""
        resident = (self.state.streams[m] for m in self.state.slots.get(group, {}).values())
        candidates = [s for s in resident if s is not needy and s.model_id not in busy and s.created]
        if not candidates:
            return None
        return min(candidates, key=self._victim_key)

    @staticmethod
    def _victim_key(stream: ModelStream) -> tuple[bool, int, str]:
        return stream.oldest_runnable() is not None, stream.last_used, stream.model_id

    def _residency_unit(self, stream: ModelStream, head: Pending) -> BarrierUnit | None:
        """Give `stream` a slot: [page out the victim,] then its create or its page-in."""
        placed = self._placement(stream, head, self._busy_models())
        if placed is None:
            return None
        group, slot, victim = placed
        unit_id = self._next_unit_id()
        ops: list[SlotOp] = []
        if victim is not None:
            vid = victim.model_id
            export = export_path(vid, unit_id) if self._exports(victim) else ""
            ops.append(PageOut(model_id=vid, request_id=page_request_id(vid), slot=slot, export=export))
        cmd = head.command
        mid = stream.model_id
        if isinstance(cmd, CreateModel):
            ops.append(InitSlot(model_id=mid, request_id=cmd.request_id, slot=slot, lora=cmd.lora, restore=cmd.restore))
        else:
            source = stream.page_file if group != self._group_of(stream) else ""
            ops.append(PageIn(model_id=mid, request_id=page_request_id(mid), slot=slot, source=source))
        return BarrierUnit(unit_id=unit_id, group=group, ops=ops, traceparent=cmd.traceparent)

    def _work_unit(self, seed_stream: ModelStream, seed: Pending) -> WorkUnit:
        command = seed.command
        assert isinstance(command, ForwardBackward)
        key = loss_class(command)
        group = self._group_of(seed_stream)
        rows: list[tuple[int, int, ModelStream, Pending]] = []
        for stream in self._active_streams():
            # only datums of models resident on the seed's group are packed
            if stream.closed or stream.slot is None or self._group_of(stream) != group:
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
            if items and tokens + datum.num_tokens > self.state.token_budget:
                break  # strictly oldest first: nothing younger jumps over a datum that did not fit
            items.append(UnitItem(stream.model_id, pending.command.request_id, index, stream.slot, datum))
            tokens += datum.num_tokens
        return WorkUnit(
            unit_id=self._next_unit_id(),
            group=group,
            forward_only=command.forward_only,
            loss_fn=command.loss_fn,
            loss_config=command.loss_config,
            items=sorted(items, key=lambda i: (i.slot, i.request_id, i.index)),
            traceparent=command.traceparent,
        )

    def _barrier_unit(self, stream: ModelStream, head: Pending) -> BarrierUnit:
        chosen = [(stream, head)]
        group = self._group_of(stream)
        if isinstance(head.command, OptimStep):
            for other in self._active_streams():
                if other is stream or other.closed or other.slot is None or self._group_of(other) != group:
                    continue
                barrier = other.ready_barrier()
                if barrier is not None and isinstance(barrier.command, OptimStep):
                    chosen.append((other, barrier))
        chosen.sort(key=lambda pair: pair[1].arrival)  # independent of stream insertion order
        ops = [self._barrier_op(s, p) for s, p in chosen]
        return BarrierUnit(unit_id=self._next_unit_id(), group=group, ops=ops, traceparent=head.command.traceparent)

    def _barrier_op(self, stream: ModelStream, pending: Pending) -> SlotOp:
        """Decide what a barrier does, given the model's window state."""
        cmd = pending.command
        rid, mid, slot = cmd.request_id, stream.model_id, stream.slot
        dirty = pending.window in stream.dirty
        if isinstance(cmd, UnloadModel) and slot is None and stream.paged:
            return DropPaged(model_id=mid, request_id=rid)
        if slot is None or not stream.created:
            return FailRequest(model_id=mid, request_id=rid, error=f"model {mid} is not loaded")
        match cmd:
            case OptimStep(seq_id=seq, adam=adam):
                poison = stream.poison.get(pending.window)
                if poison is None:
                    return StepSlot(model_id=mid, request_id=rid, slot=slot, adam=adam)
                reason = f"the gradient window before optim_step seq_id {seq} is incomplete ({poison})"
                return DiscardSlot(model_id=mid, request_id=rid, slot=slot, reason=reason)
            case SaveWeights(name=name, ttl_s=ttl_s, user_metadata=metadata):
                return SaveSlot(
                    model_id=mid,
                    request_id=rid,
                    slot=slot,
                    tinker_path=tinker_path(mid, "training", name),
                    tenant=stream.tenant,
                    ttl_s=ttl_s,
                    user_metadata=metadata,
                )
            case SaveForSampler(name=name, external=external, sampling_session_id=sampler, ttl_s=ttl_s):
                kind = "external" if external else "sampler"
                return ExportSlot(
                    model_id=mid,
                    request_id=rid,
                    slot=slot,
                    tinker_path=tinker_path(mid, kind, name) if name else None,
                    sampling_session_id=sampler,
                    tenant=stream.tenant,
                    ttl_s=ttl_s,
                )
            case LoadWeights() if dirty:
                return FailRequest(model_id=mid, request_id=rid, error=LOAD_WITH_PENDING_GRADS)
            case LoadWeights(restore=restore):
                return LoadSlot(model_id=mid, request_id=rid, slot=slot, restore=restore)
            case UnloadModel():
                return ReleaseSlot(model_id=mid, request_id=rid, slot=slot)
        return FailRequest(
            model_id=mid, request_id=rid, error=f"unsupported command {type(cmd).__name__}", category="server"
        )

    def _apply_barrier_side_effects(self, op: SlotOp, group: str) -> None:
        """What emitting a barrier op does to the state (live and on replay alike)."""
        stream = self.state.streams.get(op.model_id)
        if stream is None:
            return
        match op:
            case InitSlot() | PageIn():
                stream.slot, stream.paged, stream.group = op.slot, False, group
                self.state.slots.setdefault(group, {})[op.slot] = op.model_id
            case AdoptSlot(from_group=lost):
                held = self.state.slots.get(lost, {})
                if stream.slot is not None and held.get(stream.slot) == stream.model_id:
                    del held[stream.slot]  # the lost group's slot is free for it when it is back
                stream.slot, stream.paged, stream.group, stream.page_file = op.slot, False, group, ""
                self.state.slots.setdefault(group, {})[op.slot] = op.model_id
            case PageOut():
                self._free(stream)
                stream.paged, stream.page_file = True, op.export
            case StepSlot() | DiscardSlot():
                stream.consume_window()
            case ReleaseSlot():
                self._free(stream)
                stream.close("was unloaded")
            case DropPaged():
                stream.paged = False
                stream.close("was unloaded")

    def _free(self, stream: ModelStream) -> None:
        """Give the stream's slot back (only if it still holds it: replay folds outcomes late)."""
        held = self.state.slots.get(self._group_of(stream), {})
        if stream.slot is not None and held.get(stream.slot) == stream.model_id:
            del held[stream.slot]
        stream.slot = None

    def _next_unit_id(self) -> str:
        return f"u{self.state.units_emitted:012d}"

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
                pending.outputs[index] = DatumResult(datum.logprobs, datum.loss, datum.k, datum.metrics)
                if pending.trains:
                    stream.mark_dirty(pending.window)

    def _fold_adoptions(self, outcome: BarrierOutcome, ops: list[SlotOp]) -> None:
        """A model whose takeover failed (its state could not be rebuilt) is closed: what it has
        queued fails, saying why."""
        failed = {o.model_id: o for o in outcome.ops if not o.ok and o.request_id == page_request_id(o.model_id)}
        for op in ops:
            stream = self.state.streams.get(op.model_id)
            if not isinstance(op, AdoptSlot) or stream is None or (got := failed.get(op.model_id)) is None:
                continue
            if stream.slot == op.slot:
                self._free(stream)
            stream.close(
                f"lost its training state: trainer group {op.from_group} was lost and the state could "
                f"not be rebuilt from its files ({got.error or 'failed'})"
            )
            self._active[stream.model_id] = None

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
        metrics, info, mid = pending.metrics, pending.info, stream.model_id
        match pending.command:
            case ForwardBackward():
                outputs = [o for o in pending.outputs if o is not None]
                summed = {"loss:sum": float(sum(o.loss for o in outputs))}
                for output in outputs:  # every per-datum metric is a `name:sum`
                    for name, value in output.metrics.items():
                        summed[name] = summed.get(name, 0.0) + value
                return ForwardBackwardResult(outputs=outputs, metrics=summed)
            case _ if info.get(HANDOFF):
                return None
            case CreateModel(restore=restore) if restore is not None:  # create mode of load_weights
                return LoadWeightsResponse(model_id=mid, path=restore.tinker_path)
            case CreateModel():
                return CreateModelResponse(model_id=mid)
            case OptimStep():
                return OptimStepResponse(metrics=dict(metrics))
            case LoadWeights(restore=restore):
                return LoadWeightsResponse(path=restore.tinker_path)
            case UnloadModel():
                return UnloadModelResponse(model_id=mid)
        return Failure(error=f"no result for {type(pending.command).__name__}", category="server")

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
        stream = self.state.streams.get(model_id)
        if stream is None:
            stream = self.state.streams[model_id] = ModelStream(model_id)
        return stream

    def _find(self, model_id: str, request_id: str) -> Pending | None:
        stream = self.state.streams.get(model_id)
        if stream is None:
            return None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending
        return None

    def _find_with_stream(self, request_id: str) -> tuple[Pending | None, ModelStream | None]:
        model_id = owner_of_request(request_id)
        stream = self.state.streams.get(model_id)
        if stream is None:
            return None, None
        for pending in stream.queue:
            if pending.command.request_id == request_id:
                return pending, stream
        return None, stream


WAIT_SLOTS = "slots"
WAIT_GROUP = "group"


def _reissued(op: SlotOp, slot: int | None) -> SlotOp | None:
    """An abandoned barrier op, as the takeover unit runs it again on the model's new `slot`
    (None: the model does not stay open). A page-out of it, or a page-in from the lost group's
    own store, needs nothing more than the `AdoptSlot` (which rebuilds that state); a release
    frees no slot there any more: the model's state is just dropped (`DropPaged`)."""
    match op:
        case PageOut() | AdoptSlot():
            return None
        case PageIn(source=""):
            return None
        case ReleaseSlot():
            return DropPaged(model_id=op.model_id, request_id=op.request_id)
        case DropPaged() | FailRequest():
            return op
        case _ if slot is None:
            return FailRequest(
                model_id=op.model_id,
                request_id=op.request_id,
                error=f"model {op.model_id} is closed; this request did not run",
                category="server",
            )
        case _:
            return msgspec.structs.replace(op, slot=slot)


def export_path(model_id: str, unit_id: str) -> str:
    """Where a page-out exports a model's state, relative to the data directory: one file per
    page-out (a later page-in on another group, and its replay, read exactly that one)."""
    return f"trainer/exports/{token(model_id)}/{unit_id}.safetensors"


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
