"""`fetch_loop` outlives a passing JetStream error (a consumer's leader moving to another node).

Unit test of the loop's control flow: the subscription is a stand-in that fails its first fetch
the way nats-py does while a cluster elects a new leader, then delivers one batch. The loop must
log, fetch again and hand the batch over, and still end when asked to.
"""

from __future__ import annotations

import asyncio
from typing import Any

import nats.js.errors

from infra.bus import fetch_loop


class FlakySub:
    """Raises `error` on the first fetch, returns `batch` on the second, then times out."""

    def __init__(self, error: Exception, batch: list[str]) -> None:
        self.error, self.batch, self.calls = error, batch, 0

    async def fetch(self, batch: int, timeout: float) -> list[str]:
        self.calls += 1
        if self.calls == 1:
            raise self.error
        if self.calls == 2:
            return self.batch
        await asyncio.sleep(0)
        raise TimeoutError


def test_fetch_loop_fetches_again_after_a_jetstream_error_and_delivers_the_next_batch() -> None:
    async def main() -> tuple[list[list[str]], int]:
        stop = asyncio.Event()
        handled: list[list[str]] = []
        sub = FlakySub(nats.js.errors.ServiceUnavailableError(), ["m1", "m2"])

        async def handle(msgs: list[Any]) -> None:
            handled.append(msgs)
            stop.set()

        sub_any: Any = sub
        await asyncio.wait_for(fetch_loop(sub_any, handle, stop), timeout=10)
        return handled, sub.calls

    handled, calls = asyncio.run(main())
    assert handled == [["m1", "m2"]]
    assert calls == 2
