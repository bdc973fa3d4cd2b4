"""`python -m services.gateway` (or `tinkerd serve gateway`): the gateway under uvicorn, on a socket
it binds itself (`TINKERD_GATEWAY_PORT`; 0: a port the kernel picks) and announces (`infra/net.py`)."""

from __future__ import annotations

import os
from pathlib import Path

from infra import tracing
from infra.net import announce_file_from_env, serve_asgi
from infra.runner import setup_logging
from services.gateway.accounts.auth import check_bind
from services.gateway.app import create_app
from services.gateway.config import load_config


def main() -> None:
    setup_logging()
    config = load_config(os.environ)
    check_bind(config.host, Path(config.keys_file) if config.keys_file else None)
    tracing.setup_tracing("gateway")
    serve_asgi(
        "gateway",
        config.host,
        config.port,
        lambda: create_app(config),
        announce_to=announce_file_from_env(os.environ),
        loop="uvloop",
        http="httptools",
        log_level="warning",
        access_log=False,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
