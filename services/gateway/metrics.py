"""This replica's request counters, rendered as Prometheus text by `GET /metrics`."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from libs.contracts.results import Failure, RequestResult
from services.gateway.engines import EnginePool


class Metrics:
    def __init__(self) -> None:
        self.accepted: Counter[str] = Counter()
        self.rejected: Counter[str] = Counter()
        self.completed: Counter[tuple[str, str]] = Counter()

    def on_result(self, result: RequestResult) -> None:
        """A future's result reached the results stream (any replica's request)."""
        self.completed[(result.kind, "failed" if isinstance(result.body, Failure) else "ok")] += 1


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def _labels(**labels: str) -> str:
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
    return "{" + inner + "}" if inner else ""


def family(
    name: str, kind: str, help_text: str, samples: Iterable[tuple[dict[str, str], float]]
) -> list[str]:
    lines = [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
    lines += [f"{name}{_labels(**labels)} {value:g}" for labels, value in samples]
    return lines


def render(
    metrics: Metrics,
    futures_waiting: int,
    sampling_in_use: int,
    sampling_capacity: int,
    queued: dict[str, int],
    engines: EnginePool | None = None,
) -> str:
    lines = [
        *family(
            "tinkerd_gateway_requests_accepted_total",
            "counter",
            "Requests accepted by this replica, per kind.",
            (({"kind": k}, v) for k, v in sorted(metrics.accepted.items())),
        ),
        *family(
            "tinkerd_gateway_requests_rejected_total",
            "counter",
            "Requests refused with a 4xx after their seq_id was claimed, per kind.",
            (({"kind": k}, v) for k, v in sorted(metrics.rejected.items())),
        ),
        *family(
            "tinkerd_gateway_requests_completed_total",
            "counter",
            "Results seen on the results stream since start, per kind and outcome.",
            (({"kind": k, "outcome": o}, v) for (k, o), v in sorted(metrics.completed.items())),
        ),
        *family(
            "tinkerd_gateway_futures_waiting",
            "gauge",
            "retrieve_future long-polls currently held.",
            [({}, futures_waiting)],
        ),
        *family(
            "tinkerd_gateway_sampling_permits_in_use",
            "gauge",
            "Sub-generations (num_samples) in flight.",
            [({}, sampling_in_use)],
        ),
        *family(
            "tinkerd_gateway_sampling_permits_capacity",
            "gauge",
            "Sampling permits available in total.",
            [({}, sampling_capacity)],
        ),
        *family(
            "tinkerd_gateway_training_queued",
            "gauge",
            "Training requests accepted here and not yet answered, per model.",
            (({"model_id": m}, v) for m, v in sorted(queued.items()) if v),
        ),
    ]
    if engines is not None:
        per_engine = sorted(engines.residency.items())
        lines += [
            *family(
                "tinkerd_gateway_samples_waiting_for_engine",
                "gauge",
                "Samples of this replica waiting for an unreachable sampling engine.",
                [({}, engines.waiting)],
            ),
            *family(
                "tinkerd_gateway_engine_adapters_loaded",
                "gauge",
                "Adapters this replica keeps loaded on each engine.",
                (({"engine": url}, len(r.resident)) for url, r in per_engine),
            ),
            *family(
                "tinkerd_gateway_engine_adapter_loads_total",
                "counter",
                "Adapter loads this replica sent to each engine (each one on demand, for a sample).",
                (({"engine": url}, r.loads) for url, r in per_engine),
            ),
            *family(
                "tinkerd_gateway_engine_adapter_unloads_total",
                "counter",
                "Least recently used adapters this replica unloaded from each engine.",
                (({"engine": url}, r.unloads) for url, r in per_engine),
            ),
        ]
    return "\n".join(lines) + "\n"
