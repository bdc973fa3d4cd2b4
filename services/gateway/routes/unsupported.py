"""Endpoints the SDK knows but this server does not offer: a clear 501 `{error, category}`.

The client-config flags that would make the SDK call them on its own (JWT auth, server-side
custom losses, ...) stay off, so only an explicit call reaches these. `x-should-retry: false`
stops the SDK's low-level HTTP retries.
"""

from __future__ import annotations

from litestar import delete, get, post
from litestar.handlers import HTTPRouteHandler

from services.gateway.auth import Tenant
from services.gateway.errors import NotImplementedYet

NO_RETRY = {"x-should-retry": "false"}

OFFERED_INSTEAD = {
    "auth_token": "JWT auth is off (client config pjwt_auth_enabled=false): send the tml- API key itself",
    "revoke_api_key": "keys are managed by the operator (`tinkerd keys`)",
    "billing_usage_events": "there is no billing on a self-hosted server",
    "billing_checkpoint_storage": "there is no billing on a self-hosted server",
    "audit_log": "operation events are on the bus instead (`tinkerd events`)",
    "session_trace_export": "traces go to the configured OpenTelemetry collector instead",
    "search_sessions": "use GET /api/v1/sessions and GET /api/v1/sessions/{id}",
    "copy_weights": "load the checkpoint (published checkpoints are readable by every tenant) and save it",
    "create_custom_loss": "server-side custom losses are off: forward_backward_custom runs the loss client-side",
}


def refuse(operation: str) -> NotImplementedYet:
    return NotImplementedYet(
        f"{operation} is not offered by this server: {OFFERED_INSTEAD[operation]}", headers=NO_RETRY
    )


@post("/api/v1/auth/token", status_code=200, operation_id="auth_token")
async def auth_token(tenant: Tenant) -> None:
    raise refuse("auth_token")


@delete("/api/v1/auth/apikey/me", status_code=200, operation_id="revoke_api_key")
async def revoke_api_key(tenant: Tenant) -> None:
    raise refuse("revoke_api_key")


@get("/api/v1/billing/usage/events", operation_id="billing_usage_events")
async def billing_usage_events(tenant: Tenant) -> None:
    raise refuse("billing_usage_events")


@get("/api/v1/billing/usage/checkpoints/current", operation_id="billing_checkpoint_storage")
async def billing_checkpoint_storage(tenant: Tenant) -> None:
    raise refuse("billing_checkpoint_storage")


@get("/api/v1/audit", operation_id="audit_log")
async def audit_log(tenant: Tenant) -> None:
    raise refuse("audit_log")


@get("/api/v1/sessions/{session_id:str}/trace_export", operation_id="session_trace_export")
async def session_trace_export(session_id: str, tenant: Tenant) -> None:
    raise refuse("session_trace_export")


@post("/api/v1/sessions/search", status_code=200, operation_id="search_sessions")
async def search_sessions(tenant: Tenant) -> None:
    raise refuse("search_sessions")


@post("/api/v1/copy_weights", status_code=200, operation_id="copy_weights")
async def copy_weights(tenant: Tenant) -> None:
    raise refuse("copy_weights")


@post("/api/v1/create_custom_loss", status_code=200, operation_id="create_custom_loss")
async def create_custom_loss(tenant: Tenant) -> None:
    raise refuse("create_custom_loss")


ROUTES: list[HTTPRouteHandler] = [
    auth_token,
    revoke_api_key,
    billing_usage_events,
    billing_checkpoint_storage,
    audit_log,
    session_trace_export,
    search_sessions,
    copy_weights,
    create_custom_loss,
]
