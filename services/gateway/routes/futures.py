"""retrieve_future (long-poll), retrieve_futures and cancel_future.

A pending future is held for up to `retrieve_wait_s` and released the moment its result is
appended to the results stream (see `FutureBoard`); only then does the SDK see `try_again`.
"""

from __future__ import annotations

from litestar import Request, Response, post

from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.records import ModelRecord, QueueRecord, SamplerRecord, SeqClaim
from services.gateway import tinker_wire as w
from services.gateway.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.errors import Gone, NotFound
from services.gateway.render import render


async def _owner(gateway: Gateway, request_id: str) -> tuple[str | None, SeqClaim | None]:
    """(tenant owning the request, its identity claim) — both None when unknown."""
    if not s.is_valid_id(request_id) or ":" not in request_id:
        return None, None
    entity, seq = ids.split_request_id(request_id)
    if seq == "unload":  # lifecycle requests have no seq claim (see submit.unload)
        model = await gateway.store.get(s.KV_MODELS, s.token(entity), ModelRecord)
        if model is None or not model.unloaded:
            return None, None
        return model.tenant, SeqClaim(
            request_id=request_id, fingerprint="", kind="unload", tenant=model.tenant, accepted_ns=now_ns()
        )
    if not seq.lstrip("-").isdigit():
        return None, None
    if ids.is_sampler_id(entity):
        sampler = await gateway.store.get(s.KV_SAMPLERS, s.token(entity), SamplerRecord)
        claim = await gateway.store.get(s.KV_SAMPLE_SEQ, s.seq_key(entity, int(seq)), SeqClaim)
        return (sampler.tenant if sampler else None), claim
    model = await gateway.store.get(s.KV_MODELS, s.token(entity), ModelRecord)
    claim = await gateway.store.get(s.KV_SEQ, s.seq_key(entity, int(seq)), SeqClaim)
    return (model.tenant if model else None), claim


@post("/api/v1/retrieve_future", status_code=200, operation_id="retrieve_future")
async def retrieve_future(
    request: Request,  # type: ignore[type-arg]
    data: w.FutureRetrieveRequest,
    gateway: Gateway,
    tenant: Tenant,
) -> Response[object]:
    result = gateway.board.peek(data.request_id)
    if result is None or result.tenant != tenant.id:
        owner, claim = await _owner(gateway, data.request_id)
        if owner != tenant.id or claim is None:
            raise NotFound(f"future {data.request_id!r} not found")
        result = await gateway.board.wait(data.request_id, gateway.config.retrieve_wait_s)
        if result is None:
            age_s = (now_ns() - claim.accepted_ns) / 1e9
            if age_s > gateway.config.result_retention_s:
                raise Gone(
                    f"the result of {data.request_id} expired after {gateway.config.result_retention_s:.0f}s; it is not run again"
                )
            queued = await gateway.store.get(s.KV_QUEUE, s.token(data.request_id), QueueRecord)
            if queued is not None and queued.queue_state in ("paused_capacity", "paused_rate_limit"):
                return Response(
                    w.TryAgainResponse(
                        request_id=data.request_id,
                        queue_state=queued.queue_state,  # type: ignore[arg-type]
                        queue_state_reason=queued.reason or None,
                    )
                )
            return Response(w.TryAgainResponse(request_id=data.request_id, queue_state="active"))
    if result.tenant != tenant.id:
        raise NotFound(f"future {data.request_id!r} not found")
    return render(result, request.headers.get("accept", ""))


@post("/api/v1/cancel_future", status_code=200, operation_id="cancel_future")
async def cancel_future(data: w.CancelFutureRequest, gateway: Gateway, tenant: Tenant) -> dict[str, str]:
    """Accepted and ignored: a training request that was sequenced always runs (its seq_id is spent)."""
    return {"status": "ok"}


@post("/api/v1/retrieve_futures", status_code=200, operation_id="retrieve_futures")
async def retrieve_futures(
    data: w.FuturesRetrieveRequest, gateway: Gateway, tenant: Tenant
) -> w.FuturesRetrieveResponse:
    """Session-level poller (only with client flag sample_use_retrieve_futures, which we leave off)."""
    return w.FuturesRetrieveResponse(completions=[], cursor=data.prev_cursor)


ROUTES = [retrieve_future, cancel_future, retrieve_futures]
