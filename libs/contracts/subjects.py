"""Every JetStream stream, subject, durable consumer and KV bucket Tinkerd uses, named in one place.

Subjects are built only by the functions below so that a grep for a subject finds its one owner.
Ids that become subject tokens are minted by Tinkerd (`[A-Za-z0-9_:-]`) and go through
`ids.token` (`:` becomes `=`), the same mapping as KV keys; ids, keys and their tokens are
`libs/contracts/ids.py`'s.
"""

from __future__ import annotations

from libs.contracts import ids

# --- streams -------------------------------------------------------------------------------------
STREAM_REQUESTS = "TINKER_REQUESTS"
"""Accepted training commands, one subject per model, in the order the gateway accepted them."""
STREAM_WORK = "TINKER_WORK"
"""Work units and barrier units emitted by the planner for trainers."""
STREAM_OUTCOMES = "TINKER_OUTCOMES"
"""What trainers report for each unit they executed."""
STREAM_PUBLISH = "TINKER_PUBLISH"
"""Publication commands (PublishCommand) (trainer -> publisher)."""
STREAM_RESULTS = "TINKER_RESULTS"
"""The final result of every future, keyed by request id; the gateway's futures projection."""
STREAM_SAMPLES = "TINKER_SAMPLES"
"""Accepted sample requests waiting for a gateway replica to run them (a work queue)."""
STREAM_STABILITY = "TINKER_STABILITY"
"""Recorded sampled sequences (`SequenceRecord`), one subject per sequence id, the last record kept."""
STREAM_EVENTS = "TINKER_EVENTS"
"""Operation events for humans and dashboards (`tinkerd events`, `nats sub 'tinker.events.>'`)."""

# --- subject roots -------------------------------------------------------------------------------
REQUESTS_ALL = "tinker.req.>"
WORK_ALL = "tinker.work.>"
OUTCOMES_ALL = "tinker.outcome.>"
PUBLISH_ALL = "tinker.publish.>"
RESULTS_ALL = "tinker.result.>"
SAMPLES_ALL = "tinker.sample.>"
STABILITY_ALL = "tinker.stability.>"
EVENTS_ALL = "tinker.events.>"

# --- durable consumers ---------------------------------------------------------------------------
DURABLE_PLANNER_REQUESTS = "planner-requests"
DURABLE_PLANNER_OUTCOMES = "planner-outcomes"
DURABLE_PUBLISHER = "publisher"
DURABLE_SAMPLE_RUNNERS = "gateway-samplers"
"""Shared by every gateway replica: whichever is free runs the next sample; a dead one's job is redelivered."""


def durable_trainer(group: str) -> str:
    """The durable work consumer of one trainer group (all ranks of one TP group share it)."""
    return f"trainer-{ids.token(group)}"


# --- KV buckets ----------------------------------------------------------------------------------
KV_SESSIONS = "tinker_sessions"
KV_MODELS = "tinker_models"
KV_SEQ = "tinker_seq"
"""(model, seq_id) -> request id + payload fingerprint: the exactly-once identity table."""
KV_SAMPLERS = "tinker_samplers"
KV_SAMPLE_SEQ = "tinker_sample_seq"
"""(sampling session, seq_id) -> request id: sampling retries are deduplicated here."""
KV_INFLIGHT = "tinker_inflight"
"""training model -> its inflight weights target (`InflightTarget`): the newest inflight sampler
export, which every inflight sampling client of the model samples with."""
KV_CHECKPOINTS = "tinker_checkpoints"
KV_TRAINERS = "tinker_trainers"
"""Live trainers and their readiness, with a TTL: the gateway's healthz reads it."""

KV_QUEUE = "tinker_queue"
"""request id -> why it waits (`QueueRecord`): the planner's waiting creates, the gateway's samples
waiting for an engine; try_again reports it."""

KV_PLANNER = "tinker_planner"
"""Per-model planner summary (slot, queue depth, missing seq_id) for operators."""

KV_GATEWAY = "tinker_gateway"
"""What every gateway replica must agree on: `signing_secret` (made once by the first replica
when `TINKERD_GATEWAY_SIGNING_SECRET` is unset), so a JWT or a signed download URL minted by
one replica is accepted by all of them."""

OBJ_SNAPSHOTS = "tinker_snapshots"
"""Object store: the planner's state at known stream positions (services/planner/snapshot.py)."""

ALL_BUCKETS = (
    KV_SESSIONS,
    KV_MODELS,
    KV_SEQ,
    KV_SAMPLERS,
    KV_SAMPLE_SEQ,
    KV_INFLIGHT,
    KV_CHECKPOINTS,
    KV_TRAINERS,
    KV_QUEUE,
    KV_PLANNER,
    KV_GATEWAY,
)

def request_subject(model_id: str) -> str:
    """The per-model subject that carries a model's accepted commands in seq_id order."""
    return f"tinker.req.{ids.token(model_id)}"


def work_subject(group: str) -> str:
    return f"tinker.work.{ids.token(group)}"


def outcome_subject(group: str) -> str:
    return f"tinker.outcome.{ids.token(group)}"


def publish_subject(model_id: str) -> str:
    return f"tinker.publish.{ids.token(model_id)}"


def result_subject(request_id: str) -> str:
    return f"tinker.result.{ids.token(request_id)}"


CANCEL_ALL = "tinker.cancel.>"
"""Core NATS (no stream): a cancelled sample, so the gateway replica running it stops it."""


def cancel_subject(request_id: str) -> str:
    return f"tinker.cancel.{ids.token(request_id)}"


def cancel_request_id(subject: str) -> str:
    """The request id a cancel subject names (the inverse of `cancel_subject`)."""
    return ids.untoken(subject.removeprefix("tinker.cancel."))


def sample_subject(sampler_id: str) -> str:
    return f"tinker.sample.{ids.token(sampler_id)}"


def stability_subject(sequence_id: str) -> str:
    """The subject of one recorded sequence (`sequence_id` must be a valid id: `is_valid_id`)."""
    return f"tinker.stability.{ids.token(sequence_id)}"


def event_subject(kind: str, model_id: str | None) -> str:
    """`tinker.events.<kind>.<model or _>`: filter by kind, by model, or watch everything."""
    return f"tinker.events.{ids.token(kind)}.{ids.token(model_id) if model_id else '_'}"
