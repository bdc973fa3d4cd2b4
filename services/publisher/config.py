"""Publisher settings."""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from infra.config import DEFAULT_DATA_DIR, DEFAULT_NATS_URL, from_env


class PublisherConfig(msgspec.Struct, frozen=True, kw_only=True):
    nats_url: str = DEFAULT_NATS_URL
    data_dir: str = DEFAULT_DATA_DIR
    reap_interval_s: float = 60.0
    """How often expired checkpoints (ttl_seconds) are deleted."""


def load_config(env: Mapping[str, str], **overrides: object) -> PublisherConfig:
    return from_env(PublisherConfig, "publisher", env, **overrides)
