"""kill -9 of one node of a 3-node JetStream cluster under SDK training traffic.

The stack runs on a 3-node cluster (`Stack(nats_nodes=3)`): every stream, bucket and the object
store has 3 replicas, and every service is given all three URLs. First the seeded SDK workload
(tests/sdk.py) runs with no fault: the reference. Then the same workload runs again
and, at its 4th accepted request, the node leading the requests stream (the log every training
command is appended to) is killed with SIGKILL and kept down: the cluster elects new leaders
on the other two nodes, clients connected to the dead node reconnect to a live one, and the run
must go on and give the reference's results bit for bit. Afterwards the node is restarted and
the streams must show nothing planned, run or answered twice.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from infra.bus import Bus
from libs.contracts import subjects as s
from tests.faults.checks import EventTrigger, exactly_once
from tests.faults.conftest import FAULT_ENV
from tests.harness import Stack
from tests.sdk import TenantRun, differences, run_workload

pytestmark = pytest.mark.slow  # a fault test: a 3-node cluster, its elections take minutes

TENANTS = 1  # one tenant keeps the module fast; the reference and the faulted run each have it


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    running = Stack(tmp_path_factory.mktemp("cluster"), env_overrides=FAULT_ENV, nats_nodes=3).start()
    try:
        yield running
    finally:
        running.stop()


async def _stream_state(nats_url: str, stream: str) -> tuple[str, int]:
    bus = await Bus.connect(nats_url, "test-cluster")
    try:
        info = await bus.js.stream_info(stream)
        assert info.cluster is not None and info.cluster.leader is not None
        return info.cluster.leader, info.config.num_replicas or 1
    finally:
        await bus.close()


def stream_state(stack: Stack, stream: str) -> tuple[str, int]:
    """(the node leading `stream`, its replica count)."""
    return asyncio.run(_stream_state(stack.nats_url, stream))


def test_streams_have_three_replicas(stack: Stack) -> None:
    """Every stream the services use was created with 3 replicas on the cluster."""
    for stream in (s.STREAM_REQUESTS, s.STREAM_WORK, s.STREAM_OUTCOMES, s.STREAM_RESULTS, s.STREAM_SAMPLES):
        assert stream_state(stack, stream)[1] == 3, stream


def failures(runs: list[TenantRun], stack: Stack) -> list[str]:
    """Each failed tenant's stalled call and error; where there is one, the services' last log
    lines are printed (pytest shows them whole under "Captured stdout", where an assertion
    message is cut short)."""
    failed = [f"tenant {r.tenant}: {r.stalled or 'error'}: {r.error!r}" for r in runs if r.error]
    if failed:
        print(stack.dump_logs())
    return failed


def test_killing_the_requests_leader_under_load_loses_nothing(stack: Stack) -> None:
    """The workload with the leader of the requests stream killed mid-run completes, equals the
    fault-free run of the same workload, the stream has a new leader, and nothing ran twice."""
    reference = run_workload(stack.base_url, stack.data_dir, tenants=TENANTS, key="cluster-ref")
    assert not failures(reference, stack)
    killed: list[str] = []

    def kill_leader() -> None:
        leader, _ = stream_state(stack, s.STREAM_REQUESTS)
        killed.append(leader)
        stack.kill_nats_node(stack.cluster.index_of(leader))  # type: ignore[union-attr]

    trigger = EventTrigger(stack.nats_url, "accepted", 4, kill_leader).start()
    try:
        runs = run_workload(stack.base_url, stack.data_dir, tenants=TENANTS, key="cluster-fault")
    finally:
        trigger.stop()
    assert trigger.error is None, trigger.error
    assert killed, "the leader was never killed"
    assert not failures(runs, stack)
    assert not differences(runs, {r.tenant: r for r in reference})
    assert stream_state(stack, s.STREAM_REQUESTS)[0] != killed[0]
    stack.restart_nats_node(stack.cluster.index_of(killed[0]))  # type: ignore[union-attr]
    report = exactly_once(stack.nats_url)
    assert report.clean, report
