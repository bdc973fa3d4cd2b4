"""Endpoints the SDK knows but this server does not offer: a clear, non-retryable 400.

Never a 5xx: the SDK retries every 5xx for minutes before failing. `x-should-retry: false` also
stops its low-level HTTP retries. The client-config flag that would make the SDK call these on its
own (`custom_loss_server_side`) stays off, so only an explicit call reaches them.
"""

from __future__ import annotations

from litestar import delete, post
from litestar.handlers import HTTPRouteHandler

from services.gateway.accounts.auth import Tenant
from services.gateway.http.errors import NotOffered

NO_RETRY = {"x-should-retry": "false"}

OFFERED_INSTEAD = {
    "revoke_api_key": "keys are managed by the operator (`tinkerd keys add`; remove a key from the keys file "
    "and restart the gateway to revoke it)",
    "create_custom_loss": "server-side custom losses are off: forward_backward_custom runs the loss client-side",
}


def refuse(operation: str) -> NotOffered:
    return NotOffered(f"{operation} is not offered by this server: {OFFERED_INSTEAD[operation]}", headers=NO_RETRY)


@delete("/api/v1/auth/apikey/me", status_code=200, operation_id="revoke_api_key")
async def revoke_api_key(tenant: Tenant) -> None:
    raise refuse("revoke_api_key")


@post("/api/v1/create_custom_loss", status_code=200, operation_id="create_custom_loss")
async def create_custom_loss(tenant: Tenant) -> None:
    raise refuse("create_custom_loss")


ROUTES: list[HTTPRouteHandler] = [revoke_api_key, create_custom_loss]
