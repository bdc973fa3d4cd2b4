"""The futures projection: a fold of the results stream, with waiters that wake on arrival.

Every gateway replica subscribes to `tinker.result.>` from the start of the stream, so any replica
can answer any future. A `retrieve_future` long-poll registers a waiter and is woken by the
subscription callback the moment the result is appended — no polling loop, no sleep.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Callable

import nats.js.errors
from nats.aio.msg import Msg
from nats.js.api import DeliverPolicy

from infra.bus import Bus
from libs.contracts import codec
from libs.contracts import subjects as s
from libs.contracts.results import RequestResult


class FutureBoard:
    def __init__(self, bus: Bus, cache_size: int = 20_000) -> None:
        self._bus = bus
        self._cache: OrderedDict[str, RequestResult] = OrderedDict()
        self._cache_size = cache_size
        self._waiters: dict[str, list[asyncio.Future[RequestResult]]] = {}
        self._caught_up = asyncio.Event()
        self._replay_until = 0
        self._sub: object | None = None
        self.listeners: list[Callable[[RequestResult], None]] = []

    async def start(self) -> None:
        info = await self._bus.js.stream_info(s.STREAM_RESULTS)
        self._replay_until = info.state.last_seq
        if info.state.messages == 0:
            self._caught_up.set()
        self._sub = await self._bus.js.subscribe(
            s.RESULTS_ALL,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.ALL,
            cb=self._on_message,
        )
        await self._caught_up.wait()

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]

    async def _on_message(self, msg: Msg) -> None:
        result = codec.result_decoder.decode(msg.data)
        self._remember(result)
        if not self._caught_up.is_set() and msg.metadata.sequence.stream >= self._replay_until:
            self._caught_up.set()

    def _remember(self, result: RequestResult) -> None:
        for listener in self.listeners:
            listener(result)
        self._cache[result.request_id] = result
        self._cache.move_to_end(result.request_id)
        while len(self._cache) > self._cache_size:
            self._cache.popitem(last=False)
        for waiter in self._waiters.pop(result.request_id, []):
            if not waiter.done():
                waiter.set_result(result)

    @property
    def waiting(self) -> int:
        """How many retrieve_future long-polls are held right now."""
        return sum(len(waiters) for waiters in self._waiters.values())

    def peek(self, request_id: str) -> RequestResult | None:
        return self._cache.get(request_id)

    async def lookup(self, request_id: str) -> RequestResult | None:
        """The result if it exists anywhere in the stream (cache first, then a direct read)."""
        if (hit := self._cache.get(request_id)) is not None:
            return hit
        try:
            raw = await self._bus.js.get_last_msg(s.STREAM_RESULTS, s.result_subject(request_id), direct=True)
        except (nats.js.errors.NotFoundError, nats.js.errors.Error):
            return None
        if raw.data is None:
            return None
        return codec.result_decoder.decode(raw.data)

    async def wait(self, request_id: str, timeout_s: float) -> RequestResult | None:
        """Wait up to `timeout_s` for the result; None means still pending."""
        loop = asyncio.get_running_loop()
        waiter: asyncio.Future[RequestResult] = loop.create_future()
        self._waiters.setdefault(request_id, []).append(waiter)  # registered before any await
        try:
            found = await self.lookup(request_id)
            if found is not None:
                return found
            return await asyncio.wait_for(asyncio.shield(waiter), timeout_s)
        except TimeoutError:
            return None
        finally:
            waiters = self._waiters.get(request_id)
            if waiters and waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[request_id]
