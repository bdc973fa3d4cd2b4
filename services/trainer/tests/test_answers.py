"""Which requests a work unit's outcome answers, and with what (services/trainer/answers.py)."""

from __future__ import annotations

import numpy as np

from libs.contracts.common import BusDatum
from libs.contracts.outcomes import DatumOutcome, WorkOutcome
from libs.contracts.results import DatumResult, ForwardBackwardResult
from libs.contracts.work import UnitItem, WholeRequest, WorkUnit
from services.trainer.answers import answered


def whole(request_id: str, num_datums: int) -> WholeRequest:
    return WholeRequest(request_id, "m-" + request_id, "tenant", 1, "forward_backward", num_datums, 0)


def unit(*requests: tuple[str, int], named: tuple[str, ...]) -> WorkUnit:
    items = [
        UnitItem("m-" + r, r, i, 0, BusDatum(tokens=np.arange(4, dtype=np.int32).tobytes(), inputs={}))
        for r, n in requests
        for i in range(n)
    ]
    sizes = dict(requests)
    return WorkUnit(
        unit_id="u1",
        forward_only=False,
        loss_fn="cross_entropy",
        items=items,
        whole=[whole(r, sizes[r]) for r in named],
    )


def ran(request_id: str, index: int, error: str | None = None) -> DatumOutcome:
    logprobs = np.full(4, -(index + 1), dtype="<f4").tobytes()
    return DatumOutcome(request_id, index, logprobs, float(index + 1), error=error, metrics={"n:sum": 4.0})


def test_a_whole_request_is_answered_with_its_datums_in_order_and_their_sums() -> None:
    work = unit(("r1", 2), named=("r1",))
    outcome = WorkOutcome(unit_id="u1", datums=[ran("r1", 1), ran("r1", 0)])
    [(request, body)] = answered(work, outcome)
    assert request.request_id == "r1"
    assert body == ForwardBackwardResult(
        outputs=[DatumResult(ran("r1", i).logprobs, float(i + 1), 0, {"n:sum": 4.0}) for i in (0, 1)],
        metrics={"loss:sum": 3.0, "n:sum": 8.0},
    )


def test_requests_the_unit_does_not_name_whole_are_left_to_the_planner() -> None:
    work = unit(("r1", 1), ("r2", 1), named=("r2",))
    outcome = WorkOutcome(unit_id="u1", datums=[ran("r1", 0), ran("r2", 0)])
    assert [request.request_id for request, _ in answered(work, outcome)] == ["r2"]


def test_a_request_with_a_failed_or_missing_datum_is_left_to_the_planner() -> None:
    work = unit(("r1", 2), ("r2", 2), ("r3", 1), named=("r1", "r2", "r3"))
    outcome = WorkOutcome(
        unit_id="u1", datums=[ran("r1", 0), ran("r1", 1, error="bad target"), ran("r2", 0), ran("r3", 0)]
    )
    assert [request.request_id for request, _ in answered(work, outcome)] == ["r3"]


def test_a_failed_unit_answers_nothing() -> None:
    work = unit(("r1", 1), named=("r1",))
    assert answered(work, WorkOutcome(unit_id="u1", error="trainer error: boom")) == []
