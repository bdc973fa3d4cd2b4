"""What a resident model's runnable command becomes: a work unit of packed datums, or a barrier.

A work unit is seeded by the oldest ready datum and packs every ready datum of the same loss class
(`loss_class`) of the models resident on the seed's group, oldest first, under the token budget;
a datum over the budget ships alone. An optim_step barrier takes every ready optim_step of that
group; any other barrier runs alone. `barrier_op` turns a command into its slot op, given the
model's gradient window (a poisoned window's optim_step discards, never steps).
"""

from __future__ import annotations

import msgspec

from libs.contracts.ids import tinker_path
from libs.contracts.requests import (
    ForwardBackward,
    LoadWeights,
    OptimStep,
    SaveForSampler,
    SaveWeights,
    UnloadModel,
)
from libs.contracts.work import (
    BarrierUnit,
    DiscardSlot,
    DropPaged,
    ExportSlot,
    FailRequest,
    LoadSlot,
    ReleaseSlot,
    SaveSlot,
    SlotOp,
    StepSlot,
    UnitItem,
    WorkUnit,
)
from services.planner.inputs import Groups, group_of
from services.planner.state import PlannerState
from services.planner.streams import ModelStream, Pending

LOAD_WITH_PENDING_GRADS = (
    "load_state while gradients are pending: forward_backward ran since the last optim_step; "
    "call optim_step first, then load_state again"
)


def loss_class(command: ForwardBackward) -> tuple[object, ...]:
    """Datums may share a unit only when this key is equal (1 and 1.0, and key order, agree)."""
    config = tuple(
        sorted(
            (k, v if isinstance(v, str) else msgspec.json.encode(float(v)))
            for k, v in command.loss_config.items()
        )
    )
    return (command.forward_only, command.loss_fn, config)


def work_unit(
    state: PlannerState, groups: Groups, token_budget: int, seed_stream: ModelStream, seed: Pending
) -> WorkUnit:
    command = seed.command
    assert isinstance(command, ForwardBackward)
    key = loss_class(command)
    group = group_of(seed_stream, groups)
    rows: list[tuple[int, int, ModelStream, Pending]] = []
    for stream in state.active_streams():
        # only datums of models resident on the seed's group are packed
        if stream.closed or stream.slot is None or group_of(stream, groups) != group:
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
        if items and tokens + datum.num_tokens > token_budget:
            break  # strictly oldest first: nothing younger jumps over a datum that did not fit
        items.append(UnitItem(stream.model_id, pending.command.request_id, index, stream.slot, datum))
        tokens += datum.num_tokens
    return WorkUnit(
        unit_id=state.next_unit_id(),
        group=group,
        forward_only=command.forward_only,
        loss_fn=command.loss_fn,
        loss_config=command.loss_config,
        items=sorted(items, key=lambda i: (i.slot, i.request_id, i.index)),
        traceparent=command.traceparent,
    )


def barrier_unit(state: PlannerState, groups: Groups, stream: ModelStream, head: Pending) -> BarrierUnit:
    chosen = [(stream, head)]
    group = group_of(stream, groups)
    if isinstance(head.command, OptimStep):
        for other in state.active_streams():
            if other is stream or other.closed or other.slot is None or group_of(other, groups) != group:
                continue
            barrier = other.ready_barrier()
            if barrier is not None and isinstance(barrier.command, OptimStep):
                chosen.append((other, barrier))
    chosen.sort(key=lambda pair: pair[1].arrival)  # independent of stream insertion order
    ops = [barrier_op(s, p) for s, p in chosen]
    return BarrierUnit(unit_id=state.next_unit_id(), group=group, ops=ops, traceparent=head.command.traceparent)


def barrier_op(stream: ModelStream, pending: Pending) -> SlotOp:
    """What a barrier does, given the model's window state."""
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
                age_recipients=cmd.age_recipients,
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
