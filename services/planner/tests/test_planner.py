"""The planner's pure core: packing, ordering, windows, barriers, failures, restart determinism.

No NATS, no trainer: `Sim` feeds commands, collects units and answers them with a fake trainer.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import msgspec
import numpy as np

from libs.contracts.outcomes import BarrierOutcome, OpOutcome, WorkOutcome
from libs.contracts.results import ForwardBackwardResult, JsonResult
from libs.contracts.work import (
    BarrierUnit,
    DiscardSlot,
    DropPaged,
    ExportSlot,
    FailRequest,
    InitSlot,
    PageIn,
    PageOut,
    SaveSlot,
    StepSlot,
    Unit,
    WorkUnit,
)
from services.planner.facts import CommandArrived, OutcomeArrived, UnitEmitted
from services.planner.inputs import DEFAULT_GROUP, Limits
from services.planner.packing import LOAD_WITH_PENDING_GRADS
from services.planner.planner import Planner
from services.planner.streams import SEALED
from services.planner.tests.sim import (
    DISCARDED,
    Sim,
    create,
    encoded,
    fb,
    optim,
    rejected,
    rid,
    sampler_save,
    save,
    unload,
)


def work(units: list[Unit]) -> list[WorkUnit]:
    assert all(isinstance(u, WorkUnit) for u in units), units
    return [u for u in units if isinstance(u, WorkUnit)]


def rows(unit: Unit) -> list[tuple[str, int]]:
    assert isinstance(unit, WorkUnit)
    return [(item.request_id, item.index) for item in unit.items]


def ops(unit: Unit) -> list[type[object]]:
    assert isinstance(unit, BarrierUnit)
    return [type(op) for op in unit.ops]


def started(*models: str, num_slots: int = 4, token_budget: int = 1_000) -> Sim:
    """A Sim with these models created (their create_model ran)."""
    sim = Sim(num_slots=num_slots, token_budget=token_budget)
    sim.send(*(create(m) for m in models))
    sim.run()
    for m in models:
        assert isinstance(sim.result(rid(m, 0)), JsonResult)
    return sim


# --- packing ---------------------------------------------------------------------------------
def test_calls_arriving_while_a_unit_is_in_flight_coalesce_into_one_unit() -> None:
    """With max_units_in_flight=1, nothing is emitted while a unit awaits its outcome; the
    forward_backward calls of three tenants that arrived meanwhile form the next unit together."""
    sim = started("a", "b", "c", "d")
    sim.planner.limits = Limits(token_budget=sim.token_budget, max_units_in_flight=1)
    sim.send(fb("a", 1, [4]))
    [first] = work(sim.plan())
    assert rows(first) == [(rid("a", 1), 0)]
    sim.send(fb("b", 1, [3]), fb("c", 1, [2]), fb("d", 1, [5]))
    assert sim.plan() == []  # the pipeline is full
    sim.finish(first)
    [second] = work(sim.plan())
    assert sorted(rows(second)) == [(rid("b", 1), 0), (rid("c", 1), 0), (rid("d", 1), 0)]


def test_no_limit_emits_each_call_as_it_arrives() -> None:
    """max_units_in_flight=0 (the pure planner's default) plans each arrival at once."""
    sim = started("a", "b")
    sim.send(fb("a", 1, [4]))
    [first] = work(sim.plan())
    sim.send(fb("b", 1, [3]))
    [second] = work(sim.plan())
    assert rows(first) == [(rid("a", 1), 0)] and rows(second) == [(rid("b", 1), 0)]


def test_same_loss_rows_pack_across_models() -> None:
    sim = started("a", "b")
    sim.send(fb("a", 1, [4, 4]), fb("b", 1, [3]))
    [unit] = work(sim.plan())
    assert rows(unit) == [("a:1", 0), ("a:1", 1), ("b:1", 0)]
    assert sorted({item.slot for item in unit.items}) == [0, 1]
    assert unit.num_tokens == 11


def test_different_loss_config_does_not_pack() -> None:
    sim = started("a", "b", "c", "d")
    sim.send(
        fb("a", 1, [4], "ppo", {"clip_low_threshold": 0.8}),
        fb("b", 1, [4], "ppo", {"clip_low_threshold": 0.9}),
        fb("c", 1, [4], "ppo", {"clip_low_threshold": 0.8}, forward_only=True),
        fb("d", 1, [4], "cross_entropy"),
    )
    units = work(sim.plan())
    assert [rows(u) for u in units] == [[("a:1", 0)], [("b:1", 0)], [("c:1", 0)], [("d:1", 0)]]


def test_equal_configs_pack_whatever_their_spelling() -> None:
    """1 and 1.0, and key order, are the same loss configuration."""
    sim = started("a", "b")
    sim.send(
        fb("a", 1, [2], "ppo", {"clip_low_threshold": 1, "clip_high_threshold": 2.0}),
        fb("b", 1, [2], "ppo", {"clip_high_threshold": 2, "clip_low_threshold": 1.0}),
    )
    assert len(work(sim.plan())) == 1


def test_token_budget_splits_a_large_request() -> None:
    sim = started("a", token_budget=10)
    sim.send(fb("a", 1, [5, 5, 5]))
    units = work(sim.plan())
    assert [rows(u) for u in units] == [[("a:1", 0), ("a:1", 1)], [("a:1", 2)]]
    for unit in units:
        sim.finish(unit)
    body = sim.result("a:1")
    assert isinstance(body, ForwardBackwardResult)
    assert [np.frombuffer(o.logprobs, "<f4")[0] for o in body.outputs] == [-1.0, -2.0, -3.0]  # in datum order
    assert body.metrics == {"loss:sum": 15.0}


def test_an_oversized_datum_ships_alone() -> None:
    sim = started("a", "b", token_budget=10)
    sim.send(fb("a", 1, [25]), fb("b", 1, [3, 3]))
    units = work(sim.plan())
    assert [rows(u) for u in units] == [[("a:1", 0)], [("b:1", 0), ("b:1", 1)]]
    assert units[0].num_tokens == 25


# --- ordering --------------------------------------------------------------------------------
def test_oldest_arrival_goes_first_an_optim_before_later_rows() -> None:
    sim = started("a", "b")
    sim.send(fb("a", 1, [4]))
    sim.run()
    sim.send(optim("a", 2), fb("b", 1, [4]))
    units = sim.plan()
    assert [type(u) for u in units] == [BarrierUnit, WorkUnit]
    assert ops(units[0]) == [StepSlot]


def test_oldest_arrival_goes_first_rows_before_a_later_optim() -> None:
    sim = started("a", "b")
    sim.send(fb("a", 1, [4]))
    sim.run()
    sim.send(fb("b", 1, [4]), optim("a", 2))
    units = sim.plan()
    assert [type(u) for u in units] == [WorkUnit, BarrierUnit]


def test_optim_barriers_of_several_models_merge_save_does_not() -> None:
    sim = started("a", "b", "c")
    sim.send(fb("a", 1, [2]), fb("b", 1, [2]), fb("c", 1, [2]))
    sim.run()
    sim.send(optim("a", 2), save("c", 2), optim("b", 2))
    sim.send(optim("c", 3))
    units = sim.plan()
    assert [ops(u) for u in units] == [[StepSlot, StepSlot], [SaveSlot]]  # c's save: alone, grads kept
    assert isinstance(units[0], BarrierUnit)
    assert [op.model_id for op in units[0].ops] == ["a", "b"]
    for unit in units:
        sim.finish(unit)
    [last] = sim.plan()
    assert ops(last) == [StepSlot]


def test_save_runs_alone_even_beside_ready_optims() -> None:
    sim = started("a", "b")
    sim.send(save("a", 1), optim("b", 1))
    units = sim.plan()
    assert [ops(u) for u in units] == [[SaveSlot], [StepSlot]]


def test_issued_rows_are_never_reissued() -> None:
    sim = started("a", "b")
    sim.send(fb("a", 1, [3, 3, 3]))
    [first] = sim.plan()
    assert sim.plan() == []
    sim.send(fb("b", 1, [3]))
    [second] = sim.plan()
    assert rows(second) == [("b:1", 0)]
    sim.finish(first)
    sim.finish(second)
    assert sim.plan() == []
    assert isinstance(sim.result("a:1"), ForwardBackwardResult)


def test_out_of_order_seq_ids_are_buffered_and_run_in_order() -> None:
    sim = started("a")
    sim.send(optim("a", 3), fb("a", 2, [2]))
    assert sim.plan() == []
    assert sim.planner.streams["a"].missing_seq == 1
    sim.send(fb("a", 1, [2]))
    [unit] = sim.plan()
    assert rows(unit) == [("a:1", 0), ("a:2", 0)]  # the window's two chunks, then the step
    sim.finish(unit)
    [step] = sim.plan()
    assert ops(step) == [StepSlot]
    sim.finish(step)
    assert list(sim.results) == ["a:0", "a:1", "a:2", "a:3"]  # completed in seq order


def test_duplicates_have_no_effect() -> None:
    sim = started("a")
    assert sim.send(fb("a", 3, [2])) == [True]
    assert sim.send(fb("a", 3, [2])) == [False]  # buffered duplicate
    assert sim.send(fb("a", 1, [2]), fb("a", 2, [2])) == [True, True]
    assert sim.send(fb("a", 1, [2]), create("a")) == [False, False]  # sequenced duplicates
    [unit] = sim.plan()
    assert rows(unit) == [("a:1", 0), ("a:2", 0), ("a:3", 0)]
    sim.finish(unit)
    sim.assert_all_completed_once()


def test_a_sealed_gap_lets_later_requests_run() -> None:
    sim = started("a")
    sim.send(fb("a", 2, [2]), optim("a", 3))
    assert sim.plan() == []
    sim.send(rejected("a", 1, SEALED, "seq_id 1 of model a never arrived"))
    [unit] = sim.plan()
    assert rows(unit) == [("a:2", 0)]
    sim.finish(unit)
    assert sim.failure("a:1").error == "seq_id 1 of model a never arrived"
    assert isinstance(sim.result("a:2"), ForwardBackwardResult)
    # The sealed seq_id might have been a chunk of this window: the window is not applied.
    [step] = sim.plan()
    assert ops(step) == [DiscardSlot]
    sim.finish(step)
    assert "seq_id 1 never arrived (sealed)" in sim.failure("a:3").error


def test_the_gap_timer_starts_with_the_hole_and_later_arrivals_do_not_reset_it() -> None:
    planner = Planner(num_slots=1)
    planner.apply(CommandArrived(create("a"), 1, now_ns=100))
    planner.apply(CommandArrived(fb("a", 2, [1]), 2, now_ns=200))
    planner.apply(CommandArrived(fb("a", 3, [1]), 3, now_ns=300))
    stream = planner.streams["a"]
    assert (stream.missing_seq, stream.gap_since_ns) == (1, 200)
    planner.apply(CommandArrived(fb("a", 1, [1]), 4, now_ns=400))
    assert (stream.missing_seq, stream.gap_since_ns) == (None, None)
    planner.apply(CommandArrived(fb("a", 5, [1]), 5, now_ns=500))
    assert (stream.missing_seq, stream.gap_since_ns) == (4, 500)


# --- windows and poisoning -------------------------------------------------------------------
def test_a_failed_forward_backward_poisons_its_window_and_the_next_is_clean() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]), fb("a", 2, [2, 2]), optim("a", 3))
    [unit] = sim.plan()
    sim.finish(unit, datum_errors={("a:2", 1): "data[1].tokens has ids outside [0, 64)"})
    assert sim.failure("a:2").error == "data[1].tokens has ids outside [0, 64)"
    assert sim.failure("a:2").category == "user"
    assert isinstance(sim.result("a:1"), ForwardBackwardResult)
    [step] = sim.plan()
    assert ops(step) == [DiscardSlot]
    sim.finish(step)
    failure = sim.failure("a:3")
    assert failure.category == "user"
    assert failure.error == (
        "the gradient window before optim_step seq_id 3 is incomplete (forward_backward seq_id 2 failed): "
        + DISCARDED
    )
    sim.send(fb("a", 4, [2]), optim("a", 5))
    sim.run()
    assert ops(sim.units[-1]) == [StepSlot]
    assert isinstance(sim.result("a:5"), JsonResult)
    assert not sim.planner.streams["a"].pending_grads


def test_a_rejected_forward_backward_poisons_its_window() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]), rejected("a", 2, "forward_backward"), optim("a", 3))
    sim.run()
    assert sim.failure("a:2").error == "refused by the gateway"
    assert ops(sim.units[-1]) == [DiscardSlot]
    assert "forward_backward seq_id 2 was rejected" in sim.failure("a:3").error


def test_forward_only_failures_do_not_poison() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]), fb("a", 2, [2], forward_only=True), rejected("a", 3, "forward"), optim("a", 4))
    units = sim.plan()
    for unit in units:
        sim.finish(unit, datum_errors={("a:2", 0): "bad"})
    sim.run()
    assert sim.failure("a:2").error == "bad" and sim.failure("a:3")
    assert ops(sim.units[-1]) == [StepSlot]
    assert isinstance(sim.result("a:4"), JsonResult)


def test_a_rejected_optim_step_does_not_end_the_window() -> None:
    """The gateway refused the step (e.g. NaN lr): the gradients stay for the next optim_step."""
    sim = started("a")
    sim.send(fb("a", 1, [2]), rejected("a", 2, "optim_step"), fb("a", 3, [2]))
    [unit] = sim.plan()
    assert rows(unit) == [("a:1", 0), ("a:3", 0)]  # one window across the refused step
    sim.finish(unit)
    assert sim.planner.streams["a"].pending_grads  # the refused step ended nothing
    from libs.contracts.requests import CheckpointRef, LoadWeights

    ref = CheckpointRef(tinker_path="tinker://x/weights/y", directory="/nowhere", with_optimizer=True)
    sim.send(LoadWeights(model_id="a", seq_id=4, request_id="a:4", restore=ref))
    [unit] = sim.plan()
    assert ops(unit) == [FailRequest]  # the window still holds gradients
    sim.finish(unit)
    sim.send(optim("a", 5))
    sim.run()
    assert ops(sim.units[-1]) == [StepSlot]


def test_a_failed_unit_fails_every_request_in_it_and_poisons_their_windows() -> None:
    sim = started("a", "b")
    sim.send(fb("a", 1, [2]), fb("b", 1, [2], forward_only=True), fb("a", 2, [2]))
    units = sim.plan()
    assert len(units) == 2
    for unit in units:
        sim.finish(unit, unit_error="trainer error: RuntimeError: boom")
    for request in ("a:1", "b:1", "a:2"):
        assert sim.failure(request).category == "server"
        assert sim.failure(request).error == "trainer error: RuntimeError: boom"
    sim.send(optim("a", 3), optim("b", 2))
    [step] = sim.plan()
    assert [type(op) for op in step.ops] == [DiscardSlot, StepSlot]  # type: ignore[union-attr]


def test_a_datum_the_trainer_did_not_report_fails_instead_of_hanging() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2, 2]))
    [unit] = sim.plan()
    sim.finish(unit, omit={("a:1", 1)})
    assert sim.failure("a:1").error == "the trainer returned no result for data[1]"


def test_a_redelivered_outcome_has_no_effect() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2, 2]), fb("a", 2, [2]))
    units = sim.plan()
    outcome = sim.finish(units[0])
    assert sim.planner.apply(OutcomeArrived(outcome)) is False
    assert sim.planner.collect() == []
    sim.assert_all_completed_once()
    body = sim.result("a:1")
    assert isinstance(body, ForwardBackwardResult) and len(body.outputs) == 2


# --- save / sampler save / load ----------------------------------------------------------------
def test_save_state_with_pending_gradients_saves_and_leaves_them_for_the_next_step() -> None:
    """save_state in the middle of a window becomes a SaveSlot (answered by the publisher), and
    the window's optim_step that follows still steps it."""
    sim = started("a")
    sim.send(fb("a", 1, [2]), save("a", 2))
    sim.run()
    assert ops(sim.units[-1]) == [SaveSlot]
    assert sim.result("a:2") is None  # the publisher answers it
    assert sim.planner.streams["a"].pending_grads  # still there: the next optim_step applies them
    sim.send(optim("a", 3))
    sim.run()
    assert ops(sim.units[-1]) == [StepSlot]
    assert not sim.planner.streams["a"].pending_grads


def test_save_state_after_a_forward_only_pass_is_fine() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2], forward_only=True), save("a", 2))
    sim.run()
    assert ops(sim.units[-1]) == [SaveSlot]


def test_load_state_with_pending_gradients_is_a_user_error() -> None:
    from libs.contracts.requests import CheckpointRef, LoadWeights

    sim = started("a")
    ref = CheckpointRef(tinker_path="tinker://x/weights/y", directory="/nowhere", with_optimizer=True)
    sim.send(fb("a", 1, [2]), LoadWeights(model_id="a", seq_id=2, request_id="a:2", restore=ref))
    sim.run()
    assert sim.failure("a:2").error == LOAD_WITH_PENDING_GRADS


def test_a_sampler_save_neither_applies_nor_discards_pending_gradients() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]), sampler_save("a", 2))
    sim.run()
    assert ops(sim.units[-1]) == [ExportSlot]
    assert sim.planner.streams["a"].pending_grads
    sim.send(optim("a", 3))
    sim.run()
    assert ops(sim.units[-1]) == [StepSlot]  # the window before the export is still whole
    assert not sim.planner.streams["a"].pending_grads


# --- slots and closed models -----------------------------------------------------------------
def test_a_create_pages_out_an_idle_model_which_pages_back_in_for_its_next_command() -> None:
    sim = started("a", num_slots=1)
    sim.send(create("b"), fb("b", 1, [2]))
    [init] = sim.plan()
    assert ops(init) == [PageOut, InitSlot]
    assert [(op.model_id, op.slot) for op in init.ops] == [("a", 0), ("b", 0)]  # type: ignore[union-attr]
    sim.finish(init)
    [work] = sim.plan()
    assert isinstance(work, WorkUnit) and work.items[0].slot == 0
    sim.finish(work)
    sim.send(fb("a", 1, [3]))
    page_in, work_a = sim.plan()  # a's datum needs no barrier to finish first: packed at once
    assert ops(page_in) == [PageOut, PageIn]  # type: ignore[list-item]
    assert [(op.model_id, op.slot) for op in page_in.ops] == [("b", 0), ("a", 0)]  # type: ignore[union-attr]
    assert isinstance(work_a, WorkUnit) and work_a.items[0].model_id == "a"
    sim.finish(page_in)
    sim.finish(work_a)
    sim.run()
    assert isinstance(sim.result("b:1"), ForwardBackwardResult)
    assert isinstance(sim.result("a:1"), ForwardBackwardResult)
    assert sim.planner.streams["b"].paged and not sim.planner.streams["a"].paged
    sim.assert_all_completed_once()


def test_a_model_with_work_in_flight_is_never_paged_out() -> None:
    sim = started("a", num_slots=1)
    sim.send(fb("a", 1, [2]))
    [work] = sim.plan()
    sim.send(create("b"))
    assert sim.plan() == []
    assert sim.planner.waiting_for_capacity() == ["b:0"]
    sim.finish(work)
    [init] = sim.plan()
    assert ops(init) == [PageOut, InitSlot]
    assert sim.planner.waiting_for_capacity() == []


def test_the_oldest_waiting_create_gets_a_slot_first() -> None:
    sim = started("a", num_slots=1)
    sim.send(create("c"), create("b"))
    units = sim.plan()
    assert [op.model_id for u in units for op in u.ops] == ["a", "c"]  # type: ignore[union-attr]
    assert sim.planner.waiting_for_capacity() == ["b:0"]  # c's create is in flight


def test_unloading_a_paged_out_model_drops_its_state_without_taking_a_slot() -> None:
    sim = started("a", "b", num_slots=1)  # b's create paged a out
    assert sim.planner.streams["a"].paged
    sim.send(unload("a", 1))
    [drop] = sim.plan()
    assert ops(drop) == [DropPaged]
    sim.finish(drop)
    sim.run()
    assert isinstance(sim.result("a:1"), JsonResult)
    assert sim.planner.streams["a"].closed and not sim.planner.streams["a"].paged
    assert sim.planner.streams["b"].slot == 0


def test_more_active_models_than_slots_all_make_progress_oldest_first() -> None:
    """Four models training on two slots: each window's forward_backward and optim_step run, in
    arrival order across models, and every request completes exactly once."""
    sim = started("a", "b", "c", "d", num_slots=2)
    for seq in (1, 3):
        for m in "abcd":
            sim.send(fb(m, seq, [2, 3]))
        for m in "abcd":
            sim.send(optim(m, seq + 1))
        sim.run()
    for m in "abcd":
        for seq in (1, 3):
            assert isinstance(sim.result(rid(m, seq)), ForwardBackwardResult)
            assert isinstance(sim.result(rid(m, seq + 1)), JsonResult)
    assert sorted(s.slot for s in sim.planner.streams.values() if s.slot is not None) == [0, 1]
    sim.assert_all_completed_once()


def test_a_failed_create_frees_its_slot_and_fails_what_was_queued() -> None:
    sim = Sim(num_slots=1)
    sim.send(create("a"), fb("a", 1, [2]), create("b"))
    [init] = sim.plan()
    sim.finish(init, op_errors={"a:0": "UserError: checkpoint base model differs"})
    assert sim.failure("a:0").error == "UserError: checkpoint base model differs"
    failure = sim.failure("a:1")
    assert failure.error.startswith("model a failed to start (UserError: checkpoint base model differs)")
    assert "did not run" in failure.error
    [init_b] = sim.plan()
    assert init_b.ops[0].model_id == "b" and init_b.ops[0].slot == 0  # type: ignore[union-attr]
    sim.send(optim("a", 2))  # arrives after the close: fails at once
    assert sim.failure("a:2")
    sim.finish(init_b)
    sim.assert_all_completed_once()


def test_every_request_of_a_closed_model_completes_once() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]), unload("a", 2), fb("a", 3, [2]), optim("a", 4))
    sim.send(fb("a", 6, [2]))  # buffered behind a hole
    sim.run()
    assert "was unloaded" in sim.failure("a:3").error
    assert sim.results.get("a:6") is None
    sim.send(rejected("a", 5, SEALED, "sealed"))  # the gap timeout seals the hole
    sim.run()
    assert "was unloaded" in sim.failure("a:6").error
    sim.send(optim("a", 7))
    sim.assert_all_completed_once()
    assert all("a" not in held.values() for held in sim.planner.state.slots.values())


def test_a_model_whose_create_never_arrived_fails_its_requests() -> None:
    sim = Sim()
    sim.send(fb("x", 1, [2]), optim("x", 2))
    sim.send(rejected("x", 0, SEALED, "seq_id 0 of model x never arrived"))
    assert sim.plan() == []
    assert "was never created" in sim.failure("x:1").error
    sim.assert_all_completed_once()


# --- fairness --------------------------------------------------------------------------------
def test_a_light_tenant_is_not_starved_by_a_heavy_one() -> None:
    """Oldest first: the light datum waits only for the heavy work that arrived before it, however
    much heavy work arrives after it."""
    sim = started("heavy", "light", token_budget=64)
    for seq in range(1, 4):
        sim.send(fb("heavy", seq, [16, 16, 16, 16]))  # 3 full units before the light request
    sim.send(fb("light", 1, [8]))
    for seq in range(4, 30):
        sim.send(fb("heavy", seq, [16, 16, 16, 16]))
    units = work(sim.plan())
    first_light = next(i for i, u in enumerate(units) if any(item.model_id == "light" for item in u.items))
    assert first_light == 3  # = ceil(heavy tokens that arrived before it / budget)
    # The same holds while the trainer works through a backlog one unit at a time.
    for unit in units:
        sim.finish(unit)
    for seq in range(30, 33):
        sim.send(fb("heavy", seq, [16, 16, 16, 16]))
    sim.send(fb("light", 2, [8, 8]))
    sim.send(*(fb("heavy", seq, [16, 16, 16, 16]) for seq in range(33, 40)))
    units = work(sim.plan())
    assert [i for i, u in enumerate(units) if any(item.model_id == "light" for item in u.items)] == [3]


# --- restart determinism ---------------------------------------------------------------------
def scenario() -> Sim:
    """Three tenants, packing, splits, out-of-order chunks, failures, barriers, a create that waits
    for a slot and then pages out an idle model."""
    sim = Sim(num_slots=3, token_budget=8)
    sim.send(create("a", "t1"), create("b", "t2"), create("c", "t3"), create("d", "t4"))
    sim.run()
    sim.send(fb("a", 2, [3, 3]), fb("b", 1, [5, 5, 2], "ppo", {"clip_low_threshold": 0.7}))
    sim.send(fb("a", 1, [4]), fb("c", 1, [9]))
    units = sim.plan()
    sim.finish(units[0])
    sim.send(optim("a", 3), rejected("c", 2, "forward_backward"), optim("c", 3))
    for unit in units[1:]:
        sim.finish(unit, datum_errors={("b:1", 2): "bad datum"})
    sim.send(optim("b", 2), sampler_save("a", 4), fb("a", 5, [2, 2, 2, 2, 2]), save("b", 3))
    for unit in sim.plan():
        sim.finish(unit)
    sim.send(unload("c", 4), fb("a", 6, [1]))
    sim.run()
    sim.send(fb("d", 1, [2]), optim("a", 7), save("a", 8))
    sim.run()
    return sim


def test_the_scenario_completes_every_request_once() -> None:
    sim = scenario()
    sim.assert_all_completed_once()
    assert sim.planner.plan() == []
    assert "forward_backward seq_id 1 failed" in sim.failure("b:2").error
    assert "seq_id 2 was rejected" in sim.failure("c:3").error
    assert isinstance(sim.result("d:1"), ForwardBackwardResult)  # d got a slot


def test_a_restarted_planner_plans_what_the_live_one_plans() -> None:
    """fold(prefix) + fold(rest) == fold(all), at every point of the scenario."""
    live = scenario()
    for cut in range(len(live.history) + 1):
        check_restart_at(live, cut)


def check_restart_at(live: Sim, cut: int, start: Planner | None = None, after: int = 0) -> Planner:
    """Rebuild from a prefix of the history (every command, then every unit, then every outcome,
    after the snapshot `start` taken at entry `after` if given), then feed the rest in its live
    order; returns the rebuilt planner after the whole history."""
    history = live.history
    fresh = live.replayed(cut, start, after)
    # Replay the live run from the cut on, feeding the fresh planner the same inputs; every unit it
    # plans must be the one the live planner planned at that point.
    pending_units: list[Unit] = []
    for what, index in history[cut:]:
        if what == "command":
            fresh.apply(live.fact(what, index))
            fresh.collect()
        elif what == "unit":
            if not pending_units:
                pending_units = fresh.plan()
                fresh.collect()
            assert pending_units, (
                f"cut {cut}: nothing planned where the live planner emitted {live.units[index]}"
            )
            assert encoded([pending_units.pop(0)]) == encoded([live.units[index]]), f"cut {cut}"
        else:
            fresh.apply(live.fact(what, index))
            fresh.collect()
    assert pending_units == [] and fresh.plan() == []
    return fresh


def live_snapshots(scenario_fn: Callable[[], Sim]) -> list[bytes]:
    """The live planner's snapshot after every history entry of the scenario (entry k: after k)."""
    snaps: list[bytes] = []
    sim = scenario_fn()
    rerun = Sim(num_slots=sim.num_slots, token_budget=sim.token_budget)
    snaps.append(rerun.planner.snapshot())
    for what, index in sim.history:
        if what == "unit":
            [unit] = [u for u in [rerun.planner.decide()] if u is not None]
            assert encoded([unit]) == encoded([sim.units[index]])
        rerun.planner.apply(sim.fact(what, index))
        rerun.planner.collect()
        snaps.append(rerun.planner.snapshot())
    return snaps


def test_snapshot_plus_replay_equals_full_replay() -> None:
    """A planner restored from the live planner's snapshot at entry k, then folding the rest of
    the history as a restart does, plans what the live planner planned and ends in the same state
    as a full replay, for every k and every later cut."""
    live = scenario()
    snaps = live_snapshots(scenario)
    full = live.replayed()
    assert full.snapshot() == Planner.restore(full.snapshot(), live.num_slots, live.token_budget).snapshot()  # the encoding round-trips
    expected = full_after(live)
    for after, snap in enumerate(snaps):
        for cut in range(after, len(live.history) + 1, 3):
            rebuilt = check_restart_at(live, cut, Planner.restore(snap, live.num_slots, live.token_budget), after)
            assert rebuilt.snapshot() == expected, f"snapshot {after}, cut {cut}"


def test_a_snapshot_whose_state_carries_the_limits_restores_to_the_same_facts() -> None:
    """The scenario's fully replayed state as encoded when `num_slots`, `token_budget` and
    `max_units_in_flight` were fields of it (the file was written by that encoder) restores to
    the state a full replay reaches now, and the restored planner decides by the limits it is
    given, not by those it finds in the file."""
    live = scenario()
    data = (Path(__file__).parent / "data" / "scenario-state-with-limits.msgpack").read_bytes()
    assert {"num_slots", "token_budget", "max_units_in_flight"} <= set(msgspec.msgpack.decode(data))
    restored = Planner.restore(data, num_slots=5, token_budget=live.token_budget)
    assert restored.state == live.replayed().state
    assert restored.groups[DEFAULT_GROUP].num_slots == 5


def full_after(live: Sim) -> bytes:
    """The state of a planner that replayed the whole history and planned what was left."""
    fresh = live.replayed()
    fresh.plan()
    fresh.collect()
    return fresh.snapshot()


def test_requests_redelivered_after_a_full_replay_are_duplicates() -> None:
    """The service replays every stream to its last sequence; the durable consumers then redeliver
    whatever was not acked (here: everything after the creates), and none of it is issued again."""
    sim = started("a", "b", token_budget=4)
    sim.send(fb("a", 1, [2, 2, 2]), fb("b", 1, [2]), optim("b", 2))
    units = sim.plan()
    fresh = sim.replayed()
    floor = 2  # only the creates were acked
    for command, arrival in sim.commands[floor:]:
        assert fresh.apply(CommandArrived(command, arrival)) is False
    assert fresh.collect() == []
    assert fresh.plan() == []
    for unit in units:
        outcome = sim.finish(unit)
        fresh.apply(OutcomeArrived(outcome))
    assert encoded(fresh.plan()) == encoded(sim.plan())


def test_an_outcome_redelivered_after_a_full_replay_has_no_second_effect() -> None:
    """After a restart the replay has folded every outcome in the stream: the requests they
    finished are completed by the replay (the service publishes them once more, refused by the
    server if they were published), and the consumer's redelivery of those outcomes does nothing."""
    sim = started("a")
    sim.send(fb("a", 1, [2, 2]), optim("a", 2))
    [unit] = sim.plan()
    outcome = sim.finish(unit)
    [step] = sim.plan()
    fresh = Planner(num_slots=sim.num_slots, token_budget=sim.token_budget)
    for what, index in sim.history:
        if what == "command":
            fresh.apply(sim.fact(what, index))
    for emitted in sim.units:
        fresh.apply(UnitEmitted(emitted))
    fresh.apply(OutcomeArrived(sim.outcomes[0]))  # the create's outcome
    fresh.collect()
    assert fresh.apply(OutcomeArrived(outcome)) is True
    completions = fresh.collect()
    assert [c.pending.command.request_id for c in completions] == ["a:1"]
    assert isinstance(completions[0].body, ForwardBackwardResult)
    assert fresh.apply(OutcomeArrived(outcome)) is False  # the redelivery
    assert fresh.plan() == []  # the step was already emitted
    step_outcome = sim.finish(step)
    fresh.apply(OutcomeArrived(step_outcome))
    assert [c.pending.command.request_id for c in fresh.collect()] == ["a:2"]


def test_a_unit_applied_twice_is_harmless() -> None:
    sim = started("a")
    sim.send(fb("a", 1, [2]))
    [unit] = sim.plan()
    fresh = sim.replayed()
    assert fresh.apply(UnitEmitted(unit)) is False
    assert fresh.plan() == []
    assert fresh.apply(OutcomeArrived(WorkOutcome(unit_id=unit.unit_id)))  # completes a:1 (a failed unit)
    assert [c.pending.command.request_id for c in fresh.collect()] == ["a:1"]
    barrier = BarrierOutcome(unit_id=unit.unit_id, ops=[OpOutcome(model_id="a", request_id="a:1", ok=True)])
    assert fresh.apply(OutcomeArrived(barrier)) is False
    assert fresh.collect() == []
