"""Restart determinism as a property: random commands, units and outcomes, on two trainer groups.

A Hypothesis state machine drives `Sim` with what a planner meets in a real run: creates,
forward_backward calls of several loss classes, optimizer steps, saves, unloads, refused and
out-of-order seq_ids, duplicates of commands and of outcomes, trainer failures of every kind,
and trainer groups that are lost and come back (so page-outs, exports, moves and takeovers
happen). After every step a planner rebuilt from the whole history (every command, then every
unit, then every outcome) holds the live state and decides the live planner's next unit. At the
end, every request has completed exactly once, and a planner rebuilt from any prefix of the
history, or from a snapshot taken at any recorded point and the facts after it, then fed the
rest in live order, reaches the live state.
"""

from __future__ import annotations

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from libs.contracts.codec import pack
from libs.contracts.requests import CheckpointRef, LoadWeights, ModelCommand
from libs.contracts.work import BarrierUnit, Unit, WorkUnit
from services.planner.inputs import GroupInfo, Limits
from services.planner.planner import Planner
from services.planner.tests.sim import (
    Sim,
    create,
    fb,
    optim,
    rejected,
    rid,
    sampler_save,
    save,
    trainer_outcome,
    unload,
)

MODELS = ("m0", "m1", "m2", "m3", "m4")
GROUPS = ("a", "b")
LOSSES: list[tuple[str, dict[str, float | str] | None]] = [
    ("cross_entropy", None),
    ("ppo", {"clip_low_threshold": 0.8}),
]


class PlannerReplay(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.sim = Sim(num_slots=2, token_budget=8)
        self.sim.planner.groups = {g: GroupInfo(num_slots=2, base_model="tiny-qwen3") for g in GROUPS}
        self.next_seq: dict[str, int] = {}
        self.held: list[ModelCommand] = []  # sent later than a higher seq_id of their model
        self.in_flight: list[Unit] = []  # emitted, no outcome yet
        self.finished: list[tuple[Unit, int]] = []  # (unit, index of its outcome in sim.outcomes)
        self.snapshots: list[tuple[int, bytes]] = []  # (history length, the live snapshot then)

    @initialize(limit=st.sampled_from([0, 1, 2]))
    def limits(self, limit: int) -> None:
        self.sim.planner.limits = Limits(token_budget=self.sim.token_budget, max_units_in_flight=limit)

    # --- commands -----------------------------------------------------------------------------
    def _seq(self, model: str) -> int:
        seq = self.next_seq[model]
        self.next_seq[model] = seq + 1
        return seq

    @precondition(lambda self: len(self.next_seq) < len(MODELS))
    @rule(data=st.data())
    def create_model(self, data: st.DataObject) -> None:
        model = data.draw(st.sampled_from([m for m in MODELS if m not in self.next_seq]))
        self.next_seq[model] = 1
        self.sim.send(create(model, tenant=f"t-{model}"))

    @precondition(lambda self: bool(self.next_seq))
    @rule(
        data=st.data(),
        sizes=st.lists(st.integers(1, 6), min_size=1, max_size=3),
        loss=st.sampled_from(LOSSES),
        forward_only=st.booleans(),
    )
    def forward_backward(
        self, data: st.DataObject, sizes: list[int], loss: tuple[str, dict[str, float | str] | None], forward_only: bool
    ) -> None:
        model = data.draw(st.sampled_from(sorted(self.next_seq)))
        self.sim.send(fb(model, self._seq(model), sizes, loss[0], loss[1], forward_only=forward_only))

    @precondition(lambda self: bool(self.next_seq))
    @rule(data=st.data(), kind=st.sampled_from(["optim", "save", "sampler_save", "load", "rejected", "unload"]))
    def barrier(self, data: st.DataObject, kind: str) -> None:
        model = data.draw(st.sampled_from(sorted(self.next_seq)))
        seq = self._seq(model)
        if kind == "optim":
            command: ModelCommand = optim(model, seq)
        elif kind == "save":
            command = save(model, seq, name=f"c{seq}")
        elif kind == "sampler_save":
            command = sampler_save(model, seq, name=f"s{seq}")
        elif kind == "load":
            ref = CheckpointRef(tinker_path="tinker://x/weights/y", directory="/nowhere", with_optimizer=True)
            command = LoadWeights(model_id=model, seq_id=seq, request_id=rid(model, seq), restore=ref)
        elif kind == "rejected":
            command = rejected(model, seq, data.draw(st.sampled_from(["forward_backward", "optim_step"])))
        else:
            command = unload(model, seq)
        self.sim.send(command)

    @precondition(lambda self: bool(self.next_seq))
    @rule(data=st.data(), lr=st.sampled_from([1e-3, 1e-2]))
    def out_of_order(self, data: st.DataObject, lr: float) -> None:
        """A model's next seq_id is held back while the one after it arrives (it is buffered)."""
        model = data.draw(st.sampled_from(sorted(self.next_seq)))
        first, second = self._seq(model), self._seq(model)
        self.held.append(fb(model, first, [2]))
        self.sim.send(optim(model, second, lr))

    @precondition(lambda self: bool(self.held))
    @rule()
    def release_held(self) -> None:
        self.sim.send(self.held.pop(0))

    @precondition(lambda self: bool(self.sim.commands))
    @rule(data=st.data())
    def duplicate_command(self, data: st.DataObject) -> None:
        """A retried command (a new stream sequence, a seq_id already seen) has no effect."""
        command, _ = data.draw(st.sampled_from(self.sim.commands))
        before = {r: len(b) for r, b in self.sim.results.items()}
        assert self.sim.send(command) == [False]
        assert {r: len(b) for r, b in self.sim.results.items() if b} == {r: n for r, n in before.items() if n}

    # --- units and outcomes ------------------------------------------------------------------
    @rule()
    def plan(self) -> None:
        self.in_flight += self.sim.plan()

    @precondition(lambda self: bool(self.in_flight))
    @rule(data=st.data(), fault=st.sampled_from(["none", "none", "unit", "datum", "op", "omit"]))
    def finish(self, data: st.DataObject, fault: str) -> None:
        unit = self.in_flight.pop(data.draw(st.integers(0, len(self.in_flight) - 1)))
        first = (unit.items[0].request_id, unit.items[0].index) if isinstance(unit, WorkUnit) and unit.items else None
        op = unit.ops[0].request_id if isinstance(unit, BarrierUnit) and unit.ops else None
        outcome = trainer_outcome(
            unit,
            unit_error="the trainer failed" if fault == "unit" else None,
            datum_errors={first: "bad datum"} if fault == "datum" and first else None,
            omit={first} if fault == "omit" and first else None,
            op_errors={op: "the op failed"} if fault == "op" and op else None,
        )
        self.sim.finish(unit, outcome)
        self.finished.append((unit, len(self.sim.outcomes) - 1))

    @precondition(lambda self: bool(self.finished))
    @rule(data=st.data())
    def duplicate_outcome(self, data: st.DataObject) -> None:
        """An outcome delivered again (after a trainer restart, a redelivery) has no effect."""
        unit, index = data.draw(st.sampled_from(self.finished))
        before = {r: list(b) for r, b in self.sim.results.items() if b}
        self.sim.finish(unit, self.sim.outcomes[index])
        assert {r: list(b) for r, b in self.sim.results.items() if b} == before

    @rule(lost=st.sampled_from([None, *GROUPS]))
    def liveness(self, lost: str | None) -> None:
        """One group stops reporting (the other takes its models over), or every group reports."""
        for group, info in self.sim.planner.groups.items():
            info.live = group != lost

    @precondition(lambda self: len(self.snapshots) < 3)
    @rule()
    def snapshot(self) -> None:
        self.snapshots.append((len(self.sim.history), self.sim.planner.snapshot()))

    # --- the properties ----------------------------------------------------------------------
    @invariant()
    def a_full_replay_holds_the_live_state_and_decides_alike(self) -> None:
        live = self.sim.planner
        fresh = self.sim.replayed()
        assert fresh.state == live.state
        fresh.groups = {g: GroupInfo(i.num_slots, i.base_model, i.live) for g, i in live.groups.items()}
        fresh.limits = live.limits
        mine, theirs = fresh.decide(), live.decide()
        assert (mine and pack(mine)) == (theirs and pack(theirs))

    @invariant()
    def no_request_completes_twice(self) -> None:
        assert all(len(bodies) <= 1 for bodies in self.sim.results.values())

    def teardown(self) -> None:
        sim = self.sim
        for info in sim.planner.groups.values():
            info.live = True
        for command in self.held:
            sim.send(command)
        for _ in range(1_000):  # a healthy trainer works through everything
            if not self.in_flight:
                self.in_flight = sim.plan()
                if not self.in_flight:
                    break
            sim.finish(self.in_flight.pop(0))
        assert not self.in_flight and sim.plan() == []
        sim.assert_all_completed_once()
        expected = sim.planner.state
        for cut in range(len(sim.history) + 1):
            self._assert_rebuilt(sim.replayed(cut), cut, expected, f"cut {cut}")
        for after, data in self.snapshots:
            for cut in range(after, len(sim.history) + 1, 4):
                start = Planner.restore(data, num_slots=sim.num_slots, token_budget=sim.token_budget)
                self._assert_rebuilt(sim.replayed(cut, start, after), cut, expected, f"snapshot {after}, cut {cut}")

    def _assert_rebuilt(self, fresh: Planner, cut: int, expected: object, where: str) -> None:
        for what, index in self.sim.history[cut:]:
            fresh.apply(self.sim.fact(what, index))
            fresh.collect()
        assert fresh.state == expected, where


PlannerReplay.TestCase.settings = settings(
    max_examples=50, stateful_step_count=80, deadline=None, derandomize=True, database=None
)
test_planner_replay = PlannerReplay.TestCase
