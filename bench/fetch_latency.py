"""Delivery latency of a message published to an idle JetStream stream, through a fetch loop.

A real nats-server; one pull consumer; a publisher that sleeps a random interval (many of them
close to the fetch window, where a pull request expires) and publishes one message; the time
from the publish call to the handler seeing the message. Two loops, each in its own run over the
same seeded intervals:

- `fetch_loop` (infra/bus.py): one message waited for, then what the server says is pending;
- `fetch(batch)`: nats-py's `fetch(64, timeout=1.0)` in a loop, the strategy it replaced.

    .venv/bin/python -m bench.fetch_latency [--messages 300]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import nats.errors

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

from bench.common import dist  # noqa: E402
from infra.bus import IDLE_FETCH_S, Bus, fetch_loop  # noqa: E402
from infra.natsd import start_nats  # noqa: E402

INTERVALS_S = [0.001, 0.01, 0.05, 0.3, 0.99, 0.999, 1.0, 1.002, 1.01]


async def plain_fetch_loop(
    sub: Any, handle: Callable[[list[Any]], Awaitable[None]], stop: asyncio.Event, batch: int
) -> None:
    while not stop.is_set():
        try:
            msgs = await sub.fetch(batch, timeout=IDLE_FETCH_S)
        except (nats.errors.TimeoutError, TimeoutError):
            continue
        await handle(msgs)


async def run(url: str, name: str, messages: int, seed: int) -> list[float]:
    bus = await Bus.connect(url, f"bench-{name}")
    try:
        stream = f"LAT_{name.upper()}"
        await bus.js.add_stream(name=stream, subjects=[f"lat.{name}.>"])
        sub = await bus.js.pull_subscribe(f"lat.{name}.>", durable="d", stream=stream)
        seen: dict[bytes, float] = {}
        arrived = asyncio.Event()

        async def handle(msgs: list[Any]) -> None:
            now = time.perf_counter()
            for m in msgs:
                seen[m.data] = now
                await m.ack()
            arrived.set()

        stop = asyncio.Event()
        loop = (
            fetch_loop(sub, handle, stop, batch=64)
            if name == "fetch_loop"
            else plain_fetch_loop(sub, handle, stop, 64)
        )
        task = asyncio.create_task(loop)
        rng = random.Random(seed)
        latencies = []
        for i in range(messages):
            await asyncio.sleep(rng.choice(INTERVALS_S))
            key = str(i).encode()
            arrived.clear()
            t0 = time.perf_counter()
            await bus.js.publish(f"lat.{name}.x", key)
            while key not in seen:
                await arrived.wait()
                arrived.clear()
            latencies.append(seen[key] - t0)
        stop.set()
        await task
        await sub.unsubscribe()  # a pull subscription is unsubscribed before the bus drains (infra/bus.py)
        return latencies
    finally:
        await bus.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--messages", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            print(f"# fetch latency from an idle stream: {args.messages} messages, seed {args.seed}\n")
            print("| loop | p50 ms | p99 ms | max ms | over 50 ms |")
            print("|---|---|---|---|---|")
            for name in ("fetch_loop", "fetch_batch"):
                lat = asyncio.run(run(server.url, name, args.messages, args.seed))
                ms = dist(lat, scale=1000)
                over = sum(x > 0.05 for x in lat)
                print(f"| {name} | {ms['p50']:.2f} | {ms['p99']:.1f} | {ms['max']:.1f} | {over} of {len(lat)} |")
        finally:
            server.stop()


if __name__ == "__main__":
    main()
