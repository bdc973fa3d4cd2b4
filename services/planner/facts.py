"""What the planner folds: three facts, each read from one stream (or decided and appended there).

A fact is the whole input of the fold (`state.evolve`): a replay after a restart folds the same
facts read back from the request, work and outcome streams, so nothing else (clocks, trainer
liveness, configuration) may change the state.
"""

from __future__ import annotations

import msgspec

from libs.contracts.outcomes import Outcome
from libs.contracts.requests import ModelCommand
from libs.contracts.work import Unit


class CommandArrived(msgspec.Struct, frozen=True, tag="command"):
    """A command read from the request stream at `arrival` (its stream sequence)."""

    command: ModelCommand
    arrival: int
    now_ns: int = 0  # when it was read: starts a gap's timeout


class UnitEmitted(msgspec.Struct, frozen=True, tag="unit"):
    """A unit appended to the work stream (decided by this planner, or found there on replay)."""

    unit: Unit


class OutcomeArrived(msgspec.Struct, frozen=True, tag="outcome"):
    """A trainer's outcome of a unit, read from the outcome stream."""

    outcome: Outcome


Fact = CommandArrived | UnitEmitted | OutcomeArrived

DEFAULT_GROUP = "default"
"""The trainer group of a planner told about none, and of a unit that names no group."""

Member = tuple[str, str, int]
"""(model_id, request_id, datum index) of a unit's item; index -1 for a barrier op."""


def unit_number(unit_id: str) -> int:
    return int(unit_id.lstrip("u"))


def unit_id(number: int) -> str:
    return f"u{number:012d}"
