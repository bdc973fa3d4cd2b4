"""The requests a work unit's outcome answers: those the unit holds whole, every datum run.

The planner names them in the unit (`WorkUnit.whole`). The trainer appends their results together
with the outcome (sent right after it, not after its ack), which spares a `forward_backward` the
planner's hop (fetch, fold, append) on its way back to the SDK. The planner still folds the outcome
and appends the same result; `infra.answers.answer` keeps the first one appended, so the second has
no effect. A request that failed (a datum's error, or the unit's) is left to the planner, whose
fold says why.

What a crash leaves: the answer can be stored while its outcome is not (the trainer died, or the
outcome's append failed, between the two). The unit is then not done: it is delivered again, to
the state recovery rebuilds without it, and runs once more, the same computation on the same
inputs (on deterministic kernels, the same values); its second answer has no effect. The answer
never comes from a unit whose outcome the trainer has not sent.
"""

from __future__ import annotations

from libs.contracts.outcomes import DatumOutcome, WorkOutcome
from libs.contracts.results import ForwardBackwardResult
from libs.contracts.work import WholeRequest, WorkUnit


def answered(unit: WorkUnit, outcome: WorkOutcome) -> list[tuple[WholeRequest, ForwardBackwardResult]]:
    """Each request of `unit.whole` whose every datum has a result in `outcome`, with that result."""
    if outcome.error is not None or not unit.whole:
        return []
    by_request: dict[str, list[DatumOutcome]] = {}
    for datum in outcome.datums:
        by_request.setdefault(datum.request_id, []).append(datum)
    answers = []
    for request in unit.whole:
        datums = sorted(by_request.get(request.request_id, []), key=lambda d: d.index)
        if [d.index for d in datums] != list(range(request.num_datums)):
            continue
        if any(d.error is not None for d in datums):
            continue
        answers.append((request, ForwardBackwardResult.of([d.result() for d in datums])))
    return answers
