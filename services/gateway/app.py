"""`create_app(config) -> Litestar`: the Tinker HTTP API over the event log."""

from __future__ import annotations

from litestar import Litestar
from litestar.di import Provide

from services.gateway.config import GatewayConfig
from services.gateway.context import lifespan, provide_gateway, provide_tenant
from services.gateway.errors import EXCEPTION_HANDLERS
from services.gateway.routes import (
    admin,
    bootstrap,
    catalog,
    futures,
    operator,
    sampling,
    sessions,
    training,
    unsupported,
    weights,
)
from services.gateway.tracing_mw import trace_requests

ROUTE_MODULES = (bootstrap, training, weights, futures, sampling, catalog, sessions, admin, unsupported, operator)


def create_app(config: GatewayConfig) -> Litestar:
    return Litestar(
        route_handlers=[handler for module in ROUTE_MODULES for handler in module.ROUTES],
        dependencies={"gateway": Provide(provide_gateway), "tenant": Provide(provide_tenant)},
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=[lifespan(config)],
        middleware=[trace_requests],
        request_max_body_size=64 * 1024 * 1024,
        openapi_config=None,
        debug=False,
    )
