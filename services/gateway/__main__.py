"""`python -m services.gateway` (or `tinkerd serve gateway`): the gateway under uvicorn."""

from __future__ import annotations

import os
from pathlib import Path

import uvicorn

from infra import tracing
from infra.runner import setup_logging
from services.gateway.app import create_app
from services.gateway.auth import check_bind
from services.gateway.config import load_config


def main() -> None:
    setup_logging()
    config = load_config(os.environ)
    check_bind(config.host, Path(config.keys_file) if config.keys_file else None)
    tracing.setup_tracing("gateway")
    uvicorn.run(
        create_app(config),
        host=config.host,
        port=config.port,
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
