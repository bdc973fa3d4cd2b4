"""Tracing with no exporter (the default): the trace context still travels, nothing is recorded.

The provider is built and used directly (`tracing.tracer_provider`), so the process's global
provider is left alone.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from infra import tracing

SAMPLED_PARENT = "00-" + "ab" * 16 + "-" + "cd" * 8 + "-01"


def test_with_no_exporter_the_trace_context_travels_and_no_span_is_recorded() -> None:
    tracer = tracing.tracer_provider("gateway", "none").get_tracer("test")
    with tracer.start_as_current_span("gateway request") as root:
        carried = tracing.current_traceparent()
    with tracer.start_as_current_span("planner unit", context=tracing.from_traceparent(carried)) as child:
        passed_on = tracing.current_traceparent()

    assert not root.is_recording() and not child.is_recording()
    trace_id = f"{root.get_span_context().trace_id:032x}"
    assert carried.split("-")[1] == trace_id
    assert passed_on.split("-")[1] == trace_id
    assert passed_on.split("-")[2] == f"{child.get_span_context().span_id:016x}"


def test_with_no_exporter_a_callers_sampled_trace_is_still_recorded() -> None:
    tracer = tracing.tracer_provider("gateway", "none").get_tracer("test")
    with tracer.start_as_current_span("gateway request", context=tracing.from_traceparent(SAMPLED_PARENT)) as span:
        assert span.is_recording()
        assert tracing.current_traceparent().split("-")[1] == "ab" * 16


def test_with_an_exporter_every_span_is_recorded_and_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TINKERD_TRACE_FILE", str(tmp_path / "traces.jsonl"))
    provider = tracing.tracer_provider("gateway", "jsonl")
    with provider.get_tracer("test").start_as_current_span("request") as span:
        assert span.is_recording()
    provider.shutdown()
    written = [json.loads(line) for line in (tmp_path / "traces.jsonl").read_text().splitlines()]
    assert [(s["service"], s["name"]) for s in written] == [("gateway", "request")]


def test_an_unknown_exporter_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="TINKERD_TRACE_EXPORTER"):
        tracing.tracer_provider("gateway", "zipkin")
