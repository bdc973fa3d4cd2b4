"""The planner service's hold on a work unit (coalescing lockstep tenants), on its pure inputs.

No NATS: `_holding` reads only the folded state, the config and the clock it is given.
"""

from __future__ import annotations

import asyncio
import math

import pytest

from libs.contracts.work import WorkUnit
from services.planner import hold
from services.planner.config import PlannerConfig
from services.planner.inputs import DEFAULT_GROUP
from services.planner.service import PlannerService
from services.planner.tests.sim import Sim, create, fb, rid

MS = 1_000_000


def service_with(sim: Sim, cohort: set[str], coalesce_ms: float = 25.0) -> PlannerService:
    service = PlannerService(bus=None, config=PlannerConfig(coalesce_ms=coalesce_ms))  # type: ignore[arg-type]
    service.planner = sim.planner
    service.hold.cohorts = {DEFAULT_GROUP: frozenset(cohort)}
    return service


def started(*models: str) -> Sim:
    sim = Sim(num_slots=4)
    sim.send(*(create(m) for m in models))
    sim.run()
    return sim


def next_work(sim: Sim) -> WorkUnit:
    unit = sim.planner.decide()
    assert isinstance(unit, WorkUnit)
    return unit


def stop_timers(service: PlannerService) -> None:
    service.hold.cancel()


def test_awaited_names_cohort_models_without_ready_datums() -> None:
    """`awaited` is the cohort's resident models whose next forward_backward has not arrived."""
    sim = started("a", "b", "c")
    sim.send(fb("a", 1, [4]))
    assert sim.planner.awaited(frozenset({"a", "b", "c"})) == {"b", "c"}
    sim.send(fb("c", 1, [4]))
    assert sim.planner.awaited(frozenset({"a", "b", "c"})) == {"b"}


def test_a_unit_is_held_until_the_cohort_arrives() -> None:
    """With nothing in flight, the first arrival of a two-model cohort is held; the second
    arrival ends the hold, and the unit then packs both."""

    async def scenario() -> None:
        sim = started("a", "b")
        service = service_with(sim, {"a", "b"})
        sim.send(fb("a", 1, [4]))
        assert service._holding(next_work(sim), 1_000 * MS)
        sim.send(fb("b", 1, [3]))
        unit = next_work(sim)
        assert not service._holding(unit, 1_001 * MS)
        assert sorted(item.request_id for item in unit.items) == [rid("a", 1), rid("b", 1)]
        stop_timers(service)

    asyncio.run(scenario())


def test_a_hold_ends_at_its_deadline() -> None:
    """A cohort model that does not come holds the unit back for coalesce_ms at most."""

    async def scenario() -> None:
        sim = started("a", "b")
        service = service_with(sim, {"a", "b"}, coalesce_ms=25.0)
        sim.send(fb("a", 1, [4]))
        unit = next_work(sim)
        assert service._holding(unit, 1_000 * MS)
        assert service._holding(unit, 1_024 * MS)
        assert not service._holding(unit, 1_025 * MS)
        stop_timers(service)

    asyncio.run(scenario())


def test_a_hold_whose_timer_fires_early_ends_only_once_its_deadline_has_passed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The event loop may fire a timer before the hold's clock reaches its deadline (uvloop arms
    timers in whole milliseconds from a cached time). The planner is woken once, with the
    deadline passed, and the unit is no longer held then: woken early, it would have found the
    hold still on and no timer left to end it."""
    clock = [1_000 * MS]
    real_sleep = asyncio.sleep

    async def early_timer(delay: float) -> None:  # every timer fires after half its delay
        clock[0] += math.ceil(delay * 1e9 / 2)
        await real_sleep(0)

    monkeypatch.setattr(hold.time, "monotonic_ns", lambda: clock[0])
    monkeypatch.setattr(hold.asyncio, "sleep", early_timer)

    async def scenario() -> None:
        sim = started("a", "b")
        service = service_with(sim, {"a", "b"}, coalesce_ms=25.0)
        woken: list[tuple[str, int, int]] = []

        async def wake(group: str, until_ns: int) -> None:
            woken.append((group, until_ns, clock[0]))

        service.hold._wake = wake
        sim.send(fb("a", 1, [4]))
        unit = next_work(sim)
        assert service._holding(unit, clock[0])
        await asyncio.gather(*service.hold.timers)
        assert [(group, until) for group, until, _ in woken] == [(DEFAULT_GROUP, 1_025 * MS)]
        woken_at = woken[0][2]
        assert woken_at >= 1_025 * MS
        assert service.hold.due(DEFAULT_GROUP, 1_025 * MS)
        assert not service._holding(unit, woken_at)

    asyncio.run(scenario())


def test_a_lone_tenant_and_a_busy_group_never_hold() -> None:
    """No hold for a cohort of one, with a unit of the group in flight, or with coalescing off."""

    async def scenario() -> None:
        sim = started("a", "b")
        sim.send(fb("a", 1, [4]))
        unit = next_work(sim)
        assert not service_with(sim, {"a"})._holding(unit, 0)
        assert not service_with(sim, {"a", "b"}, coalesce_ms=0)._holding(unit, 0)
        sim.plan()  # a's unit is now in flight
        sim.send(fb("a", 2, [4]))
        assert not service_with(sim, {"a", "b"})._holding(next_work(sim), 0)

    asyncio.run(scenario())


def test_decide_skips_held_groups() -> None:
    """`decide(skip=...)` offers nothing for a held group (the service plans other groups)."""
    sim = started("a")
    sim.send(fb("a", 1, [4]))
    assert sim.planner.decide(skip=frozenset({DEFAULT_GROUP})) is None
    assert isinstance(sim.planner.decide(), WorkUnit)
