"""The coalescing hold: whether to hold a work unit back, so tenants stepping in lockstep share one.

Eight tenants sending forward_backward at the same moment reach the planner milliseconds apart;
planned on arrival, the first would run alone and the other seven after it. So while nothing of
its group is in flight, a work unit waits for the models packed with that group's last work unit
that have not sent their next call yet: until they all have, or `coalesce_ms` after the hold
began. A model that does not come drops out of the cohort with the unit that leaves without it, so
a tenant training alone never waits. Timing only: what is decided stays `decide`'s, nothing here
is folded, and a replay never holds.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable

from libs.contracts.work import WorkUnit
from services.planner.state import PlannerState


def awaited(state: PlannerState, cohort: frozenset[str]) -> set[str]:
    """The resident models of `cohort` with no datum ready to issue: the ones whose next
    forward_backward has not arrived yet (a unit may be held back for them)."""
    out = set()
    for model_id in cohort:
        stream = state.streams.get(model_id)
        if stream is None or stream.closed or stream.slot is None:
            continue  # could not join the unit anyway
        if not any(p.issued < p.num_datums for p in stream.open_window()):
            out.add(model_id)
    return out


class Hold:
    """Per group: the models of its last work unit (`cohorts`) and when a hold ends (`holds`).

    When a hold begins, a timer calls `wake(group, until_ns)` at its deadline; the caller decides
    again if `due(group, until_ns)` still holds then. A timer that failed is reported through
    `failed` (set by `start`), so the caller can stop rather than run on with a unit half-emitted.
    """

    def __init__(self, coalesce_ms: float, wake: Callable[[str, int], Awaitable[None]]) -> None:
        self.coalesce_ms = coalesce_ms
        self.cohorts: dict[str, frozenset[str]] = {}
        self.holds: dict[str, int] = {}
        self.timers: set[asyncio.Task[None]] = set()
        self.failed: asyncio.Future[None] | None = None
        self._wake = wake

    def holding(self, unit: WorkUnit, now: int, state: PlannerState) -> bool:
        """Whether to hold `unit` back at `now` (the loop's monotonic clock, in ns)."""
        group = unit.group
        cohort = self.cohorts.get(group, frozenset())
        if (
            self.coalesce_ms <= 0
            or len(cohort) < 2
            or group in state.inflight_group.values()
            or not awaited(state, cohort)
        ):
            self.holds.pop(group, None)
            return False
        until = self.holds.get(group)
        if until is None:
            until = self.holds[group] = now + int(self.coalesce_ms * 1e6)
            timer = asyncio.create_task(self._end(group, until))
            self.timers.add(timer)
            timer.add_done_callback(self._ended)
        return now < until

    def emitted(self, unit: WorkUnit) -> None:
        """`unit` left: its models are its group's cohort now, and the group's hold is over."""
        self.cohorts[unit.group] = frozenset(item.model_id for item in unit.items)
        self.holds.pop(unit.group, None)

    def due(self, group: str, until_ns: int) -> bool:
        """Whether the hold that ends at `until_ns` is still the group's."""
        return self.holds.get(group) == until_ns

    def start(self) -> asyncio.Future[None]:
        self.failed = asyncio.get_running_loop().create_future()
        return self.failed

    def cancel(self) -> None:
        for timer in list(self.timers):
            timer.cancel()

    async def _end(self, group: str, until_ns: int) -> None:
        # A deadline, not synchronisation. The event loop may fire a timer before the clock that
        # `holding` reads has passed it (uvloop arms timers in whole milliseconds from its cached
        # time); woken then, the caller would find the hold still on and no timer left to end it,
        # and the unit would wait for the next message to arrive. So sleep until it has passed.
        while (left_ns := until_ns - time.monotonic_ns()) > 0:
            await asyncio.sleep(left_ns / 1e9)
        await self._wake(group, until_ns)

    def _ended(self, timer: asyncio.Task[None]) -> None:
        self.timers.discard(timer)
        failed = self.failed
        if failed is None or failed.done() or timer.cancelled():
            return
        if (exc := timer.exception()) is not None:
            failed.set_exception(exc)
