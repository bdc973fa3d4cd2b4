"""This replica's request counters and gauges, exposed by `GET /metrics` through prometheus-client.

The counters live in ``Metrics`` (plain ``Counter``s that the request paths bump); the gauges are
read from the gateway's live state at scrape time by ``GatewayCollector``, so nothing has to be
kept in sync. Each gateway app has its own registry (never the process-global one), so two
gateways in one process, as in the tests, report separately.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from libs.contracts.results import Failure, RequestResult
from services.gateway.sampling.engines import EnginePool

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class Metrics:
    def __init__(self) -> None:
        self.accepted: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.completed: Counter[tuple[str, str]] = Counter()

    def on_result(self, result: RequestResult) -> None:
        """A future's result reached the results stream (any replica's request)."""
        self.completed[(result.kind, "failed" if isinstance(result.body, Failure) else "ok")] += 1


@dataclass(frozen=True)
class Live:
    """What the gauges read at scrape time."""

    futures_waiting: int
    sampling_in_use: int
    sampling_capacity: int
    queued: dict[str, int]
    engines: list[EnginePool]
    """Every base model's engine pool."""


class GatewayCollector(Collector):
    def __init__(self, metrics: Metrics, live: Callable[[], Live]) -> None:
        self.metrics = metrics
        self.live = live

    def collect(self) -> Iterator[Metric]:
        m, live = self.metrics, self.live()
        accepted = CounterMetricFamily(
            "tinkerd_gateway_requests_accepted", "Requests accepted by this replica, per kind.", labels=["kind"]
        )
        for kind, n in sorted(m.accepted.items()):
            accepted.add_metric([kind], n)
        rejected = CounterMetricFamily(
            "tinkerd_gateway_requests_rejected",
            "Requests refused with a 4xx after their seq_id was claimed, per kind.",
            labels=["kind"],
        )
        for kind, n in sorted(m.rejected.items()):
            rejected.add_metric([kind], n)
        completed = CounterMetricFamily(
            "tinkerd_gateway_requests_completed",
            "Results seen on the results stream since start, per kind and outcome.",
            labels=["kind", "outcome"],
        )
        for (kind, outcome), n in sorted(m.completed.items()):
            completed.add_metric([kind, outcome], n)
        queued = GaugeMetricFamily(
            "tinkerd_gateway_training_queued",
            "Training requests accepted here and not yet answered, per model.",
            labels=["model_id"],
        )
        for model, n in sorted(live.queued.items()):
            if n:
                queued.add_metric([model], n)
        yield from (accepted, rejected, completed, queued)
        yield GaugeMetricFamily(
            "tinkerd_gateway_futures_waiting", "retrieve_future long-polls currently held.", live.futures_waiting
        )
        yield GaugeMetricFamily(
            "tinkerd_gateway_sampling_permits_in_use", "Sub-generations (num_samples) in flight.", live.sampling_in_use
        )
        yield GaugeMetricFamily(
            "tinkerd_gateway_sampling_permits_capacity", "Sampling permits available in total.", live.sampling_capacity
        )
        if live.engines:
            yield from _engine_metrics(live.engines)


def _engine_metrics(pools: list[EnginePool]) -> Iterator[Metric]:
    yield GaugeMetricFamily(
        "tinkerd_gateway_samples_waiting_for_engine",
        "Samples of this replica waiting for an unreachable sampling engine.",
        sum(pool.waiting for pool in pools),
    )
    loaded = GaugeMetricFamily(
        "tinkerd_gateway_engine_adapters_loaded", "Adapters this replica keeps loaded on each engine.", labels=["engine"]
    )
    loads = CounterMetricFamily(
        "tinkerd_gateway_engine_adapter_loads",
        "Adapter loads this replica sent to each engine (each one on demand, for a sample).",
        labels=["engine"],
    )
    unloads = CounterMetricFamily(
        "tinkerd_gateway_engine_adapter_unloads",
        "Least recently used adapters this replica unloaded from each engine.",
        labels=["engine"],
    )
    residencies = {url: r for pool in pools for url, r in pool.residency.items()}
    for url, residency in sorted(residencies.items()):
        loaded.add_metric([url], len(residency.resident))
        loads.add_metric([url], residency.loads)
        unloads.add_metric([url], residency.unloads)
    yield from (loaded, loads, unloads)


def registry(metrics: Metrics, live: Callable[[], Live]) -> CollectorRegistry:
    """A registry of its own for one gateway app."""
    reg = CollectorRegistry(auto_describe=False)
    reg.register(GatewayCollector(metrics, live))
    return reg


def render(reg: CollectorRegistry) -> str:
    return generate_latest(reg).decode()
