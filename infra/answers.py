"""Answering a future: a request's one result appended to its subject, then the event saying so.

Every service that finishes a request (the planner, the publisher, the gateway for samples and
cancellations) answers through `answer`. The result goes to `tinker.result.<request_id>` only if
that subject is empty (`Bus.publish_once`): whoever answers first wins, and a repeated answer (a
replay, a redelivery, a job run twice) has no second effect, not even a second event.
"""

from __future__ import annotations

from typing import Literal

from infra.bus import Bus
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import RequestCompleted, RequestFailed
from libs.contracts.results import Failure, RequestResult, ResultBody

Announce = Literal["soon", "now", "none"]
"""After appending: emit `completed` / `failed` in the background, awaited, or not at all (the
caller emits its own event, such as a sample's metered `completed`)."""


async def answer(
    bus: Bus,
    *,
    kind: str,
    body: ResultBody,
    tenant: str,
    model_id: str,
    request_id: str,
    seq_id: int,
    traceparent: str = "",
    started_ns: int = 0,
    announce: Announce = "soon",
) -> bool:
    """Append the future's result; True if this call appended it (False: answered before).
    `started_ns`, when known, gives the event its `duration_ms`."""
    result = RequestResult(
        kind=kind,
        body=body,
        tenant=tenant,
        model_id=model_id,
        request_id=request_id,
        seq_id=seq_id,
        at_ns=now_ns(),
        traceparent=traceparent,
    )
    if not await bus.publish_once(s.result_subject(request_id), codec.pack(result), msg_id=request_id):
        return False
    if announce == "none":
        return True
    event = settled(result, (now_ns() - started_ns) / 1e6 if started_ns else 0.0)
    if announce == "now":
        await bus.emit(event)
    else:
        bus.emit_soon(event)
    return True


def settled(result: RequestResult, duration_ms: float) -> RequestCompleted | RequestFailed:
    """The operation event of an appended result."""
    if isinstance(result.body, Failure):
        return RequestFailed(
            kind=result.kind,
            error=result.body.error,
            category=result.body.category,
            duration_ms=duration_ms,
            model_id=result.model_id,
            request_id=result.request_id,
            seq_id=result.seq_id,
            tenant=result.tenant,
            at_ns=now_ns(),
        )
    return RequestCompleted(
        kind=result.kind,
        duration_ms=duration_ms,
        model_id=result.model_id,
        request_id=result.request_id,
        seq_id=result.seq_id,
        tenant=result.tenant,
        at_ns=now_ns(),
    )
