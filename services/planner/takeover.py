"""A lost trainer group's resident models with work, taken over by one live group of their base.

A group whose trainers stopped reporting is not decided for; once one of its resident models has
work (queued, or in one of its units still awaiting an outcome), `takeover_unit` moves them in one
barrier unit: page-outs of the new group's victims, one `AdoptSlot` per model that stays open,
then the abandoned units' barrier ops again, retargeted at the new slots. Every unit of the lost
group still in flight is abandoned (named in each `AdoptSlot`), so a replay needs no clock or
liveness: the decision is a unit, and `state.evolve` folds it like any other.
"""

from __future__ import annotations

import msgspec

from libs.checkpoints.layout import export_file
from libs.contracts.ids import page_request_id
from libs.contracts.work import (
    AdoptSlot,
    BarrierUnit,
    DropPaged,
    FailRequest,
    InitSlot,
    PageIn,
    PageOut,
    ReleaseSlot,
    SlotOp,
)
from services.planner.facts import unit_number
from services.planner.inputs import Groups, serves
from services.planner.residency import exports, load, victim_key
from services.planner.state import PlannerState
from services.planner.streams import ModelStream


def on_lost_group(groups: Groups, stream: ModelStream) -> bool:
    """Resident on a group whose trainers stopped reporting: nothing more is emitted for it
    there; once it has work, it is taken over by a live group (`takeover_unit`)."""
    info = groups.get(stream.group) if stream.slot is not None else None
    return info is not None and not info.live


def takeover_unit(state: PlannerState, groups: Groups, lost: str, full: set[str]) -> BarrierUnit | None:
    """Move the resident models of the lost group `lost` that have work to the least loaded live
    group of the same base model that has room for them (free slots, or idle models to page out);
    None while no live group has."""
    abandoned = sorted((u for u, g in state.inflight_group.items() if g == lost), key=unit_number)
    busy = state.busy_models()
    moving = {
        s.model_id
        for s in state.active_streams()
        if s.slot is not None and s.group == lost and (s.oldest_runnable() is not None or s.model_id in busy)
    }
    for unit_id in abandoned:
        moving |= {m for m, _, _ in state.inflight[unit_id]}
    streams = [state.streams[m] for m in sorted(moving)]
    adopters = [s for s in streams if not s.closed]
    base = groups[lost].base_model
    live = [g for g, info in groups.items() if g != lost and info.live and serves(info, base) and g not in full]
    for group in sorted(live, key=lambda g: (load(state, g), g)):
        held = state.slots.get(group, {})
        free = [slot for slot in range(groups[group].num_slots) if slot not in held]
        victims: list[ModelStream] = []
        if len(free) < len(adopters):
            resident = (state.streams[m] for m in held.values())
            candidates = sorted(
                (s for s in resident if s.model_id not in busy and s.model_id not in moving and s.created),
                key=victim_key,
            )
            victims = candidates[: len(adopters) - len(free)]
            if len(free) + len(victims) < len(adopters):
                continue
        return _takeover_ops(state, groups, lost, group, abandoned, adopters, free, victims)
    return None


def _takeover_ops(
    state: PlannerState,
    groups: Groups,
    lost: str,
    group: str,
    abandoned: list[str],
    adopters: list[ModelStream],
    free: list[int],
    victims: list[ModelStream],
) -> BarrierUnit:
    unit_id = state.next_unit_id()
    ops: list[SlotOp] = []
    slots = [*free, *(v.slot for v in victims if v.slot is not None)][: len(adopters)]
    for victim in victims:
        assert victim.slot is not None
        export = export_file(victim.model_id, unit_id) if exports(groups, victim) else ""
        ops.append(
            PageOut(model_id=victim.model_id, request_id=page_request_id(victim.model_id), slot=victim.slot, export=export)
        )
    again = [op for u in abandoned for op in state.inflight_ops.get(u, [])]
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
        redo = reissued(op, new_slot.get(op.model_id))
        if redo is not None:
            ops.append(redo)
    traceparent = next((s.queue[0].command.traceparent for s in adopters if s.queue), "")
    return BarrierUnit(unit_id=unit_id, group=group, ops=ops, traceparent=traceparent)


def reissued(op: SlotOp, slot: int | None) -> SlotOp | None:
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
