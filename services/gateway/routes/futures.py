"""retrieve_future (long-poll), retrieve_futures and cancel_future.

A pending future is held for up to `retrieve_wait_s` and released the moment its result is
appended to the results stream (see `FutureBoard`); only then does the SDK see `try_again`.
"""

from __future__ import annotations

from litestar import Request, Response, post

from infra.answers import answer
from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.records import ModelRecord, QueueRecord, SamplerRecord, SeqClaim
from libs.contracts.results import Failure
from services.gateway.accounts.auth import Tenant
from services.gateway.context import Gateway
from services.gateway.http.errors import Gone, NotFound, NotOffered
from services.gateway.wire import tinker_wire as w
from services.gateway.wire.render import render


async def _owner(gateway: Gateway, request_id: str) -> tuple[str | None, SeqClaim | None]:
    """(tenant owning the request, its identity claim) — both None when unknown."""
    if not ids.is_valid_id(request_id) or ":" not in request_id:
        return None, None
    entity, seq = ids.split_request_id(request_id)
    if seq == "unload":  # lifecycle requests have no seq claim (see submit.unload)
        model = await gateway.store.get(s.KV_MODELS, ids.token(entity), ModelRecord)
        if model is None or not model.unloaded:
            return None, None
        return model.tenant, SeqClaim(
            request_id=request_id, fingerprint="", kind="unload", tenant=model.tenant, accepted_ns=now_ns()
        )
    if not seq.lstrip("-").isdigit():
        return None, None
    if ids.is_sampler_id(entity):
        sampler = await gateway.store.get(s.KV_SAMPLERS, ids.token(entity), SamplerRecord)
        claim = await gateway.store.get(s.KV_SAMPLE_SEQ, ids.seq_key(entity, int(seq)), SeqClaim)
        return (sampler.tenant if sampler else None), claim
    # a model's owner never changes: its record, once found, is kept (`Store.get`)
    model = await gateway.store.get(s.KV_MODELS, ids.token(entity), ModelRecord, kept=True)
    claim = await gateway.store.get(s.KV_SEQ, ids.seq_key(entity, int(seq)), SeqClaim)
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
            queued = await gateway.store.get(s.KV_QUEUE, ids.token(data.request_id), QueueRecord)
            if queued is not None and queued.queue_state != "active":
                return Response(
                    w.TryAgainResponse(
                        request_id=data.request_id,
                        queue_state=queued.queue_state,
                        queue_state_reason=queued.reason or None,
                    )
                )
            return Response(w.TryAgainResponse(request_id=data.request_id, queue_state="active"))
    if result.tenant != tenant.id:
        raise NotFound(f"future {data.request_id!r} not found")
    return render(result, request.headers.get("accept", ""))


CANCELLED = "cancelled by the client (cancel_future): the sample was stopped"


@post("/api/v1/cancel_future", status_code=200, operation_id="cancel_future")
async def cancel_future(data: w.CancelFutureRequest, gateway: Gateway, tenant: Tenant) -> dict[str, str]:
    """Stop a sample the client abandoned (the SDK sends this when `sample_cancel_enabled`).

    The future answers a `user` failure at once (which also frees its sampling permits on every
    replica), and the replica running the job stops it: its engine request is closed, so the
    engine drops its rows. A job still queued is skipped when it is pulled (it has a result). A
    training request is left alone: once sequenced it always runs (its seq_id is spent)."""
    owner, claim = await _owner(gateway, data.request_id)
    if owner != tenant.id or claim is None:
        raise NotFound(f"future {data.request_id!r} not found")
    entity, _ = ids.split_request_id(data.request_id)
    if not ids.is_sampler_id(entity) or await gateway.board.lookup(data.request_id) is not None:
        return {"status": "ok"}
    await answer(
        gateway.bus,
        kind="sample",
        body=Failure(error=CANCELLED, category="user"),
        tenant=tenant.id,
        model_id=entity,
        request_id=data.request_id,
        seq_id=claim_seq(data.request_id),
        announce="none",
    )
    await gateway.bus.nc.publish(s.cancel_subject(data.request_id), b"")
    return {"status": "cancelled"}


def claim_seq(request_id: str) -> int:
    _, seq = ids.split_request_id(request_id)
    return int(seq)


@post("/api/v1/retrieve_futures", status_code=200, operation_id="retrieve_futures")
async def retrieve_futures(
    data: w.FuturesRetrieveRequest, gateway: Gateway, tenant: Tenant
) -> w.FuturesRetrieveResponse:
    """The session-level poller is not offered: client config never sets
    `sample_use_retrieve_futures`, so an SDK never calls this; anyone else learns it at once."""
    raise NotOffered(
        "retrieve_futures is not offered by this server (client config sample_use_retrieve_futures "
        "is false): poll each future with retrieve_future"
    )


ROUTES = [retrieve_future, cancel_future, retrieve_futures]
