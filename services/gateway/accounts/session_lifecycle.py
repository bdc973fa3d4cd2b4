"""Sessions end as on the hosted service: by `finish`, or when their heartbeats lapse.

The SDK beats every 10 s while a client lives. A gateway records a session's heartbeat in its
record (`tinker_sessions`, at most once per `BEAT_WRITE_S`, or a quarter of the expiry if that
is shorter, per session and replica, so a beat costs a KV write only now and then) and, every `session_reap_interval_s`, looks for sessions
whose last sign of life (heartbeat, or creation) is older than `session_expiry_s`. Marking one
expired is a compare-and-set on its record, so with many replicas exactly one of them expires
it: that one emits the `session` event (`what: expired`) and unloads the session's models. A
heartbeat for an expired or finished session answers 410, which stops the SDK's heartbeat loop.

What survives expiry: every future already accepted still answers (requests queued before the
unload run first), saved checkpoints and sampler exports stay, and sampling clients keep
sampling; new training calls on the session's models fail, since the models are unloaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from libs.contracts import ids
from libs.contracts import subjects as s
from libs.contracts.common import now_ns
from libs.contracts.events import SessionEvent
from libs.contracts.records import ModelRecord, SessionRecord
from services.gateway.context import Gateway
from services.gateway.http.errors import Gone
from services.gateway.submit import unload

log = logging.getLogger("tinkerd.gateway")

BEAT_WRITE_S = 30.0


class SessionLifecycle:
    def __init__(self, gateway: Gateway) -> None:
        self.gateway = gateway
        self.expiry_ns = int(gateway.config.session_expiry_s * 1e9)
        self.beat_write_ns = int(min(BEAT_WRITE_S, gateway.config.session_expiry_s / 4) * 1e9)
        self._written: dict[str, int] = {}  # session -> when this replica last wrote its beat
        self._task: asyncio.Task[None] | None = None
        # A gateway that was down (or just started) saw no beats: it expires nothing until every
        # live client has had the expiry time to beat again.
        self._reap_from_ns = now_ns() + self.expiry_ns

    async def beat(self, record: SessionRecord) -> None:
        """A heartbeat of `record`'s session; 410 when the session is over."""
        if record.finished or record.expired:
            how = "expired (no heartbeat for too long)" if record.expired else "finished"
            raise Gone(f"session {record.session_id} has {how}; create a new ServiceClient to go on")
        now = now_ns()
        if now - self._written.get(record.session_id, 0) < self.beat_write_ns:
            return
        self._written[record.session_id] = now

        def stamp(current: SessionRecord) -> SessionRecord | None:
            if current.expired or current.finished:
                return None
            current.heartbeat_ns = now
            return current

        await self.gateway.store.update(s.KV_SESSIONS, ids.token(record.session_id), SessionRecord, stamp)

    async def reap_once(self) -> list[str]:
        """Expire every lapsed session this replica wins; returns their ids."""
        now = now_ns()
        expired: list[str] = []
        if now < self._reap_from_ns:
            return expired
        for key, record in await self.gateway.store.scan(s.KV_SESSIONS, SessionRecord):
            if record.finished or record.expired or self._last_sign(record) + self.expiry_ns > now:
                continue

            def expire(current: SessionRecord) -> SessionRecord | None:
                if current.finished or current.expired or self._last_sign(current) + self.expiry_ns > now:
                    return None  # another replica expired it, or it beat meanwhile
                current.expired = True
                return current

            if await self.gateway.store.update(s.KV_SESSIONS, key, SessionRecord, expire) is None:
                continue
            await self._unload_models(record)
            await self.gateway.bus.emit(
                SessionEvent(session_id=record.session_id, what="expired", tenant=record.tenant, at_ns=now_ns())
            )
            log.info("session %s expired: no heartbeat for %.0f s", record.session_id, self.expiry_ns / 1e9)
            expired.append(record.session_id)
        return expired

    async def _unload_models(self, record: SessionRecord) -> None:
        prefix = ids.session_models_prefix(record.session_id)
        for _, model in await self.gateway.store.scan(s.KV_MODELS, ModelRecord, prefix=prefix):
            if model.tenant == record.tenant:
                await unload(self.gateway, model)

    @staticmethod
    def _last_sign(record: SessionRecord) -> int:
        return max(record.heartbeat_ns, record.created_ns)

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _loop(self) -> None:
        interval = min(self.gateway.config.session_reap_interval_s, self.gateway.config.session_expiry_s / 4)
        while True:
            await asyncio.sleep(interval)
            try:
                await self.reap_once()
            except Exception:  # the bus reconnecting, a KV hiccup: try again next round
                log.exception("session reaping failed; retrying in %.0f s", interval)
