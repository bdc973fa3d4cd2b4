"""Which model holds which adapter slot of which trainer group, and who is paged out.

A model holds a slot only while it needs one. A create, or the next command of a paged-out model,
gets a slot on one of its candidate groups (`candidate_groups`): the lowest free slot of the first
group that has one, else the slot of the best victim of all of them (`victim`: nothing in flight;
idle before queued work, then least recently used), paged out in the same barrier. With more than
one group for its base, each page-out also exports the state to a file (`exports`), so the model
may page in on another group. Every function reads; the unit it returns changes the state when it
is emitted (state.evolve).
"""

from __future__ import annotations

from libs.checkpoints.layout import export_file
from libs.contracts.ids import page_request_id
from libs.contracts.requests import CreateModel, UnloadModel
from libs.contracts.work import BarrierUnit, InitSlot, PageIn, PageOut, SlotOp
from services.planner.inputs import Groups, group_of, serves
from services.planner.state import PlannerState
from services.planner.streams import ModelStream, Pending

Placement = tuple[str, int, ModelStream | None]
"""(group, slot, the victim to page out first or None)."""


def needs_slot(stream: ModelStream, head: Pending) -> bool:
    if stream.slot is not None:
        return False
    if isinstance(head.command, CreateModel):
        return True
    return stream.paged and not isinstance(head.command, UnloadModel)


def residency_unit(state: PlannerState, groups: Groups, stream: ModelStream, head: Pending) -> BarrierUnit | None:
    """Give `stream` a slot: [page out the victim,] then its create or its page-in."""
    placed = placement(state, groups, stream, head, state.busy_models())
    if placed is None:
        return None
    group, slot, victim = placed
    unit_id = state.next_unit_id()
    ops: list[SlotOp] = []
    if victim is not None:
        vid = victim.model_id
        export = export_file(vid, unit_id) if exports(groups, victim) else ""
        ops.append(PageOut(model_id=vid, request_id=page_request_id(vid), slot=slot, export=export))
    cmd = head.command
    mid = stream.model_id
    if isinstance(cmd, CreateModel):
        ops.append(InitSlot(model_id=mid, request_id=cmd.request_id, slot=slot, lora=cmd.lora, restore=cmd.restore))
    else:
        source = stream.page_file if group != group_of(stream, groups) else ""
        ops.append(PageIn(model_id=mid, request_id=page_request_id(mid), slot=slot, source=source))
    return BarrierUnit(unit_id=unit_id, group=group, ops=ops, traceparent=cmd.traceparent)


def placement(
    state: PlannerState, groups: Groups, stream: ModelStream, head: Pending, busy: set[str]
) -> Placement | None:
    """Where `stream` goes, or None if it must wait: a free slot in the first candidate group that
    has one, else the best victim of all the candidate groups (idle first, then least recently
    used: as with one group). A model with a unit in flight stays on its own group: its export
    is written when the group's trainer runs its page-out, so no other group may read it yet."""
    candidates = candidate_groups(state, groups, stream, head)
    if stream.model_id in busy:
        candidates = [g for g in candidates if g == group_of(stream, groups)]
    for group in candidates:
        slot = free_slot(state, groups, group)
        if slot is not None:
            return group, slot, None
    victims = [(v, g) for g in candidates if (v := victim(state, stream, busy, g)) is not None]
    if not victims:
        return None
    chosen, group = min(victims, key=lambda pair: (*victim_key(pair[0]), candidates.index(pair[1])))
    assert chosen.slot is not None
    return group, chosen.slot, chosen


def candidate_groups(state: PlannerState, groups: Groups, stream: ModelStream, head: Pending) -> list[str]:
    """The groups `stream` may be placed on now, preferred first: for a create, the live groups
    of its base model, least loaded first; for a page-in, its own group, then (only when its
    state was exported) the other live groups of its base, least loaded first."""
    live = [g for g, info in groups.items() if info.live and serves(info, stream.base_model)]
    by_load = sorted(live, key=lambda g: (load(state, g), g))
    if isinstance(head.command, CreateModel):
        return by_load
    home = group_of(stream, groups)
    if not stream.page_file:
        return [home] if home in live else []  # only its own group holds its state: wait for it
    return [*([home] if home in live else []), *(g for g in by_load if g != home)]


def free_slot(state: PlannerState, groups: Groups, group: str) -> int | None:
    held = state.slots.get(group, {})
    info = groups.get(group)
    for slot in range(info.num_slots if info is not None else 0):
        if slot not in held:
            return slot
    return None


def load(state: PlannerState, group: str) -> tuple[int, int]:
    """A group's load: resident models with queued work, then resident models."""
    held = state.slots.get(group, {}).values()
    return sum(m in state.active for m in held), len(held)


def exports(groups: Groups, stream: ModelStream) -> bool:
    """Whether a page-out of `stream` exports its state: more than one group serves its base."""
    return sum(serves(info, stream.base_model) for info in groups.values()) > 1


def victim(state: PlannerState, needy: ModelStream, busy: set[str], group: str) -> ModelStream | None:
    """The resident model of `group` to page out: nothing in flight; idle ones (nothing runnable)
    first, then the least recently used."""
    resident = (state.streams[m] for m in state.slots.get(group, {}).values())
    candidates = [s for s in resident if s is not needy and s.model_id not in busy and s.created]
    if not candidates:
        return None
    return min(candidates, key=victim_key)


def victim_key(stream: ModelStream) -> tuple[bool, int, str]:
    return stream.oldest_runnable() is not None, stream.last_used, stream.model_id


def placing_unit(
    state: PlannerState,
    groups: Groups,
    waiting: list[tuple[int, ModelStream, Pending]],
    before: int | None,
    full: set[str],
) -> BarrierUnit | None:
    """The residency unit of the oldest model waiting for a slot that can be placed now (and
    arrived before `before`, the oldest runnable resident command). A model that cannot be placed
    blocks the younger ones that compete for its groups (no overtaking on the same slots), not
    those of other groups: a create on a lost or full group never holds up one on a free group."""
    blocked: set[str] = set()
    for arrival, stream, head in sorted(waiting, key=lambda w: w[0]):
        if before is not None and arrival >= before:
            break
        candidates = set(candidate_groups(state, groups, stream, head))
        if candidates & blocked:
            continue
        unit = residency_unit(state, groups, stream, head)
        if unit is not None and unit.group not in full:
            return unit
        blocked |= candidates
        if blocked >= set(groups):
            break  # nothing younger can be placed either (one group: after the first)
    return None
