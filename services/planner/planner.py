"""The planner's pure core: a fold of commands, emitted units and outcomes, and a decision.

The planner's whole state (`PlannerState`, state.py) is a fold of three facts (facts.py),
`CommandArrived`, `UnitEmitted` and `OutcomeArrived`, through one function, `state.evolve`. The
live service and a replay after a restart fold through the same `Planner.apply`: the live path
decides a unit (`decide.decide`, pure: it reads the state, the trainer groups and the limits, and
changes nothing), appends it to the work stream and applies its `UnitEmitted`; a replay applies
every command, then every unit, then every outcome found in the streams, up to their last
sequence. Both reach the same state, because every fact the state keeps about a window is fixed
when its command is sequenced (see streams.py), not by the order in which outcomes are folded. A
snapshot (`Planner.snapshot`) is that state at known stream positions, so a restart replays only
what came after it; groups and limits are never in it.

Where each rule lives: the fold in state.py (and streams.py per model), the decision in
decide.py, packing in packing.py, residency in residency.py, takeover in takeover.py, what a
finished request answers in completions.py, the coalescing hold in hold.py; the service
(service.py) only reads and writes the streams.

Rules (see docs/semantics.md):
- Seed = the oldest ready thing by global arrival. If it is a datum, the unit packs every ready
  datum of the same class (forward_only, loss_fn, canonical loss config) across all models, oldest
  first, under a token budget; a datum over the budget ships alone. A large request is split by
  the same rule. If it is an optim_step, every ready optim_step of every model joins one barrier
  unit; any other barrier runs alone.
- A window whose forward_backward failed (or was rejected, or whose seq_id was sealed) is
  poisoned: its optim_step discards the accumulated gradients (never a partial step) and fails,
  saying what to resubmit.
- save_state and save_weights_for_sampler with gradients pending save the current weights (and
  optimizer state) and neither apply nor discard the gradients: the next optim_step steps the
  whole window. load_state with gradients pending is a user error (the gradients belong to the
  weights it would replace).
- Residency: a model holds an adapter slot only while it needs one. A create, or the next command
  of a paged-out model, takes the lowest free slot; with none free, the barrier that gives it a
  slot first pages out the least recently used resident model with nothing in flight (idle ones
  before ones with queued work), whose complete training state the trainer keeps. With every slot
  held by a model with work in flight it waits (queue_state "paused_capacity").
- Trainer groups: each group serves one base model with its own slots; a model is placed on one
  group (its create goes to the live group of its base with a free slot and the least load, see
  `residency.placement`) and every unit names its group. With more than one group for a base, each
  page-out also exports the state to a file under the data directory, so the model may page in
  on another group (a free slot there before a page-out at home); a group whose trainer stopped
  reporting is not placed on, its models whose state is exported move to live groups, and its
  resident models with work are taken over by a live group (`takeover.takeover_unit`: a unit of
  `AdoptSlot` ops that names the lost group's units it abandons, so a replay needs no clock).
- Every sequenced request completes exactly once: a closed model (failed create, unloaded) fails
  whatever it can no longer run.
"""

from __future__ import annotations

import msgspec

from libs.contracts.work import Unit
from services.planner import decide as decision
from services.planner.completions import Completion
from services.planner.facts import Fact, UnitEmitted
from services.planner.hold import awaited
from services.planner.inputs import DEFAULT_GROUP, GroupInfo, Groups, Limits
from services.planner.state import PlannerState, evolve
from services.planner.streams import ModelStream


class Planner:
    """The folded state with the inputs decisions read (groups, limits), and what the fold
    reported and no one has collected yet (finished requests, touched models)."""

    def __init__(
        self,
        num_slots: int,
        token_budget: int = Limits.token_budget,
        state: PlannerState | None = None,
        max_units_in_flight: int = Limits.max_units_in_flight,
    ) -> None:
        self.state = state if state is not None else PlannerState()
        self.limits = Limits(token_budget=token_budget, max_units_in_flight=max_units_in_flight)
        # The trainer groups decisions may use (from their heartbeats); one default group else.
        self.groups: Groups = {DEFAULT_GROUP: GroupInfo(num_slots)}
        self._completed: list[Completion] = []
        self._touched: set[str] = set()

    @property
    def streams(self) -> dict[str, ModelStream]:
        return self.state.streams

    # --- the fold -----------------------------------------------------------------------------
    def apply(self, fact: Fact) -> bool:
        """Fold one fact; False if it had no effect. Requests it finished wait for `collect`."""
        change = evolve(self.state, fact)
        if change is None:
            return False
        self._completed += change.completed
        self._touched |= change.touched
        return True

    def collect(self) -> list[Completion]:
        """The requests finished since the last call (each exactly once), oldest fact first."""
        done, self._completed = self._completed, []
        return done

    def changed_models(self) -> list[ModelStream]:
        """The models a fact touched since the last call (their queue summary may have changed)."""
        touched, self._touched = self._touched, set()
        return [self.state.streams[m] for m in sorted(touched) if m in self.state.streams]

    # --- snapshots ----------------------------------------------------------------------------
    def snapshot(self) -> bytes:
        """The state, encoded (msgpack); take it only when `collect` has been drained."""
        assert not self._completed, "snapshot with uncollected completions"
        return msgspec.msgpack.encode(self.state)

    @classmethod
    def restore(
        cls,
        data: bytes,
        num_slots: int,
        token_budget: int = Limits.token_budget,
        max_units_in_flight: int = Limits.max_units_in_flight,
    ) -> Planner:
        """A planner on the state of `snapshot()`; the inputs are today's, not the snapshot's."""
        state = msgspec.msgpack.decode(data, type=PlannerState)
        return cls(num_slots, token_budget, state, max_units_in_flight)

    # --- the decision -------------------------------------------------------------------------
    def decide(self, skip: frozenset[str] = frozenset()) -> Unit | None:
        """The next unit to emit, or None (`decide.decide`); the state changes only when it is applied."""
        return decision.decide(self.state, self.groups, self.limits, skip)

    def plan(self) -> list[Unit]:
        """Decide and apply every unit that can be emitted now, in emission order (the caller
        appends them to the work stream in this order)."""
        units: list[Unit] = []
        while (unit := self.decide()) is not None:
            self.apply(UnitEmitted(unit))
            units.append(unit)
        return units

    def waiting(self) -> dict[str, str]:
        """Request ids that wait to be placed, and why (`decide.waiting`)."""
        return decision.waiting(self.state, self.groups)

    def waiting_for_capacity(self) -> list[str]:
        """Request ids that wait for an adapter slot (queue_state paused_capacity)."""
        return sorted(r for r, why in self.waiting().items() if why == decision.WAIT_SLOTS)

    def awaited(self, cohort: frozenset[str]) -> set[str]:
        """The resident models of `cohort` whose next forward_backward has not arrived (`hold.awaited`)."""
        return awaited(self.state, cohort)
