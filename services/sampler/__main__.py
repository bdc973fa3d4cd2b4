"""Run the CPU sampler: ``python -m services.sampler`` (configured by ``TINKERD_SAMPLER_*``)."""

from __future__ import annotations

import os

import uvicorn

from services.sampler.app import create_app
from services.sampler.config import SamplerConfig


def main() -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach for the model hub
    config = SamplerConfig.from_env(os.environ)
    uvicorn.run(create_app(config), host=config.host, port=config.port, log_level="info")


if __name__ == "__main__":
    main()
