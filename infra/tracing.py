"""OpenTelemetry for every service; the trace context travels in NATS message headers.

The exporter is chosen by configuration (`TINKERD_TRACE_EXPORTER` = none | console | otlp; none by
default). With `otlp`, the standard `OTEL_EXPORTER_OTLP_*` variables set the endpoint.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter

EXPORTERS = ("none", "console", "otlp")


def setup_tracing(service: str, exporter: str | None = None) -> None:
    """Install a tracer provider named after `service`, exporting as configured."""
    choice = (exporter or os.environ.get("TINKERD_TRACE_EXPORTER", "none")).lower()
    if choice not in EXPORTERS:
        raise ValueError(f"TINKERD_TRACE_EXPORTER must be one of {EXPORTERS}, got {choice!r}")
    provider = TracerProvider(resource=Resource.create({"service.name": f"tinkerd-{service}"}))
    span_exporter: SpanExporter | None = None
    if choice == "console":
        span_exporter = ConsoleSpanExporter()
    elif choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    if span_exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    trace.set_tracer_provider(provider)


def tracer(name: str) -> trace.Tracer:
    return trace.get_tracer(name)


def inject(headers: dict[str, str] | None = None) -> dict[str, str]:
    """Add the current trace context (`traceparent`) to a header dict and return it."""
    carrier = headers if headers is not None else {}
    propagate.inject(carrier)
    return carrier


def extract(headers: Mapping[str, str] | None) -> context.Context:
    """The trace context carried by a message's headers (or an empty context)."""
    return propagate.extract(dict(headers or {}))


def from_traceparent(traceparent: str) -> context.Context:
    return propagate.extract({"traceparent": traceparent} if traceparent else {})


def current_traceparent() -> str:
    return inject({}).get("traceparent", "")
