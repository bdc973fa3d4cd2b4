"""The gateway's process-wide context: config, bus, projections, and the served base model.

Built once by the app's lifespan (`app.py`, the composition root) and handed to handlers through
dependency injection. A leaf: it names the parts it holds, never the loops that use it.
"""

from __future__ import annotations

import functools
import logging
import secrets
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from litestar import Request
from prometheus_client import CollectorRegistry

from infra.bus import Bus
from libs.contracts import subjects as s
from libs.contracts.records import SessionRecord, SigningSecret
from libs.contracts.results import RequestResult
from libs.models.registry import SHORT_NAMES, ResolvedModel, resolve_base_model
from services.gateway.accounts.auth import KeyRing, Tenant
from services.gateway.config import GatewayConfig
from services.gateway.futures import FutureBoard
from services.gateway.http.admission import Admission
from services.gateway.metrics import Live, Metrics
from services.gateway.metrics import registry as metrics_registry
from services.gateway.sampling.engines import EnginePool
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
    sessions: SessionBeats | None = None  # accounts.session_lifecycle.SessionLifecycle, set by the lifespan
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


def gateway_of(request: Request) -> Gateway:  # type: ignore[type-arg]
    return request.app.state.gateway  # type: ignore[no-any-return]


async def provide_gateway(request: Request) -> Gateway:  # type: ignore[type-arg]
    return gateway_of(request)


async def provide_tenant(request: Request, gateway: Gateway) -> Tenant:  # type: ignore[type-arg]
    """The caller, as the router's ``guards.api_key`` authenticated it.

    It names ``gateway`` only so as to be resolved after it. Litestar resolves a route's
    dependencies that do not depend on one another together, in an anyio task group per request
    (about 40 µs and a pass through the event loop on a 2-core machine); a chain it resolves
    inline."""
    del gateway
    return request.state.tenant  # type: ignore[no-any-return]
