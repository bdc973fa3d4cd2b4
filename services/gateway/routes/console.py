"""The web console: `GET /console` (one static page) and the JSON and SSE endpoints it reads.

Everything is read from what the bus already holds, nothing is stored for the console:
the KV records (sessions, models, samplers, checkpoints, the planner's and the queue's
records), the events stream (`TINKER_EVENTS`, as `tinkerd events` shows it) and the results
stream (losses: a forward_backward's `loss:sum`, from the futures projection).

- tenant endpoints (`/api/v1/console/...`, the tenant router: `X-API-Key`) cover only the
  caller's tenant: every record and event is filtered on its `tenant` field;
- operator endpoints (`/api/v1/console/operator/...`, the operator router: loopback or
  `X-Admin-Key`) see everything, as `tinkerd status` and `tinkerd events` do.

Live updates are server-sent events: an ordered consumer on the events stream starting right
after the sequence the page's snapshot was read at (`after`), so no step is lost in between.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime as dt
import time
from collections import Counter, defaultdict
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import msgspec
from litestar import Request, get
from litestar.response import Response, ServerSentEvent
from litestar.response.sse import ServerSentEventMessage
from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy

from infra.bus import last_seq
from infra.status import status_of
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import (
    OperationEvent,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    RequestRejected,
    UnitFinished,
    UnitPlanned,
    UnitStarted,
    describe,
)
from libs.contracts.ids import split_path
from libs.contracts.records import (
    CheckpointRecord,
    ModelQueueRecord,
    ModelRecord,
    QueueRecord,
    SamplerRecord,
    SessionRecord,
)
from libs.contracts.results import ForwardBackwardResult
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog import metering
from services.gateway.catalog.events import read_events
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest

AnyRequest = Request[Any, Any, Any]
PAGE = Path(__file__).resolve().parent.parent / "static" / "console.html"
TAIL_LIMIT = 500
RATE_WINDOW_S = 300
LOSS_WAIT_S = 10.0
DAY_NS = 86_400 * 1_000_000_000


def tag_of(event: OperationEvent) -> str:
    return str(type(event).__struct_config__.tag)


def event_view(event: OperationEvent, seq: int = 0) -> dict[str, Any]:
    """One event as the page shows it: its fields, its tag and the line `tinkerd events` prints."""
    return {"seq": seq, "tag": tag_of(event), "line": describe(event), **msgspec.to_builtins(event)}


def loss_of(result: Any) -> float | None:
    if result is not None and isinstance(result.body, ForwardBackwardResult):
        value = result.body.metrics.get("loss:sum")
        return None if value is None else float(value)
    return None


def after_seq(after: int | None) -> int:
    if after is not None and after < 0:
        raise BadRequest("after must be a stream sequence >= 0")
    return after or 0


# --- the page -----------------------------------------------------------------------------------

@get("/console", operation_id="console_page", include_in_schema=False)
async def console_page() -> Response[bytes]:
    """The console: one HTML file with its script inline, no build step, nothing fetched from outside."""
    return Response(PAGE.read_bytes(), media_type="text/html; charset=utf-8")


# --- tenant view --------------------------------------------------------------------------------

def _model_state(
    record: ModelRecord, plan: ModelQueueRecord | None, create_failed: str | None, create_waiting: bool
) -> str:
    if create_failed is not None:
        return "failed"
    if record.unloaded or (plan is not None and plan.closed):
        return "unloaded"
    if create_waiting or plan is None:
        return "queued"
    if plan.paged:
        return "paged out"
    if plan.slot is not None:
        return "training" if plan.queued > 0 else "resident"
    return "queued"


def _usage_by_model_and_day(events: list[OperationEvent], tenant: str) -> list[dict[str, Any]]:
    """`metering.fold_usage` (the numbers `get_billing_usage` answers), keyed by model instead of
    session and summed over UTC days."""
    totals = metering.fold_usage(events, tenant, 0, time.time_ns() + DAY_NS, group=lambda entity: entity or None)
    days: dict[tuple[str, str], dict[str, Any]] = {}
    for (hour, kind, model, cached), amount in totals.items():
        day = metering.at(hour - hour % DAY_NS).date().isoformat()
        row = days.setdefault(
            (day, model or ""),
            {
                "day": day,
                "model_id": model or "",
                "training_tokens": 0,
                "prefill_tokens": 0,
                "prefill_cached_tokens": 0,
                "sampled_tokens": 0,
                "checkpoints": 0,
            },
        )
        column = {
            "training": "training_tokens",
            "sampling_prefill": "prefill_cached_tokens" if cached else "prefill_tokens",
            "sampling_sample": "sampled_tokens",
            "checkpoint": "checkpoints",
        }[kind]
        row[column] += amount
    return [days[key] for key in sorted(days)]


async def _loss_points(gateway: Gateway, completed: list[RequestCompleted]) -> list[dict[str, Any]]:
    points = []
    for event in completed:
        result = gateway.board.peek(event.request_id) or await gateway.board.lookup(event.request_id)
        loss = loss_of(result)
        if loss is not None:
            points.append({"seq_id": event.seq_id, "request_id": event.request_id, "at_ns": event.at_ns, "loss": loss})
    return points


@get("/api/v1/console/overview", operation_id="console_overview")
async def console_overview(gateway: Gateway, tenant: Tenant) -> dict[str, Any]:
    """The caller's sessions, models (state, queue), loss curves, checkpoints, samplers and usage.

    `events_seq` is the events-stream sequence this snapshot covers; pass it as `after` to
    `GET /api/v1/console/live` to receive what happens from there on.
    """
    events_seq = await last_seq(gateway.bus, s.STREAM_EVENTS)
    events = await read_events(gateway)
    mine = [e for e in events if e.tenant == tenant.id]
    store = gateway.store
    sessions = [r for _, r in await store.scan(s.KV_SESSIONS, SessionRecord) if r.tenant == tenant.id]
    models = [r for _, r in await store.scan(s.KV_MODELS, ModelRecord) if r.tenant == tenant.id]
    plans = {r.model_id: r for _, r in await store.scan(s.KV_PLANNER, ModelQueueRecord)}
    waiting_all = sorted((r for _, r in await store.scan(s.KV_QUEUE, QueueRecord)), key=lambda r: r.since_ns)
    samplers = [r for _, r in await store.scan(s.KV_SAMPLERS, SamplerRecord) if r.tenant == tenant.id]
    checkpoints = [r for _, r in await store.scan(s.KV_CHECKPOINTS, CheckpointRecord) if r.tenant == tenant.id]

    accepted = {e.request_id: e for e in mine if isinstance(e, RequestAccepted)}
    failed = {e.request_id: e for e in mine if isinstance(e, RequestFailed)}
    waiting = []
    for position, held in enumerate(waiting_all, start=1):
        if held.request_id in accepted:  # only the caller's requests; the position counts everyone's
            waiting.append(
                {
                    "request_id": held.request_id,
                    "kind": accepted[held.request_id].kind,
                    "model_id": accepted[held.request_id].model_id,
                    "queue_state": held.queue_state,
                    "reason": held.reason,
                    "position": position,
                    "since_ns": held.since_ns,
                }
            )
    waiting_by_request = {w["request_id"]: w for w in waiting}

    steps: Counter[str] = Counter()
    fb_completed: dict[str, list[RequestCompleted]] = defaultdict(list)
    last_error: dict[str, str] = {}
    sampling: dict[str, dict[str, int]] = defaultdict(lambda: {"samples": 0, "prompt_tokens": 0, "sampled_tokens": 0, "last_ns": 0})
    for event in mine:
        if isinstance(event, RequestCompleted):
            if event.kind == "optim_step":
                steps[event.model_id] += 1
            elif event.kind == "forward_backward":
                fb_completed[event.model_id].append(event)
            elif event.kind == "sample":
                activity = sampling[event.model_id]
                activity["samples"] += 1
                activity["prompt_tokens"] += event.prompt_tokens
                activity["sampled_tokens"] += event.sampled_tokens
                activity["last_ns"] = max(activity["last_ns"], event.at_ns)
        elif isinstance(event, RequestFailed):
            last_error[event.model_id] = f"{event.kind}: {event.error}"[:300]

    model_rows, loss = [], {}
    for record in sorted(models, key=lambda r: r.created_ns):
        plan = plans.get(record.model_id)
        create_failure = failed.get(record.create_request_id)
        queue = waiting_by_request.get(record.create_request_id)
        loss[record.model_id] = await _loss_points(gateway, fb_completed.get(record.model_id, []))
        model_rows.append(
            {
                "model_id": record.model_id,
                "session_id": record.session_id,
                "base_model": record.base_model,
                "rank": record.lora.rank,
                "created_ns": record.created_ns,
                "state": _model_state(record, plan, create_failure.error if create_failure else None, queue is not None),
                "slot": plan.slot if plan else None,
                "commands_queued": plan.queued if plan else 0,
                "queue_position": queue["position"] if queue else None,
                "queue_state": queue["queue_state"] if queue else None,
                "queue_reason": queue["reason"] if queue else None,
                "optim_steps": steps[record.model_id],
                "forward_backward": len(fb_completed.get(record.model_id, [])),
                "last_error": last_error.get(record.model_id),
            }
        )
    now = time.time_ns()
    checkpoint_rows = []
    for ckpt in sorted(checkpoints, key=lambda r: r.created_ns):
        run, rest = split_path(ckpt.tinker_path)
        checkpoint_rows.append(
            {
                "tinker_path": ckpt.tinker_path,
                "training_run_id": ckpt.training_run_id,
                "kind": ckpt.kind,
                "name": ckpt.name,
                "size_bytes": ckpt.size_bytes,
                "created_ns": ckpt.created_ns,
                "expires_ns": ckpt.expires_ns,
                "ttl_s": None if ckpt.expires_ns is None else max(0, (ckpt.expires_ns - now) // 1_000_000_000),
                "public": ckpt.public,
                # GET it with the key: it answers a signed URL to a tar of the checkpoint
                "archive": f"/api/v1/training_runs/{run}/checkpoints/{rest}/archive",
            }
        )
    sampler_rows = [
        {
            "sampler_id": r.sampler_id,
            "session_id": r.session_id,
            "model_path": r.model_path,
            "adapter_name": r.adapter_name,  # an ephemeral sampler's export has a name but no path
            "created_ns": r.created_ns,
            **sampling.get(r.sampler_id, {"samples": 0, "prompt_tokens": 0, "sampled_tokens": 0, "last_ns": 0}),
        }
        for r in sorted(samplers, key=lambda r: r.created_ns)
    ]
    return {
        "tenant": tenant.id,
        "now_ns": now,
        "events_seq": events_seq,
        "sessions": [msgspec.to_builtins(r) for r in sorted(sessions, key=lambda r: r.created_ns)],
        "models": model_rows,
        "waiting": waiting,
        "loss": loss,
        "checkpoints": checkpoint_rows,
        "samplers": sampler_rows,
        "usage": _usage_by_model_and_day(events, tenant.id),
    }


async def _live(
    gateway: Gateway, after: int, tenant: str | None, with_loss: bool
) -> AsyncIterator[ServerSentEventMessage]:
    """Events from sequence `after + 1` on (only `tenant`'s when given), one SSE message each;
    a completed forward_backward carries its loss (the result may land just after the event)."""
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        await queue.put(msg)

    config = (
        ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
        if after
        else ConsumerConfig(deliver_policy=DeliverPolicy.NEW)
    )
    sub = await gateway.bus.js.subscribe(
        s.EVENTS_ALL, stream=s.STREAM_EVENTS, ordered_consumer=True, cb=on_message, config=config
    )
    try:
        yield ServerSentEventMessage(event="hello", data=msgspec.json.encode({"after": after}).decode())
        while True:
            msg = await queue.get()
            try:
                event = codec.event_decoder.decode(msg.data)
            except (msgspec.DecodeError, msgspec.ValidationError):
                continue
            if tenant is not None and event.tenant != tenant:
                continue
            view = event_view(event, msg.metadata.sequence.stream)
            if with_loss and isinstance(event, RequestCompleted) and event.kind == "forward_backward":
                view["loss"] = loss_of(await gateway.board.wait(event.request_id, LOSS_WAIT_S))
            yield ServerSentEventMessage(event="event", data=msgspec.json.encode(view).decode(), id=str(view["seq"]))
    finally:  # the client went away: Litestar cancelled the stream, so shield the cleanup
        with anyio.CancelScope(shield=True), contextlib.suppress(Exception):
            await sub.unsubscribe()


@get("/api/v1/console/live", operation_id="console_live")
async def console_live(gateway: Gateway, tenant: Tenant, after: int | None = None) -> ServerSentEvent:
    """Server-sent events: the caller's operation events after stream sequence `after` (a
    completed forward_backward with its `loss`); without `after`, from now on."""
    return ServerSentEvent(_live(gateway, after_seq(after), tenant.id, with_loss=True))


# --- operator view ------------------------------------------------------------------------------

def _rates(events: list[OperationEvent], now_ns: int) -> dict[str, Any]:
    """Per kind: accepted, completed, failed and rejected in the last RATE_WINDOW_S (per minute),
    and failures by category over everything retained."""
    since = now_ns - RATE_WINDOW_S * 1_000_000_000
    window: dict[str, Counter[str]] = defaultdict(Counter)
    errors: Counter[str] = Counter()
    errors_window: Counter[str] = Counter()
    for event in events:
        if isinstance(event, RequestFailed):
            errors[event.category] += 1
        elif isinstance(event, RequestRejected):
            errors[f"rejected {event.status}"] += 1
        if event.at_ns < since:
            continue
        if isinstance(event, RequestAccepted | RequestCompleted | RequestFailed | RequestRejected):
            window[event.kind][tag_of(event)] += 1
            if isinstance(event, RequestFailed):
                errors_window[event.category] += 1
            elif isinstance(event, RequestRejected):
                errors_window[f"rejected {event.status}"] += 1
    per_minute = RATE_WINDOW_S / 60
    return {
        "window_s": RATE_WINDOW_S,
        "per_minute": {
            kind: {tag: round(n / per_minute, 2) for tag, n in sorted(counts.items())}
            for kind, counts in sorted(window.items())
        },
        "errors_by_category": dict(sorted(errors.items())),
        "errors_by_category_window": dict(sorted(errors_window.items())),
    }


def _matches(view: dict[str, Any], tag: str | None, tenant: str | None, model_id: str | None, text: str | None) -> bool:
    return (
        (not tag or view["tag"] == tag)
        and (not tenant or view["tenant"] == tenant)
        and (not model_id or view["model_id"] == model_id)
        and (not text or text.lower() in view["line"].lower())
    )


async def _tail(
    gateway: Gateway, tag: str | None, tenant: str | None, model_id: str | None, text: str | None, limit: int
) -> tuple[int, list[dict[str, Any]], list[OperationEvent]]:
    if not 1 <= limit <= TAIL_LIMIT:
        raise BadRequest(f"limit must be between 1 and {TAIL_LIMIT}")
    events_seq = await last_seq(gateway.bus, s.STREAM_EVENTS)
    events = await read_events(gateway)
    views = [event_view(e) for e in events]
    return events_seq, [v for v in views if _matches(v, tag, tenant, model_id, text)][-limit:], events


@get("/api/v1/console/operator/overview", operation_id="console_operator_overview")
async def operator_overview(gateway: Gateway) -> dict[str, Any]:
    """`tinkerd status` (trainers, slots, residency, streams, consumer lag, waiting requests),
    request and error rates from the events, and the newest events."""
    status = msgspec.to_builtins(await status_of(gateway.bus))
    events_seq, tail, events = await _tail(gateway, None, None, None, None, 100)
    now = time.time_ns()
    return {
        "now_ns": now,
        "events_seq": events_seq,
        "status": status,
        "rates": _rates(events, now),
        "tail": tail,
    }


@get("/api/v1/console/operator/events", operation_id="console_operator_events")
async def operator_events(
    gateway: Gateway,
    tag: str | None = None,
    tenant_id: str | None = None,
    model_id: str | None = None,
    text: str | None = None,
    limit: int = 200,
) -> dict[str, Any]:
    """The newest retained events matching every filter given (event tag, tenant id, model, a
    substring of the `tinkerd events` line), oldest first."""
    events_seq, tail, _ = await _tail(gateway, tag, tenant_id, model_id, text, limit)
    return {"events_seq": events_seq, "events": tail}


@get("/api/v1/console/operator/trace/{ident:str}", operation_id="console_operator_trace")
async def operator_trace(gateway: Gateway, ident: str) -> dict[str, Any]:
    """One request's path, by request id or W3C trace id: accepted, the units that carried it
    (planned, started, finished), completed or failed; each step with its time since acceptance."""
    ident = ident.strip()
    if not ident:
        raise BadRequest("ident must be a request id or a trace id")
    events = await read_events(gateway)

    def trace_id(event: OperationEvent) -> str:
        parts = event.traceparent.split("-")
        return parts[1] if len(parts) >= 3 else ""

    requests = {e.request_id for e in events if e.request_id and (e.request_id == ident or trace_id(e) == ident)}
    units = {e.unit_id for e in events if isinstance(e, UnitPlanned) and requests & set(e.requests)}
    path = [
        e
        for e in events
        if (e.request_id in requests and not isinstance(e, UnitPlanned | UnitStarted | UnitFinished))
        or (isinstance(e, UnitPlanned | UnitStarted | UnitFinished) and e.unit_id in units)
    ]
    phase = {"accepted": 0, "planned": 1, "started": 2, "unit_done": 3, "completed": 4, "failed": 4}
    path.sort(key=lambda e: (e.at_ns, phase.get(tag_of(e), 5)))
    start = path[0].at_ns if path else 0
    return {
        "ident": ident,
        "requests": sorted(requests),
        "units": sorted(units),
        "steps": [{**event_view(e), "ms": round((e.at_ns - start) / 1e6, 3)} for e in path],
        "total_ms": round((path[-1].at_ns - start) / 1e6, 3) if path else None,
        "started_at": dt.datetime.fromtimestamp(start / 1e9, tz=dt.UTC).isoformat() if path else None,
    }


@get("/api/v1/console/operator/live", operation_id="console_operator_live")
async def operator_live(gateway: Gateway, after: int | None = None) -> ServerSentEvent:
    """Server-sent events: every operation event after stream sequence `after` (from now on without it)."""
    return ServerSentEvent(_live(gateway, after_seq(after), None, with_loss=False))


TENANT_ROUTES = [console_overview, console_live]
OPERATOR_ROUTES = [operator_overview, operator_events, operator_trace, operator_live]
PUBLIC_ROUTES = [console_page]
