"""The gateway's process-wide context: config, bus, projections, and the served base model.

Built once by the app's lifespan and handed to handlers through dependency injection.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

import httpx
from litestar import Litestar, Request
from prometheus_client import CollectorRegistry

from infra.bus import Bus
from infra.stack_state import state_file_from_env
from infra.streams import ensure_streams
from libs.contracts import subjects as s
from libs.contracts.records import SessionRecord, SigningSecret
from libs.contracts.results import RequestResult
from libs.models.hf_cache import install_tokenizer
from libs.models.registry import SHORT_NAMES, ResolvedModel, resolve_base_model
from services.gateway.admission import Admission
from services.gateway.auth import KeyRing, Tenant
from services.gateway.config import GatewayConfig
from services.gateway.engines import EnginePool
from services.gateway.futures import FutureBoard
from services.gateway.metrics import Live, Metrics
from services.gateway.metrics import registry as metrics_registry
from services.gateway.store import Store

log = logging.getLogger("tinkerd.gateway")


class SessionBeats(Protocol):
    async def beat(self, record: SessionRecord) -> None: ...

    async def close(self) -> None: ...


@dataclass
class Gateway:
    config: GatewayConfig
    bus: Bus
    store: Store
    board: FutureBoard
    keys: KeyRing
    model: ResolvedModel
    admission: Admission
    engines: EnginePool
    metrics: Metrics = field(default_factory=Metrics)
    sessions: SessionBeats | None = None  # session_lifecycle.SessionLifecycle, set by the lifespan
    signing_secret: bytes = field(default_factory=lambda: secrets.token_bytes(32))
    extra_models: list[ResolvedModel] = field(default_factory=list)  # more served base models
    extra_pools: dict[str, EnginePool] = field(default_factory=dict)
    """The engines of each extra base model that has some, by its name (`base_sampler_urls`);
    `engines` are the primary base model's."""

    def pool(self, base: str) -> EnginePool | None:
        """The engines that sample base model `base` (a record's name); None: it has none."""
        return self.engines if base == self.model.name else self.extra_pools.get(base)

    @property
    def pools(self) -> list[EnginePool]:
        """Every engine pool, the primary base model's first."""
        return [self.engines, *self.extra_pools.values()]

    @property
    def models(self) -> list[ResolvedModel]:
        """Every base model served, the primary one first."""
        return [self.model, *self.extra_models]

    def served(self, name: str) -> ResolvedModel | None:
        """The served base model `name` refers to (its name, alias or path), or None."""
        for model in self.models:
            if name in (model.name, str(model.path), f"tinkerd/{model.name}"):
                return model
        try:
            path = resolve_base_model(name, self.data_dir, build_missing=False).path
        except ValueError:
            return None
        return next((m for m in self.models if m.path == path), None)

    def model_named(self, name: str) -> ResolvedModel:
        """A served base model by the name a record carries (the primary one if unknown)."""
        return next((m for m in self.models if m.name == name), self.model)

    @property
    def data_dir(self) -> Path:
        return Path(self.config.data_dir).expanduser().resolve()

    @functools.cached_property
    def metrics_registry(self) -> CollectorRegistry:
        """This gateway's Prometheus registry: the counters, and gauges read at scrape time."""
        return metrics_registry(self.metrics, self._live)

    def _live(self) -> Live:
        return Live(
            futures_waiting=self.board.waiting,
            sampling_in_use=self.admission.sampling_in_use,
            sampling_capacity=self.config.sampling_capacity,
            queued=self.admission.queued(),
            engines=self.pools,
        )

    def on_result(self, result: RequestResult) -> None:
        """A result arrived: the request no longer counts against admission limits."""
        self.admission.finished(result.tenant, result.model_id, result.request_id)
        self.metrics.on_result(result)


async def shared_signing_secret(store: Store, candidate: bytes) -> bytes:
    """The deployment's signing secret: the first replica to start stores its random one
    (a create-only write, so exactly one wins) and every replica uses what is stored."""
    _, stored = await store.create(
        s.KV_GATEWAY, "signing_secret", SigningSecret(candidate.hex()), SigningSecret
    )
    return bytes.fromhex(stored.secret_hex)


def engine_urls_by_base(
    config: GatewayConfig, primary: ResolvedModel, served: Callable[[str], ResolvedModel | None]
) -> dict[str, list[str]]:
    """`base_sampler_urls` as {extra base model's name: its engine URLs}; `served` maps a name
    as written (name, alias or path) to the served base model.

    Raises:
        ValueError: an entry names a base model that is not served, or the primary one (its
            engines are `sampler_urls`), or one engine is listed for two base models.
    """
    urls: dict[str, list[str]] = {}
    for name, listed in config.base_engines().items():
        model = served(name)
        if model is None:
            raise ValueError(
                f"TINKERD_GATEWAY_BASE_SAMPLER_URLS names {name!r}, which this gateway does not serve "
                f"(TINKERD_BASE_MODEL, TINKERD_GATEWAY_EXTRA_BASE_MODELS)"
            )
        if model.name == primary.name:
            raise ValueError(
                f"TINKERD_GATEWAY_BASE_SAMPLER_URLS names the primary base model {name!r}: its engines "
                "are TINKERD_GATEWAY_SAMPLER_URLS (or TINKERD_GATEWAY_SAMPLER_URL)"
            )
        mine = urls.setdefault(model.name, [])
        mine.extend(url for url in listed if url not in mine)
    owner = dict.fromkeys(config.engines(), primary.name)
    for base, listed in urls.items():
        for url in listed:
            if owner.setdefault(url, base) != base:
                raise ValueError(
                    f"engine {url} is listed for base models {owner[url]!r} and {base!r}; an engine serves one"
                )
    return urls


def model_names(model: ResolvedModel) -> tuple[str, ...]:
    """What an engine of `model` may call it in its `/get_model_info` (`model_path`): the name
    first, then its alias and its directory."""
    alias = SHORT_NAMES.get(model.name)
    return (model.name, *([alias] if alias else []), str(model.path))


def lifespan(config: GatewayConfig):  # type: ignore[no-untyped-def]
    @asynccontextmanager
    async def run(app: Litestar) -> AsyncIterator[None]:
        data_dir = Path(config.data_dir).expanduser().resolve()
        model = resolve_base_model(config.base_model, data_dir)
        extra_models = [
            resolve_base_model(name.strip(), data_dir) for name in config.extra_base_models.split(",") if name.strip()
        ]
        for served in [model, *extra_models] if config.cache_tokenizer else []:
            if served.name in SHORT_NAMES:
                try:
                    install_tokenizer(served.path, [served.name, SHORT_NAMES[served.name]])
                except OSError as exc:  # a read-only cache costs get_tokenizer() only
                    log.warning("could not cache the tokenizer of %s: %s", served.name, exc)
        bus = await Bus.connect(config.nats_url, "gateway")
        client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=10.0), limits=httpx.Limits(max_connections=256)
        )
        state_file = state_file_from_env(os.environ)

        def pool_of(urls: list[str], served: ResolvedModel) -> EnginePool:
            return EnginePool(
                client, urls, config.max_loaded_adapters, data_dir, model_names(served), state_file=state_file
            )

        engines = pool_of(config.engines(), model)
        extra_pools: dict[str, EnginePool] = {}
        try:
            await ensure_streams(bus.js)
            board = FutureBoard(bus)
            await board.start()
            keys = KeyRing(Path(config.keys_file) if config.keys_file else None)
            gateway = Gateway(config, bus, Store(bus), board, keys, model, Admission(config), engines)
            gateway.extra_models = extra_models
            for base, urls in engine_urls_by_base(config, model, gateway.served).items():
                extra_pools[base] = pool_of(urls, gateway.model_named(base))
            gateway.extra_pools = extra_pools
            board.listeners.append(gateway.on_result)  # after the replay: live results only
            if config.signing_secret:
                gateway.signing_secret = config.signing_secret.encode()
            else:
                gateway.signing_secret = await shared_signing_secret(gateway.store, gateway.signing_secret)
            from services.gateway.sample_runner import SampleRunner  # it needs Gateway from here
            from services.gateway.session_lifecycle import SessionLifecycle

            runner = SampleRunner(gateway)
            await runner.start()
            lifecycle = SessionLifecycle(gateway)
            await lifecycle.start()
            gateway.sessions = lifecycle
            app.state.gateway = gateway
            names = ", ".join(m.name for m in gateway.models)
            log.info("gateway ready (base model %s)", names)
            yield
        finally:
            if "runner" in locals():
                await runner.close()
            if "gateway" in locals() and gateway.sessions is not None:
                await gateway.sessions.close()
            if hasattr(app.state, "gateway"):
                await app.state.gateway.board.stop()
            for pool in [engines, *extra_pools.values()]:
                await pool.close()
            await client.aclose()
            await bus.close()

    return run


def gateway_of(request: Request) -> Gateway:  # type: ignore[type-arg]
    return request.app.state.gateway  # type: ignore[no-any-return]


async def provide_gateway(request: Request) -> Gateway:  # type: ignore[type-arg]
    return gateway_of(request)


async def provide_tenant(request: Request) -> Tenant:  # type: ignore[type-arg]
    """The caller, as the router's ``guards.api_key`` authenticated it."""
    return request.state.tenant  # type: ignore[no-any-return]
