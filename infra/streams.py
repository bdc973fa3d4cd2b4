"""Declares every stream, KV bucket and durable consumer, and creates them idempotently at start.

Services never create what they bind to (no create-if-missing subscribes): `ensure_streams()` runs
first (in `tinkerd up`, in each service's start, in tests), and repeated runs are no-ops or update a
changed retention in place.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import (
    AckPolicy,
    ConsumerConfig,
    DeliverPolicy,
    DiscardPolicy,
    KeyValueConfig,
    ObjectStoreConfig,
    RetentionPolicy,
    StorageType,
    StreamConfig,
)

from libs.contracts import subjects as s

DAY_S = 86_400.0


def replicas_from_env() -> int:
    """How many copies JetStream keeps of every stream, bucket and object store.

    `TINKERD_NATS_REPLICAS`: 1 (the default) for a single nats-server, 3 on a 3-node cluster (each
    write is then acknowledged once a majority of the nodes hold it, so one node can be lost).
    """
    raw = os.environ.get("TINKERD_NATS_REPLICAS", "1")
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"TINKERD_NATS_REPLICAS must be an integer from 1 to 5, got {raw!r}") from None
    if not 1 <= value <= 5:
        raise ValueError(f"TINKERD_NATS_REPLICAS must be an integer from 1 to 5, got {raw!r}")
    return value


@dataclass(frozen=True)
class Retention:
    """How long each stream keeps its messages (seconds); `TINKERD_RETENTION_<FIELD>` overrides."""

    log_s: float = 7 * DAY_S  # requests, work, outcomes, publish: the replayable log
    results_s: float = 3_600.0  # a future's result; past it the future answers 410
    events_s: float = DAY_S
    stability_s: float = 2 * DAY_S  # sequence records: they live one day past their last use
    dedupe_window_s: float = 120.0
    trainer_ttl_s: float = 20.0  # a trainer that stops heartbeating drops out of healthz


    @classmethod
    def from_env(cls) -> Retention:
        values = {}
        for name in cls.__dataclass_fields__:
            raw = os.environ.get(f"TINKERD_RETENTION_{name.upper()}")
            if raw is not None:
                values[name] = float(raw)
        return cls(**values)


def stream_configs(r: Retention, replicas: int = 1) -> list[StreamConfig]:
    def log(name: str, subject: str) -> StreamConfig:
        return StreamConfig(
            num_replicas=replicas,
            name=name,
            subjects=[subject],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=r.log_s,
            duplicate_window=r.dedupe_window_s,
            discard=DiscardPolicy.OLD,
            allow_direct=True,
        )

    def latest(name: str, subject: str, max_age: float) -> StreamConfig:
        """A stream that keeps one message per subject (the latest), read by direct get."""
        return StreamConfig(
            name=name,
            num_replicas=replicas,
            subjects=[subject],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=max_age,
            max_msgs_per_subject=1,
            duplicate_window=r.dedupe_window_s,
            allow_direct=True,
        )

    return [
        log(s.STREAM_REQUESTS, s.REQUESTS_ALL),
        log(s.STREAM_WORK, s.WORK_ALL),
        log(s.STREAM_OUTCOMES, s.OUTCOMES_ALL),
        log(s.STREAM_PUBLISH, s.PUBLISH_ALL),
        latest(s.STREAM_RESULTS, s.RESULTS_ALL, r.results_s),
        StreamConfig(
            name=s.STREAM_SAMPLES,
            num_replicas=replicas,
            subjects=[s.SAMPLES_ALL],
            retention=RetentionPolicy.WORK_QUEUE,
            storage=StorageType.FILE,
            max_age=r.results_s,
            duplicate_window=r.dedupe_window_s,
        ),
        latest(s.STREAM_STABILITY, s.STABILITY_ALL, r.stability_s),
        StreamConfig(
            name=s.STREAM_EVENTS,
            num_replicas=replicas,
            subjects=[s.EVENTS_ALL],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            max_age=r.events_s,
            max_bytes=1 << 30,
        ),
    ]


@dataclass(frozen=True)
class Durable:
    """A durable pull consumer: the stream it reads and its settings (see ``bus.ensure_durable``)."""

    stream: str
    config: ConsumerConfig


def _durable(stream: str, name: str, subject: str, ack_wait_s: float, max_ack_pending: int) -> Durable:
    return Durable(
        stream,
        ConsumerConfig(
            durable_name=name,
            filter_subject=subject,
            ack_policy=AckPolicy.EXPLICIT,
            deliver_policy=DeliverPolicy.ALL,
            ack_wait=ack_wait_s,
            max_ack_pending=max_ack_pending,
        ),
    )


def planner_durables() -> list[Durable]:
    """The planner reads every model's requests and every group's outcomes."""
    return [
        _durable(s.STREAM_REQUESTS, s.DURABLE_PLANNER_REQUESTS, s.REQUESTS_ALL, 60.0, 10_000),
        _durable(s.STREAM_OUTCOMES, s.DURABLE_PLANNER_OUTCOMES, s.OUTCOMES_ALL, 60.0, 10_000),
    ]


def trainer_durable(group: str) -> Durable:
    """One unit at a time, strictly in order; a running unit reports progress every 15 s."""
    return _durable(s.STREAM_WORK, s.durable_trainer(group), s.work_subject(group), 60.0, 1)


def publisher_durable() -> Durable:
    """Publications copy checkpoint files: a generous ack wait."""
    return _durable(s.STREAM_PUBLISH, s.DURABLE_PUBLISHER, s.PUBLISH_ALL, 300.0, 64)


def sample_runner_durable(ack_wait_s: float) -> Durable:
    """Shared by every gateway: each queued sample goes to one of them."""
    return _durable(s.STREAM_SAMPLES, s.DURABLE_SAMPLE_RUNNERS, s.SAMPLES_ALL, ack_wait_s, 10_000)


def bucket_configs(r: Retention, replicas: int = 1) -> list[KeyValueConfig]:
    configs = []
    for bucket in s.ALL_BUCKETS:
        ttl = r.trainer_ttl_s if bucket == s.KV_TRAINERS else None
        configs.append(
            KeyValueConfig(bucket=bucket, history=1, ttl=ttl, storage=StorageType.FILE, replicas=replicas)
        )
    return configs


async def ensure_streams(
    js: JetStreamContext, retention: Retention | None = None, replicas: int | None = None
) -> None:
    """Create (or update in place) every stream and bucket. Safe to run from many processes.

    `replicas` (default `TINKERD_NATS_REPLICAS`) applies to what is created; an existing stream
    is also scaled to it in place, buckets and the object store keep the count they were made with.
    """
    r = retention or Retention.from_env()
    n = replicas or replicas_from_env()
    for config in stream_configs(r, n):
        try:
            await js.add_stream(config)
        except nats.js.errors.BadRequestError:
            await js.update_stream(config)  # exists with other settings: converge to ours
    for kv in bucket_configs(r, n):
        try:
            await js.create_key_value(kv)
        except nats.js.errors.BadRequestError:
            pass  # exists; KV settings never change after creation
    try:
        # nats-py overwrites config.bucket with its `bucket` argument: pass both
        store = ObjectStoreConfig(bucket=s.OBJ_SNAPSHOTS, storage=StorageType.FILE, replicas=n)
        await js.create_object_store(s.OBJ_SNAPSHOTS, store)
    except nats.js.errors.BadRequestError:
        pass  # exists
