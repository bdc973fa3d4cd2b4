"""`replay` feeds exactly the messages of its subject in its range, and returns at once when there
are none: a stream full of other groups' messages must not make a trainer's recovery (or a
takeover's read of a lost group) wait forever for one of its own."""

from __future__ import annotations

import asyncio

from nats.aio.msg import Msg

from infra.bus import Bus, last_seq, replay
from infra.natsd import NatsServer


def test_replay_returns_the_subjects_messages_in_range_and_nothing_without_waiting(
    nats_server: NatsServer,
) -> None:
    async def main() -> list[tuple[str, int, int, list[int]]]:
        bus = await Bus.connect(nats_server.url, "test-replay")
        try:
            await bus.js.add_stream(name="T", subjects=["x.>"])
            await bus.js.publish("x.b", b"0")  # seq 1
            for _ in range(3):
                await bus.js.publish("x.a", b"1")  # seq 2..4
            upto = await last_seq(bus, "T")
            out = []
            for subject, start in (("x.c", 1), ("x.b", 2), ("x.b", 1), ("x.a", 3), ("x.>", 1)):
                seen: list[int] = []

                def record(msg: Msg, seen: list[int] = seen) -> None:
                    seen.append(msg.metadata.sequence.stream)

                count = await asyncio.wait_for(
                    replay(bus, "T", subject, upto, record, start),
                    timeout=30,  # a hang fails the test instead of the suite
                )
                out.append((subject, start, count, seen))
            return out
        finally:
            await bus.close()

    assert asyncio.run(main()) == [
        ("x.c", 1, 0, []),  # no message of the subject at all
        ("x.b", 2, 0, []),  # only before the start: a group whose snapshot covers its last unit
        ("x.b", 1, 1, [1]),
        ("x.a", 3, 2, [3, 4]),
        ("x.>", 1, 4, [1, 2, 3, 4]),
    ]
