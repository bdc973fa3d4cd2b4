"""Account and admin endpoints, answered from what the event log and the catalogue already hold.

- `POST /api/v1/auth/token`: a short-lived JWT for the caller's key (see services.gateway.accounts.jwt_auth).
- `GET /api/v1/billing/usage/events`: usage metering folded from events (services.gateway.catalog.metering).
- `GET /api/v1/billing/usage/checkpoints/current`: the caller's checkpoints, counted and sized.
- `GET /api/v1/audit`: who did what, folded from events.
- `POST /api/v1/sessions/search`: sessions by id, display name, metadata, project and status.
- `GET /api/v1/sessions/{id}/trace_export`: a Perfetto trace of the session's requests, ready at once.
- `POST /api/v1/copy_weights`: a checkpoint copied into a new, untrainable run (files hard-linked).

An "organization" is the tenant: every admin view covers exactly the caller's tenant, and any key of
the tenant may read it (there are no roles on a self-hosted server).
"""

from __future__ import annotations

import asyncio
import datetime as dt
import hashlib
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Any

from litestar import Request, get, post

from libs.checkpoints import layout
from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.ids import checkpoint_key
from libs.contracts.records import CheckpointRecord, ModelRecord, SessionRecord
from services.gateway.accounts import jwt_auth
from services.gateway.accounts.audit import audit
from services.gateway.accounts.auth import Tenant
from services.gateway.catalog import downloads, metering, perfetto
from services.gateway.catalog.catalog import readable_checkpoint, str_metadata, within
from services.gateway.catalog.events import read_events
from services.gateway.context import Gateway
from services.gateway.http.errors import BadRequest
from services.gateway.http.ownership import owned_session
from services.gateway.wire import admin_wire as a

AnyRequest = Request[Any, Any, Any]
HOUR_S = 3_600
MAX_WINDOW_S = 14 * 24 * HOUR_S
TEN_YEARS_S = 10 * 365 * 24 * HOUR_S
TRACE_URL_S = 3_600


def org_user(tenant_id: str) -> str:
    return f"tml:org-user:{tenant_id}"


async def session_projects(gateway: Gateway, tenant: Tenant) -> dict[str, SessionRecord]:
    return {r.session_id: r for _, r in await gateway.store.scan(s.KV_SESSIONS, SessionRecord) if r.tenant == tenant.id}


# --- auth ---------------------------------------------------------------------------------------

@post("/api/v1/auth/token", status_code=200, operation_id="auth_token")
async def auth_token(gateway: Gateway, tenant: Tenant) -> a.AuthTokenResponse:
    """Exchange the caller's key (or a still-valid JWT) for a fresh JWT."""
    return a.AuthTokenResponse(jwt=jwt_auth.mint(tenant, gateway.signing_secret, gateway.config.jwt_lifetime_s))


# --- billing ------------------------------------------------------------------------------------

def parse_instant(value: str | None, field: str) -> dt.datetime:
    if not value:
        raise BadRequest(f"{field} is required (an RFC 3339 time on a UTC hour boundary)")
    try:
        parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        raise BadRequest(f"{field} {value!r} is not an RFC 3339 time") from None
    if parsed.tzinfo is None:
        parsed = parsed.replace(tzinfo=dt.UTC)
    if parsed.minute or parsed.second or parsed.microsecond:
        raise BadRequest(f"{field} {value!r} must be aligned to a UTC hour boundary")
    return parsed


@get("/api/v1/billing/usage/events", operation_id="billing_usage_events")
async def billing_usage_events(
    gateway: Gateway, tenant: Tenant, starting_on: str | None = None, ending_before: str | None = None
) -> a.BillingUsageResponse:
    start, end = parse_instant(starting_on, "starting_on"), parse_instant(ending_before, "ending_before")
    if start > dt.datetime.now(dt.UTC):
        raise BadRequest(f"starting_on {starting_on} is in the future")
    if not start < end or (end - start).total_seconds() > MAX_WINDOW_S:
        raise BadRequest("ending_before must be after starting_on and at most 14 days after it")
    start_ns, end_ns = int(start.timestamp()) * 10**9, int(end.timestamp()) * 10**9
    totals = metering.fold_usage(await read_events(gateway), tenant.id, start_ns, end_ns)
    sessions = await session_projects(gateway, tenant)
    projects = {sid: r.project_id for sid, r in sessions.items()}
    rows = metering.usage_rows(totals, gateway.model.name, org_user(tenant.id), projects)
    seen = {row.session_id for row in rows if row.session_id}
    side = {
        sid: a.BillingUsageSession(user_metadata=str_metadata(sessions[sid].user_metadata) if sid in sessions else None)
        for sid in sorted(seen)
    }
    return a.BillingUsageResponse(data=rows, sessions=side)


@get("/api/v1/billing/usage/checkpoints/current", operation_id="billing_checkpoint_storage")
async def billing_checkpoint_storage(
    gateway: Gateway, tenant: Tenant, project_id: str | None = None
) -> a.CurrentCheckpointStorageUsageResponse:
    """The caller's live checkpoints (the catalogue, now), grouped by their session's project."""
    projects = {sid: r.project_id for sid, r in (await session_projects(gateway, tenant)).items()}
    groups: dict[str | None, list[int]] = {}
    for _, record in await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord):
        if record.tenant != tenant.id:
            continue
        project = projects.get(ids.session_of(record.training_run_id) or "")
        if project_id is not None and project != project_id:
            continue
        groups.setdefault(project, []).append(record.size_bytes)
    items = [
        a.CurrentCheckpointStorageUsageItem(
            project_id=project,
            org_user_urn=org_user(tenant.id),
            user_name=tenant.id,
            checkpoint_count=len(sizes),
            size_bytes=sum(sizes),
            size_gigabytes=sum(sizes) / 1e9,
        )
        for project, sizes in sorted(groups.items(), key=lambda kv: kv[0] or "")
    ]
    return a.CurrentCheckpointStorageUsageResponse(data=items)


# --- audit log ----------------------------------------------------------------------------------

@get("/api/v1/audit", operation_id="audit_log")
async def audit_log(
    gateway: Gateway, tenant: Tenant, event_type: str = "all", day: str | None = None
) -> a.AuditLogResponse:
    if event_type not in metering.AUDIT_TYPES:
        raise BadRequest(f"event_type {event_type!r} must be one of {', '.join(metering.AUDIT_TYPES)}")
    try:
        date = dt.date.fromisoformat(day) if day else dt.datetime.now(dt.UTC).date()
    except ValueError:
        raise BadRequest(f"day {day!r} is not a date (YYYY-MM-DD)") from None
    start = dt.datetime(date.year, date.month, date.day, tzinfo=dt.UTC)
    start_ns = int(start.timestamp()) * 10**9
    end_ns = start_ns + 24 * HOUR_S * 10**9
    entries = metering.audit_entries(await read_events(gateway), tenant.id, event_type, start_ns, end_ns)
    return a.AuditLogResponse(entries=entries)


# --- session search -----------------------------------------------------------------------------

def session_status(record: SessionRecord) -> a.SessionStatus:
    if record.finished:
        reason = record.finish_reason or "success"
        return a.SessionStatus(type="client_finished", reason=a.FinishReason(type=reason))
    return a.SessionStatus(type="active")


def status_matches(status: a.SessionStatus, queries: list[a.StatusQuery] | None) -> bool:
    if queries is None:
        return True
    for query in queries:
        if query.type == status.type and (
            query.reasons is None or (status.reason is not None and status.reason.type in query.reasons)
        ):
            return True
    return False


def search_matches(record: SessionRecord, request: a.SessionSearchRequest) -> bool:
    if request.session_id is not None or request.display_name is not None:
        by_id = request.session_id is not None and record.session_id == request.session_id
        name = (record.display_name or "").lower()
        words = (request.display_name or "").lower().split()
        by_name = request.display_name is not None and all(word in name for word in words)
        if not (by_id or by_name):
            return False
    if request.project_ids is not None and record.project_id not in request.project_ids:
        return False
    metadata = str_metadata(record.user_metadata) or {}
    return all(metadata.get(k) == v for k, v in request.user_metadata.items())


@post("/api/v1/sessions/search", status_code=200, operation_id="search_sessions")
async def search_sessions(
    data: a.SessionSearchRequest, gateway: Gateway, tenant: Tenant
) -> a.SessionSearchResponse:
    """The caller's sessions, newest first; `owner` other than own or accessible matches only URNs
    of this tenant (a self-hosted tenant is one owner)."""
    if not 1 <= data.limit <= 200:
        raise BadRequest(f"limit must be in [1, 200], got {data.limit}")
    if data.owner.type == "user" and org_user(tenant.id) not in (data.owner.owner_urns or []):
        return a.SessionSearchResponse(sessions=[])
    found = [r for r in (await session_projects(gateway, tenant)).values() if search_matches(r, data)]
    found.sort(key=lambda r: (r.created_ns, r.session_id), reverse=True)
    if data.cursor is not None:
        after = (int(data.cursor.last_created_at.timestamp() * 1e9), data.cursor.last_session_id)
        found = [r for r in found if (r.created_ns, r.session_id) < after]
    checkpoints: dict[str, list[int]] = {}
    for _, checkpoint in await gateway.store.scan(s.KV_CHECKPOINTS, CheckpointRecord):
        if checkpoint.tenant == tenant.id:
            checkpoints.setdefault(ids.session_of(checkpoint.training_run_id) or "", []).append(
                checkpoint.size_bytes
            )
    page: list[a.SessionSummary] = []
    last: SessionRecord | None = None
    for record in found:
        status = session_status(record)
        if not status_matches(status, data.statuses):
            continue
        if len(page) == data.limit:
            break
        sizes = checkpoints.get(record.session_id, [])
        page.append(
            a.SessionSummary(
                session_id=record.session_id,
                created_at=metering.at(record.created_ns),
                owner=org_user(tenant.id),
                project_id=record.project_id or "",
                status=status,
                checkpoints_count=len(sizes),
                display_name=record.display_name,
                user_metadata=str_metadata(record.user_metadata),
                checkpoint_storage_bytes=sum(sizes),
            )
        )
        last = record
    more = last is not None and any(
        (r.created_ns, r.session_id) < (last.created_ns, last.session_id) and status_matches(session_status(r), data.statuses)
        for r in found
    )
    cursor = (
        a.SessionSearchCursor(last_created_at=metering.at(last.created_ns), last_session_id=last.session_id)
        if more and last is not None
        else None
    )
    return a.SessionSearchResponse(sessions=page, next_cursor=cursor)


# --- trace export -------------------------------------------------------------------------------

def _write_trace(path: Path, payload: bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".tmp-{path.name}-{uuid.uuid4().hex[:8]}")
    tmp.write_bytes(payload)
    tmp.replace(path)


@get("/api/v1/sessions/{session_id:str}/trace_export", operation_id="session_trace_export")
async def session_trace_export(
    request: AnyRequest, session_id: str, gateway: Gateway, tenant: Tenant
) -> a.TraceExportResponse:
    """Built at once from the retained events; the answer is `ready` with a signed URL to the file."""
    await owned_session(gateway, tenant, session_id)
    slices = metering.session_timeline(await read_events(gateway), tenant.id, session_id)
    payload = perfetto.encode(session_id, slices)
    digest = hashlib.sha256(payload).hexdigest()[:16]
    relative = layout.trace_file(session_id, digest)
    await asyncio.to_thread(_write_trace, gateway.data_dir / relative, payload)
    base = gateway.config.public_url or str(request.base_url)
    url = downloads.signed_url(base, gateway.signing_secret, relative, int(time.time()) + TRACE_URL_S)
    return a.TraceExportResponse(status="ready", url=url)


# --- copy_weights -------------------------------------------------------------------------------

def link_tree(source: Path, target: Path) -> int:
    """`target` as a hard-linked copy of `source` (a byte copy across filesystems); returns its size.

    Written under a temporary name and renamed into place, so a crash leaves no half copy.
    """
    if target.exists():
        return sum(f.stat().st_size for f in target.rglob("*") if f.is_file())
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_name(f".tmp-{target.name}-{uuid.uuid4().hex[:8]}")
    size = 0
    try:
        for src in sorted(source.rglob("*")):
            dst = tmp / src.relative_to(source)
            if src.is_dir():
                dst.mkdir(parents=True, exist_ok=True)
                continue
            dst.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(src, dst)
            except OSError:
                shutil.copy2(src, dst)
            size += dst.stat().st_size
        tmp.mkdir(parents=True, exist_ok=True)
        os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return size


async def _copy_destination(
    request: AnyRequest, data: a.CopyWeightsRequest, gateway: Gateway, tenant: Tenant
) -> tuple[str, str]:
    """(session id, run id) that will hold the copy."""
    if data.session_id is not None or data.model_seq_id is not None:
        if data.session_id is None or data.model_seq_id is None or data.model_seq_id < 0:
            raise BadRequest("copy_weights: session_id and model_seq_id (>= 0) go together")
        await owned_session(gateway, tenant, data.session_id)
        return data.session_id, ids.model_id(data.session_id, data.model_seq_id)
    if not data.destination_project_id:
        raise BadRequest("copy_weights needs destination_project_id, or session_id and model_seq_id")
    # A new session per copy; the SDK's idempotency key makes a retried call land on the same one.
    key = request.headers.get("x-idempotency-key") or uuid.uuid4().hex
    seed = f"{tenant.id}|copy|{key}|{data.source_path}"
    session_id = "s-" + hashlib.sha256(seed.encode()).hexdigest()[:20]
    session = SessionRecord(
        session_id=session_id,
        tenant=tenant.id,
        created_ns=now_ns(),
        tags=["copy_weights"],
        finished=True,
        finish_reason="success",
        project_id=data.destination_project_id,
        display_name=f"copy of {data.source_path}",
    )
    await gateway.store.create(s.KV_SESSIONS, ids.token(session_id), session, SessionRecord)
    return session_id, ids.model_id(session_id, 0)


@post("/api/v1/copy_weights", status_code=200, operation_id="copy_weights")
async def copy_weights(
    request: AnyRequest, data: a.CopyWeightsRequest, gateway: Gateway, tenant: Tenant
) -> a.CopyWeightsResponse:
    """Copy a checkpoint the caller may read (their own, or a published one) into a new run of theirs.

    The copy keeps the source's kind and name, shares its bytes (hard links), and belongs to a run
    that holds only copies and cannot be trained on. Deleting either leaves the other intact.
    """
    if data.weights_access_token is not None:
        raise BadRequest(
            "weights_access_token: this server has no cross-account tokens; publish the source "
            "checkpoint instead (published checkpoints are readable, and copyable, by every tenant)"
        )
    if data.ttl_seconds is not None and not HOUR_S <= data.ttl_seconds <= TEN_YEARS_S:
        raise BadRequest(f"ttl_seconds must be between 3600 and 10 years, got {data.ttl_seconds}")
    source = await readable_checkpoint(gateway, tenant, data.source_path)
    session_id, run_id = await _copy_destination(request, data, gateway, tenant)
    model = ModelRecord(
        model_id=run_id,
        tenant=tenant.id,
        session_id=session_id,
        base_model=source.base_model,
        lora=source.lora,
        created_ns=now_ns(),
        create_request_id="",
        unloaded=True,
        copy_of=source.tinker_path,
    )
    created, existing = await gateway.store.create(s.KV_MODELS, ids.token(run_id), model, ModelRecord)
    if not created and (existing.tenant != tenant.id or existing.copy_of is None):
        raise BadRequest(f"training run {run_id} already exists; use another model_seq_id")
    path = ids.tinker_path(run_id, source.kind, source.name)
    version = layout.version_dir(gateway.data_dir, run_id, source.kind, source.name, "copy")
    if not within(gateway.data_dir, version):
        raise BadRequest(f"cannot copy {data.source_path} into run {run_id}")
    size = await asyncio.to_thread(link_tree, Path(source.directory), version)
    public = layout.public_path(gateway.data_dir, run_id, source.kind, source.name)
    if not public.exists():
        await asyncio.to_thread(layout.switch_link, public, version)
    record = CheckpointRecord(
        tinker_path=path,
        training_run_id=run_id,
        kind=source.kind,
        name=source.name,
        tenant=tenant.id,
        base_model=source.base_model,
        lora=source.lora,
        directory=str(version),
        created_ns=now_ns(),
        size_bytes=size,
        expires_ns=now_ns() + data.ttl_seconds * 10**9 if data.ttl_seconds else None,
        user_metadata=source.user_metadata,
        adapter_name=source.adapter_name,
    )
    await gateway.store.create(s.KV_CHECKPOINTS, checkpoint_key(run_id, source.kind, source.name), record, CheckpointRecord)
    await audit(gateway, tenant, "checkpoint", "copied", path, source=source.tinker_path)
    return a.CopyWeightsResponse(tinker_path=path)


ROUTES = [
    auth_token,
    billing_usage_events,
    billing_checkpoint_storage,
    audit_log,
    search_sessions,
    session_trace_export,
    copy_weights,
]
