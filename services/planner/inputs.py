"""What decisions read besides the folded state: the trainer groups and the planner's limits.

Neither is a fact: groups come from the trainers' heartbeats (liveness is a clock), limits from
the configuration. Both are arguments of `decide`, never part of the encoded state, so a snapshot
holds only facts and a restart with other settings decides by the new ones.
"""

from __future__ import annotations

from dataclasses import dataclass

from infra.config import TOKEN_BUDGET
from services.planner.facts import DEFAULT_GROUP
from services.planner.streams import ModelStream


@dataclass
class GroupInfo:
    """A trainer group as its trainers report it."""

    num_slots: int
    base_model: str = ""  # "" serves any base model (a planner not told otherwise)
    live: bool = True  # its trainer reported recently


Groups = dict[str, GroupInfo]


@dataclass(frozen=True)
class Limits:
    token_budget: int = TOKEN_BUDGET.default  # tokens per work unit; a single datum over it ships alone
    max_units_in_flight: int = 0  # per group, emitted ahead of their outcomes; 0: no limit


def serves(info: GroupInfo, base_model: str) -> bool:
    return info.base_model in ("", base_model)


def group_of(stream: ModelStream, groups: Groups) -> str:
    """The group that holds `stream`'s state; a model never placed (its create failed or never
    came) has its barriers (failures) run by the first live group."""
    if stream.group:
        return stream.group
    live = sorted(g for g, info in groups.items() if info.live)
    return live[0] if live else min(groups, default=DEFAULT_GROUP)
