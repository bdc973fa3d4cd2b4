"""Operator views: `GET /api/v1/operator/status` (JSON) and `GET /metrics` (Prometheus text).

Only loopback clients may call them, unless the request carries `X-Admin-Key` equal to the
configured `admin_key` (403 otherwise: these are not tenant resources, so nothing is hidden).
"""

from __future__ import annotations

import hmac
from typing import Any

import msgspec
from litestar import Request, Response, get

from infra.watch import status_of
from services.gateway import metrics
from services.gateway.auth import is_loopback
from services.gateway.context import Gateway
from services.gateway.errors import Forbidden

PROMETHEUS = "text/plain; version=0.0.4; charset=utf-8"


def require_operator(request: Request[Any, Any, Any], gateway: Gateway) -> None:
    key, expected = request.headers.get("x-admin-key"), gateway.config.admin_key
    if key and expected and hmac.compare_digest(key.encode(), expected.encode()):
        return
    if request.client is not None and is_loopback(request.client.host):
        return
    raise Forbidden("operator routes answer loopback clients, or a request carrying the right X-Admin-Key")


@get("/api/v1/operator/status", operation_id="operator_status")
async def operator_status(request: Request[Any, Any, Any], gateway: Gateway) -> dict[str, Any]:
    """Models, trainers, sessions, stream sizes and consumer lag, as `tinkerd status` shows them."""
    require_operator(request, gateway)
    status = msgspec.to_builtins(await status_of(gateway.bus))
    status["gateway"] = {"sampling_permits_in_use": gateway.admission.sampling_in_use}
    status["gateway"]["futures_waiting"] = gateway.board.waiting
    status["gateway"]["samples_waiting_for_engine"] = gateway.engines.waiting
    return status  # type: ignore[no-any-return]


@get("/metrics", operation_id="metrics")
async def prometheus_metrics(request: Request[Any, Any, Any], gateway: Gateway) -> Response[str]:
    require_operator(request, gateway)
    text = metrics.render(
        gateway.metrics,
        futures_waiting=gateway.board.waiting,
        sampling_in_use=gateway.admission.sampling_in_use,
        sampling_capacity=gateway.config.sampling_capacity,
        queued=gateway.admission.queued(),
        engines=gateway.engines,
    )
    return Response(text, media_type=PROMETHEUS)


ROUTES = [operator_status, prometheus_metrics]
