"""Operator views: `GET /api/v1/operator/status` (JSON) and `GET /metrics` (Prometheus text).

Mounted under the operator router (``guards.operator_only``: loopback or the admin key).
"""

from __future__ import annotations

import os
from typing import Any

import msgspec
from litestar import Request, Response, get

from infra.stack_state import read_state, state_file_from_env
from infra.status import status_of
from services.gateway import metrics
from services.gateway.context import Gateway


@get("/api/v1/operator/status", operation_id="operator_status")
async def operator_status(request: Request[Any, Any, Any], gateway: Gateway) -> dict[str, Any]:
    """Services, models, trainers, sessions, stream sizes and consumer lag, as `tinkerd status`
    shows them (`services`: each supervised service's state under `tinkerd up`, else empty)."""
    status = msgspec.to_builtins(await status_of(gateway.bus))
    state_file = state_file_from_env(os.environ)
    stack = read_state(state_file) if state_file is not None else None
    status["services"] = msgspec.to_builtins(stack.services) if stack is not None else {}
    status["gateway"] = {"sampling_permits_in_use": gateway.admission.sampling_in_use}
    status["gateway"]["futures_waiting"] = gateway.board.waiting
    status["gateway"]["samples_waiting_for_engine"] = sum(pool.waiting for pool in gateway.pools)
    return status  # type: ignore[no-any-return]


@get("/metrics", operation_id="metrics")
async def prometheus_metrics(request: Request[Any, Any, Any], gateway: Gateway) -> Response[str]:
    return Response(metrics.render(gateway.metrics_registry), media_type=metrics.CONTENT_TYPE)


ROUTES = [operator_status, prometheus_metrics]
