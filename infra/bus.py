"""The NATS connection every service holds, with the few rules the event log depends on.

- Every publish carries the trace context in its headers, and a `Nats-Msg-Id` where a retry or a
  redelivery could publish the same fact twice (JetStream drops the duplicate, but only within
  its duplicate window: nothing may depend on that for correctness).
- A request's result is appended with `publish_once`: the server refuses it when the request's
  subject already holds a result (`Nats-Expected-Last-Subject-Sequence: 0`), whenever it comes,
  so a result is appended at most once however late a redelivered message redoes the work.
- Pull subscriptions are unsubscribed before `drain()`: a pull fetch that timed out otherwise makes
  drain hang for its whole timeout (nats.py#933).
- An empty `fetch()` raises TimeoutError; consumer loops treat that as "nothing yet".
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import nats
import nats.errors
import nats.js.errors
from nats.aio.client import Client
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy, PubAck
from nats.js.kv import KeyValue

from infra import tracing
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.events import OperationEvent

log = logging.getLogger("tinkerd.bus")
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code when that expectation fails


class Bus:
    """A connected NATS client plus its JetStream context and KV handles."""

    def __init__(self, nc: Client, js: JetStreamContext) -> None:
        self.nc = nc
        self.js = js
        self._kv: dict[str, KeyValue] = {}
        self._pull_subs: list[JetStreamContext.PullSubscription] = []
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    async def connect(cls, url: str, name: str) -> Bus:
        """`url` may list several servers, comma-separated (a cluster's nodes): the client connects
        to one of them and, when it is lost, reconnects to any other (without end)."""

        async def on_error(exc: Exception) -> None:
            log.warning("nats: %s", exc)

        nc = await nats.connect(
            [u.strip() for u in url.split(",") if u.strip()],
            name=f"tinkerd-{name}",
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.5,
            error_cb=on_error,
        )
        return cls(nc, nc.jetstream(timeout=10.0))

    async def kv(self, bucket: str) -> KeyValue:
        if bucket not in self._kv:
            self._kv[bucket] = await self.js.key_value(bucket)
        return self._kv[bucket]

    async def publish(
        self, subject: str, payload: bytes, msg_id: str | None = None, traceparent: str = ""
    ) -> PubAck:
        headers = tracing.inject({})
        if traceparent and "traceparent" not in headers:
            headers["traceparent"] = traceparent
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        return await self.js.publish(subject, payload, headers=headers)

    async def publish_once(
        self, subject: str, payload: bytes, msg_id: str | None = None, traceparent: str = ""
    ) -> bool:
        """Append to `subject` only if it holds no message yet; False when one was already there.

        The check is the server's (optimistic concurrency on the subject's last sequence), so it
        holds across processes and restarts and does not depend on the duplicate window.
        """
        headers = tracing.inject({})
        if traceparent and "traceparent" not in headers:
            headers["traceparent"] = traceparent
        if msg_id:
            headers["Nats-Msg-Id"] = msg_id
        headers[EXPECTED_LAST_SUBJECT_SEQ] = "0"
        try:
            ack = await self.js.publish(subject, payload, headers=headers)
        except nats.js.errors.BadRequestError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                return False
            raise
        return not ack.duplicate

    def emit_soon(self, event: OperationEvent) -> None:
        """Publish an operation event without waiting for its ack (off the critical path)."""
        task = asyncio.create_task(self.emit(event))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def emit(self, event: OperationEvent) -> None:
        """Publish an operation event; observability must never break the operation itself."""
        kind = type(event).__struct_config__.tag
        try:
            await self.js.publish(s.event_subject(str(kind), event.model_id or None), codec.to_json(event))
        except Exception as exc:
            log.warning("could not emit %s event: %s", kind, exc)

    async def pull(self, subject: str, durable: str, stream: str) -> JetStreamContext.PullSubscription:
        """Bind to an existing durable pull consumer (created by the service's `ensure_*`)."""
        sub = await self.js.pull_subscribe_bind(durable=durable, stream=stream)
        self._pull_subs.append(sub)
        return sub

    async def close(self) -> None:
        for sub in self._pull_subs:
            try:
                await sub.unsubscribe()
            except Exception:
                pass
        if not self.nc.is_closed:
            try:
                await asyncio.wait_for(self.nc.drain(), timeout=5.0)
            except (TimeoutError, nats.errors.Error):
                await self.nc.close()


BUS_UNAVAILABLE: tuple[type[Exception], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)
"""The broker did not answer for a passing reason: it is restarting, the client is reconnecting,
a stream's leader is being elected. The same request succeeds once it is back. (nats-py's
TimeoutError is an OSError: a handler that catches OSError for a full disk must let these
through first.)"""


IDLE_FETCH_S = 1.0
"""How long a fetch waits for messages on an idle stream: also the longest `stop` waits for it (a
fetch is never cancelled, which could strand a delivered message until its ack wait)."""

FOLLOW_FETCH_S = 0.05
"""How long a follow-up fetch (`fetch_loop`) waits for messages the server said were pending."""


async def fetch_loop(
    sub: JetStreamContext.PullSubscription,
    handle: Callable[[list[Msg]], Awaitable[Any]],
    stop: asyncio.Event,
    batch: int = 64,
    wait_s: float = IDLE_FETCH_S,
) -> None:
    """Fetch batches and hand them to `handle` until `stop` is set.

    `handle` acks what it has made durable; anything unacked is redelivered after the consumer's
    ack wait, which is why every handler must be idempotent.

    A batch is one message waited for, then the messages the server says are pending behind it
    (`num_pending`), fetched without waiting for more. nats-py's `fetch(n > 1)` can otherwise
    hold a message it already has until `n` arrive or its window ends: from an idle stream, one
    message in 11 to 33 (published near a window's end) waited out the whole window
    (`bench/fetch_latency.py`).
    """
    while not stop.is_set():
        try:
            msgs = await sub.fetch(1, timeout=wait_s)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        except nats.errors.ConnectionClosedError:
            return
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            await fetch_failed(exc, stop)
            continue
        while len(msgs) < batch and (pending := msgs[-1].metadata.num_pending) > 0:
            try:
                msgs += await sub.fetch(min(batch - len(msgs), pending), timeout=FOLLOW_FETCH_S)
            except (nats.errors.Error, nats.js.errors.Error, TimeoutError):
                break  # what was fetched is handled; the rest comes with the next fetch
        await handle(msgs)


FETCH_RETRY_S = 0.5


async def fetch_failed(exc: Exception, stop: asyncio.Event) -> None:
    """A fetch failed for a passing reason: the consumer's leader is moving to another cluster
    node (a node died), the server is reconnecting, JetStream has no quorum for a moment. Log it
    and let the caller fetch again after FETCH_RETRY_S (sooner if `stop` is set)."""
    log.warning("fetch failed (%s: %s); fetching again in %.1f s", type(exc).__name__, exc, FETCH_RETRY_S)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(stop.wait(), FETCH_RETRY_S)


async def replay(
    bus: Bus,
    stream: str,
    subject: str,
    upto_seq: int,
    handle: Callable[[Msg], Awaitable[None] | None],
    from_seq: int = 1,
) -> int:
    """Feed every message of `stream` (matching `subject`) with sequence <= `upto_seq` to `handle`.

    Uses an ordered consumer from the first message: this is how a service rebuilds its state
    from the log on start. Returns how many messages were replayed.
    """
    info = await bus.js.stream_info(stream)
    if upto_seq <= 0 or info.state.messages == 0 or max(info.state.first_seq, from_seq) > upto_seq:
        return 0
    queue: asyncio.Queue[Msg] = asyncio.Queue()

    async def on_message(msg: Msg) -> None:
        await queue.put(msg)

    if from_seq > 1:
        sub = await bus.js.subscribe(
            subject,
            stream=stream,
            ordered_consumer=True,
            cb=on_message,
            config=ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=from_seq),
        )
    else:
        sub = await bus.js.subscribe(subject, stream=stream, ordered_consumer=True, cb=on_message)
    count = 0
    try:
        # No message of `subject` at or after the start (another group's messages fill the
        # stream, or all of this subject's lie before `from_seq`): nothing will ever arrive, so
        # do not wait for one. The server's delivered and pending counts are read together, so a
        # message already on its way is counted in `delivered`.
        state = await sub.consumer_info()
        delivered = state.delivered.consumer_seq if state.delivered is not None else 0
        if not delivered and not state.num_pending:
            return 0
        while True:
            msg = await queue.get()
            seq = msg.metadata.sequence.stream
            if seq > upto_seq:
                break
            result = handle(msg)
            if result is not None:
                await result
            count += 1
            if seq >= upto_seq or msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return count


async def ensure_durable(bus: Bus, stream: str, config: ConsumerConfig) -> None:
    """Create the durable consumer, or — when it exists — rewind it to its ack floor.

    A process killed mid-message leaves that message "in flight" until its ack wait expires. The
    restarted process is the consumer's only reader, so it rewinds the consumer to just after the
    ack floor: unacked messages come again at once instead of after the ack wait.
    """
    try:
        info = await bus.js.consumer_info(stream, config.durable_name or "")
    except nats.js.errors.NotFoundError:
        await bus.js.add_consumer(stream, config)
        return
    if not info.num_ack_pending:
        return
    floor = info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0
    await bus.js.delete_consumer(stream, config.durable_name or "")
    rewound = dataclasses.replace(
        config, deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=floor + 1
    )
    await bus.js.add_consumer(stream, rewound)


KV_SCAN_IDLE_S = 5.0  # a scan waits this long for its next message before re-checking the stream


async def kv_scan(bus: Bus, bucket: str) -> dict[str, bytes]:
    """Every live key of a KV bucket and its value, in one pass over the bucket's stream (the last
    message of each key, until the consumer reports nothing pending).

    Not nats-py's `keys()` / `watchall()`: their "initial values done" marker can come before the
    first value when the client is slow to run its callbacks, and a scan then saw an empty bucket.
    """
    js = bus.js
    stream = f"KV_{bucket}"
    if (await js.stream_info(stream)).state.messages == 0:
        return {}
    queue: asyncio.Queue[Msg] = asyncio.Queue()
    sub = await js.subscribe(
        f"$KV.{bucket}.>",
        stream=stream,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
        cb=queue.put,
    )
    found: dict[str, bytes] = {}
    prefix = f"$KV.{bucket}."
    try:
        while True:
            try:
                msg = await asyncio.wait_for(queue.get(), KV_SCAN_IDLE_S)
            except TimeoutError:
                if (await js.stream_info(stream)).state.messages == 0:
                    break  # purged meanwhile: nothing left to read
                continue
            key = msg.subject[len(prefix) :]
            headers = msg.headers or {}
            removed = headers.get("KV-Operation") in ("DEL", "PURGE") or "Nats-Marker-Reason" in headers
            if removed or not msg.data:
                found.pop(key, None)
            else:
                found[key] = msg.data
            if msg.metadata.num_pending == 0:
                break
    finally:
        await sub.unsubscribe()
    return found


async def ack_floor(bus: Bus, stream: str, durable: str) -> int:
    """The stream sequence up to which `durable` has acknowledged everything (0 if new)."""
    info = await bus.js.consumer_info(stream, durable)
    return info.ack_floor.stream_seq if info.ack_floor and info.ack_floor.stream_seq else 0


async def has_message(bus: Bus, stream: str, subject: str) -> bool:
    """Whether `stream` holds a message on `subject` (a direct get of the subject's last one)."""
    try:
        await bus.js.get_last_msg(stream, subject, direct=True)
    except nats.js.errors.NotFoundError:
        return False
    return True


async def last_seq(bus: Bus, stream: str) -> int:
    info = await bus.js.stream_info(stream)
    return info.state.last_seq
