"""Usage metering, audit log and session timelines, folded from the operation events.

Pure functions over decoded events (`libs.contracts.events`); the routes read the events stream
(`TINKER_EVENTS`, kept `TINKERD_RETENTION_EVENTS_S`, one day by default) and hand it here. So what
they can report reaches back as far as that retention and no further.

Metering, per tenant, bucketed by UTC hour, base model and session:
- training: the tokens of every accepted `forward` / `forward_backward` (its `accepted` event's
  `num_tokens`, in the hour it was accepted); one that then failed costs nothing;
- sampling_prefill: each answered sample's prompt tokens (once per request, however many
  `num_samples`), split into cached (the engine's prefix cache) and not;
- sampling_sample: the tokens generated, over all sequences;
- checkpoint: named checkpoints written (`checkpoint_published` with a `tinker://` path).
There are no prices: every cost and rate is null.
"""

from __future__ import annotations

import datetime as dt
from collections import defaultdict
from collections.abc import Callable, Iterable

from libs.contracts import ids
from libs.contracts.events import (
    Audited,
    CheckpointPublished,
    OperationEvent,
    RequestAccepted,
    RequestCompleted,
    RequestFailed,
    SessionEvent,
)
from services.gateway.wire import admin_wire as a

HOUR_NS = 3_600 * 1_000_000_000
TRAINING_KINDS = ("forward", "forward_backward")


def at(ns: int) -> dt.datetime:
    return dt.datetime.fromtimestamp(ns / 1e9, tz=dt.UTC)


def hour_of(ns: int) -> int:
    return ns - ns % HOUR_NS


Key = tuple[int, str, str | None, bool]  # (hour start ns, usage type, session, cached)


def fold_usage(
    events: Iterable[OperationEvent],
    tenant: str,
    start_ns: int,
    end_ns: int,
    group: Callable[[str], str | None] = ids.session_of,
) -> dict[Key, int]:
    """Quantities per (hour, usage type, session, cached) of `tenant` in [start_ns, end_ns).

    Each request counts once (a redelivered sample that ran twice reports twice); training
    tokens count at acceptance, and a request that then failed is taken out again. `group` maps
    an entity id (training run or sampler) to the key's third part: its session by default, the
    entity itself for the console's per-model view.
    """
    training: dict[str, tuple[int, str | None, int]] = {}  # request id -> (at, session, tokens)
    failed: set[str] = set()
    sampled: set[str] = set()
    totals: dict[Key, int] = defaultdict(int)

    def add(ns: int, kind: str, session: str | None, amount: int, cached: bool = False) -> None:
        if start_ns <= ns < end_ns and amount > 0:
            totals[(hour_of(ns), kind, session, cached)] += amount

    for event in events:
        if event.tenant != tenant:
            continue
        if isinstance(event, RequestAccepted) and event.kind in TRAINING_KINDS:
            training.setdefault(event.request_id, (event.at_ns, group(event.model_id), event.num_tokens))
        elif isinstance(event, RequestFailed):
            failed.add(event.request_id)
        elif isinstance(event, RequestCompleted) and event.kind == "sample":
            if event.request_id in sampled:
                continue
            sampled.add(event.request_id)
            session = group(event.model_id)
            cached = min(event.cached_tokens, event.prompt_tokens)
            add(event.at_ns, "sampling_prefill", session, event.prompt_tokens - cached)
            add(event.at_ns, "sampling_prefill", session, cached, cached=True)
            add(event.at_ns, "sampling_sample", session, event.sampled_tokens)
        elif isinstance(event, CheckpointPublished) and ids.is_tinker_path(event.tinker_path):
            add(event.at_ns, "checkpoint", group(event.model_id), 1)
    for request_id, (ns, session, tokens) in training.items():
        if request_id not in failed:
            add(ns, "training", session, tokens)
    return totals


def usage_rows(
    totals: dict[Key, int], base_model: str, user_id: str, projects: dict[str, str | None]
) -> list[a.BillingUsageEvent]:
    """The SDK's rows: ordered by bucket, then by descending quantity."""
    rows = []
    for (hour, kind, session, cached), amount in totals.items():
        info: a.BillingEventInfo
        if kind == "training":
            info = a.TrainingBillingEvent(token_count=amount)
        elif kind == "sampling_prefill":
            info = a.SamplingPrefillBillingEvent(cached=cached, token_count=amount)
        elif kind == "sampling_sample":
            info = a.SamplingSampleBillingEvent(token_count=amount)
        else:
            info = a.CheckpointBillingEvent(count=amount)
        rows.append(
            (
                hour,
                -amount,
                kind,
                a.BillingUsageEvent(
                    bucket_start=at(hour),
                    bucket_end=at(hour + HOUR_NS),
                    base_model=base_model,
                    user_id=user_id,
                    session_id=session,
                    project_id=projects.get(session) if session else None,
                    event_info=info,
                ),
            )
        )
    rows.sort(key=lambda row: (row[0], row[1], row[2]))
    return [row[3] for row in rows]


# --- audit log ----------------------------------------------------------------------------------

AUDIT_TYPES = ("all", "checkpoints", "projects", "teams", "organizations")


def audit_entries(
    events: Iterable[OperationEvent], tenant: str, event_type: str, start_ns: int, end_ns: int
) -> list[a.AuditLogEntry]:
    """Who did what to the tenant's checkpoints and projects (and, under "all", sessions)."""
    entries: list[tuple[int, a.AuditLogEntry]] = []
    for event in events:
        if event.tenant != tenant or not start_ns <= event.at_ns < end_ns:
            continue
        entry: a.AuditLogEntry | None = None
        if isinstance(event, Audited):
            resource = {"checkpoint": "checkpoints", "project": "projects"}.get(event.resource, "")
            if event_type not in ("all", resource):
                continue
            details: dict[str, object] = {"actor": event.actor, "subject": event.subject, **event.details}
            is_checkpoint = event.resource == "checkpoint"
            if is_checkpoint:
                details["tinker_path"] = event.subject
            entry = a.AuditLogEntry(
                timestamp=at(event.at_ns),
                event=f"{event.resource}_{event.action}",
                event_details=details,
                model_id=(event.model_id or None) if is_checkpoint else None,
                tinker_path=event.subject if is_checkpoint else None,
                purpose=event.details.get("purpose") if event.action == "read" else None,
            )
        elif isinstance(event, CheckpointPublished) and ids.is_tinker_path(event.tinker_path):
            if event_type not in ("all", "checkpoints"):
                continue
            entry = a.AuditLogEntry(
                timestamp=at(event.at_ns),
                event="checkpoint_created",
                event_details={"tinker_path": event.tinker_path, "model_id": event.model_id},
                model_id=event.model_id or None,
                tinker_path=event.tinker_path,
            )
        elif isinstance(event, SessionEvent) and event_type == "all":
            what, _, reason = event.what.partition(":")
            details = {"session_id": event.session_id}
            if reason:
                details["reason"] = reason
            entry = a.AuditLogEntry(timestamp=at(event.at_ns), event=f"session_{what}", event_details=details)
        if entry is not None:
            entries.append((event.at_ns, entry))
    entries.sort(key=lambda pair: pair[0])
    return [entry for _, entry in entries]


# --- session timelines --------------------------------------------------------------------------

class Slice:
    """One request of a session: from acceptance to its result (or the last event seen)."""

    def __init__(self, track: str, name: str, start_ns: int) -> None:
        self.track, self.name, self.start_ns, self.end_ns = track, name, start_ns, start_ns
        self.args: dict[str, str | int] = {}


def session_timeline(events: Iterable[OperationEvent], tenant: str, session_id: str) -> list[Slice]:
    """Every request of the session's training runs and samplers, one slice each, by track."""
    prefix = ids.session_prefix(session_id)
    slices: dict[str, Slice] = {}
    ordered: list[Slice] = []
    for event in events:
        if event.tenant != tenant:
            continue
        if isinstance(event, SessionEvent) and event.session_id == session_id:
            instant = Slice("session", f"session {event.what}", event.at_ns)
            ordered.append(instant)
            continue
        if not event.model_id.startswith(prefix) or not event.request_id:
            continue
        current = slices.get(event.request_id)
        if current is None:
            kind = getattr(event, "kind", None) or type(event).__struct_config__.tag
            current = Slice(event.model_id, str(kind), event.at_ns)
            current.args["request_id"] = event.request_id
            if event.seq_id >= 0:
                current.args["seq_id"] = event.seq_id
            slices[event.request_id] = current
            ordered.append(current)
        current.end_ns = max(current.end_ns, event.at_ns)
        if isinstance(event, RequestAccepted) and event.num_tokens:
            current.args["num_tokens"] = event.num_tokens
            current.args["num_datums"] = event.num_datums
        elif isinstance(event, RequestCompleted):
            current.args["outcome"] = "ok"
            if event.kind == "sample":
                current.args["prompt_tokens"] = event.prompt_tokens
                current.args["sampled_tokens"] = event.sampled_tokens
                current.start_ns = min(current.start_ns, event.at_ns - int(event.duration_ms * 1e6))
        elif isinstance(event, RequestFailed):
            current.args["outcome"] = f"failed: {event.error}"[:200]
        elif isinstance(event, CheckpointPublished):
            current.args["tinker_path"] = event.tinker_path
    return ordered
