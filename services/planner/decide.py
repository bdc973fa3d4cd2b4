"""The next unit to emit, and what waits: pure reads of the state, the groups and the limits.

`decide` returns a unit or None and changes nothing: the state changes only when the unit is
folded (`state.evolve(UnitEmitted(unit))`). In order: a takeover of a lost group's models with
work (takeover.py), else a residency unit for the oldest model waiting for a slot that arrived
before the oldest runnable resident command (residency.py), else that command's work unit or
barrier (packing.py).
"""

from __future__ import annotations

from libs.contracts.work import BarrierUnit, Unit
from services.planner.inputs import Groups, Limits, group_of, serves
from services.planner.packing import barrier_unit, work_unit
from services.planner.residency import candidate_groups, needs_slot, placement, placing_unit
from services.planner.state import PlannerState
from services.planner.streams import ModelStream, Pending
from services.planner.takeover import on_lost_group, takeover_unit

WAIT_SLOTS = "slots"
WAIT_GROUP = "group"


def decide(state: PlannerState, groups: Groups, limits: Limits, skip: frozenset[str] = frozenset()) -> Unit | None:
    """The next unit to emit, or None.

    The oldest runnable command of all models goes first (by arrival). A resident model's runs
    now; a model that holds no slot (a create, or a paged-out model) first gets one: a free slot,
    or the least recently used slot of a model with nothing in flight, which is paged out in the
    same barrier. Groups in `skip` get nothing (the service holds them).

    Nothing is decided for a group while `max_units_in_flight` of its units wait for their
    outcomes: calls that arrive meanwhile (other tenants' forward_backward, typically) are packed
    into one unit when an outcome frees the pipeline, instead of one small unit each.
    """
    full = full_groups(state, limits) | skip
    best_rows: tuple[ModelStream, Pending] | None = None
    best_barrier: tuple[ModelStream, Pending] | None = None
    best_arrival: int | None = None
    waiting: list[tuple[int, ModelStream, Pending]] = []
    lost: dict[str, None] = {}  # lost groups with a resident model that has work
    busy: set[str] | None = None
    for stream in state.active_streams():
        if stream.closed:
            continue
        head = stream.oldest_runnable()
        if on_lost_group(groups, stream):
            if busy is None:
                busy = state.busy_models()
            if head is not None or stream.model_id in busy:
                lost[stream.group] = None  # taken over by a live group
            continue
        if head is None:
            continue
        if needs_slot(stream, head):
            waiting.append((head.arrival, stream, head))
            continue
        if group_of(stream, groups) in full:
            continue  # its group's pipeline is full: decided when an outcome frees it
        if best_arrival is not None and head.arrival >= best_arrival:
            continue
        best_arrival = head.arrival
        if head.is_window:
            best_rows, best_barrier = (stream, head), None
        else:
            best_rows, best_barrier = None, (stream, head)
    for group in sorted(lost):
        takeover: BarrierUnit | None = takeover_unit(state, groups, group, full)
        if takeover is not None:
            return takeover
    unit = placing_unit(state, groups, waiting, best_arrival, full)
    if unit is not None:
        return unit
    if best_rows is not None:
        return work_unit(state, groups, limits.token_budget, *best_rows)
    if best_barrier is not None:
        return barrier_unit(state, groups, *best_barrier)
    return None


def full_groups(state: PlannerState, limits: Limits) -> set[str]:
    """Groups with `max_units_in_flight` units awaiting outcomes (none when there is no limit)."""
    limit = limits.max_units_in_flight
    if not limit:
        return set()
    counts: dict[str, int] = {}
    for group in state.inflight_group.values():
        counts[group] = counts.get(group, 0) + 1
    return {group for group, count in counts.items() if count >= limit}


def waiting(state: PlannerState, groups: Groups) -> dict[str, str]:
    """Request ids that wait to be placed, and why: `WAIT_SLOTS` (every slot of the groups that
    could take it holds a model with work in flight) or `WAIT_GROUP` (no live trainer group serves
    its base model, or holds its state). Their futures answer queue_state "paused_capacity"."""
    why: dict[str, str] = {}
    busy = state.busy_models()
    for stream in state.active_streams():
        head = None if stream.closed else stream.oldest_runnable()
        if head is not None and on_lost_group(groups, stream):
            if takeover_unit(state, groups, stream.group, set()) is None:
                others = any(
                    g != stream.group and info.live and serves(info, stream.base_model)
                    for g, info in groups.items()
                )
                why[head.command.request_id] = WAIT_SLOTS if others else WAIT_GROUP
            continue
        if head is None or not needs_slot(stream, head):
            continue
        if not candidate_groups(state, groups, stream, head):
            why[head.command.request_id] = WAIT_GROUP
        elif placement(state, groups, stream, head, busy) is None:
            why[head.command.request_id] = WAIT_SLOTS
    return why
