"""Shared fixtures: a real nats-server per test session, and a real Tinkerd stack per module."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.natsd import NatsServer, start_nats
from tests.harness import Stack

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh real nats-server with JetStream on a free loopback port, stopped after the test."""
    server = start_nats(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    """The whole stack (nats-server, gateway, planner, trainer, publisher, sampler), one per module."""
    data_dir: Path = tmp_path_factory.mktemp("stack")
    running = Stack(data_dir).start()
    try:
        yield running
    finally:
        running.stop()
