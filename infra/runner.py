"""Runs one service's async main until SIGTERM or SIGINT, then lets it shut down cleanly."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import NoReturn

from infra import tracing

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def setup_logging() -> None:
    level = os.environ.get("TINKERD_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr)
    for noisy in ("nats", "httpx", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


LIVENESS_EVERY_S = 2.0


async def _show_liveness(path: Path) -> None:
    """Touch the supervisor's liveness file while this event loop runs (a frozen or deadlocked
    process stops touching it, and the supervisor restarts it: tinkerd/supervisor.py)."""
    while True:
        with contextlib.suppress(OSError):
            path.touch()
        await asyncio.sleep(LIVENESS_EVERY_S)  # a heartbeat, not synchronisation


def run_service(name: str, main: Callable[[asyncio.Event], Awaitable[None]]) -> None:
    """Set up logging and tracing, run `main(stop)`, and set `stop` on SIGTERM/SIGINT."""
    setup_logging()
    tracing.setup_tracing(name)

    async def runner() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        liveness = os.environ.get("TINKERD_LIVENESS_FILE")
        beat = asyncio.create_task(_show_liveness(Path(liveness))) if liveness else None
        try:
            await main(stop)
        finally:
            if beat is not None:
                beat.cancel()

    try:
        import uvloop

        uvloop.run(runner())
    except ImportError:  # pragma: no cover - uvloop ships with uvicorn[standard]
        asyncio.run(runner())
    exit_after_shutdown()


def exit_after_shutdown() -> NoReturn:
    """End a service whose main has returned: it has closed, written and published everything it
    owns, so spans and logs are flushed and the process exits at once. The interpreter's own
    teardown, module by module, only delays the exit: about a second for a process that imported
    torch and megatron-core, paid by every restart and every stop of a stack."""
    tracing.shutdown_tracing()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
