"""Planner snapshots: the folded state at known positions of the three streams it reads.

A restart loads the newest snapshot and replays only what came after it (requests, units and
outcomes with a higher stream sequence), so start-up time is bounded by the snapshot interval,
not by the age of the log, and a model stays known after its commands have aged out of the
request stream's retention. The snapshot is a cache of a fold: deleting it costs a full replay,
never correctness. Stored as one object in the JetStream object store `tinker_snapshots`.

The state holds facts only: the trainer groups and the limits (`num_slots`, `token_budget`,
`max_units_in_flight`) are today's settings, given on restore. A snapshot whose state still
carries those three fields restores as it is (the decoder ignores them), so the format has no
version number; one that cannot be decoded costs a full replay.
"""

from __future__ import annotations

import msgspec
import nats.js.errors

from infra.bus import Bus
from libs.contracts import ids
from libs.contracts import subjects as s


class Positions(msgspec.Struct, frozen=True):
    """The last stream sequence folded into a state, per stream (0: nothing yet)."""

    requests: int = 0
    work: int = 0
    outcomes: int = 0


class PlannerSnapshot(msgspec.Struct, frozen=True):
    positions: Positions
    state: bytes  # Planner.snapshot()
    at_ns: int = 0


async def load(bus: Bus, group: str) -> PlannerSnapshot | None:
    store = await bus.js.object_store(s.OBJ_SNAPSHOTS)
    try:
        found = await store.get(ids.planner_snapshot_name(group))
    except nats.js.errors.ObjectNotFoundError:
        return None
    if not found.data:
        return None
    return msgspec.msgpack.decode(found.data, type=PlannerSnapshot)


async def save(bus: Bus, group: str, snapshot: PlannerSnapshot) -> int:
    """Store `snapshot` (replacing the previous one); returns its size in bytes."""
    store = await bus.js.object_store(s.OBJ_SNAPSHOTS)
    data = msgspec.msgpack.encode(snapshot)
    await store.put(ids.planner_snapshot_name(group), data)
    return len(data)
