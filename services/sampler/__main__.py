"""Run the CPU sampler: ``python -m services.sampler`` (configured by ``TINKERD_SAMPLER_*``).

It binds its own socket (``TINKERD_SAMPLER_PORT``; 0: a port the kernel picks) before loading
the model, and announces the bound address once it serves (``infra/net.py``).
"""

from __future__ import annotations

import os

from infra.net import announce_file_from_env, serve_asgi
from services.sampler.app import create_app
from services.sampler.config import SamplerConfig


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the model hub
    config = SamplerConfig.from_env(os.environ)
    serve_asgi(
        "sampler",
        config.host,
        config.port,
        lambda: create_app(config),
        announce_to=announce_file_from_env(os.environ),
        log_level="info",
    )


if __name__ == "__main__":
    main()
