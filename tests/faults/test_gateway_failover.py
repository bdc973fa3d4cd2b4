"""kill -9 of one of two gateway replicas loses nothing.

The stack runs two gateways. Replica 0 carries a fault point that SIGKILLs it right after it has
claimed its 3rd training seq_id and before it appended the command: the worst moment, the claim
exists and nothing is in the log. The client (`Failover`, the way a load balancer with retries
behaves) sends each call to the next replica in turn and, when a replica refuses the connection,
drops it or answers 5xx, resends the identical body to the other one. So the call that was in
flight when replica 0 died is completed by replica 1, from replica 0's claim.

Checks: every call of the run completes, its results equal those of a reference model with the
same seed driven through replica 1 alone (the fault-free run, on the same stack), the fault
really fired, and the streams show nothing planned, run or answered twice.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest

from tests.faults.checks import exactly_once
from tests.harness import READY_MARKERS, Stack
from tests.sdk import json_datum

pytestmark = pytest.mark.slow  # a fault test: a stack of its own, kills and restarts

VOCAB = 2048  # tiny-qwen3
STEPS = 4
FAULT = "gateway.command_claimed@3"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    data_dir = tmp_path_factory.mktemp("failover")
    faults = {"TINKERD_FAULT_POINTS": FAULT, "TINKERD_FAULT_DIR": str(data_dir / "faults")}
    running = Stack(data_dir, gateways=2, child_env={"gateway": faults}).start()
    try:
        yield running
    finally:
        running.stop()


@dataclass
class Failover:
    """Round-robin over the replicas; a call that fails on one is resent, unchanged, to the next."""

    urls: list[str]
    key: str
    turn: int = 0
    failovers: list[tuple[str, str]] = field(default_factory=list)  # (replica given up on, why)

    def post(self, path: str, body: dict[str, Any], first: int | None = None, attempts: int = 20) -> httpx.Response:
        """POST to replica `first` (default: the next in turn), failing over to the next ones."""
        why = ""
        if first is not None:
            self.turn = first
        for _ in range(attempts):
            url = self.urls[self.turn % len(self.urls)]
            self.turn += 1
            try:
                response = httpx.post(url + path, json=body, headers={"X-API-Key": self.key}, timeout=120)
            except httpx.TransportError as exc:
                why = repr(exc)
            else:
                if response.status_code < 500:
                    return response
                why = f"{response.status_code} {response.text[:200]}"
            self.failovers.append((url, why))
        raise AssertionError(f"{path} failed at every replica {attempts} times; last: {why}")

    def result(self, request_id: str, first: int | None = None) -> dict[str, Any]:
        while True:  # each retrieve is held by the gateway until the result (or try_again)
            body: dict[str, Any] = self.post("/api/v1/retrieve_future", {"request_id": request_id}, first).json()
            if body.get("type") != "try_again":
                return body


def datum(step: int) -> dict[str, Any]:
    return json_datum([(step * 53 + 7 * i) % VOCAB for i in range(9)])


def train(client: Failover) -> list[Any]:
    """A seeded model, STEPS x (forward_backward, optim_step); every result, in call order."""
    session = client.post("/api/v1/create_session", {"tags": [], "sdk_version": "test"}).json()["session_id"]
    create = {"session_id": session, "model_seq_id": 0, "base_model": "tiny-qwen3", "lora_config": {"rank": 2, "seed": 7}}
    response = client.post("/api/v1/create_model", create)
    assert response.status_code == 200, response.text
    model_id = response.json()["model_id"]
    out: list[Any] = []
    seq, call = 1, 0
    for step in range(STEPS):
        fb = {"forward_backward_input": {"data": [datum(step)], "loss_fn": "cross_entropy"}, "model_id": model_id, "seq_id": seq}
        optim = {"model_id": model_id, "seq_id": seq + 1, "adam_params": {"learning_rate": 1e-2}}
        for path, body in (("/api/v1/forward_backward", fb), ("/api/v1/optim_step", optim)):
            # training calls alternate replicas (0 takes calls 0, 2, 4, ...); each future is read
            # at the other replica
            accepted = client.post(path, body, first=call % len(client.urls))
            assert accepted.status_code == 200, accepted.text
            result = client.result(accepted.json()["request_id"], first=(call + 1) % len(client.urls))
            out.append(result.get("loss_fn_outputs", result.get("metrics")))
            call += 1
        seq += 2
    return out


class Restarted:
    """Set once `name` has exited and its restarted process is ready (seen in its log lines)."""

    def __init__(self, stack: Stack, name: str) -> None:
        self.name, self.exited, self.ready = name, False, threading.Event()
        stack.listeners.append(self.on_line)

    def on_line(self, service: str, line: str) -> None:
        if service != self.name:
            return
        if "exited with code" in line:
            self.exited = True
        elif self.exited and READY_MARKERS["gateway"] in line:
            self.ready.set()


@pytest.fixture(scope="module")
def reference(stack: Stack) -> list[Any]:
    """The fault-free run: the same seeded model and calls, through replica 1 alone, before any fault."""
    client = Failover(stack.base_urls[1:], "tml-failover-reference")
    results = train(client)
    assert not client.failovers, client.failovers
    return results


def test_killing_a_replica_between_claim_and_append_loses_nothing(stack: Stack, reference: list[Any]) -> None:
    """Replica 0 is SIGKILLed by its fault point between a claim and its append; the resent call
    completes at replica 1, replica 0 is restarted, every result matches the fault-free reference,
    and nothing ran twice."""
    restarted = Restarted(stack, "gateway")
    run = Failover(stack.base_urls, "tml-failover")
    got = train(run)
    assert any((stack.data_dir / "faults").glob("*.fired")), "the fault never fired"
    assert any(url == stack.base_urls[0] for url, _ in run.failovers), run.failovers
    assert got == reference
    assert restarted.ready.wait(120), "the killed replica was not restarted"
    report = exactly_once(stack.nats_url)
    assert report.clean, report


def test_calls_keep_completing_while_a_replica_is_down(stack: Stack, reference: list[Any]) -> None:
    """With replica 1 killed (kill -9) and held down, the same run through both URLs completes
    at replica 0 alone, equals the reference, and nothing runs twice."""
    stack.stop_service("gateway-1")
    try:
        run = Failover(stack.base_urls, "tml-failover-down")
        got = train(run)
    finally:
        ready = stack.start_service("gateway-1")
    assert any(url == stack.base_urls[1] for url, _ in run.failovers), run.failovers
    assert got == reference
    assert ready.wait(120), "replica 1 did not come back"
    report = exactly_once(stack.nats_url)
    assert report.clean, report
