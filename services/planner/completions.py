"""What a finished request answers: the result body the planner appends to its future.

The fold (`state.evolve`) reports the requests a fact finished, in seq_id order, as
`Completion`s; the body is read off the finished command (`result_body`). A save's or a sampler
export's body is the publisher's to write (its outcome is a hand-off), so it has none here.
"""

from __future__ import annotations

from dataclasses import dataclass

from libs.contracts.ids import HANDOFF
from libs.contracts.requests import CreateModel, ForwardBackward, LoadWeights, OptimStep, UnloadModel
from libs.contracts.results import (
    CreateModelResponse,
    Failure,
    ForwardBackwardResult,
    LoadWeightsResponse,
    OptimStepResponse,
    ResultBody,
    UnloadModelResponse,
)
from services.planner.streams import Pending


@dataclass(frozen=True)
class Completion:
    """A request the planner has finished (it left its model's queue)."""

    pending: Pending
    model_id: str

    @property
    def body(self) -> ResultBody | None:
        """What its future answers; None means another service (the publisher) answers it."""
        return result_body(self.model_id, self.pending)


def result_body(model_id: str, pending: Pending) -> ResultBody | None:
    if pending.error is not None:
        return Failure(error=pending.error, category=pending.category)
    metrics, info, mid = pending.metrics, pending.info, model_id
    match pending.command:
        case ForwardBackward():
            outputs = [o for o in pending.outputs if o is not None]
            summed = {"loss:sum": float(sum(o.loss for o in outputs))}
            for output in outputs:  # every per-datum metric is a `name:sum`
                for name, value in output.metrics.items():
                    summed[name] = summed.get(name, 0.0) + value
            return ForwardBackwardResult(outputs=outputs, metrics=summed)
        case _ if info.get(HANDOFF):
            return None
        case CreateModel(restore=restore) if restore is not None:  # create mode of load_weights
            return LoadWeightsResponse(model_id=mid, path=restore.tinker_path)
        case CreateModel():
            return CreateModelResponse(model_id=mid)
        case OptimStep():
            return OptimStepResponse(metrics=dict(metrics))
        case LoadWeights(restore=restore):
            return LoadWeightsResponse(path=restore.tinker_path)
        case UnloadModel():
            return UnloadModelResponse(model_id=mid)
    return Failure(error=f"no result for {type(pending.command).__name__}", category="server")
