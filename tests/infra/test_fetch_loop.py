"""`fetch_loop`: it outlives a passing JetStream error (a consumer's leader moving to another
node), and it hands over what is already queued as one batch (up to its size).

The first test is a unit test of the loop's control flow: the subscription is a stand-in that
fails its first fetch the way nats-py does while a cluster elects a new leader, then delivers one
message. The loop must log, fetch again and hand the message over, and still end when asked to.
The others run against a real nats-server.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

import nats.js.errors
import pytest

from infra.bus import Bus, fetch_loop
from infra.natsd import NatsServer


@dataclass
class FakeMsg:
    """A delivered message as `fetch_loop` reads it: nothing pending behind it."""

    name: str
    metadata: Any = field(default_factory=lambda: type("Metadata", (), {"num_pending": 0})())


class FlakySub:
    """Raises `error` on the first fetch, returns `batch` on the second, then times out."""

    def __init__(self, error: Exception, batch: list[FakeMsg]) -> None:
        self.error, self.batch, self.calls = error, batch, 0

    async def fetch(self, batch: int, timeout: float) -> list[FakeMsg]:
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
        sub = FlakySub(nats.js.errors.ServiceUnavailableError(), [FakeMsg("m1")])

        async def handle(msgs: list[Any]) -> None:
            handled.append([m.name for m in msgs])
            stop.set()

        sub_any: Any = sub
        await asyncio.wait_for(fetch_loop(sub_any, handle, stop), timeout=10)
        return handled, sub.calls

    handled, calls = asyncio.run(main())
    assert handled == [["m1"]]
    assert calls == 2


@pytest.mark.parametrize(("batch", "sizes"), [(64, [10]), (4, [4, 4, 2])])
def test_fetch_loop_hands_over_the_messages_already_queued_as_batches_of_its_size(
    nats_server: NatsServer, batch: int, sizes: list[int]
) -> None:
    """Ten messages queued before the loop starts reach `handle` in order, in batches of at most
    `batch`, each as large as the queue allows."""

    async def main() -> list[list[bytes]]:
        bus = await Bus.connect(nats_server.url, "test-fetch-loop")
        try:
            await bus.js.add_stream(name="FETCH", subjects=["fetch.>"])
            for i in range(10):
                await bus.js.publish("fetch.x", str(i).encode())
            sub = await bus.js.pull_subscribe("fetch.>", durable="loop", stream="FETCH")
            stop = asyncio.Event()
            handled: list[list[bytes]] = []

            async def handle(msgs: list[Any]) -> None:
                handled.append([m.data for m in msgs])
                for m in msgs:
                    await m.ack()
                if sum(map(len, handled)) == 10:
                    stop.set()

            await asyncio.wait_for(fetch_loop(sub, handle, stop, batch=batch), timeout=30)
            return handled
        finally:
            await bus.close()

    handled = asyncio.run(main())
    assert [len(b) for b in handled] == sizes
    assert [m for b in handled for m in b] == [str(i).encode() for i in range(10)]
