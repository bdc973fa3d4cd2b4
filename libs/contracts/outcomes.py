"""What a trainer reports after executing a unit (`tinker.outcome.<group>`).

Outcomes are facts: the planner folds them to complete requests. A trainer emits exactly one outcome
per unit id (`Nats-Msg-Id` = unit id), so a redelivered unit never produces a second effect.
"""

from __future__ import annotations

import msgspec

from libs.contracts.common import Envelope


class DatumOutcome(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    index: int
    logprobs: bytes  # float32 little-endian, one per input token (K per token for top-K targets)
    loss: float
    error: str | None = None  # a per-datum failure (validation); other datums are unaffected
    k: int = 0  # 0: logprobs is [N]; K >= 1: it is [N, K] (top-K target_tokens)
    metrics: dict[str, float] = {}  # the loss's own per-datum metrics, each `name:sum`


class WorkOutcome(Envelope, tag="work_done", kw_only=True, frozen=True):
    unit_id: str
    datums: list[DatumOutcome] = []
    error: str | None = None  # the whole unit failed (every datum in it failed)
    started_ns: int = 0
    finished_ns: int = 0


class OpOutcome(msgspec.Struct, frozen=True, kw_only=True):
    model_id: str
    request_id: str
    ok: bool
    error: str | None = None
    category: str = "user"
    metrics: dict[str, float] = {}
    info: dict[str, str] = {}


class BarrierOutcome(Envelope, tag="barrier_done", kw_only=True, frozen=True):
    unit_id: str
    ops: list[OpOutcome] = []
    started_ns: int = 0
    finished_ns: int = 0


Outcome = WorkOutcome | BarrierOutcome
