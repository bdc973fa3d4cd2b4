"""Trainer groups and base models in the planner's pure core: placement by load and base model,
moves between groups through an exported page-out, lost groups, and replay of placements."""

from __future__ import annotations

import msgspec

from libs.checkpoints.layout import export_file
from libs.contracts.outcomes import BarrierOutcome, OpOutcome, WorkOutcome
from libs.contracts.requests import CreateModel
from libs.contracts.work import BarrierUnit, InitSlot, PageIn, PageOut, Unit, WorkUnit
from services.planner.decide import WAIT_GROUP, WAIT_SLOTS
from services.planner.inputs import GroupInfo
from services.planner.tests.sim import Sim, create, fb, optim, rid, unload


def grouped(slots: int = 2, bases: tuple[str, str] = ("tiny-qwen3", "tiny-qwen3")) -> Sim:
    sim = Sim(num_slots=slots)
    sim.planner.groups = {
        "a": GroupInfo(num_slots=slots, base_model=bases[0]),
        "b": GroupInfo(num_slots=slots, base_model=bases[1]),
    }
    return sim


def create_on(model: str, base: str) -> CreateModel:
    return msgspec.structs.replace(create(model), base_model=base)


def placed(units: list[Unit]) -> dict[str, str]:
    """model -> group of every create / page-in in `units`."""
    out = {}
    for unit in units:
        if isinstance(unit, BarrierUnit):
            for op in unit.ops:
                if isinstance(op, (InitSlot, PageIn)):
                    out[op.model_id] = unit.group
    return out


def test_creates_are_balanced_across_groups_and_units_stay_within_one_group() -> None:
    """Four creates on two groups of two slots land two per group; a work unit packs only datums of
    models on its own group, and an optim_step barrier merges only its own group's steps."""
    sim = grouped(slots=2)
    sim.send(*(create(m) for m in "wxyz"))
    where = placed(sim.run())
    assert sorted(where.values()) == ["a", "a", "b", "b"]
    sim.send(*(fb(m, 1, [3]) for m in "wxyz"))
    units = sim.plan()
    assert len(units) == 2 and all(isinstance(u, WorkUnit) for u in units)
    for unit in units:
        assert isinstance(unit, WorkUnit)
        assert {where[i.model_id] for i in unit.items} == {unit.group}
    for unit in units:
        sim.finish(unit)
    sim.send(*(optim(m, 2) for m in "wxyz"))
    barriers = sim.plan()
    assert len(barriers) == 2
    for unit in barriers:
        assert isinstance(unit, BarrierUnit)
        assert {where[op.model_id] for op in unit.ops} == {unit.group}
    for unit in barriers:
        sim.finish(unit)
    sim.assert_all_completed_once()


def test_a_model_paged_out_with_an_export_pages_in_on_another_group_with_a_free_slot() -> None:
    """With one slot per group: m1 on a, m2 on b; m3's create pages m1 out on a, exporting its
    state (two groups serve its base); once b's slot frees, m1's next command pages it in on b,
    reading that export: a free slot elsewhere comes before evicting m3 at home."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m3"))
    (evict,) = sim.plan()
    assert isinstance(evict, BarrierUnit) and evict.group == "a"
    page_out, init = evict.ops
    assert isinstance(page_out, PageOut) and page_out.model_id == "m1"
    assert page_out.export == export_file("m1", evict.unit_id)
    assert isinstance(init, InitSlot) and init.model_id == "m3"
    sim.finish(evict)
    sim.send(unload("m2", 1))
    sim.run()
    sim.send(fb("m1", 1, [3]))
    move, work_unit = sim.plan()
    assert isinstance(move, BarrierUnit) and move.group == "b"
    (page_in,) = move.ops
    assert isinstance(page_in, PageIn) and page_in.source == page_out.export
    assert isinstance(work_unit, WorkUnit) and work_unit.group == "b"
    assert sim.replayed().state == sim.planner.state  # placements are a fold of the units


def test_with_no_free_slot_anywhere_the_least_recently_used_idle_model_of_any_group_makes_room() -> None:
    """m1 paged out on a (exported); a holds m3 and b holds m2, both idle, m2 the least recently
    used: m1 pages m2 out on b and pages in there from its export (as with one group, the LRU
    idle model goes first, whichever group holds it)."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m3"))  # evicts m1 on a (m1 is older than m2)
    (evict,) = sim.run()
    sim.send(fb("m1", 1, [3]))
    barrier = sim.plan()[0]
    assert isinstance(barrier, BarrierUnit) and barrier.group == "b"
    page_out, page_in = barrier.ops
    assert isinstance(page_out, PageOut) and page_out.model_id == "m2"
    assert isinstance(page_in, PageIn) and page_in.model_id == "m1"
    assert page_in.source == export_file("m1", evict.unit_id)


def test_a_model_paged_out_and_back_in_on_its_own_group_reads_its_page_store() -> None:
    """Only a move reads the export: m1 paged out on a and paged in on a again names no source."""
    sim = grouped(slots=1)
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m1"))
    sim.run()  # m2 on a, m1 on b
    sim.send(create("m3"))  # evicts m2 (LRU) on a
    sim.run()
    sim.send(fb("m1", 1, [3]))
    sim.run()  # m1 is used: m3 on a is now the LRU idle model
    sim.send(fb("m2", 1, [3]))
    barrier = sim.plan()[0]
    assert isinstance(barrier, BarrierUnit) and barrier.group == "a"
    page_out, page_in = barrier.ops
    assert isinstance(page_out, PageOut) and page_out.model_id == "m3"
    assert isinstance(page_in, PageIn) and page_in.model_id == "m2" and page_in.source == ""


def test_a_lost_group_is_not_placed_on_and_its_exported_models_move() -> None:
    """Group a stops reporting: a create goes to b, m1 (paged out on a with an export) pages in on
    b, and with b full of busy models a create waits for slots, not for a group."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m3"))  # m1 paged out on a (exported), m3 on a
    sim.run()
    sim.planner.groups["a"].live = False
    sim.send(unload("m2", 1))
    sim.run()
    sim.send(fb("m1", 1, [3]))
    move = sim.plan()[0]
    assert isinstance(move, BarrierUnit) and move.group == "b"
    sim.send(create("m4"))  # b's only slot holds m1 with work in flight; a is lost
    assert sim.planner.waiting() == {rid("m4", 0): WAIT_SLOTS}
    sim.planner.groups["b"].live = False
    assert sim.planner.waiting() == {rid("m4", 0): WAIT_GROUP}


def test_models_are_placed_only_on_groups_of_their_base_model_and_an_unserved_base_waits() -> None:
    """Groups a (tiny-qwen3) and b (tiny-wide): each create lands on its base's group, whatever the
    load; a base no group serves waits with WAIT_GROUP; no export happens for a base with one group."""
    sim = grouped(slots=2, bases=("tiny-qwen3", "tiny-wide"))
    sim.send(create_on("q1", "tiny-qwen3"), create_on("q2", "tiny-qwen3"), create_on("w1", "tiny-wide"))
    assert placed(sim.run()) == {"q1": "a", "q2": "a", "w1": "b"}
    sim.send(create_on("q3", "tiny-qwen3"))
    (evict,) = sim.plan()
    assert isinstance(evict, BarrierUnit) and evict.group == "a"
    assert isinstance(evict.ops[0], PageOut) and evict.ops[0].export == ""
    sim.finish(evict)
    sim.send(create_on("g1", "other-base"))
    assert sim.plan() == []
    assert sim.planner.waiting() == {rid("g1", 0): WAIT_GROUP}


def test_a_resident_model_of_a_lost_group_waits_while_no_live_group_has_room_and_runs_home_when_back() -> None:
    """m1 is resident on a, m2 on b (one slot each) with work in flight; a is lost: m1 cannot be
    taken over (b's only slot is busy), so its next command waits (WAIT_SLOTS); once a is live
    again before b frees, m1's command is emitted to a (see test_takeover.py for the takeover)."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(fb("m2", 1, [3]))
    (unit,) = sim.plan()
    assert isinstance(unit, WorkUnit) and unit.group == "b"
    sim.planner.groups["a"].live = False
    sim.send(fb("m1", 1, [3]))
    assert sim.plan() == []
    assert sim.planner.waiting() == {rid("m1", 1): WAIT_SLOTS}
    sim.planner.groups["a"].live = True
    (back,) = sim.plan()
    assert isinstance(back, WorkUnit) and back.group == "a" and {i.model_id for i in back.items} == {"m1"}
    assert sim.planner.waiting() == {}


def test_a_create_that_cannot_be_placed_does_not_hold_up_one_for_another_group() -> None:
    """Group a (base X) is lost, group b (base Y) is free: m1's create on X waits with
    WAIT_GROUP, and m2's create on Y, which arrived after it, is placed on b at once."""
    sim = grouped(slots=1, bases=("base-x", "base-y"))
    sim.planner.groups["a"] = GroupInfo(num_slots=1, base_model="base-x", live=False)
    sim.send(create_on("m1", "base-x"), create_on("m2", "base-y"))
    assert placed(sim.run()) == {"m2": "b"}
    assert sim.planner.waiting() == {rid("m1", 0): WAIT_GROUP}


def test_a_create_waiting_for_a_busy_group_does_not_hold_up_one_for_a_free_group() -> None:
    """Group a's only slot holds a model with work in flight; a create for a's base waits for it,
    and a younger create for b's base is placed on b meanwhile."""
    sim = grouped(slots=1, bases=("base-x", "base-y"))
    sim.send(create_on("m0", "base-x"))
    sim.run()
    sim.send(fb("m0", 1, [3]))
    [busy] = sim.plan()  # m0's unit in flight: m0 cannot be paged out
    sim.send(create_on("m1", "base-x"), create_on("m2", "base-y"))
    assert placed(sim.plan()) == {"m2": "b"}
    assert sim.planner.waiting() == {rid("m1", 0): WAIT_SLOTS}
    sim.finish(busy)


def test_a_model_whose_export_is_in_flight_is_not_paged_in_on_another_group_before_it_is_written() -> None:
    """m3's create pages m1 out on a (exporting it); m1's next command arrives at once, and b's
    idle m2 could make room. The export is written by a's trainer when it runs that unit, so m1
    waits until its outcome is folded, and only then pages in on b from the export (never from a
    file that is not there yet)."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m3"))
    (evict,) = sim.plan()
    assert isinstance(evict, BarrierUnit) and evict.group == "a"
    page_out = evict.ops[0]
    assert isinstance(page_out, PageOut) and page_out.model_id == "m1" and page_out.export
    sim.send(fb("m1", 1, [3]))
    assert sim.plan() == []
    assert sim.planner.waiting() == {rid("m1", 1): WAIT_SLOTS}
    sim.finish(evict)
    move, work = sim.plan()
    assert isinstance(move, BarrierUnit) and move.group == "b"
    paged_m2, page_in = move.ops
    assert isinstance(paged_m2, PageOut) and paged_m2.model_id == "m2"
    assert isinstance(page_in, PageIn) and page_in.source == page_out.export
    assert isinstance(work, WorkUnit) and work.group == "b"


def test_a_page_in_that_fails_closes_the_model_and_its_queued_work_fails_saying_why() -> None:
    """b's trainer could not read m1's export: m1 is closed with a message naming the page-in and
    the trainer's error, its queued forward_backward fails once (never run on a slot that does not
    hold it), and b's slot is free again."""
    sim = grouped(slots=1)
    sim.send(create("m1"))
    sim.run()
    sim.send(create("m2"))
    sim.run()
    sim.send(create("m3"))
    sim.run()  # m1 paged out on a, exported
    sim.send(fb("m1", 1, [3]))
    move, work = sim.plan()
    paged_m2, page_in = move.ops  # type: ignore[union-attr]
    assert isinstance(page_in, PageIn) and page_in.source
    failed = BarrierOutcome(
        unit_id=move.unit_id,
        ops=[
            OpOutcome(model_id="m2", request_id=paged_m2.request_id, ok=True),
            OpOutcome(model_id="m1", request_id=page_in.request_id, ok=False, error="no such file", category="server"),
        ],
    )
    sim.finish(move, failed)
    sim.finish(work, WorkOutcome(unit_id=work.unit_id, error="slot 0 is not initialised"))
    stream = sim.planner.streams["m1"]
    assert stream.closed and "could not be paged in on trainer group b (no such file)" in stream.closed_reason
    assert "could not be paged in" in sim.failure(rid("m1", 1)).error
    assert sim.planner.state.slots["b"] == {}
    sim.assert_all_completed_once()
