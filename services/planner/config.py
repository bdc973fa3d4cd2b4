"""Planner settings."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from infra.config import DEFAULT_NATS_URL, NUM_SLOTS, TOKEN_BUDGET, from_env


class PlannerConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = DEFAULT_NATS_URL
    trainer_group: str = "default"
    """Names the planner's snapshot; the planner serves every trainer group that reports."""
    num_slots: int = NUM_SLOTS.default
    """Adapter slots per trainer group until the group reports its own (the trainer's count wins)."""
    group_timeout_s: float = 15.0
    """A trainer group whose trainers have not reported for this long is lost: nothing new is placed
    on it, and its models whose state was exported move to live groups of their base model."""
    token_budget: int = TOKEN_BUDGET.default
    """Tokens per work unit; a single datum over it ships alone."""
    max_units_in_flight: int = 1
    """Units emitted ahead of their outcomes; calls arriving meanwhile coalesce into the next
    unit. 1 packs concurrent tenants best; 0 emits every plannable unit at once."""
    coalesce_ms: float = 25.0
    """With nothing in flight, a work unit is held back at most this long for the models that were
    packed with it last time and have not sent their next forward_backward yet; 0: never."""
    gap_timeout_s: float = 120.0
    """A missing seq_id that stays missing this long is sealed as a failure."""
    snapshot_every_s: float = 30.0
    """How often (at most) the folded state is stored, bounding what a restart replays; 0: never."""


def load_config(env: Mapping[str, str], **overrides: object) -> PlannerConfig:
    return from_env(PlannerConfig, "planner", env, **overrides)
