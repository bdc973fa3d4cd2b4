"""Shared fixtures: a real nats-server per test, and real Tinkerd stacks shared across modules.

Tiers: a test that starts a whole stack is marked ``stack`` here, without a word in its module:
it asks for the ``stack`` fixture (or the fault tests' ``reference`` run), or its module builds
its own `tests.harness.Stack`. ``make check`` leaves out ``stack`` and ``slow`` tests;
``make test`` runs every tier.

Workers: ``make test`` and ``make check`` run the tests on two pytest-xdist workers with
``--dist loadfile``: a module's tests run on one worker, in order, so they share its module
fixtures (a stack started once per module); a session fixture (the shared stacks, the fault
tests' reference run) is built once by each worker that uses it.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from infra.natsd import NatsServer, start_nats
from tests.harness import SharedStacks, Stack

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")


STACK_FIXTURES = frozenset({"stack", "reference"})
"""Names of the fixtures under tests/ that start a whole stack (this module's `stack`, a module's
own `stack`, tests/faults/conftest.py's `reference`); a unit test's `reference` elsewhere is not one."""


def starts_a_stack(item: pytest.Item) -> bool:
    """Whether a test starts a whole stack: through such a fixture (used directly or through
    another fixture), or because its module builds a `Stack` of its own."""
    info = getattr(item, "_fixtureinfo", None)
    definitions = info.name2fixturedefs if info is not None else {}
    for name in STACK_FIXTURES.intersection(getattr(item, "fixturenames", ())):
        if any(d.baseid == "tests" or d.baseid.startswith("tests/") for d in definitions.get(name, ())):
            return True
    module = getattr(item, "module", None)
    return module is not None and getattr(module, "Stack", None) is Stack


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if starts_a_stack(item):
            item.add_marker(pytest.mark.stack)


@pytest.fixture
def nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh real nats-server with JetStream on a free loopback port, stopped after the test."""
    server = start_nats(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def shared_stacks(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStacks]:
    stacks = SharedStacks(tmp_path_factory)
    try:
        yield stacks
    finally:
        stacks.stop()


@pytest.fixture(scope="module")
def stack(shared_stacks: SharedStacks) -> Stack:
    """The whole stack (nats-server, gateway, planner, trainer, publisher, sampler) with the default
    settings, started once and shared by every module that asks for it."""
    return shared_stacks.get()
