"""`create_app(config) -> Litestar`: the Tinker HTTP API over the event log."""

from __future__ import annotations

from litestar import Litestar
from litestar.di import Provide

from services.gateway.config import GatewayConfig
from services.gateway.context import lifespan, provide_gateway, provide_tenant
from services.gateway.errors import EXCEPTION_HANDLERS
from services.gateway.routes import bootstrap
from services.gateway.tracing_mw import trace_requests


def create_app(config: GatewayConfig) -> Litestar:
    routes = [*bootstrap.ROUTES]
    for module_name in ("training", "futures", "sampling", "catalog", "operator"):
        try:
            module = __import__(f"services.gateway.routes.{module_name}", fromlist=["ROUTES"])
        except ModuleNotFoundError:
            continue
        routes += module.ROUTES
    return Litestar(
        route_handlers=routes,
        dependencies={"gateway": Provide(provide_gateway), "tenant": Provide(provide_tenant)},
        exception_handlers=EXCEPTION_HANDLERS,  # type: ignore[arg-type]
        lifespan=[lifespan(config)],
        middleware=[trace_requests],
        request_max_body_size=64 * 1024 * 1024,
        openapi_config=None,
        debug=False,
    )
