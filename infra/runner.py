"""Runs one service's async main until SIGTERM or SIGINT, then lets it shut down cleanly."""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable

from infra import tracing

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging() -> None:
    level = os.environ.get("TINKERD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    for noisy in ("nats", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def run_service(name: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Set up logging and tracing, run `main(stop)`, and set `stop` on SIGTERM/SIGINT."""
    setup_logging()
    tracing.setup_tracing(name)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await main(stop)

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(runner())
