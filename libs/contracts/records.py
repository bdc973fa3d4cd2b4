"""Records kept in JetStream KV buckets: sessions, models, samplers, checkpoints and identities.

A KV bucket is itself a stream with history; services read these on start instead of holding
state only in memory.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from libs.contracts.common import LoraConfig
from libs.contracts.publish import AdapterHandover


class SessionRecord(msgspec.Struct, kw_only=True):
    session_id: str
    tenant: str
    created_ns: int
    tags: list[str] = []
    user_metadata: dict[str, object] | None = None
    sdk_version: str = ""
    finished: bool = False
    heartbeat_ns: int = 0  # the last heartbeat written (at most one write per beat_write_s)
    expired: bool = False  # its heartbeats lapsed: its models were unloaded (session_lifecycle.py)
    finish_reason: str | None = None  # "success" | "errored" | "interrupted", from the finish call
    project_id: str | None = None  # from create_session or assign_session_project
    display_name: str | None = None


class ModelRecord(msgspec.Struct, kw_only=True):
    model_id: str
    tenant: str
    session_id: str
    base_model: str
    lora: LoraConfig
    created_ns: int
    create_request_id: str
    user_metadata: dict[str, object] | None = None
    unloaded: bool = False
    copy_of: str | None = None  # a run made by copy_weights: holds the copy, cannot be trained on


class SeqClaim(msgspec.Struct, kw_only=True, frozen=True):
    """The identity of one (model, seq_id): who claimed it, with which payload fingerprint."""

    request_id: str
    fingerprint: str
    kind: str
    tenant: str
    accepted_ns: int
    error: str | None = None  # set when the content was refused: a retry gets the same 400
    status: int = 200


QueueState = Literal["active", "paused_capacity", "paused_rate_limit"]
"""The SDK's queue state of a pending future: "active" (it runs), or why it cannot start yet."""


class QueueRecord(msgspec.Struct, kw_only=True, frozen=True):
    """A request that is accepted but cannot start yet (create_model with no free slot, a sample
    whose sampling engine is unreachable)."""

    request_id: str
    queue_state: QueueState  # a paused state: only requests that cannot start have a record
    reason: str = ""
    since_ns: int = 0


class SamplerRecord(msgspec.Struct, kw_only=True):
    sampler_id: str
    tenant: str
    session_id: str
    base_model: str
    model_path: str | None = None  # tinker:// path of the sampler export, None for the base model
    adapter_name: str | None = None  # the name the sampling engine knows the adapter by
    adapter_dir: str | None = None  # None while only the handover exists (the files follow)
    handover: AdapterHandover | None = None  # ephemeral exports, until adapter_dir is set
    pending_request_id: str | None = None  # ephemeral samplers: the save that produces the export
    created_ns: int = 0
    inflight_model_id: str | None = None  # inflight samplers: the model whose inflight target they follow
    save_seq_id: int | None = None  # ephemeral samplers: the seq_id of the save that created them


class InflightTarget(msgspec.Struct, kw_only=True, frozen=True):
    """A training model's mutable inflight weights (KV `tinker_inflight`, key = model): the
    newest inflight sampler export, by the seq_id of its save. It only moves forward."""

    model_id: str
    seq_id: int  # the save that produced it
    sampler_id: str  # the inflight sampling client that save created
    adapter_name: str
    adapter_dir: str | None = None  # None while only the handover exists (the files follow)
    handover: AdapterHandover | None = None
    updated_ns: int = 0


class CheckpointRecord(msgspec.Struct, kw_only=True):
    tinker_path: str
    training_run_id: str
    kind: str  # "training" | "sampler"
    name: str
    tenant: str
    base_model: str
    lora: LoraConfig
    directory: str
    created_ns: int
    size_bytes: int = 0
    public: bool = False
    expires_ns: int | None = None
    user_metadata: dict[str, object] | None = None
    adapter_name: str | None = None  # sampler exports: the name the sampling engines know


class TrainerStatus(msgspec.Struct, kw_only=True):
    trainer_id: str
    group: str
    ready: bool
    base_model: str
    num_slots: int
    slots_used: int = 0
    updated_ns: int = 0
    snapshot_work_seq: int = 0  # newest internal snapshot covers work units up to this sequence
    snapshot_ns: int = 0
    last_work_seq: int = 0


class ModelQueueRecord(msgspec.Struct, kw_only=True, frozen=True):
    """The planner's view of one model, for `tinkerd status` (KV `tinker_planner`, key = model)."""

    model_id: str
    slot: int | None
    queued: int  # sequenced commands not yet completed
    buffered: int  # arrived ahead of a missing seq_id
    waiting_for_seq: int | None = None
    closed: bool = False
    paged: bool = False  # its training state is in the trainer's page store (it holds no slot)
    group: str = ""  # the trainer group that holds its state (resident or paged), "" before placement


class SigningSecret(msgspec.Struct, frozen=True):
    """The gateways' shared signing secret (KV `tinker_gateway`, key `signing_secret`), used when
    `TINKERD_GATEWAY_SIGNING_SECRET` is unset: created once by the first replica to start."""

    secret_hex: str
