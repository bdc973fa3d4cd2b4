"""OpenTelemetry for every service; the trace context travels in NATS message headers.

The exporter is chosen by configuration (`TINKERD_TRACE_EXPORTER` = none | console | otlp | jsonl;
none by default). With `otlp`, the standard `OTEL_EXPORTER_OTLP_*` variables set the endpoint; with
`jsonl`, spans are appended to `TINKERD_TRACE_FILE`. With `none`, spans still carry the trace
context from service to service (events keep their `traceparent`, which the console's trace view
reads) but are not recorded: nothing would read them.

How a call becomes one trace: the gateway opens a span per HTTP request (continuing an incoming
`traceparent`), and every bus message it causes carries that context (NATS headers and the
envelope's `traceparent`). The planner, trainer and publisher each open their span as a child of
the message's context, and pass their own context on.
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager

from opentelemetry import context, propagate, trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import (
    BatchSpanProcessor,
    ConsoleSpanExporter,
    SimpleSpanProcessor,
    SpanExporter,
    SpanExportResult,
)
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ParentBased

EXPORTERS = ("none", "console", "otlp", "jsonl")


class JsonLinesExporter(SpanExporter):
    """One JSON line per finished span, appended to a file (used by tests and for offline looks)."""

    def __init__(self, path: str, service: str) -> None:
        self._path = path
        self._service = service

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        with open(self._path, "a") as handle:
            for span in spans:
                ctx = span.get_span_context()
                parent = span.parent
                handle.write(
                    json.dumps(
                        {
                            "service": self._service,
                            "name": span.name,
                            "trace_id": f"{ctx.trace_id:032x}" if ctx else "",
                            "span_id": f"{ctx.span_id:016x}" if ctx else "",
                            "parent_id": f"{parent.span_id:016x}" if parent else None,
                            "links": [f"{link.context.trace_id:032x}" for link in span.links],
                            "attributes": dict(span.attributes or {}),
                        }
                    )
                    + "\n"
                )
        return SpanExportResult.SUCCESS

    def shutdown(self) -> None:
        pass


def setup_tracing(service: str, exporter: str | None = None) -> None:
    """Install a tracer provider named after `service`, exporting as configured."""
    choice = (exporter or os.environ.get("TINKERD_TRACE_EXPORTER", "none")).lower()
    trace.set_tracer_provider(tracer_provider(service, choice))


def tracer_provider(service: str, choice: str) -> TracerProvider:
    """The provider of `service` for the exporter `choice` (one of `EXPORTERS`)."""
    if choice not in EXPORTERS:
        raise ValueError(f"TINKERD_TRACE_EXPORTER must be one of {EXPORTERS}, got {choice!r}")
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"tinkerd-{service}"}),
        # nothing exports: new traces are not recorded, which halves what a span costs
        # (docs/benchmarks.md, "Submissions under load"); a caller's sampled trace still is
        sampler=ParentBased(ALWAYS_OFF) if choice == "none" else None,
    )
    span_exporter: SpanExporter | None = None
    if choice == "console":
        span_exporter = ConsoleSpanExporter()
    elif choice == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        span_exporter = OTLPSpanExporter()
    elif choice == "jsonl":
        path = os.environ.get("TINKERD_TRACE_FILE", "traces-{service}.jsonl").format(service=service)
        # Synchronous export: a span is on disk the moment it ends.
        provider.add_span_processor(SimpleSpanProcessor(JsonLinesExporter(path, service)))
    if span_exporter is not None:
        provider.add_span_processor(BatchSpanProcessor(span_exporter))
    return provider


def shutdown_tracing() -> None:
    """Export what the span processors still hold (the OTLP exporter batches) and stop them."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, TracerProvider):
        provider.shutdown()


@functools.cache
def _tracer_of(provider: trace.TracerProvider) -> trace.Tracer:
    """The tracer of `span`, one per provider: `trace.get_tracer` builds a new one on every call."""
    return provider.get_tracer("tinkerd")


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


@contextmanager
def span(
    name: str, parent_traceparent: str = "", links: Sequence[str] = (), **attributes: object
) -> Iterator[str]:
    """A span that continues `parent_traceparent`; yields the new span's own traceparent."""
    parent = from_traceparent(parent_traceparent)
    link_objs = []
    for link in links:
        link_ctx = trace.get_current_span(from_traceparent(link)).get_span_context()
        if link_ctx.is_valid:
            link_objs.append(trace.Link(link_ctx))
    with _tracer_of(trace.get_tracer_provider()).start_as_current_span(
        name, context=parent, links=link_objs, attributes={k: str(v) for k, v in attributes.items()}
    ):
        yield current_traceparent()
