"""`create_app(config) -> Litestar`: the Tinker HTTP API over the event log."""

from __future__ import annotations

from litestar import Litestar, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from services.gateway import guards
from services.gateway.config import GatewayConfig
from services.gateway.context import lifespan, provide_gateway, provide_tenant
from services.gateway.errors import EXCEPTION_HANDLERS
from services.gateway.routes import (
    admin,
    bootstrap,
    catalog,
    console,
    futures,
    operator,
    sampling,
    sessions,
    training,
    unsupported,
    weights,
)
from services.gateway.tracing_mw import trace_requests

TENANT_ROUTES = [
    handler
    for module in (bootstrap, training, weights, futures, sampling, catalog, sessions, admin, unsupported)
    for handler in module.ROUTES
] + console.TENANT_ROUTES
OPERATOR_ROUTES = [*operator.ROUTES, *console.OPERATOR_ROUTES]
PUBLIC_ROUTES = [*bootstrap.PUBLIC_ROUTES, *catalog.PUBLIC_ROUTES, *console.PUBLIC_ROUTES]
ALL_ROUTES = [*TENANT_ROUTES, *OPERATOR_ROUTES, *PUBLIC_ROUTES]


def create_app(config: GatewayConfig) -> Litestar:
    """Every route under exactly one access policy (see ``guards.py``)."""
    tenant_api = Router(path="/", guards=[guards.api_key], route_handlers=TENANT_ROUTES)
    operator_api = Router(path="/", guards=[guards.operator_only], route_handlers=OPERATOR_ROUTES)
    public = Router(path="/", route_handlers=PUBLIC_ROUTES)
    return Litestar(
        route_handlers=[tenant_api, operator_api, public],
        dependencies={"gateway": Provide(provide_gateway), "tenant": Provide(provide_tenant)},
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=[lifespan(config)],
        middleware=[trace_requests],
        request_max_body_size=64 * 1024 * 1024,
        # the schema of every route at GET /schema/openapi.json (public, like the health probes)
        openapi_config=OpenAPIConfig(title="Tinkerd", version="1", path="/schema"),
        debug=False,
    )
