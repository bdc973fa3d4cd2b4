"""`create_app(config) -> Litestar`: the Tinker HTTP API over the event log, and the gateway's
composition root (its lifespan builds the `Gateway` and starts the loops that use it)."""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack, asynccontextmanager
from pathlib import Path

import httpx
from litestar import Litestar, Router
from litestar.di import Provide
from litestar.openapi import OpenAPIConfig

from infra.bus import Bus
from infra.stack_state import state_file_from_env
from infra.streams import ensure_streams
from libs.models.hf_cache import install_tokenizer
from libs.models.registry import SHORT_NAMES, ResolvedModel, resolve_base_model
from services.gateway.accounts.auth import KeyRing
from services.gateway.accounts.session_lifecycle import SessionLifecycle
from services.gateway.config import GatewayConfig
from services.gateway.context import (
    Gateway,
    engine_urls_by_base,
    model_names,
    provide_gateway,
    provide_tenant,
    shared_signing_secret,
)
from services.gateway.futures import FutureBoard
from services.gateway.http import guards
from services.gateway.http.admission import Admission
from services.gateway.http.errors import EXCEPTION_HANDLERS
from services.gateway.http.tracing_mw import trace_requests
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
from services.gateway.sampling.engines import EnginePool
from services.gateway.sampling.sample_runner import SampleRunner
from services.gateway.store import Store

log = logging.getLogger("tinkerd.gateway")

TENANT_ROUTES = [
    handler
    for module in (bootstrap, training, weights, futures, sampling, catalog, sessions, admin, unsupported)
    for handler in module.ROUTES
] + console.TENANT_ROUTES
OPERATOR_ROUTES = [*operator.ROUTES, *console.OPERATOR_ROUTES]
PUBLIC_ROUTES = [*bootstrap.PUBLIC_ROUTES, *catalog.PUBLIC_ROUTES, *console.PUBLIC_ROUTES]
ALL_ROUTES = [*TENANT_ROUTES, *OPERATOR_ROUTES, *PUBLIC_ROUTES]


def lifespan(config: GatewayConfig):  # type: ignore[no-untyped-def]
    """The gateway's composition root: builds every part once, in order, and closes them in
    reverse (an `AsyncExitStack`), whether start-up finished or not."""

    @asynccontextmanager
    async def run(app: Litestar) -> AsyncIterator[None]:
        async with AsyncExitStack() as stack:
            data_dir = Path(config.data_dir).expanduser().resolve()
            model = resolve_base_model(config.base_model, data_dir)
            extra_models = [
                resolve_base_model(name.strip(), data_dir)
                for name in config.extra_base_models.split(",")
                if name.strip()
            ]
            for served in [model, *extra_models] if config.cache_tokenizer else []:
                if served.name in SHORT_NAMES:
                    try:
                        install_tokenizer(served.path, [served.name, SHORT_NAMES[served.name]])
                    except OSError as exc:  # a read-only cache costs get_tokenizer() only
                        log.warning("could not cache the tokenizer of %s: %s", served.name, exc)
            bus = await Bus.connect(config.nats_url, "gateway")
            stack.push_async_callback(bus.close)
            client = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=256)
            )
            stack.push_async_callback(client.aclose)
            state_file = state_file_from_env(os.environ)
            pools: list[EnginePool] = []

            async def close_pools() -> None:
                for pool in pools:
                    await pool.close()

            stack.push_async_callback(close_pools)

            def pool_of(urls: list[str], served: ResolvedModel) -> EnginePool:
                pool = EnginePool(
                    client, urls, config.max_loaded_adapters, data_dir, model_names(served), state_file=state_file
                )
                pools.append(pool)
                return pool

            engines = pool_of(config.engines(), model)
            await ensure_streams(bus.js)
            board = FutureBoard(bus)
            await board.start()
            stack.push_async_callback(board.stop)
            keys = KeyRing(Path(config.keys_file) if config.keys_file else None)
            gateway = Gateway(config, bus, Store(bus), board, keys, model, Admission(config), engines)
            gateway.extra_models = extra_models
            for base, urls in engine_urls_by_base(config, model, gateway.served).items():
                gateway.extra_pools[base] = pool_of(urls, gateway.model_named(base))
            board.listeners.append(gateway.on_result)  # after the replay: live results only
            if config.signing_secret:
                gateway.signing_secret = config.signing_secret.encode()
            else:
                gateway.signing_secret = await shared_signing_secret(gateway.store, gateway.signing_secret)
            runner = SampleRunner(gateway)
            await runner.start()
            stack.push_async_callback(runner.close)
            lifecycle = SessionLifecycle(gateway)
            await lifecycle.start()
            stack.push_async_callback(lifecycle.close)
            gateway.sessions = lifecycle
            app.state.gateway = gateway
            log.info("gateway ready (base model %s)", ", ".join(m.name for m in gateway.models))
            yield

    return run


def create_app(config: GatewayConfig) -> Litestar:
    """Every route under exactly one access policy (see ``http/guards.py``)."""
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
