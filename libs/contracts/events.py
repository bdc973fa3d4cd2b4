"""Operation events (`tinker.events.<kind>.<model>`): every request's path, for people and tools.

Encoded as JSON with the tag first, so `nats sub 'tinker.events.>'` and `tinkerd events` read well.
These are observations, not inputs: no service's state depends on them.
"""

from __future__ import annotations

from libs.contracts.common import Envelope


class RequestAccepted(Envelope, tag="accepted", kw_only=True, frozen=True):
    kind: str
    num_datums: int = 0
    num_tokens: int = 0


class RequestRejected(Envelope, tag="rejected", kw_only=True, frozen=True):
    kind: str
    status: int
    error: str


class UnitPlanned(Envelope, tag="planned", kw_only=True, frozen=True):
    unit_id: str
    unit_kind: str
    models: list[str] = []
    requests: list[str] = []
    num_tokens: int = 0


class UnitStarted(Envelope, tag="started", kw_only=True, frozen=True):
    unit_id: str
    trainer: str


class UnitFinished(Envelope, tag="unit_done", kw_only=True, frozen=True):
    unit_id: str
    trainer: str
    duration_ms: float
    ok: bool


class RequestCompleted(Envelope, tag="completed", kw_only=True, frozen=True):
    kind: str
    duration_ms: float
    prompt_tokens: int = 0  # samples: tokens prefilled (the prompt, once per request)
    sampled_tokens: int = 0  # samples: tokens generated, over all num_samples sequences
    cached_tokens: int = 0  # samples: of prompt_tokens, those served from the engine's prefix cache


class RequestFailed(Envelope, tag="failed", kw_only=True, frozen=True):
    kind: str
    error: str
    category: str
    duration_ms: float


class CheckpointPublished(Envelope, tag="checkpoint_published", kw_only=True, frozen=True):
    tinker_path: str
    adapter_name: str
    directory: str


class SlotAssigned(Envelope, tag="slot_assigned", kw_only=True, frozen=True):
    """The planner gave a model an adapter slot: on create, to page it back in, or to take it
    over from a lost trainer group."""

    slot: int
    reason: str  # "create" | "page_in" | "takeover"
    evicted: str = ""  # the idle model paged out to free the slot, if any
    group: str = "default"  # the trainer group the slot belongs to: where the model is placed
    moved: bool = False  # the model moved between groups (a page_in from an export, or a takeover)
    from_group: str = ""  # a takeover: the lost group whose files its state is rebuilt from


class ModelPagedOut(Envelope, tag="model_paged_out", kw_only=True, frozen=True):
    """A trainer moved an idle model's training state out of its slot."""

    slot: int
    bytes: int
    ms: float
    where: str  # "host" | "disk" (host memory over its budget)


class ModelPagedIn(Envelope, tag="model_paged_in", kw_only=True, frozen=True):
    slot: int
    bytes: int
    ms: float
    where: str  # where the state came from: "host" | "disk"


class SessionEvent(Envelope, tag="session", kw_only=True, frozen=True):
    session_id: str
    what: str  # "created" | "finished" | "expired"


class ServiceEvent(Envelope, tag="service", kw_only=True, frozen=True):
    service: str
    what: str  # "ready" | "stopping"
    detail: str = ""


class Audited(Envelope, tag="audit", kw_only=True, frozen=True):
    """A change to (or a read of) something a tenant owns, made through the gateway: who did what.

    `resource` is "checkpoint" or "project"; `action` e.g. "deleted", "published", "copied";
    `subject` the tinker path or session id; `actor` the caller's key id (not the key).
    """

    resource: str
    action: str
    subject: str
    actor: str = ""
    details: dict[str, str] = {}


OperationEvent = (
    RequestAccepted
    | RequestRejected
    | UnitPlanned
    | UnitStarted
    | UnitFinished
    | RequestCompleted
    | RequestFailed
    | CheckpointPublished
    | SlotAssigned
    | ModelPagedOut
    | ModelPagedIn
    | SessionEvent
    | ServiceEvent
    | Audited
)


def describe(event: OperationEvent) -> str:
    """One readable line per event, as `tinkerd events` prints it."""
    tag = type(event).__struct_config__.tag
    parts = [f"{tag:<18}"]
    if event.model_id:
        parts.append(f"model={event.model_id}")
    if event.seq_id >= 0:
        parts.append(f"seq={event.seq_id}")
    if event.request_id:
        parts.append(f"req={event.request_id}")
    skip = set(Envelope.__struct_fields__)
    for name in event.__struct_fields__:
        if name in skip:
            continue
        value = getattr(event, name)
        if isinstance(value, float):
            value = f"{value:.1f}"
        if isinstance(value, list):
            value = ",".join(map(str, value[:6])) + ("…" if len(value) > 6 else "")
        parts.append(f"{name}={value}")
    if event.tenant:
        parts.append(f"tenant={event.tenant}")
    return " ".join(parts)
