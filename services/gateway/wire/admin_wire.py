"""Wire shapes of the admin and account endpoints (billing usage, checkpoint storage, audit log,
session search, trace export, copy_weights, auth token): field names as the SDK's pydantic types
(tinker.types.*) read them. JSON only; these endpoints have no protobuf form."""

from __future__ import annotations

import datetime as dt
from typing import Literal

import msgspec


class AuthTokenResponse(msgspec.Struct, frozen=True):
    jwt: str


# --- billing usage ------------------------------------------------------------------------------

class TrainingBillingEvent(msgspec.Struct, frozen=True, tag_field="type", tag="training"):
    token_count: int


class SamplingPrefillBillingEvent(msgspec.Struct, frozen=True, tag_field="type", tag="sampling_prefill"):
    cached: bool
    token_count: int


class SamplingSampleBillingEvent(msgspec.Struct, frozen=True, tag_field="type", tag="sampling_sample"):
    token_count: int


class CheckpointBillingEvent(msgspec.Struct, frozen=True, tag_field="type", tag="checkpoint"):
    count: int


BillingEventInfo = (
    TrainingBillingEvent | SamplingPrefillBillingEvent | SamplingSampleBillingEvent | CheckpointBillingEvent
)


class BillingUsageEvent(msgspec.Struct, frozen=True, kw_only=True):
    bucket_start: dt.datetime
    bucket_end: dt.datetime
    base_model: str | None
    user_id: str | None
    session_id: str | None
    project_id: str | None
    event_info: BillingEventInfo
    user_name: str | None = None
    estimated_cost_usd: float | None = None
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None


class BillingUsageSession(msgspec.Struct, frozen=True):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(msgspec.Struct, frozen=True):
    data: list[BillingUsageEvent]
    sessions: dict[str, BillingUsageSession]
    cost_data_through: dt.datetime | None = None


# --- checkpoint storage -------------------------------------------------------------------------

class CurrentCheckpointStorageUsageItem(msgspec.Struct, frozen=True, kw_only=True):
    project_id: str | None
    org_user_urn: str | None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    user_email: str | None = None
    user_name: str | None = None
    estimated_monthly_cost_usd: float | None = None


class CurrentCheckpointStorageUsageResponse(msgspec.Struct, frozen=True):
    data: list[CurrentCheckpointStorageUsageItem]
    effective_rate_usd_per_gigabyte_month: float | None = None


# --- audit log ----------------------------------------------------------------------------------

class AuditLogEntry(msgspec.Struct, frozen=True, kw_only=True):
    timestamp: dt.datetime
    event: str
    event_details: dict[str, object]
    model_id: str | None = None
    tinker_path: str | None = None
    purpose: str | None = None


class AuditLogResponse(msgspec.Struct, frozen=True):
    entries: list[AuditLogEntry]


# --- session search -----------------------------------------------------------------------------

class SearchOwner(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["own", "accessible", "user"] = "own"
    owner_urns: list[str] | None = None


class StatusQuery(msgspec.Struct, frozen=True, kw_only=True):
    type: Literal["active", "cancelled", "failed", "client_finished"]
    reasons: list[Literal["success", "errored", "interrupted"]] | None = None


class SessionSearchCursor(msgspec.Struct, frozen=True):
    last_created_at: dt.datetime
    last_session_id: str


class SessionSearchRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    session_id: str | None = None
    project_ids: list[str] | None = None
    user_metadata: dict[str, str] = {}
    display_name: str | None = None
    owner: SearchOwner = SearchOwner()
    statuses: list[StatusQuery] | None = None
    limit: int = 50
    cursor: SessionSearchCursor | None = None


class FinishReason(msgspec.Struct, frozen=True):
    type: str


class SessionStatus(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """`{"type": "active"}` or `{"type": "client_finished", "reason": {"type": ...}}`."""

    type: str
    reason: FinishReason | None = None
    detail: str | None = None


class SessionSummary(msgspec.Struct, frozen=True, kw_only=True):
    session_id: str
    created_at: dt.datetime
    owner: str
    project_id: str
    status: SessionStatus | None
    checkpoints_count: int
    display_name: str | None = None
    user_metadata: dict[str, str] | None = None
    checkpoint_storage_bytes: int | None = None


class SessionSearchResponse(msgspec.Struct, frozen=True):
    sessions: list[SessionSummary]
    next_cursor: SessionSearchCursor | None = None


# --- trace export, copy_weights ----------------------------------------------------------------

class TraceExportResponse(msgspec.Struct, frozen=True):
    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    error: str | None = None


class CopyWeightsRequest(msgspec.Struct, frozen=True, kw_only=True):
    source_path: str
    session_id: str | None = None
    model_seq_id: int | None = None
    destination_project_id: str | None = None
    ttl_seconds: int | None = None
    weights_access_token: str | None = None


class CopyWeightsResponse(msgspec.Struct, frozen=True):
    tinker_path: str
