"""The stack's status read from the bus: sessions, models, trainers, stream and consumer depth,
the planner's queues and what waits (`tinkerd status` prints it; the gateway's operator and
console routes serve it)."""

from __future__ import annotations

from typing import TypeVar

import msgspec
import nats.errors

from infra.bus import Bus, kv_scan
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.records import (
    CheckpointRecord,
    ModelQueueRecord,
    ModelRecord,
    QueueRecord,
    SessionRecord,
    TrainerStatus,
)

T = TypeVar("T")


async def _records(bus: Bus, bucket: str, type_: type[T]) -> list[T]:
    return [codec.from_json(value, type_) for value in (await kv_scan(bus, bucket)).values()]


class Status(msgspec.Struct):
    sessions: list[SessionRecord]
    models: list[ModelRecord]
    trainers: list[TrainerStatus]
    streams: dict[str, dict[str, int]]
    consumers: dict[str, dict[str, int]]
    commands_per_model: dict[str, int]
    planner: dict[str, ModelQueueRecord] = {}
    newest_checkpoint: dict[str, str] = {}
    waiting: list[QueueRecord] = []  # requests that wait (no free slot; no reachable sampling engine)


async def collect_status(nats_url: str) -> Status:
    bus = await Bus.connect(nats_url, "status")
    try:
        return await status_of(bus)
    finally:
        await bus.close()


async def status_of(bus: Bus) -> Status:
    """The status as seen through an existing connection (the gateway's operator route uses it)."""
    sessions = await _records(bus, s.KV_SESSIONS, SessionRecord)
    models = await _records(bus, s.KV_MODELS, ModelRecord)
    trainers = await _records(bus, s.KV_TRAINERS, TrainerStatus)
    streams = {}
    for name in (
        s.STREAM_REQUESTS,
        s.STREAM_WORK,
        s.STREAM_OUTCOMES,
        s.STREAM_PUBLISH,
        s.STREAM_RESULTS,
        s.STREAM_EVENTS,
    ):
        info = await bus.js.stream_info(name)
        streams[name] = {
            "messages": info.state.messages,
            "bytes": info.state.bytes,
            "last_seq": info.state.last_seq,
        }
    consumers = {}
    for name in (s.STREAM_REQUESTS, s.STREAM_WORK, s.STREAM_OUTCOMES, s.STREAM_PUBLISH):
        for consumer in await bus.js.consumers_info(name):
            if consumer.config.durable_name:
                consumers[f"{name}/{consumer.name}"] = {
                    "pending": consumer.num_pending or 0,
                    "ack_pending": consumer.num_ack_pending or 0,
                    "redelivered": consumer.num_redelivered or 0,
                }
    depth: dict[str, int] = {}
    for model in models:
        try:
            info = await bus.js.stream_info(
                s.STREAM_REQUESTS, subjects_filter=s.request_subject(model.model_id)
            )
            depth[model.model_id] = sum((info.state.subjects or {}).values()) if info.state.subjects else 0
        except nats.errors.Error:
            depth[model.model_id] = 0
    planner = {r.model_id: r for r in await _records(bus, s.KV_PLANNER, ModelQueueRecord)}
    newest: dict[str, tuple[int, str]] = {}
    for ckpt in await _records(bus, s.KV_CHECKPOINTS, CheckpointRecord):
        if ckpt.created_ns >= newest.get(ckpt.training_run_id, (0, ""))[0]:
            newest[ckpt.training_run_id] = (ckpt.created_ns, ckpt.tinker_path)
    checkpoints = {run: path for run, (_, path) in newest.items()}
    waiting = sorted(await _records(bus, s.KV_QUEUE, QueueRecord), key=lambda r: r.since_ns)
    return Status(sessions, models, trainers, streams, consumers, depth, planner, checkpoints, waiting)
