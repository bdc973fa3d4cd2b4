"""Takeover of a lost trainer group's resident models by a live group (pure planner core):
the decision is a unit (`AdoptSlot` ops naming the abandoned units), abandoned outcomes are
ignored, abandoned datums are planned again, abandoned barriers run again in the takeover unit,
and a replay of the history folds to the same state."""

from __future__ import annotations

from libs.contracts.outcomes import BarrierOutcome, OpOutcome, WorkOutcome
from libs.contracts.results import ForwardBackwardResult, OptimStepResponse
from libs.contracts.work import AdoptSlot, BarrierUnit, InitSlot, PageOut, StepSlot, WorkUnit
from services.planner.decide import WAIT_SLOTS
from services.planner.facts import OutcomeArrived
from services.planner.tests.sim import Sim, create, fb, optim, rid, trainer_outcome
from services.planner.tests.test_groups import grouped


def on_a(sim: Sim, *models: str) -> None:
    """Create `models`, each placed on group a (b is made to look lost while they are created)."""
    sim.planner.groups["b"].live = False
    sim.send(*(create(m) for m in models))
    sim.run()
    sim.planner.groups["b"].live = True
    assert all(sim.planner.streams[m].group == "a" for m in models)


def test_a_resident_model_of_a_lost_group_is_adopted_by_a_live_group_when_it_has_work() -> None:
    """m1 and m2 live on a; a is lost. m1's next forward_backward first gets a takeover unit on
    b (one AdoptSlot from a, nothing abandoned), then runs on b; idle m2 stays where it is."""
    sim = grouped(slots=2)
    on_a(sim, "m1", "m2")
    sim.planner.groups["a"].live = False
    sim.send(fb("m1", 1, [3]))
    takeover, work = sim.plan()
    assert isinstance(takeover, BarrierUnit) and takeover.group == "b"
    (adopt,) = takeover.ops
    assert isinstance(adopt, AdoptSlot)
    assert (adopt.model_id, adopt.from_group, adopt.abandoned, adopt.fresh) == ("m1", "a", [], False)
    assert isinstance(work, WorkUnit) and work.group == "b" and work.items[0].slot == adopt.slot
    assert sim.planner.streams["m2"].group == "a"
    assert sim.planner.state.slots["a"] == {1: "m2"}  # m1's slot on a is free for a's return


def test_an_abandoned_unit_is_planned_again_and_its_late_outcome_is_ignored() -> None:
    """m1 and m2's datums are packed into one unit on a, which is lost before its outcome: both
    models move to b in one takeover unit that abandons it, their datums go into a new unit on b,
    and the abandoned unit's outcome, arriving later, has no effect: each request completes
    once, with b's results."""
    sim = grouped(slots=2)
    on_a(sim, "m1", "m2")
    sim.send(fb("m1", 1, [3]), fb("m2", 1, [4]))
    (lost_unit,) = sim.plan()
    assert isinstance(lost_unit, WorkUnit) and lost_unit.group == "a" and len(lost_unit.items) == 2
    sim.planner.groups["a"].live = False
    takeover, again = sim.plan()
    assert isinstance(takeover, BarrierUnit) and takeover.group == "b"
    adopts = [op for op in takeover.ops if isinstance(op, AdoptSlot)]
    assert sorted(op.model_id for op in adopts) == ["m1", "m2"]
    assert all(op.abandoned == [lost_unit.unit_id] for op in adopts)
    assert isinstance(again, WorkUnit) and again.group == "b"
    assert sorted((i.request_id, i.index) for i in again.items) == [(rid("m1", 1), 0), (rid("m2", 1), 0)]
    sim.finish(takeover)
    late = trainer_outcome(lost_unit)
    assert not sim.planner.apply(OutcomeArrived(late))  # abandoned: ignored
    sim.finish(again)
    sim.history.append(("outcome", len(sim.outcomes)))  # the late outcome is part of the history
    sim.outcomes.append(late)
    for model in ("m1", "m2"):
        assert isinstance(sim.result(rid(model, 1)), ForwardBackwardResult)
    sim.assert_all_completed_once()
    assert sim.replayed().state == sim.planner.state


def test_an_abandoned_optim_step_runs_again_in_the_takeover_unit_and_consumes_one_window() -> None:
    """m1's optim_step is in flight on a when a is lost: the takeover unit adopts m1 on b and
    runs the same StepSlot there (on its new slot); the window is consumed once, so the next
    forward_backward and optim_step of m1 run normally on b."""
    sim = grouped(slots=1)
    on_a(sim, "m1")
    sim.send(fb("m1", 1, [3]))
    sim.run()
    sim.send(optim("m1", 2))
    (step_unit,) = sim.plan()
    sim.planner.groups["a"].live = False
    (takeover,) = sim.plan()
    assert isinstance(takeover, BarrierUnit) and takeover.group == "b"
    adopt, step = takeover.ops
    assert isinstance(adopt, AdoptSlot) and adopt.abandoned == [step_unit.unit_id]
    assert isinstance(step, StepSlot) and step.request_id == rid("m1", 2) and step.slot == adopt.slot
    sim.finish(takeover)
    assert isinstance(sim.result(rid("m1", 2)), OptimStepResponse)
    assert sim.planner.streams["m1"].windows_done == 1
    sim.send(fb("m1", 3, [3]), optim("m1", 4))
    units = sim.run()
    assert [u.group for u in units] == ["b", "b"]
    assert isinstance(units[1], BarrierUnit) and isinstance(units[1].ops[0], StepSlot)
    sim.assert_all_completed_once()


def test_an_abandoned_create_is_made_again_after_a_fresh_adoption() -> None:
    """m1's create is in flight on a when a is lost: the takeover adopts m1 `fresh` on b (it may
    have no state on a) and runs its InitSlot there; the create completes once."""
    sim = grouped(slots=1)
    sim.planner.groups["b"].live = False
    sim.send(create("m1"))
    (init_unit,) = sim.plan()
    sim.planner.groups["b"].live = True
    sim.planner.groups["a"].live = False
    (takeover,) = sim.plan()
    adopt, init = takeover.ops  # type: ignore[union-attr]
    assert isinstance(adopt, AdoptSlot) and adopt.fresh and adopt.abandoned == [init_unit.unit_id]
    assert isinstance(init, InitSlot) and init.slot == adopt.slot
    sim.finish(takeover)
    sim.send(fb("m1", 1, [3]))
    assert [u.group for u in sim.run()] == ["b"]
    sim.assert_all_completed_once()


def test_a_full_live_group_pages_out_an_idle_model_to_take_one_over() -> None:
    """b's only slot holds idle m2: m1's takeover from lost a pages m2 out (exported: two groups
    serve the base) in the same unit, before adopting m1 into that slot. With m2 busy instead,
    m1 waits for slots."""
    sim = grouped(slots=1)
    on_a(sim, "m1")
    sim.send(create("m2"))
    sim.run()
    assert sim.planner.streams["m2"].group == "b"
    sim.planner.groups["a"].live = False
    sim.send(fb("m2", 1, [3]))
    (busy_unit,) = sim.plan()
    sim.send(fb("m1", 1, [3]))
    assert sim.planner.waiting() == {rid("m1", 1): WAIT_SLOTS}
    assert sim.plan() == []
    sim.finish(busy_unit)
    takeover, _ = sim.plan()
    page_out, adopt = takeover.ops  # type: ignore[union-attr]
    assert isinstance(page_out, PageOut) and page_out.model_id == "m2" and page_out.export
    assert isinstance(adopt, AdoptSlot) and adopt.slot == page_out.slot


def test_a_failed_adoption_closes_the_model_and_fails_its_queue_once() -> None:
    """The trainer could not rebuild m1's state (no readable snapshot): m1 is closed with a
    message that says so, its queued forward_backward fails once, and its slot on b is free."""
    sim = grouped(slots=1)
    on_a(sim, "m1")
    sim.planner.groups["a"].live = False
    sim.send(fb("m1", 1, [3]))
    takeover, work = sim.plan()
    adopt = takeover.ops[0]  # type: ignore[union-attr]
    failed = BarrierOutcome(
        unit_id=takeover.unit_id,
        ops=[OpOutcome(model_id="m1", request_id=adopt.request_id, ok=False, error="no snapshot", category="server")],
    )
    sim.finish(takeover, failed)
    sim.finish(work, WorkOutcome(unit_id=work.unit_id, error="slot 0 is not initialised"))
    assert sim.planner.streams["m1"].closed
    assert "trainer group a was lost" in sim.planner.streams["m1"].closed_reason
    sim.send(optim("m1", 2))
    assert "lost its training state" in sim.failure(rid("m1", 2)).error
    assert sim.planner.state.slots["b"] == {}
    sim.assert_all_completed_once()


def takeover_history() -> Sim:
    """Two models on a with packed datums and an optim step in flight when a is lost, taken
    over by b; then more training on b, and the abandoned outcomes arriving late."""
    sim = grouped(slots=2)
    on_a(sim, "m1", "m2")
    sim.send(fb("m1", 1, [3, 2]), fb("m2", 1, [4]))
    sim.run()
    sim.send(optim("m1", 2), fb("m2", 2, [5]))
    in_flight = sim.plan()
    sim.planner.groups["a"].live = False
    sim.send(fb("m1", 3, [2]))
    units = sim.plan()
    for unit in units:
        sim.finish(unit)
    sim.run()
    for unit in in_flight:  # a comes back and reports what it ran before it died: ignored
        sim.history.append(("outcome", len(sim.outcomes)))
        sim.outcomes.append(trainer_outcome(unit))
        sim.planner.apply(OutcomeArrived(sim.outcomes[-1]))
        sim.planner.collect()
    sim.planner.groups["a"].live = True
    sim.send(optim("m1", 4), optim("m2", 3))
    sim.run()
    return sim


def test_replay_across_a_takeover_folds_to_the_live_state_at_every_cut() -> None:
    """A planner rebuilt from any prefix of the history (commands, then units, then outcomes, as
    on restart) and then fed the rest in live order reaches the live planner's state; the
    takeover decided while a was lost needs no clock or liveness on replay (it is a unit)."""
    live = takeover_history()
    live.assert_all_completed_once()
    expected = live.planner.snapshot()
    for cut in range(len(live.history) + 1):
        fresh = live.replayed(cut)
        for what, index in live.history[cut:]:
            fresh.apply(live.fact(what, index))
            fresh.collect()
        assert fresh.snapshot() == expected, f"cut {cut}"


def test_a_restarted_planner_decides_what_the_live_one_decided_after_the_takeover() -> None:
    """Restarted right after the takeover unit (a still lost), the planner plans the same next
    units as the live one."""
    live = takeover_history()
    cut = next(
        k for k, (what, index) in enumerate(live.history)
        if what == "unit" and any(isinstance(op, AdoptSlot) for op in getattr(live.units[index], "ops", []))
    ) + 1
    fresh = live.replayed(cut)
    fresh.groups = {g: type(info)(info.num_slots, info.base_model, info.live) for g, info in live.planner.groups.items()}
    fresh.groups["a"].live = False
    planned = fresh.plan()
    later = [live.units[i] for what, i in live.history[cut:] if what == "unit"][: len(planned)]
    assert planned and planned == later
