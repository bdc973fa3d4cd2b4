"""Who may call what: the gateway's access policies, as Litestar guards on its routers.

``app.py`` mounts every route under exactly one of three routers, so the policy of an
endpoint is read in one place:

- **tenant** (``api_key``): the `X-API-Key` header names a tenant (``auth.KeyRing``), or holds a
  JWT this gateway minted for one (``jwt_auth``); the
  handler receives it as its ``tenant`` dependency, and everything it touches is checked
  against that tenant's ownership. Unknown or missing keys are a 401.
- **operator** (``operator_only``): loopback clients, or a request carrying `X-Admin-Key`
  equal to the configured ``admin_key``; otherwise 403 (nothing is hidden: these are not
  tenant resources).
- **public**: no check; health probes, and signed download URLs, which carry their own
  signature (``catalog/downloads.py``).
"""

from __future__ import annotations

import hmac
from typing import Any

from litestar.connection import ASGIConnection
from litestar.handlers.base import BaseRouteHandler

from services.gateway.accounts import jwt_auth
from services.gateway.accounts.auth import Tenant, is_loopback
from services.gateway.context import Gateway
from services.gateway.http.errors import Forbidden

Connection = ASGIConnection[Any, Any, Any, Any]


def _gateway(connection: Connection) -> Gateway:
    return connection.app.state.gateway  # type: ignore[no-any-return]


async def api_key(connection: Connection, _: BaseRouteHandler) -> None:
    gateway, credential = _gateway(connection), connection.headers.get("x-api-key")
    if jwt_auth.looks_like_jwt(credential):  # a JWT from POST /api/v1/auth/token (see accounts/jwt_auth.py)
        connection.state.tenant = jwt_auth.verify(credential or "", gateway.signing_secret)
        return
    connection.state.tenant = gateway.keys.authenticate(credential)


async def operator_only(connection: Connection, _: BaseRouteHandler) -> None:
    key, expected = connection.headers.get("x-admin-key"), _gateway(connection).config.admin_key
    if key and expected and hmac.compare_digest(key.encode(), expected.encode()):
        return
    if connection.client is not None and is_loopback(connection.client.host):
        return
    raise Forbidden("operator routes answer loopback clients, or a request carrying the right X-Admin-Key")


def tenant_of(connection: Connection) -> Tenant:
    """The tenant ``api_key`` authenticated for this request."""
    return connection.state.tenant  # type: ignore[no-any-return]
